"""kernels/pages.py: packed weights on memory advised for huge pages, the same bytes wherever they lie."""

import mmap
import sys

import pytest
import torch

from nanoserve.kernels.pages import HUGE, weight_buffer


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` in this process (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
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
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert buffer.data_ptr() % HUGE == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="huge-page advice is Linux's")
def test_the_kernel_is_advised_to_back_a_large_buffer_with_huge_pages():
    buffer = weight_buffer(2 * HUGE)
    buffer.fill_(1)
    assert "hg" in vm_flags(buffer.data_ptr())  # MADV_HUGEPAGE as the kernel recorded it


def test_a_packed_weight_survives_its_pages(kernels):
    """kx16's pack into a huge-page buffer and back gives the file's bytes."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("ks", Path(__file__).parents[1] / "scripts" / "kquant-speed.py")
    weights = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(weights)
    raw = weights.weight("Q4_K", 2048, 2048)
    packed = kernels.kx16_pack("Q4_K", raw, 2048)
    assert packed.numel() >= HUGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert packed.data_ptr() % HUGE == 0  # on weight_buffer's pages
    assert torch.equal(kernels.kx16_unpack("Q4_K", packed, 2048, 2048), raw)
