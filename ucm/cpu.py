"""What this machine's CPU computes in hardware, for choices that cost two orders of magnitude when wrong.

vLLM's CPU build runs ``--dtype auto`` in bfloat16 on every x86 CPU — float32 weights included (it
lists bfloat16 first among the CPU's dtypes). Without AVX512-BF16 or AMX the CPU has no bfloat16
arithmetic and each product goes through conversions: on a 2-core AVX2 machine a bfloat16 matmul of
a small model's shapes ran ~100x slower than float32 (1 against 143 GFLOPS), and a 135M-parameter
model prefilled ~40 tokens/s.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# The flags that mean bfloat16 arithmetic: x86's (/proc/cpuinfo "flags") and Arm's ("Features").
BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def native_bfloat16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU multiplies bfloat16 in hardware. ``cpuinfo``: /proc/cpuinfo's text (read when
    not given); where it cannot be read (not Linux) the answer is True, so that nothing changes."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return True
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            return not BFLOAT16_FLAGS.isdisjoint(value.split())
    return True
