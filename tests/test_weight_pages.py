"""kernels/pages.py: packed weights aligned for huge pages and moved onto them after load, the same bytes."""

import mmap

import pytest
import torch
from torch import nn

from nanoserve.kernels.pages import HUGE, HugePageMover, huge_spans, weight_buffer


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding `address` in this process (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_small_buffer_is_torchs_own():
    small = weight_buffer(HUGE - 4096)
    assert small.dtype is torch.uint8 and small.numel() == HUGE - 4096


def test_a_large_buffer_starts_on_a_huge_page_and_holds_what_is_written():
    n = 3 * HUGE + 12345
    buffer = weight_buffer(n)
    assert buffer.numel() == n and buffer.dtype is torch.uint8
    values = torch.randint(0, 256, (n,), dtype=torch.uint8)
    buffer.copy_(values)
    assert torch.equal(buffer, values)
    if hasattr(mmap, "MAP_PRIVATE"):
        assert buffer.data_ptr() % HUGE == 0


def test_the_spans_are_the_whole_huge_pages_inside_each_weight():
    module = nn.Module()
    module.register_buffer("aligned", weight_buffer(2 * HUGE + 100))
    module.register_buffer("small", torch.zeros(100, dtype=torch.uint8))
    module.register_buffer("floats", torch.zeros(HUGE))
    assert huge_spans(module) == [(module.aligned.data_ptr(), 2 * HUGE)]


def test_moving_the_weights_changes_no_byte_and_the_status_is_the_kernels_answer():
    module = nn.Module()
    module.register_buffer("w", weight_buffer(4 * HUGE))
    values = torch.randint(0, 256, (4 * HUGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    module.w.copy_(values)
    mover = HugePageMover(module).start()
    assert mover.done.wait(60)
    status = mover.status()
    assert torch.equal(module.w, values)
    if status["stopped"]:
        pytest.skip(f"this system cannot move pages: {status['stopped']}")
    assert status["weight_bytes"] == status["asked_bytes"] == 4 * HUGE and status["done"]
    if status["moved_bytes"] == 4 * HUGE:  # the kernel said so: the mapping must show it
        assert anon_huge_kib(module.w.data_ptr()) >= 4 * HUGE // 1024
    else:  # no free huge page for it (a fragmented system): the pages stay small, and the status says so
        assert anon_huge_kib(module.w.data_ptr()) < 4 * HUGE // 1024


def test_a_packed_weight_survives_its_pages(kernels):
    """kx16's pack into a huge-page-aligned buffer and back gives the file's bytes."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("ks", Path(__file__).parents[1] / "scripts" / "kquant-speed.py")
    weights = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(weights)
    raw = weights.weight("Q4_K", 2048, 2048)
    packed = kernels.kx16_pack("Q4_K", raw, 2048)
    assert packed.numel() >= HUGE
    if hasattr(mmap, "MAP_PRIVATE"):
        assert packed.data_ptr() % HUGE == 0  # on weight_buffer's pages
    assert torch.equal(kernels.kx16_unpack("Q4_K", packed, 2048, 2048), raw)


def test_an_engine_reports_its_weights_pages(tmp_path):
    """/health's fused.huge_pages: the mover's own counts, finished, on an engine of the fused kernels."""
    from nanoserve import LLM
    from tests.gguf_oracles import Q4_K_M_MIX, write_mixed

    _, path = write_mixed(tmp_path / "tiny-q4_k_m.gguf", Q4_K_M_MIX, "Q4_K")
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)
    fused = llm.engine.runner.loaded.fused
    if not fused.active:
        pytest.skip(f"no fused kernels here: {fused.reason}")
    assert fused.huge_pages.done.wait(60)
    status = llm.engine.stats().features["fused"]["huge_pages"]
    assert status == fused.huge_pages.status() and status["done"]
    assert status["weight_bytes"] == sum(n for _, n in huge_spans(llm.engine.runner.model))
