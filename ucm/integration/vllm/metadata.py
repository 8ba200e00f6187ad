"""What the scheduler half tells the workers each step (pickled across processes: keep it small)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class BlockTransfer:
    """Move these blocks of one request between the store and the paged cache."""

    req_id: str
    store_ids: list[bytes]  # rank-0 store keys; a worker of another rank derives its own
    block_ids: list[int]  # vLLM block ids, pairwise with store_ids
    # A PD prefill's save: the step (and so the request's answer) waits until it is in the store.
    wait: bool = False


@dataclass
class BlendTransfer:
    """Blend one request's region ``[0, len(tokens))`` into its paged cache (see ``.blend``)."""

    req_id: str
    tokens: list[int]  # the region's token ids
    computed: int  # leading tokens whose KV is exact and in place once this step's loads are done
    block_ids: list[int]  # vLLM block ids covering the region
    first_block: int  # the first of them the blend writes (computed // block size)
    chunks: list[tuple[int, list[bytes]]]  # (position of a chunk, rank-0 keys of its leading stored blocks)


@dataclass
class OffloadMove:
    """A decoding request's logical blocks ``first, first + 1, ...`` leave the paged cache for the
    host arena (sparse off-load, ``.offload``); it attends them through ``slots`` from now on."""

    req_id: str
    first: int
    block_ids: list[int]  # the vLLM blocks they are in, freed this step
    arena: list[int]  # the arena blocks they move to, pairwise
    slots: list[int]  # vLLM blocks held for the request


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    blends: list[BlendTransfer] = field(default_factory=list)
    offloads: list[OffloadMove] = field(default_factory=list)
    offloaded: dict[str, int] = field(default_factory=dict)  # off-loaded requests of the step: their writing block
    released: list[str] = field(default_factory=list)  # off-loaded requests that ended or were preempted


def store_keys(block_ids: Sequence[bytes], rank: int, tp_size: int) -> list[bytes]:
    """Each worker — a tensor-parallel rank of a pipeline stage, ``rank`` of ``tp_size`` such
    shares — stores its share of a block (its heads of its layers) under its own key; one worker
    needs no suffix."""
    if tp_size == 1:
        return list(block_ids)
    suffix = rank.to_bytes(2, "little")
    return [b + suffix for b in block_ids]


def rank_keys(rank0_keys: Sequence[bytes], rank: int, tp_size: int) -> list[bytes]:
    """Rank ``rank``'s keys from the rank-0 keys the scheduler sent."""
    if tp_size == 1 or rank == 0:
        return list(rank0_keys)
    return store_keys([k[:-2] for k in rank0_keys], rank, tp_size)
