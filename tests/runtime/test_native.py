"""The native transfer layer matches the torch reference byte for byte; ucm works without it."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from ucm import native

ucm_native = pytest.importorskip("ucm_native", reason="make dev builds runtime/native")
NB = 12


def layouts(dtype: torch.dtype) -> dict[str, list[tuple[torch.Tensor, int]]]:
    g = torch.Generator().manual_seed(7)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    padded = rand(2, NB + 5, 4, 3, 8)
    wide = rand(NB, 4, 4, 24)
    return {
        # vLLM CPU: per layer [num_blocks, kv_heads, block_size, 2*head_dim]
        "blocks-first": [(rand(NB, 2, 4, 16), 0) for _ in range(3)],
        # FlashAttention: per layer [2, num_blocks, block_size, kv_heads, head_dim] (K/V = 2 chunks)
        "kv-first": [(rand(2, NB, 4, 3, 8), 1) for _ in range(2)],
        # Non-contiguous: blocks strided past padding, and a slice of a wider tensor.
        "strided": [(padded[:, :NB], 1), (wide[:, 1:3], 0)],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["blocks-first", "kv-first", "strided"])
@pytest.mark.parametrize("threads", [1, 3])
def test_gather_and_scatter_match_torch(dtype, layout, threads):
    layers = layouts(dtype)[layout]
    assert all(native.segment_of(t, d) is not None for t, d in layers)
    blocks = [5, 0, 11, 5, 7]  # repeats allowed
    width = native.payload_bytes(layers)
    got = torch.zeros(len(blocks), width + 16, dtype=torch.uint8)  # rows longer than a payload
    want = torch.zeros_like(got)
    native.gather(layers, blocks, got, threads)
    native.torch_move(layers, blocks, want, to_buffer=True)
    assert torch.equal(got, want)

    fill = torch.randint(0, 255, (3, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    mine = [(t.clone(), d) for t, d in layers]
    ref = [(t.clone(), d) for t, d in layers]
    native.scatter(mine, [1, 9, 4], fill, threads)
    native.torch_move(ref, [1, 9, 4], fill, to_buffer=False)
    for (a, _), (b, _) in zip(mine, ref, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_layout_that_is_no_segment_falls_back_to_torch():
    t = torch.randn(NB, 4, 8).transpose(1, 2)  # inner dimensions not contiguous
    assert native.segment_of(t, 0) is None
    buf = torch.zeros(2, native.payload_bytes([(t, 0)]), dtype=torch.uint8)
    native.gather([(t, 0)], [3, 1], buf)
    assert torch.equal(buf[0].view(torch.float32), t[3].contiguous().flatten())


def test_bad_buffers_are_refused():
    layers = layouts(torch.float32)["blocks-first"]
    with pytest.raises(ValueError, match="fewer than"):
        native.gather(layers, [1, 2], torch.zeros(1, 10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        native.gather(layers, [1], torch.zeros(1, 10))


def test_ucm_works_without_the_extension():
    code = (
        "import sys; sys.modules['ucm_native'] = None\n"
        "import torch; from ucm import native\n"
        "assert not native.available()\n"
        "t = torch.arange(24.).view(4, 6); b = torch.zeros(2, 24, dtype=torch.uint8)\n"
        "native.gather([(t, 0)], [2, 0], b)\n"
        "assert torch.equal(b[0].view(torch.float32), t[2])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_cuda_kernels_were_built_where_nvcc_exists():
    """Compile-only here: the CUDA sources are built for sm_80 and sm_90a whenever nvcc exists."""
    assert ucm_native.cuda == (shutil.which("nvcc") is not None)


def test_the_cuda_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("UCM_NATIVE_CUDA", "0")
    assert not native.cuda_available()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device machine)")
@pytest.mark.parametrize("buffer", ["pinned", "device", "pageable"])
@pytest.mark.parametrize("layout", ["blocks-first", "kv-first", "strided", "many-layers"])
def test_cuda_gather_scatter_match_torch(layout, buffer, monkeypatch):
    """Pinned host and device buffers go through the kernel; pageable memory, which the kernel
    cannot reach, through torch. More layers than fit one launch's fixed table once did (64)."""
    monkeypatch.delenv("UCM_NATIVE_CUDA", raising=False)  # on by default
    assert native.cuda_available()
    if layout == "many-layers":
        host = [(torch.randn(NB, 2, 4, 16).to(torch.bfloat16), 0) for _ in range(70)]
    else:
        host = layouts(torch.bfloat16)[layout]
    layers = [(t.cuda(), d) for t, d in host]
    assert native.reachable(layers, torch.empty(1, dtype=torch.uint8).pin_memory())
    blocks = [5, 0, 11, 5, 7]
    width = native.payload_bytes(layers)
    got = torch.zeros(len(blocks), width, dtype=torch.uint8)
    got = {"pinned": got.pin_memory(), "device": got.cuda(), "pageable": got}[buffer]
    assert native.reachable(layers, got) == (buffer != "pageable")
    want = torch.zeros(len(blocks), width, dtype=torch.uint8)
    native.gather(layers, blocks, got)
    native.torch_move(layers, blocks, want, to_buffer=True)
    assert torch.equal(got.cpu(), want)
    mine = [(t.clone(), d) for t, d in layers]
    ref = [(t.clone(), d) for t, d in layers]
    native.scatter(mine, blocks[:3], got)
    native.torch_move(ref, blocks[:3], got, to_buffer=False)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(mine, ref, strict=True))
