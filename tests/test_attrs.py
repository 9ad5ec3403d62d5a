"""FastAttributes: the instance-dict mirror of a module's registries never disagrees with them."""

import pytest
import torch
from torch import nn

from nanoserve.model.attrs import FastAttributes
from nanoserve.model.layers import RMSNorm
from nanoserve.model.linear import RowParallelLinear


class Holder(FastAttributes, nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.register_buffer("table", torch.zeros(2))
        self.child = nn.Identity()
        self.plain = 5


def mirrored(module, name):
    return name in module.__dict__


def test_registered_entries_are_found_without_module_getattr(monkeypatch):
    h = Holder()
    calls = []
    real = nn.Module.__getattr__
    monkeypatch.setattr(nn.Module, "__getattr__", lambda self, name: calls.append(name) or real(self, name))
    assert h.weight is h._parameters["weight"] and h.table is h._buffers["table"] and h.child is h._modules["child"]
    assert calls == []


def test_reassignment_and_registration_keep_the_mirror_current():
    h = Holder()
    h.table = torch.ones(2)  # a buffer reassigned: torch's own __setattr__ would leave a stale copy
    assert h.table is h._buffers["table"] and h.table.sum() == 2
    h.register_buffer("table", torch.full((2,), 7.0))
    assert h.table is h._buffers["table"] and h.table[0] == 7
    h.weight = nn.Parameter(torch.zeros(3))
    assert h.weight is h._parameters["weight"]
    h.child = nn.ReLU()
    assert isinstance(h.child, nn.ReLU) and h.child is h._modules["child"]
    h.weight = None
    assert h.weight is None and "weight" in h._parameters
    del h.table
    assert not mirrored(h, "table") and "table" not in h._buffers
    with pytest.raises(AttributeError):
        _ = h.table


def test_a_plain_attribute_is_still_refused_as_a_buffer_name():
    h = Holder()
    with pytest.raises(KeyError):
        h.register_buffer("plain", torch.zeros(1))
    assert h.plain == 5


def test_apply_replaces_the_mirrored_tensors_with_the_converted_ones():
    h = Holder().to(torch.float64)
    assert h.table.dtype == torch.float64 and h.table is h._buffers["table"]
    assert h.weight.dtype == torch.float64 and h.weight is h._parameters["weight"]
    norm = RMSNorm(4, 1e-6).to(torch.bfloat16)
    assert norm.weight is norm._parameters["weight"] and norm.weight.dtype == torch.bfloat16


def test_load_state_dict_with_assign_and_the_state_dict_read_the_registries():
    lin = RowParallelLinear(4, 2)
    new = torch.randn(2, 4)
    lin.load_state_dict({"weight": new}, assign=True)
    assert lin.weight is lin._parameters["weight"]
    torch.testing.assert_close(lin(torch.eye(4)), new.t())
    assert set(lin.state_dict()) == {"weight"}
