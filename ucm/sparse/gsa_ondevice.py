"""GSA on-device: sign-bit hashes of keys and queries, blocks scored by Hamming distance.

Keys and queries are projected with a Haar-random orthogonal matrix (QR of a Gaussian, seeded,
sign-corrected), and each projected coordinate's sign becomes one bit, packed 8 to a byte. Signs
of random rotations preserve angles (SimHash): a small Hamming distance means a large dot product.
A block's distance for a query head is the smallest distance of its tokens; a KV head sums it over
its query group; the ``k`` nearest blocks are kept (plus sink and local windows). Key hashes are
computed once per token, as blocks fill (the hash cache), so selection costs XOR + popcount.
"""

from __future__ import annotations

import torch

from ucm.sparse.base import BlockMeta, BlockSelector, PagedKV, group_query
from ucm.sparse.options import GSAOnDeviceConfig

_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.uint8)


def haar_orthogonal(d: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r))  # makes the distribution Haar (uniform over rotations)
    return q.to(device=device, dtype=torch.float32)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """(..., bits) floats -> (..., bits/8) uint8, bit i of byte j = sign of coordinate 8j+i."""
    bits = (x > 0).to(torch.uint8).view(*x.shape[:-1], -1, 8)
    weights = 1 << torch.arange(8, dtype=torch.uint8, device=x.device)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def hamming(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bit distance between packed hashes, broadcasting over leading dims: (...,)."""
    return _POPCOUNT.to(a.device)[torch.bitwise_xor(a, b).long()].sum(-1, dtype=torch.int32)


class GSAOnDevice(BlockSelector):
    def __init__(
        self, head_dim: int, config: GSAOnDeviceConfig | None = None, device: str = "cpu", shared: bool = False
    ) -> None:
        config = config or GSAOnDeviceConfig()
        bits = config.hash_bits or head_dim
        if bits % 8 or not 8 <= bits <= head_dim:
            raise ValueError(
                f"hash_bits: must be a multiple of 8 in [8, head_dim={head_dim}] (a rotation of head_dim "
                f"dimensions gives at most head_dim sign bits), got {bits}"
            )
        self.config = config or GSAOnDeviceConfig()
        self.shared = shared
        self.projection = haar_orthogonal(head_dim, config.seed, device)[:, :bits]
        self._key_hashes = torch.empty(0, dtype=torch.uint8)  # (tokens, Hkv, bytes), the hash cache
        self.hashed_tokens = 0

    def hash(self, x: torch.Tensor) -> torch.Tensor:
        return pack_signs(x.to(self.projection.dtype) @ self.projection)

    def update(self, kv: PagedKV) -> torch.Tensor:
        """Hash the keys of tokens added since the last call; returns all key hashes (N, Hkv, bytes)."""
        if kv.num_tokens > self.hashed_tokens:
            b = kv.block_size
            first, offset = divmod(self.hashed_tokens, b)
            keys = kv.keys[kv.block_table[first : kv.num_blocks]].flatten(0, 1)  # (tokens, Hkv, D)
            new = self.hash(keys[offset : offset + kv.num_tokens - self.hashed_tokens])
            self._key_hashes = torch.cat([self._key_hashes.to(new.device), new])
            self.hashed_tokens = kv.num_tokens
        return self._key_hashes

    def block_distances(self, q: torch.Tensor, kv: PagedKV) -> torch.Tensor:
        """(Hkv, n): per KV head, the sum over its query heads of each block's nearest-token distance."""
        keys = self.update(kv)  # (N, Hkv, bytes)
        hkv = keys.shape[1]
        qh = self.hash(group_query(q, hkv))  # (Hkv, G, bytes)
        dist = hamming(qh[:, :, None, :], keys.permute(1, 0, 2)[:, None, :, :])  # (Hkv, G, N)
        n, b = kv.num_blocks, kv.block_size
        pad = n * b - kv.num_tokens
        big = torch.iinfo(torch.int32).max // 4
        dist = torch.nn.functional.pad(dist, (0, pad), value=big)
        return dist.view(hkv, -1, n, b).amin(-1).sum(1)

    def select(self, q: torch.Tensor, kv: PagedKV, meta: BlockMeta | None = None, step: int = 0) -> torch.Tensor:
        # Its own metadata is the key-hash cache; block statistics are not needed.
        return self.config.choose(-self.block_distances(q, kv).float(), kv.block_size, self.shared)
