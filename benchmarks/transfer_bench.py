"""The transfer layer: KV block gather/scatter, native vs torch vs the limit; block files, store vs raw.

Gather/scatter: a request's blocks between paged KV tensors of a realistic layout (32 layers, each
[2 (K/V), num_blocks, block_tokens, 8 KV heads, 128 dim] bf16, FlashAttention's layout: 2 chunks
per layer and block) and a contiguous buffer, at 1 and 2 threads:
  native   ucm_native.gather / scatter (runtime/native)
  torch    the reference (index_select + copy per layer; what runs without the extension), with
           torch's intra-op threads set to the same count
  memcpy   one parallel memcpy of the same total bytes (the limit)
at 32-token blocks (64 KiB per chunk) and 8-token blocks (16 KiB, "small").

Files: the same payload as one file per block in the posix store's directory layout, read back
with plain Python preads (raw, the baseline) and by the posix store itself (buffered and O_DIRECT).
(A native batch file reader was measured here at 1.03-1.06x raw, against the store's 0.94x; it did
not fit the store's segmented, checksummed reads, so it no longer ships.)

    python benchmarks/transfer_bench.py --quick --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from store_bench import Raw, store_case, timed  # benchmarks/ is on sys.path when run as a script

from ucm import native
from ucm.store import create_store

LAYERS, HEADS, DIM = 32, 8, 128


def median_time(fn: Any, trials: int) -> float:
    fn()  # warm: page faults, thread start, caches
    return statistics.median(timed(fn) for _ in range(trials))


def kv_case(
    block_tokens: int, pool_blocks: int, request_blocks: int, threads: int, trials: int
) -> tuple[dict[str, float], bool]:
    """GB/s of each copy, and whether the native gather's bytes are the reference's."""
    layers = [(torch.randn(2, pool_blocks, block_tokens, HEADS, DIM, dtype=torch.bfloat16), 1) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(0)
    blocks = torch.randperm(pool_blocks, generator=g)[:request_blocks].tolist()
    width = native.payload_bytes(layers)
    buf = torch.empty(request_blocks, width, dtype=torch.uint8)
    src = torch.randint(0, 255, buf.shape, dtype=torch.uint8)  # written: untouched pages read as zeros, fast
    total = buf.numel()
    gb = total / 1e9
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)  # torch gets the same threads as the native copy
    try:
        out = {
            "native_gather": gb / median_time(lambda: native.gather(layers, blocks, buf, threads), trials),
            "native_scatter": gb / median_time(lambda: native.scatter(layers, blocks, buf, threads), trials),
            "torch_gather": gb / median_time(lambda: native.torch_move(layers, blocks, buf, True), trials),
            "torch_scatter": gb / median_time(lambda: native.torch_move(layers, blocks, buf, False), trials),
        }
    finally:
        torch.set_num_threads(saved)
    mc = median_time(lambda: native._native.memcpy(buf.data_ptr(), src.data_ptr(), total, threads), trials)
    out["memcpy"] = gb / mc
    reference = torch.empty_like(buf)
    native.torch_move(layers, blocks, reference, True)
    native.gather(layers, blocks, buf, threads)
    return {k: round(v, 3) for k, v in out.items()}, torch.equal(buf, reference)


def files_case(root: Path, block_bytes: int, n: int, threads: int, trials: int) -> dict[str, float]:
    data = [torch.randint(0, 255, (block_bytes,), dtype=torch.uint8) for _ in range(n)]
    dst = [torch.empty(block_bytes, dtype=torch.uint8) for _ in range(n)]
    src_views = [memoryview(d.numpy()) for d in data]
    dst_views = [memoryview(d.numpy()) for d in dst]
    gb = block_bytes * n / 1e9
    out: dict[str, float] = {}

    raw = Raw(root / "raw", threads, fsync=False)
    ids = [os.urandom(32) for _ in range(n)]
    out["raw_dump"] = gb / timed(lambda: raw.write(ids, src_views))
    out["raw_load"] = gb / median_time(lambda: raw.read(ids, dst_views), trials)
    for direct in (False, True):
        (root / f"store-{direct}").mkdir()
        store = create_store(
            {
                "spec": "posix",
                "posix": {"roots": [str(root / f"store-{direct}")], "io_threads": threads, "direct_io": direct},
            }
        )
        samples = [store_case(store, src_views, dst_views) for _ in range(trials)]
        name = "posix_direct" if direct else "posix"
        out[f"{name}_dump"] = gb / statistics.median(s[0] for s in samples)
        out[f"{name}_load"] = gb / statistics.median(s[1] for s in samples)
        store.close()
    return {k: round(v, 3) for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer blocks and trials")
    p.add_argument("--smoke", action="store_true", help="4 blocks, 1 trial: the flow at its smallest (make test)")
    p.add_argument("--dir", help="where block files go (default: a temporary directory here, on disk)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if not native.available():
        print("transfer_bench: ucm_native is not installed (make dev builds runtime/native)", file=sys.stderr)
        return 2
    trials = 1 if args.smoke else 3 if args.quick else 7
    request = 4 if args.smoke else 16 if args.quick else 64
    report: dict[str, Any] = {"layout": f"{LAYERS} layers x [2, blocks, tokens, {HEADS}, {DIM}] bf16", "kv": {}}
    same = []
    for tokens in (32, 8):
        for threads in (1, 2):
            case, equal = kv_case(tokens, 4 * request, request, threads, trials)
            report["kv"][f"block{tokens}_threads{threads}"] = case
            same.append(equal)
            print(
                f"block {tokens:>2} tokens, {threads} thread(s): " + ", ".join(f"{k} {v} GB/s" for k, v in case.items())
            )
    with tempfile.TemporaryDirectory(dir=args.dir or ".") as tmp:
        blocks = 4 if args.smoke else 32 if args.quick else 128
        report["files"] = files_case(Path(tmp).resolve(), 2 << 20, blocks, threads=2, trials=trials)
    print("files, 2 MiB blocks, 2 threads: " + ", ".join(f"{k} {v} GB/s" for k, v in report["files"].items()))

    big, small = report["kv"]["block32_threads2"], report["kv"]["block8_threads1"]
    report["native_vs_memcpy"] = round(min(big["native_gather"], big["native_scatter"]) / big["memcpy"], 2)
    report["native_vs_torch"] = round(
        min(small["native_gather"] / small["torch_gather"], small["native_scatter"] / small["torch_scatter"]), 2
    )
    report["native_gather_equals_torch"] = all(same)  # every case's bytes, not only its speed
    f = report["files"]
    report["posix_store_load_vs_raw"] = round(f["posix_load"] / f["raw_load"], 2)
    for key in ("native_vs_memcpy", "native_vs_torch", "posix_store_load_vs_raw", "native_gather_equals_torch"):
        print(f"{key:28} {report[key]}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
