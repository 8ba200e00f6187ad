"""Whether this CPU has bfloat16 arithmetic: read from /proc/cpuinfo's flags."""

from ucm.cpu import native_bfloat16

# Trimmed /proc/cpuinfo of the machines this project has run on, and of an Arm server.
AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2\n"
AMX = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
AVX512_BF16 = "flags\t\t: avx2 avx512f avx512bw avx512_bf16\n"
AVX512 = "flags\t\t: avx2 avx512f avx512bw avx512_vnni\n"  # a Skylake/Cascade Lake Xeon
ARM = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"
ARM_OLD = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n"


def test_bfloat16_arithmetic_is_read_from_the_cpu_flags():
    assert native_bfloat16(AMX) and native_bfloat16(AVX512_BF16) and native_bfloat16(ARM)
    assert not native_bfloat16(AVX2) and not native_bfloat16(AVX512) and not native_bfloat16(ARM_OLD)


def test_without_flags_nothing_changes():
    assert native_bfloat16("") and native_bfloat16("model name\t: something\n")
    assert isinstance(native_bfloat16(), bool)  # this machine's, read from /proc/cpuinfo
