"""What the kernel backs memory with, read from /proc/self/smaps; and whether it grants this
process 2 MiB pages at all."""

from __future__ import annotations

import ctypes
import functools
import mmap
from pathlib import Path

import torch

from ucm.hugepages import HUGE_PAGE, PR_GET_THP_DISABLE, huge_range, thp_mode

SMAPS = Path("/proc/self/smaps")


def huge_page_bytes(t: torch.Tensor, smaps: Path = SMAPS) -> int:
    """Bytes of 2 MiB pages (AnonHugePages) in the mappings that overlap the whole 2 MiB pages of
    ``t``'s storage (its unaligned ends share mappings with other memory)."""
    start, length = huge_range(t)
    return anon_huge_bytes(start, start + length, smaps)


def anon_huge_bytes(start: int, end: int, smaps: Path = SMAPS) -> int:
    """Bytes of 2 MiB pages (AnonHugePages) in the mappings that overlap ``[start, end)``."""
    total, inside = 0, False
    for line in smaps.read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if not first.endswith(":"):  # a mapping's header: "lo-hi perms offset dev inode [path]"
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo < end and start < hi
        elif inside and first == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


@functools.cache
def huge_pages_refused() -> str | None:
    """Why this process gets no 2 MiB pages when it asks for them (None: it gets them). Beyond the
    kernel's mode, a process may have them disabled (``PR_SET_THP_DISABLE``, inherited) and a node
    may have no free huge page to give (fragmented memory, ``defrag`` off): a probe of its own,
    asked with ``madvise`` directly (not through the code under test), tells. The mode and flag are
    read here too rather than through ``ucm.hugepages.thp_refused``, for the same reason."""
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        return f"transparent_hugepage is {mode!r} here: the kernel grants no huge pages"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1:
        return "huge pages are disabled for this process (PR_SET_THP_DISABLE)"
    try:
        # Private: a shared anonymous mapping is shmem, which anonymous huge pages never back.
        probe = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # 3+ whole 2 MiB pages
    except OSError as exc:
        return f"huge pages cannot be probed here: {exc}"
    try:
        probe.madvise(mmap.MADV_HUGEPAGE)
        for offset in range(0, len(probe), mmap.PAGESIZE):
            probe[offset] = 1
        view = ctypes.c_char.from_buffer(probe)
        start = ctypes.addressof(view)
        del view  # the mapping cannot close while a view of it is alive
        if anon_huge_bytes(start, start + len(probe)) == 0:
            return "the kernel backed a probe with no huge page (memory too fragmented, or defrag off)"
    except OSError as exc:  # a sandbox without /proc/self/smaps
        return f"huge pages cannot be probed here: {exc}"
    finally:
        probe.close()
    return None
