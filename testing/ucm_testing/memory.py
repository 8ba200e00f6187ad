"""What the kernel backs a tensor with, read from /proc/self/smaps."""

from __future__ import annotations

from pathlib import Path

import torch

from ucm.hugepages import huge_range


def huge_page_bytes(t: torch.Tensor, smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes of 2 MiB pages (AnonHugePages) in the mappings that overlap the whole 2 MiB pages of
    ``t``'s storage (its unaligned ends share mappings with other memory)."""
    start, length = huge_range(t)
    end = start + length
    total, inside = 0, False
    for line in smaps.read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if not first.endswith(":"):  # a mapping's header: "lo-hi perms offset dev inode [path]"
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo < end and start < hi
        elif inside and first == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
