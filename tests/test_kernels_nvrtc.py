"""Every kernel variant the dispatcher can select compiles with NVRTC, with no spill.

Runs on machines without a GPU: NVRTC from the PyPI wheels compiles without a driver. Skipped,
with the reason, where NVRTC or the CUDA headers are not installed. sm_70 needs a CUDA 12 NVRTC
(CUDA 13 dropped it): ``pip install "nvidia-cuda-nvrtc-cu12==12.*"
"nvidia-cuda-runtime-cu12==12.*"``; without one its cases skip with that reason.
"""

from __future__ import annotations

import pytest
from support import needs_nvrtc

from cuonline.kernels import families, source
from cuonline.toolchain import nvrtc
from cuonline.kernels.heuristics import (SMEM_OPT_IN_LIMIT, arch_number, bwd_smem_limit,
                                         bwd_uses_mma, mma_smem_limit,
                                         simt_smem_limit, simt_smem_opt_in_limit)

pytestmark = [needs_nvrtc, pytest.mark.slow]   # the fast tier leaves it out

SPECS = families.listing_specs()
# (spec, arch): each arch's listing (below sm_80 without the tensor-core family)
CASES = [(s, a) for a in nvrtc.DEFAULT_ARCHS for s in families.listing_specs(a)]


@pytest.mark.parametrize(("spec", "arch"), CASES, ids=[f"{s.key}-{a}" for s, a in CASES])
def test_variant_compiles_without_spills(spec, arch):
    reason = nvrtc.arch_unavailable(arch)
    if reason is not None:
        pytest.skip(reason)
    report = nvrtc.compile_spec(spec, arch)
    names = {k.name for k in report.kernels}
    assert names == set(families.entries_of(spec)), report.log
    for k in report.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills:\n{report.log}"
        assert k.stack_frame == 0, f"{k.name} has a stack frame:\n{report.log}"
        assert k.registers <= 255
    # SIMT blocks stay small enough for two per sm_80 SM; tensor-core blocks opt in to more
    # (their tiles are 16-bit or the accumulators are in registers) but must fit an sm_80 SM.
    # SIMT blocks also fit sm_75's 64 KiB opt-in limit where they are listed for it; with
    # rel_qk's staging they may take the arch's whole opt-in limit (one block per SM).
    tensor_core = spec.family in ("attention_fwd_mma", "attention_bwd_mma")
    limit = (SMEM_OPT_IN_LIMIT["sm_80"] if tensor_core
             else simt_smem_opt_in_limit(arch) if "rel_qk" in getattr(spec, "features", ())
             else simt_smem_limit(arch))
    if spec.family == "attention_bwd_simt":
        # the backward opts in where one row per warp needs it (float64 D = 256 on sm_80+)
        limit = bwd_smem_limit(arch)
    if spec.family == "attention_bwd_mma" and not bwd_uses_mma(
            spec.dtype, spec.d, spec.dv, spec.features, "sm_80", "tf32", spec.dr):
        # a tensor-core backward that sm_80's dispatcher sends to the SIMT family (float64
        # with every option: the dQ kernel's reduction tiles beside rel_qk's staging) need
        # only fit the arch it is listed for
        limit = mma_smem_limit(arch)
    assert spec.shared_bytes <= limit


@pytest.mark.parametrize("arch", ["sm_70", "sm_75"])
def test_older_archs_list_only_the_families_that_run_there(arch):
    specs = families.listing_specs(arch)
    assert {s.family for s in specs} == {"attention_fwd_simt", "attention_bwd_simt", "softmax",
                                         "attention_stats"}
    # every dtype has SIMT attention variants there (the tensor-core dtypes included)
    assert {s.dtype for s in specs if s.family == "attention_fwd_simt"} == {
        "float16", "bfloat16", "float32", "float64"}
    # and sm_75's 64 KiB leaves out the float64 D = 256 block that sm_80 lists (72 KiB)
    big = {s.key for s in families.listing_specs("sm_80") if s.family == "attention_fwd_simt"
           and s.dtype == "float64" and s.d == 256}
    assert big and (arch == "sm_70") == (big <= {s.key for s in specs})


def test_archs_the_installed_nvrtc_lacks_are_reported_with_the_install_line(monkeypatch):
    monkeypatch.setattr(nvrtc, "_FALLBACK", [None])   # as if no CUDA 12 NVRTC were installed
    if arch_number("sm_70") in nvrtc.compiler().supported_archs():
        pytest.skip("this NVRTC still compiles for sm_70")
    reason = nvrtc.arch_unavailable("sm_70")
    assert "nvidia-cuda-nvrtc-cu12" in reason and "sm_70" in reason
    with pytest.raises(nvrtc.NvrtcUnavailable, match="sm_70"):
        nvrtc.compile_source("extern \"C\" __global__ void f() {}", "sm_70")
    assert nvrtc.arch_unavailable("sm_75") is None


def test_listing_has_unique_readable_keys():
    keys = [s.key for s in SPECS]
    assert len(keys) == len(set(keys))
    assert "attention_fwd_simt_f32_d64_dv64_bm32_bn64_w4_bias" in keys


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
