"""The tensor-core kernels' key-tile loop, read from SASS: the reader itself, and an instruction
budget per mma that the shipped kernels keep (a static count, not a timing)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import ROOT

from cuonline.toolchain import nvrtc, sass
from cuonline.kernels.specs import AttentionMmaSpec

pytestmark = pytest.mark.slow   # the fast tier (-m 'not slow') leaves it out

SAMPLE = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_3:
        /*0010*/                   IADD3 R4, R4, 0x1, RZ ;
.L_x_4:
        /*0020*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0030*/                   HMMA.16816.F32 R12, R8, R6, R12 ;
        /*0040*/              @!P0 BRA `(.L_x_5) ;
        /*0050*/                   FMUL R12, R12, 0.5 ;
.L_x_5:
        /*0060*/                   HMMA.16816.F32 R16, R8, R6, R16 ;
        /*0070*/               @P1 BRA `(.L_x_4) ;
        /*0080*/               @P2 BRA `(.L_x_3) ;
        /*0090*/                   EXIT ;
"""


def test_loop_reader_takes_the_innermost_loop_around_every_mma():
    lines = sass.key_tile_loop(SAMPLE)
    assert lines[0] == ".L_x_4:" and "BRA `(.L_x_4)" in lines[-1]
    assert sass.loop_mix(SAMPLE) == {"LDSM": 1, "HMMA": 2, "BRA": 2, "FMUL": 1}
    mix = sass.LoopMix("k", "sm_90", 0, sass.loop_mix(SAMPLE))
    assert (mix.instructions, mix.mma, mix.per_mma, mix.ldsm_per_mma) == (6, 2, 3.0, 0.5)
    # a forward branch is no loop; a branch back inside the body is
    assert sass.inner_loops(lines) == 0
    nested = SAMPLE.replace("@!P0 BRA `(.L_x_5)", "FMUL R12, R12, 0.5").replace(
        "        /*0060*/                   HMMA.16816.F32 R16, R8, R6, R16 ;",
        "        /*0060*/                   HMMA.16816.F32 R16, R8, R6, R16 ;\n"
        "        /*0068*/              @P3 BRA `(.L_x_5) ;")
    assert sass.inner_loops(sass.key_tile_loop(nested)) == 1


def test_loop_reader_refuses_text_without_a_loop_around_the_mmas():
    with pytest.raises(ValueError, match="no HMMA/DMMA"):
        sass.key_tile_loop("        /*0000*/  EXIT ;")
    with pytest.raises(ValueError, match="no loop"):
        sass.key_tile_loop(SAMPLE.replace("@P1 BRA `(.L_x_4)", "NOP").replace(
            "@P2 BRA `(.L_x_3)", "NOP"))


# name only what is missing: ".[test]" brings nvdisasm on Linux, ".[cuda13]" brings NVRTC
_MISSING = ([] if nvrtc.nvrtc_available() else ['NVRTC (pip install ".[cuda13]")']) + (
    [] if sass.nvdisasm_path() is not None
    else ['nvdisasm (pip install "nvidia-cuda-nvdisasm==13.*", in ".[test]" on Linux)'])
needs_tools = pytest.mark.skipif(bool(_MISSING), reason="needs " + " and ".join(_MISSING))

# Instructions per mma in the key-tile loop, at most. Measured on sm_90 (docs/kernels.md):
# f16/bf16 d128 6.2, f64 d128 6.2, f16 d64 with two query tiles per warp 9.8; before the
# hoisted addressing (f8c2ca3) 12.5, 10.4 and (one query tile) 20.8.
BUDGET = [
    (AttentionMmaSpec(dtype="float16", d=128, dv=128, warps=4, block_n=64, stages=2), 8.0),
    (AttentionMmaSpec(dtype="bfloat16", d=128, dv=128, warps=4, block_n=64, stages=2), 8.0),
    (AttentionMmaSpec(dtype="float64", d=128, dv=128, warps=2, block_n=16, stages=1), 8.0),
    (AttentionMmaSpec(dtype="float16", d=64, dv=64, warps=4, block_n=32, stages=2,
                      m_tiles=2), 12.0),
]


def expected_mma(spec):
    """mma instructions per key tile and warp: Q K^T then P V per query tile, two DMMA per
    f64 16x8 tile."""
    k = {"float64": 4, "float32": 8}.get(spec.dtype, 16)
    per_tile = (spec.d // k) * (spec.block_n // 8) + (spec.block_n // k) * (spec.dv // 8)
    return per_tile * spec.m_tiles * (2 if spec.dtype == "float64" else 1)


@needs_tools
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("spec,budget", BUDGET, ids=[s.key for s, _ in BUDGET])
def test_key_tile_loop_stays_within_its_instruction_budget(spec, budget, arch):
    mix = sass.variant_mix(spec, arch)
    assert mix.mma == expected_mma(spec), mix.opcodes
    assert "LDL" not in mix.opcodes and "STL" not in mix.opcodes, mix.opcodes  # no local memory
    assert mix.inner_loops == 0      # the static count is what a tile issues (per branch side)
    assert mix.per_mma <= budget, (mix.key, arch, mix.per_mma, mix.opcodes)


@needs_tools
def test_cubin_is_a_whole_elf_image():
    spec = BUDGET[0][0]
    cubin, _ = sass.compile_cubin(sass.source.build_source(spec), "sm_90")
    le = "little"
    end = int.from_bytes(cubin[32:40], le) + int.from_bytes(cubin[56:58], le) * int.from_bytes(
        cubin[54:56], le)
    assert cubin[:4] == b"\x7fELF" and len(cubin) >= end
    assert "HMMA" in sass.disassemble(cubin)


@needs_tools
def test_benchmark_prints_before_and_after():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sass_mix.py"), "--only", "f16 d64 mt1",
         "--against", "HEAD"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert "f16 d64" in result.stdout and "per mma" in result.stdout
    assert "before:" in result.stdout
