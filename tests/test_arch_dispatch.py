"""Which kernel family runs on which GPU architecture (pure planner checks, no GPU).

V100 (sm_70) and T4 (sm_75) have no tensor-core instructions the tensor-core family uses
(mma.sync for bf16/tf32/f64, cp.async: sm_80), so every dtype runs the SIMT family there, within
their shared-memory limits (T4: 64 KiB per block).
"""

from __future__ import annotations

import numpy as np
import pytest
from support import BFLOAT16, needs_emulation
from oracle import reference_attention

from cuonline._validate import validate_attention
from cuonline.engines import cuda
from cuonline.engines.target import overrides
from cuonline.kernels import families, heuristics, specs
from cuonline.kernels.launch import Launch

DTYPES = [np.float16, np.float32, np.float64] + ([BFLOAT16] if BFLOAT16 is not None else [])
DTYPE_IDS = [np.dtype(t).name for t in DTYPES]


def problem(dtype, *, lq=4096, lk=4096, d=64, dv=None, precision="highest"):
    dv = d if dv is None else dv
    # zero-strided views: the planner reads shapes and dtypes only
    q = np.broadcast_to(np.zeros((1, 1), dtype), (lq, d))
    k = np.broadcast_to(np.zeros((1, 1), dtype), (lk, d))
    v = np.broadcast_to(np.zeros((1, 1), dtype), (lk, dv))
    return validate_attention(q, k, v, scale=None, causal=False, window=None, bias=None,
                              mask=None, kv_lengths=None, alibi_slopes=None, softcap=None,
                              return_lse=False, backend="emulate", precision=precision)


@pytest.mark.parametrize("arch", ["sm_70", "sm_75"])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_older_archs_run_every_dtype_on_the_simt_family(dtype, d, arch):
    for precision in ("highest", "tf32") if dtype == np.float32 else ("highest",):
        for lq in (1, 4096):
            plan = families.plan_attention(problem(dtype, lq=lq, d=d, precision=precision),
                                           Launch(arch=arch))
            assert plan.spec.family == "attention_fwd_simt", (arch, precision, lq, plan.spec.key)
            assert plan.shared_bytes <= heuristics.simt_smem_limit(arch)


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90", "sm_90a", "sm_100"])
@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["float16", "float64"])
def test_sm80_and_newer_keep_the_tensor_cores(dtype, arch):
    plan = families.plan_attention(problem(dtype), Launch(arch=arch))
    assert plan.spec.family == "attention_fwd_mma"


def test_uses_mma_follows_the_arch():
    assert heuristics.uses_mma("float16", 64, 64)                 # default arch: sm_90
    assert not heuristics.uses_mma("float16", 64, 64, arch="sm_75")
    assert not heuristics.uses_mma("float32", 64, 64, "tf32", arch="sm_70")
    assert heuristics.uses_mma("float32", 64, 64, "tf32", arch="sm_80")
    assert [heuristics.mma_supported(a) for a in ("sm_70", "sm_75", "sm_80", "sm_120")] == [
        False, False, True, True]


def test_forcing_the_tensor_cores_below_sm80_is_refused():
    with pytest.raises(ValueError, match=r"'attention_fwd_mma' needs sm_80.*'sm_75'"):
        families.plan_attention(problem(np.float16),
                                Launch(arch="sm_75", family="attention_fwd_mma"))


def test_bad_arch_names_are_refused():
    with pytest.raises(ValueError, match=r"arch must look like 'sm_80'.*'ampere'"):
        families.plan_attention(problem(np.float16), Launch(arch="ampere"))


def test_t4_shared_memory_limit():
    # float64 D = 256 takes 72 KiB on sm_80 (and on sm_70's 96 KiB), more than T4's 64 KiB
    for arch in ("sm_80", "sm_70"):
        plan = families.plan_attention(problem(np.float64, d=256), Launch(arch=arch))
        assert 64 * 1024 < plan.shared_bytes <= heuristics.simt_smem_limit(arch)
    with pytest.raises(ValueError, match=r"D = 256.*shared memory.*sm_75.*backend='numpy'"):
        families.plan_attention(problem(np.float64, d=256), Launch(arch="sm_75"))
    # the widest float64 head that fits sm_75, and float32 D = 256 (48 KiB)
    for dtype, d in ((np.float64, 226), (np.float32, 256)):
        plan = families.plan_attention(problem(dtype, d=d), Launch(arch="sm_75"))
        assert plan.shared_bytes <= 64 * 1024


@needs_emulation
def test_emulated_float16_on_sm75_runs_simt_and_matches_numpy():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, n, 32)).astype(np.float16) for n in (17, 70, 70))
    p = validate_attention(q, k, v, scale=None, causal=True, window=None, bias=None, mask=None,
                           kv_lengths=None, alibi_slopes=None, softcap=None, return_lse=False,
                           backend="emulate")
    assert families.plan_attention(p, Launch(arch="sm_75")).spec.family == "attention_fwd_simt"
    with overrides(arch="sm_75"):
        out, _ = cuda.attention(p)
    ref, _ = reference_attention(q, k, v, causal=True)
    assert np.abs(out - ref).max() < 4e-3


@pytest.mark.parametrize("arch", ["sm_86", "sm_89", "sm_120", "sm_121"])
def test_tensor_core_tiles_fit_archs_without_a_table_of_their_own(arch):
    """RTX 30xx/40xx (sm_86, sm_89) and consumer Blackwell (sm_120) let a block opt into 99 KiB
    of shared memory, not the 163 or 227 KiB of the sm_80 and sm_90 tables; an arch cuonline
    does not know gets the smallest limit. Every planned tile must fit, or the launch fails."""
    limit = heuristics.mma_smem_limit(arch)
    assert limit == 99 * 1024
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for width in (32, 64, 128, 256):
            if width > specs.MMA_MAX_HEAD_DIM[dtype]:
                continue
            for lq in (1, 17, 4096):
                tiles = heuristics.choose_mma_tiles(dtype, width, width, lq, arch)
                spec = specs.AttentionMmaSpec(dtype=dtype, d=width, dv=width, **tiles._asdict())
                assert spec.shared_bytes <= limit, (arch, spec.key, spec.shared_bytes)
