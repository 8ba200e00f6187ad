"""A store that holds nothing: every lookup misses. The baseline for measuring the others."""

from __future__ import annotations

from collections.abc import Sequence

from ucm.config import StrictModel
from ucm.store.base import Blob, Store, Task


class EmptyConfig(StrictModel):
    pass


class EmptyStore(Store):
    backend = "empty"

    def _lookup(self, ids: Sequence[bytes]) -> list[bool]:
        return [False] * len(ids)

    def _dump(self, ids: Sequence[bytes], payloads: Sequence[Blob]) -> Task:
        return Task.completed([True] * len(ids))  # accepted and dropped

    def _load(self, ids: Sequence[bytes], buffers: Sequence[Blob]) -> Task:
        return Task.completed([False] * len(ids))

    def remove(self, ids: Sequence[bytes]) -> list[bool]:
        return [False] * len(ids)
