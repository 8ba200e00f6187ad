"""Block payloads from paged KV tensors of every layout vLLM uses (CPU here for real; CUDA shapes
with CPU tensors of the same shapes and strides)."""

import pytest
import torch

from ucm.integration.vllm.layout import KVLayout, blocks_dim

NB, BS, H, D = 12, 32, 2, 64


def cpu_layout():  # vLLM CPU backend: [blocks, kv_heads, block_size, 2*head_dim]
    return torch.randn(NB, H, BS, 2 * D)


def flash_attn_legacy():  # [2, blocks, block_size, kv_heads, head_dim]
    return torch.randn(2, NB, BS, H, D)


def flashinfer():  # [blocks, 2, block_size, kv_heads, head_dim]
    return torch.randn(NB, 2, BS, H, D)


def token_major_view():  # logical [B, H, N, C] over physical [B, N, H, C] (non-contiguous)
    return torch.randn(NB, BS, H, 2 * D).permute(0, 2, 1, 3)


def bf16_cuda_shape():
    return torch.randn(2, NB, BS, 8, 128).to(torch.bfloat16)


LAYOUTS = [cpu_layout, flash_attn_legacy, flashinfer, token_major_view, bf16_cuda_shape]


def reference_payload(tensors: dict[str, torch.Tensor], block: int) -> bytes:
    out = b""
    for t in tensors.values():
        d = blocks_dim(t, NB)
        out += t.select(d, block).contiguous().view(torch.uint8).numpy().tobytes()
    return out


@pytest.mark.parametrize("make", LAYOUTS)
def test_gather_matches_per_block_reference(make):
    kv = {f"layer{i}": make() for i in range(3)}
    layout = KVLayout(kv, NB)
    blocks = [7, 0, 11, 3]
    staging = layout.new_staging(len(blocks))
    layout.gather(blocks, staging)
    for row, b in enumerate(blocks):
        assert staging[row].numpy().tobytes() == reference_payload(kv, b)


def scatter_by_layer(layout: KVLayout, blocks: list[int], staging: torch.Tensor) -> None:
    for layer in range(len(layout.slots)):  # a staged load: each layer before its attention
        layout.scatter_layer(layer, blocks, staging)


def scatter_by_block(layout: KVLayout, blocks: list[int], staging: torch.Tensor) -> None:
    for row, block in enumerate(blocks):  # a landed load: each block as the store hands it over
        layout.scatter_block(block, memoryview(staging[row].numpy()))


@pytest.mark.parametrize("scatter", [scatter_by_layer, scatter_by_block])
@pytest.mark.parametrize("make", LAYOUTS)
def test_scatter_restores_blocks_into_other_slots_and_touches_nothing_else(make, scatter):
    src = {f"layer{i}": make() for i in range(2)}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    layout_src, layout_dst = KVLayout(src, NB), KVLayout(dst, NB)
    staging = layout_src.new_staging(3)
    layout_src.gather([1, 5, 9], staging)
    scatter(layout_dst, [2, 4, 6], staging)
    for name in src:
        d = blocks_dim(src[name], NB)
        for s, t in ((1, 2), (5, 4), (9, 6)):
            assert torch.equal(src[name].select(d, s), dst[name].select(d, t))
        untouched = [b for b in range(NB) if b not in (2, 4, 6)]
        assert all(not dst[name].select(d, b).any() for b in untouched)


def test_payload_size_and_offsets():
    kv = {"a": cpu_layout(), "b": cpu_layout()}
    layout = KVLayout(kv, NB)
    per_layer = H * BS * 2 * D * 4
    assert layout.block_bytes == 2 * per_layer
    assert [s.offset for s in layout.slots] == [0, per_layer]
    assert layout.layer_index("b") == 1


def test_blocks_dim_prefers_the_outermost_when_sizes_collide():
    t = torch.zeros(2, 32, 32, 2, 64)  # num_blocks == block_size == 32
    assert blocks_dim(t, 32) == 1


def test_no_blocks_dim_is_a_clear_error():
    with pytest.raises(ValueError, match="num_blocks=99"):
        KVLayout({"layer0": torch.zeros(4, 4)}, 99)


def test_in_place_segments_are_the_payload_of_the_block():
    kv = {f"layer{i}": cpu_layout() for i in range(2)}
    layout = KVLayout(kv, NB)
    assert layout.in_place
    staging = layout.new_staging(1)
    layout.gather([4], staging)
    assert b"".join(bytes(s) for s in layout.block_segments(4)) == staging[0].numpy().tobytes()
    assert not KVLayout({"a": flash_attn_legacy()}, NB).in_place  # K and V of a block are apart


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device machine)")
@pytest.mark.parametrize("copier", ["torch", "native-cuda"])
@pytest.mark.parametrize("make", LAYOUTS)
def test_layouts_on_a_gpu_gather_to_pinned_staging_and_scatter_back(make, copier, monkeypatch):
    monkeypatch.setenv("UCM_NATIVE_CUDA", "1" if copier == "native-cuda" else "0")
    host = {f"layer{i}": make() for i in range(3)}
    kv = {name: t.cuda() for name, t in host.items()}
    layout = KVLayout(kv, NB)
    blocks = [7, 0, 11, 3]
    staging = layout.new_staging(len(blocks))
    assert staging.is_pinned()
    layout.gather(blocks, staging)
    torch.cuda.synchronize()
    for row, b in enumerate(blocks):
        assert staging[row].numpy().tobytes() == reference_payload(host, b)
    dst = {name: torch.zeros_like(t) for name, t in kv.items()}
    into = KVLayout(dst, NB)
    for layer in range(len(into.slots)):
        into.scatter_layer(layer, [2, 4, 6, 8], staging)
    torch.cuda.synchronize()
    for name in host:
        d = blocks_dim(host[name], NB)
        for s, t in zip(blocks, [2, 4, 6, 8], strict=True):
            assert torch.equal(host[name].select(d, s), dst[name].select(d, t).cpu())
        assert all(not dst[name].select(d, b).any() for b in range(NB) if b not in (2, 4, 6, 8))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [cpu_layout, token_major_view])  # vLLM 0.32's logical order, two physical ones
def test_head_shares_hold_their_heads_and_together_restore_the_block(make, device, monkeypatch):
    """store_tp: share j of k holds heads [j*H/k, (j+1)*H/k) of every layer; scattering every share of
    a block into an empty cache rebuilds it. On a GPU the shares are strided views the CUDA kernel
    cannot take as one segment per block, so this also checks the fallback copy there."""
    monkeypatch.delenv("UCM_NATIVE_CUDA", raising=False)
    host = {f"layer{i}": make() for i in range(2)}
    kv = {name: t.to(device) for name, t in host.items()}
    shares = [KVLayout(kv, NB).head_share(H, H, j) for j in range(H)]
    dst = {name: torch.zeros_like(t) for name, t in kv.items()}
    into = [KVLayout(dst, NB).head_share(H, H, j) for j in range(H)]
    blocks = [7, 0, 11]
    for j, share in enumerate(shares):
        staging = share.new_staging(len(blocks))
        share.gather(blocks, staging)
        if device == "cuda":
            torch.cuda.synchronize()
        want = {name: t.narrow(1, j, 1) for name, t in host.items()}  # blocks first, heads next
        for row, b in enumerate(blocks):
            assert staging[row].numpy().tobytes() == reference_payload(want, b)
        for layer in range(len(into[j].slots)):
            into[j].scatter_layer(layer, [1, 2, 3], staging)
    if device == "cuda":
        torch.cuda.synchronize()
    for name in host:
        for s, t in zip(blocks, [1, 2, 3], strict=True):
            assert torch.equal(host[name][s], dst[name][t].cpu())
