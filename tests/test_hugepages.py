"""ucm.hugepages: host tensors moved onto 2 MiB pages, their contents unchanged."""

import subprocess
import sys

import pytest
import torch

from ucm import hugepages
from ucm.hugepages import HUGE_PAGE, MADV_DONTNEED, _madvise, huge_range, huge_zeros, reback_zeroed, thp_mode
from ucm_testing.memory import huge_page_bytes, huge_pages_refused

granted = pytest.mark.skipif(huge_pages_refused() is not None, reason=str(huge_pages_refused()))
FLOATS = 8 * HUGE_PAGE // 4  # 16 MiB of float32: at least seven whole 2 MiB pages inside
MADV_NOHUGEPAGE = 15


def test_the_kernels_mode_is_the_bracketed_word(tmp_path):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert thp_mode(tmp_path / "enabled") == "madvise"
    assert thp_mode(tmp_path / "missing") is None


@granted
def test_huge_zeros_are_zeros_on_huge_pages_even_in_memory_used_before():
    for _ in range(3):
        # Freed tensors: the allocator hands their pages (4 KiB, present) out again.
        for floats in (FLOATS, FLOATS // 2, FLOATS):
            torch.ones(floats)
        t = huge_zeros(FLOATS // 64, 64, dtype=torch.float32)
        assert t.shape == (FLOATS // 64, 64) and t.dtype == torch.float32
        assert not t.any()
        assert huge_page_bytes(t) >= 7 * HUGE_PAGE


@granted
def test_a_zeroed_tensor_rebacked_reads_the_same_and_is_written_on_huge_pages():
    t = torch.zeros(FLOATS)
    start, length = huge_range(t)  # on 4 KiB pages, whatever the allocator handed out
    assert _madvise(start, length, MADV_NOHUGEPAGE) and _madvise(start, length, MADV_DONTNEED)
    t.zero_()
    assert huge_page_bytes(t) == 0
    moved = reback_zeroed([t, t[:100], t.view(2, -1)[1]])  # one storage, counted once
    assert 7 * HUGE_PAGE <= moved <= t.numel() * 4 and moved % HUGE_PAGE == 0
    assert not t.any()
    t.fill_(1.5)
    assert bool((t == 1.5).all())
    assert huge_page_bytes(t) >= 7 * HUGE_PAGE


def test_tensors_without_a_whole_huge_page_or_off_the_host_are_left_alone():
    small = torch.zeros(1000)
    assert reback_zeroed([small, torch.zeros(FLOATS, device="meta")]) == 0
    small[3] = 2.0
    assert small[3] == 2.0 and small.sum() == 2.0


def test_nothing_is_given_back_where_the_kernel_grants_no_huge_pages(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    t = torch.ones(FLOATS)  # not zeros: a page given back would read 0
    assert reback_zeroed([t]) == 0
    assert bool((t == 1).all())


@pytest.mark.skipif(sys.platform != "linux" or thp_mode() == "never", reason="Linux with huge pages on the node")
def test_nothing_is_given_back_in_a_process_with_huge_pages_disabled():
    """PR_SET_THP_DISABLE (set by some container runtimes and service managers, inherited): the
    pages would come back 4 KiB, so none is given back, and the worker says why."""
    script = (
        "import ctypes, torch\n"
        "assert ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) == 0  # PR_SET_THP_DISABLE\n"
        "from ucm.hugepages import reback_zeroed, thp_refused\n"
        f"t = torch.ones({FLOATS})  # not zeros: a page given back would read 0\n"
        "print(reback_zeroed([t]), bool((t == 1).all()), thp_refused())\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "0 True huge pages are disabled for this process (PR_SET_THP_DISABLE)"
