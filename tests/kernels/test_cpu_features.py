"""CPU feature probing and the choices made from it, on the flag lines of the project's two machine
types (an AVX2-only AMD EPYC and an AVX-512 Zen 4) and on features taken away."""

from __future__ import annotations

import pytest

from kvpilot.kernels import cpu_features

AVX2_EPYC = "flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2 vaes vpclmulqdq"
ZEN4 = (AVX2_EPYC + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni"
        " avx512_bitalg avx512_vpopcntdq")


def test_an_avx2_cpu_gets_no_avx512_path():
    features = cpu_features.parse(AVX2_EPYC)
    assert features.has("avx2", "fma") and not features.avx512
    assert not features.onednn_bf16_prepack and not features.native_bf16
    assert features.int8_matmul_isa == "avx2"
    assert features.compile_flags() == ()


def test_the_int8_kernel_needs_avx2_and_fma_at_least():
    assert cpu_features.parse(AVX2_EPYC, "-avx2").int8_matmul_isa is None
    assert cpu_features.parse(AVX2_EPYC, "-fma").int8_matmul_isa is None
    assert cpu_features.parse(AVX2_EPYC.replace(" f16c", "")).int8_matmul_isa is None  # its float16 scales


def test_an_avx512_bf16_vnni_cpu_gets_every_path():
    features = cpu_features.parse(ZEN4)
    assert features.avx512 and features.native_bf16 and features.onednn_bf16_prepack
    assert features.int8_matmul_isa == "avx512_vnni"


def test_avx_ne_convert_alone_allows_onednn_bfloat16_reorder():
    features = cpu_features.parse(AVX2_EPYC + " avx_vnni avx_ne_convert")
    assert features.onednn_bf16_prepack and not features.native_bf16


def test_removing_a_feature_removes_what_builds_on_it_and_turns_it_off_in_builds():
    features = cpu_features.parse(ZEN4, "-avx512f")
    assert not features.avx512 and not features.has("avx512_vnni") and not features.has("avx512_bf16")
    assert not [name for name in features.flags if name.startswith("avx512")]  # VBMI, BITALG, ... too
    assert features.has("avx2") and features.int8_matmul_isa == "avx2"  # what tests use to run the AVX2 path
    assert "-mno-avx512f" in features.compile_flags() and "-mno-avx512vnni" in features.compile_flags()
    assert "removed by KVPILOT_CPU_FEATURES" in features.summary()
    assert cpu_features.parse(ZEN4, "-avx512_vnni").int8_matmul_isa == "avx2"
    assert cpu_features.parse(ZEN4, "-avx512_vnni").native_bf16
    assert cpu_features.parse(ZEN4, "-avx2").int8_matmul_isa is None


def test_a_feature_cannot_be_added():
    with pytest.raises(ValueError, match="KVPILOT_CPU_FEATURES: 'avx512f': only features can be removed"):
        cpu_features.parse(AVX2_EPYC, "avx512f")


def test_this_machine_is_probed():
    features = cpu_features.detect()
    assert features.flags  # /proc/cpuinfo on Linux
    assert features.summary()


@pytest.mark.parametrize("saved,cpu,expected", [
    ("float32", ZEN4, "float32"),  # a float32 checkpoint is asked for in full precision
    ("bfloat16", ZEN4, "bfloat16"), ("bfloat16", AVX2_EPYC, "float32"),  # not emulated bfloat16 on AVX2
    ("float16", AVX2_EPYC, "float32"), (None, ZEN4, "bfloat16"), (None, AVX2_EPYC, "float32"),  # None: a GGUF
])
def test_dtype_auto_follows_the_cpu(saved, cpu, expected):
    from kvpilot.engine.startup import auto_cpu_dtype

    assert auto_cpu_dtype(saved, cpu_features.parse(cpu)) == expected


@pytest.mark.skipif(not cpu_features.parse(cpu_features.cpu_flags_line()).has("avx2"), reason="no AVX2 to run as")
def test_as_avx2_runs_kvpilot_torch_and_onednn_without_avx512():
    """scripts/as-avx2.sh: kvpilot's features, torch's ATen kernels and oneDNN's all stop at AVX2."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "as-avx2.sh"
    probe = ("import os, torch; from kvpilot.kernels import cpu_features as c; f = c.detect(); "
             "print(f.avx512, f.has('avx_vnni'), f.int8_matmul_isa, torch.backends.cpu.get_cpu_capability(), "
             "os.environ['ONEDNN_MAX_CPU_ISA'])")
    out = subprocess.run([str(script), sys.executable, "-P", "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "avx2", "AVX2", "AVX2"]
