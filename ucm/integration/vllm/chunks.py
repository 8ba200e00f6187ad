"""Where a prompt's chunks are, for Blend: the prompt cut at each occurrence of the separator's
tokens. Every part but the last is a chunk; the last (the question) is always computed.

A chunk's KV is stored under the block ids its tokens have as a prompt of their own
(``BlockHasher.block_ids(chunk)``: model, dtype, block size, deployment and request salt bound in
as for any prefix, nothing of what precedes the chunk), computed at positions from 0. So a chunk
prefilled alone, or as the start of a prompt, is cached by the ordinary save path, and another
model or tenant never finds it.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_chunks(prompt: Sequence[int], separator: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of ``prompt``, in order; the separators and the part after the
    last one belong to none; empty chunks are left out. No separator: no chunks."""
    if not separator:
        raise ValueError("separator: no tokens")
    first, n = separator[0], len(separator)
    bounds = []
    start = 0
    i = 0
    end = len(prompt) - n
    while i <= end:
        if prompt[i] == first and list(prompt[i : i + n]) == list(separator):
            if i > start:
                bounds.append((start, i))
            start = i + n
            i = start
        else:
            i += 1
    return bounds
