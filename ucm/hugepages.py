"""Transparent huge pages (2 MiB) for the host memory decode reads at scattered places: a CPU
engine's KV cache and sparse attention's off-load arena.

A decode step reads each request's blocks wherever the allocator put them. With 4 KiB pages a
block of one layer and KV head (4 KiB of keys at 32 tokens and head dim 64 in bfloat16) is a page
of its own, so nearly every block read misses the TLB and walks the page tables; a 2 MiB page holds
hundreds of them. Linux backs an anonymous range with 2 MiB pages when the program asks
(``madvise(MADV_HUGEPAGE)``), and the common default of ``transparent_hugepage`` ("madvise", as on
this project's machines) gives them to no program that does not ask. vLLM does not ask.

Measured on a 2-core AVX-512 EPYC (``benchmarks/sparse_serving.py`` at 32,000 tokens, 8 rows, both
page sizes side by side; docs/benchmarks/sparse_serving.md, "Huge pages"): GSA, whose blocks are
scattered, decoded 1.09x faster on huge pages (median of 8 paired rounds); dense and the static
window, which read runs of neighbouring blocks, no faster.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+
PR_GET_THP_DISABLE = 42
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), None where unknown."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def thp_refused() -> str | None:
    """Why asking for huge pages would change nothing in this process (None: the kernel may grant
    them): the node's mode is "never", or the process has them disabled (``PR_SET_THP_DISABLE``,
    which container runtimes and service managers can set and children inherit)."""
    if thp_mode() == "never":
        return "transparent_hugepage is 'never' on this node"
    if _libc is not None and _libc.prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1:
        return "huge pages are disabled for this process (PR_SET_THP_DISABLE)"
    return None


def huge_range(t: torch.Tensor) -> tuple[int, int]:
    """(start, length) of the whole 2 MiB pages inside ``t``'s storage (length 0: none)."""
    storage = t.untyped_storage()
    begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    start = -(-begin // HUGE_PAGE) * HUGE_PAGE
    return start, max(0, end // HUGE_PAGE * HUGE_PAGE - start)


def _madvise(start: int, length: int, advice: int) -> bool:
    if _libc is None or length == 0:
        return False
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), ctypes.c_int(advice)) == 0:
        return True
    logger.info("madvise(%d) of %d bytes refused: errno %d; 4 KiB pages stay", advice, length, ctypes.get_errno())
    return False


def _reback(t: torch.Tensor) -> int:
    """Bytes of ``t``'s whole 2 MiB pages asked for huge pages and given back (their next touch
    faults in a zeroed huge page): pages already present would otherwise stay 4 KiB."""
    start, length = huge_range(t)
    return length if _madvise(start, length, MADV_HUGEPAGE) and _madvise(start, length, MADV_DONTNEED) else 0


def huge_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on 2 MiB pages where the kernel grants them. The
    allocator may hand out memory used before (4 KiB pages, present): it is given back first, and
    the zeroing faults in huge pages."""
    t = torch.empty(shape, dtype=dtype)
    if not thp_refused():
        _reback(t)
    return t.zero_()


def reback_zeroed(tensors: Iterable[torch.Tensor]) -> int:
    """Move host tensors that hold only zeros, and that nothing reads but through them, onto 2 MiB
    pages; returns the bytes moved. Each distinct storage's whole 2 MiB pages are asked for huge
    pages and given back (``MADV_DONTNEED``): their next touch faults in a zeroed huge page, so the
    contents read the same. Present pages would otherwise stay 4 KiB until the kernel's background
    collapse gets to them (16 MiB every 10 s by default), and collapsing them now copies every page
    (~2.4 s per GiB here).

    Only private memory of this process qualifies: pinned tensors (a GPU copies through their
    pages) are left alone. The pages are faulted in again at once where the kernel can
    (``MADV_POPULATE_WRITE``), as ``torch.zeros`` had them: no first-touch faults while serving.
    Nothing is done where the kernel would not grant them (:func:`thp_refused`: the pages would
    come back 4 KiB).

    For vLLM's KV cache at registration: allocated with ``torch.zeros`` and registered before any
    forward pass, so no request's KV is in it yet."""
    if thp_refused():
        return 0
    moved, seen = 0, set()
    for t in tensors:
        if t.device.type != "cpu" or t.is_pinned() or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        done = _reback(t)
        if done:
            _madvise(huge_range(t)[0], done, MADV_POPULATE_WRITE)
        moved += done
    return moved
