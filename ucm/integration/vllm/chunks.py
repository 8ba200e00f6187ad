"""Where a prompt's chunks are, for Blend: the prompt cut at each occurrence of the separator's
tokens (every part but the last is a chunk; the last, the question, is always computed), or the
boundaries a client gave in ``kv_transfer_params.ucm_chunks`` (token offsets; tokens in no chunk
are computed, as a separator's are).

A chunk's KV is stored under the block ids its tokens have as a prompt of their own
(``BlockHasher.block_ids(chunk)``: model, dtype, block size, deployment and request salt bound in
as for any prefix, nothing of what precedes the chunk), computed at positions from 0. So a chunk
prefilled alone, or as the start of a prompt, is cached by the ordinary save path, and another
model or tenant never finds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FIELD = "kv_transfer_params.ucm_chunks"


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


def explicit_chunks(value: Any, num_tokens: int, limit: int, field: str = FIELD) -> list[tuple[int, int]]:
    """A client's ``[[start, end], ...]`` (token offsets into a prompt of ``num_tokens``, in order, not
    overlapping, none empty, at most ``limit`` of them) as :func:`split_chunks` gives chunks;
    ValueError naming the entry (the proxy checks its own ``ucm_chunks`` field with this too)."""
    if not isinstance(value, list):
        raise ValueError(f"{field}: expected a list of [start, end] token offsets, got {type(value).__name__}")
    if len(value) > limit:  # before reading entries: the scheduler checks on every lookup
        raise ValueError(f"{field}: at most {limit} chunks, got {len(value)}")
    bounds: list[tuple[int, int]] = []
    previous = 0
    for i, pair in enumerate(value):
        ok = isinstance(pair, list) and len(pair) == 2
        if not ok or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair):
            raise ValueError(f"{field}[{i}]: expected [start, end], two integers, got {pair!r}")
        start, end = pair
        if not previous <= start < end <= num_tokens:
            raise ValueError(
                f"{field}[{i}]: [{start}, {end}] must satisfy {previous} <= start < end <= {num_tokens} "
                "(chunks in order, not overlapping, not empty, inside the prompt)"
            )
        bounds.append((start, end))
        previous = end
    return bounds
