"""Every kernel variant the dispatcher can select compiles with NVRTC, with no spill.

Runs on machines without a GPU: NVRTC from the PyPI wheels compiles without a driver. Skipped,
with the reason, where NVRTC or the CUDA headers are not installed.
"""

from __future__ import annotations

import pytest

from cuonline.kernels import nvrtc, source
from cuonline.kernels.heuristics import SMEM_MAX, SMEM_OPT_IN_LIMIT

pytestmark = pytest.mark.skipif(
    not nvrtc.nvrtc_available(),
    reason='NVRTC not installed (pip install cupy-cuda13x "nvidia-cuda-nvrtc==13.*" '
           '"nvidia-cuda-runtime==13.*")',
)

SPECS = nvrtc.listing_specs()


@pytest.mark.parametrize("arch", nvrtc.DEFAULT_ARCHS)
@pytest.mark.parametrize("spec", SPECS, ids=[s.key for s in SPECS])
def test_variant_compiles_without_spills(spec, arch):
    report = nvrtc.compile_spec(spec, arch)
    names = {k.name for k in report.kernels}
    assert names == set(spec.entries()), report.log
    for k in report.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills:\n{report.log}"
        assert k.stack_frame == 0, f"{k.name} has a stack frame:\n{report.log}"
        assert k.registers <= 255
    # SIMT blocks stay small enough for two per sm_80 SM; tensor-core blocks opt in to more
    # (their tiles are 16-bit or the accumulators are in registers) but must fit an sm_80 SM.
    limit = SMEM_OPT_IN_LIMIT["sm_80"] if spec.family == "attention_mma" else SMEM_MAX
    assert spec.shared_bytes <= limit


def test_listing_has_unique_readable_keys():
    keys = [s.key for s in SPECS]
    assert len(keys) == len(set(keys))
    assert "attention_fwd_f32_d64_dv64_bm32_bn64_w4_bias" in keys


def test_compile_error_is_reported():
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        nvrtc.compile_source("this is not cuda", "sm_90")


def test_source_pastes_header_and_defines():
    text = source.build_source(SPECS[0])
    assert text.startswith(f"// cuonline kernel variant {SPECS[0].key}")
    assert "#define CUONLINE_D 32" in text
    assert "struct SoftmaxState" in text           # common.cuh pasted, not #include'd
    assert '#include "common.cuh"' not in text


def test_parse_ptxas_log():
    log = (
        "ptxas info    : Compiling entry function 'cuonline_attention_fwd' for 'sm_90'\n"
        "ptxas info    : Function properties for cuonline_attention_fwd\n"
        "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 96 registers, used 1 barriers, 380 bytes cmem[0]\n"
    )
    (k,) = nvrtc.parse_ptxas_log(log)
    assert (k.name, k.registers, k.stack_frame, k.spill_stores, k.spill_loads) == (
        "cuonline_attention_fwd", 96, 8, 4, 12)
