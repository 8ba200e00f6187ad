"""KVStar: multi-step retrieval with pruned, compressed block representations.

Retrieval (top-k of mean-key scores, as ESA) runs every ``retrieval_stride`` steps and its result
is reused in between. Representations are shrunk twice: only the share
``blk_repre_dim_prune_ratio`` of channels (UCM's name and meaning: 0.5 keeps half) whose block means
vary most (per KV head) take part in scores, since near-constant channels add the same to every
block; and they are stored in ``store_dtype`` (float16 by default). Both cut the cost of scoring;
benchmarks/sparse_eval.py measures what they cost in recall.
"""

from __future__ import annotations

import torch

from ucm.sparse.base import BlockMeta, BlockSelector, PagedKV, group_query
from ucm.sparse.esa import Reused
from ucm.sparse.options import KVStarConfig


def pruned_representation(
    means: torch.Tensor, keep: int | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, Hkv, D) means -> (channels (Hkv, r), representation (n, Hkv, r) in ``dtype``)."""
    n, hkv, d = means.shape
    r = d if keep is None else min(keep, d)
    var = means.float().var(0, unbiased=False) if n > 1 else torch.ones(hkv, d, device=means.device)
    channels = torch.topk(var, r, dim=-1).indices  # (Hkv, r)
    rep = torch.gather(means, 2, channels[None].expand(n, -1, -1))
    return channels, rep.to(dtype)


class KVStar(BlockSelector):
    def __init__(self, config: KVStarConfig | None = None, shared: bool = False) -> None:
        self.config = config or KVStarConfig()
        self.shared = shared
        self._reuse = Reused()
        self.retrievals = 0

    def select(self, q: torch.Tensor, kv: PagedKV, meta: BlockMeta, step: int = 0) -> torch.Tensor:
        c = self.config
        if self._reuse.selection is None or step % c.retrieval_stride == 0:
            meta.update(kv)  # metadata is needed only when retrieving
            keep = c.keep_dims(meta.mean.shape[2])
            channels, rep = pruned_representation(meta.mean, keep, getattr(torch, c.store_dtype))
            qg = group_query(q, rep.shape[1]).sum(1)  # (Hkv, D)
            q_r = torch.gather(qg, 1, channels)  # (Hkv, r)
            scores = torch.einsum("hr,nhr->hn", q_r.float(), rep.float())
            self._reuse.set(c.choose(scores, kv.block_size, self.shared))
            self.retrievals += 1
        return self._reuse.with_recent(kv.num_blocks, c.windows(kv.block_size)[1])
