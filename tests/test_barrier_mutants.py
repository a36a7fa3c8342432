"""Every barrier of the kernels is needed: removing any one must be caught.

``mutants.barrier_mutants()`` removes, one at a time, each ``__syncthreads()``, ``__syncwarp``
and ``cp_async_wait<...>()`` call of the kernel files (a call marked ``// barrier-redundant:
<reason>`` is skipped). Each mutant runs the cases of the families that paste its file, with
enough key tiles for a stage to be reused (>= kStages + 2 tiles, a ragged last one, several
warps), through the float64 oracle in the emulation's default mode (warps out of step). A
mutant the oracle does not catch must make ThreadSanitizer report a race: the survivors run in
one TSan subprocess, the real kernels first (they must report none).
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import pytest
from conftest import emulation_available, run_under_tsan
from mutants import barrier_mutant_sources, barrier_mutants, barrier_skips
from oracle import reference_attention

import cuonline
from cuonline._validate import validate_attention
from cuonline.engines import cuda
from cuonline.engines.target import overrides
from cuonline.testing.emulate import EmulationError

MUTANTS = barrier_mutants()

#: The cases that run a file's code: the families that paste it.
CASES_OF = {
    "attention_fwd.cu": ("simt",),
    "attention_mma.cu": ("mma",),
    "tensor_core.cuh": ("mma",),
    "attention_block.cuh": ("simt", "mma"),
    "attention_combine.cuh": ("simt_split", "mma_split"),
    "common.cuh": ("simt", "mma", "softmax"),
    "softmax.cu": ("softmax",),
}

#: (dtype, family, lq, lk, n_splits): 200 keys are 4 tiles of 64 (mma f16 D = 32: two stages,
#: so stage 0 is refilled at tile 2 and read again at tile 3) and a ragged tail; 40 rows are
#: 5 SIMT blocks of 4 warps, 80 rows 3 warps of two query tiles; split: 2 key splits.
_ATTENTION = {
    "simt": (np.float32, "attention_fwd_simt", 40, 200, None),
    "mma": (np.float16, "attention_fwd_mma", 80, 200, None),
    "simt_split": (np.float32, "attention_fwd_simt", 40, 300, 2),
    "mma_split": (np.float16, "attention_fwd_mma", 80, 300, 2),
}
#: An error this far above the dtype's rounding is a broken kernel.
_BROKEN = {np.float32: 1e-3, np.float16: 3e-2}


def run_case(case, sources=None, tsan=False):
    """Run ``case`` on the kernels (with ``sources`` replacing files); return its max error
    (inf for a non-finite output, or a kernel the emulation stops: a deadlock, a trap)."""
    try:
        return _run_case(case, sources, tsan)
    except EmulationError:
        return float("inf")


def _run_case(case, sources, tsan):
    options = dict(mode="threads", tsan=True) if tsan else None
    rng = np.random.default_rng(7)
    if case == "softmax":
        x = rng.standard_normal((3, 3000)).astype(np.float32)  # 4 warps per row, one block
        with overrides(max_blocks=1, kernel_sources=sources, emulate_options=options):
            out = cuonline.softmax(x, axis=1, backend="emulate")
        if not np.isfinite(out).all():
            return float("inf")
        e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
        return float(np.abs(out - e / e.sum(axis=1, keepdims=True)).max())
    dtype, family, lq, lk, n_splits = _ATTENTION[case]
    q = rng.standard_normal((2, lq, 32)).astype(dtype)
    k = rng.standard_normal((2, lk, 32)).astype(dtype)
    v = rng.standard_normal((2, lk, 24)).astype(dtype)
    p = validate_attention(q, k, v, scale=None, causal=False, window=None, bias=None, mask=None,
                           kv_lengths=None, alibi_slopes=None, softcap=None, return_lse=True,
                           backend="emulate")
    with overrides(num_sms=1, n_splits=n_splits, family=family, tuned={},
                   kernel_sources=sources, emulate_options=options):
        out, _ = cuda.attention(p)
    if not np.isfinite(out).all():
        return float("inf")
    ref, _ = reference_attention(q, k, v)
    return float(np.abs(out.astype(np.float64) - ref).max())


def _threshold(case):
    return 1e-6 if case == "softmax" else _BROKEN[_ATTENTION[case][0]]


@functools.cache
def oracle_catches(name) -> bool:
    file = MUTANTS[name][0]
    sources = barrier_mutant_sources(name)
    return any(run_case(c, sources) > _threshold(c) for c in CASES_OF[file])


_TSAN_SCRIPT = """
import sys
import test_barrier_mutants as t
from mutants import barrier_mutant_sources
for name in [None] + {names!r}:
    sys.stderr.write(f"\\n@@MUTANT {{name}}\\n"); sys.stderr.flush()
    sources = barrier_mutant_sources(name) if name else None
    cases = t.CASES_OF[t.MUTANTS[name][0]] if name else sorted(t._ATTENTION) + ["softmax"]
    for case in cases:
        t.run_case(case, sources, tsan=True)
print("DONE")
"""


@functools.cache
def tsan_races() -> dict:
    """``{mutant name: whether TSan reported a race}`` for the oracle's survivors, in one
    subprocess (after the real kernels, which must be race-free on the same cases)."""
    survivors = sorted(n for n in MUTANTS if not oracle_catches(n))
    proc, _ = run_under_tsan(_TSAN_SCRIPT.format(names=survivors))
    assert "DONE" in proc.stdout, proc.stderr[-3000:]
    parts = proc.stderr.split("\n@@MUTANT ")[1:]
    raced = {part.split("\n", 1)[0]: "ThreadSanitizer: data race" in part for part in parts}
    assert raced.pop("None") is False, "TSan reports a race in the real kernels"
    return raced


def test_the_generator_finds_every_barrier_and_every_skip_has_a_reason():
    names = set(MUTANTS) | set(barrier_skips())
    files = {n.split(":")[0] for n in names}
    # the barriers of both attention families, their cp.async waits and softmax's merges
    assert {"attention_fwd.cu", "attention_mma.cu", "softmax.cu"} <= files
    assert sum(n.endswith(":cp_async_wait") for n in names) >= 3
    assert sum(n.endswith(":syncthreads") for n in names) >= 9
    for name, reason in barrier_skips().items():
        assert len(reason) >= 10, f"{name} is marked redundant without a reason: {reason!r}"
    assert set(CASES_OF) >= files


def test_the_real_kernels_pass_the_cases():
    reason = emulation_available()
    if reason is not None:
        pytest.skip(reason)
    for case in sorted(_ATTENTION) + ["softmax"]:
        assert run_case(case) <= _threshold(case) / 10, case


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_removing_the_barrier_is_caught(name):
    reason = emulation_available()
    if reason is not None:
        pytest.skip(reason)
    if oracle_catches(name):
        return
    if sys.platform != "linux":
        pytest.skip("the oracle passes it and ThreadSanitizer runs on Linux only")
    assert tsan_races()[name], f"{name}: neither the oracle nor TSan catches its removal"
