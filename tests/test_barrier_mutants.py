"""Every barrier of the kernels is needed: removing any one must be caught.

``mutants.barrier_mutants()`` removes, one at a time, each ``__syncthreads()``, ``__syncwarp``
and ``cp_async_wait<...>()`` call of the kernel files (a call marked ``// barrier-redundant:
<reason>`` is skipped). Each mutant runs the cases of the families that paste its file
(``support.BARRIER_CASES_OF``, shared with the TSan subprocess), with
enough key tiles for a stage to be reused (>= kStages + 2 tiles, a ragged last one, several
warps), through the float64 oracle in the emulation's default mode (warps out of step). A
mutant the oracle does not catch must make ThreadSanitizer report a race: the survivors run in
one TSan subprocess, the real kernels first (they must report none).
"""

from __future__ import annotations

import functools
import sys

import pytest
from mutants import barrier_mutant_sources, barrier_mutants, barrier_skips
from support import (BARRIER_CASES, BARRIER_CASES_OF, barrier_threshold, needs_emulation,
                     run_barrier_case, run_under_tsan)

MUTANTS = barrier_mutants()


@functools.cache
def oracle_catches(name) -> bool:
    file = MUTANTS[name][0]
    sources = barrier_mutant_sources(name)
    return any(run_barrier_case(c, sources) > barrier_threshold(c) for c in BARRIER_CASES_OF[file])


_TSAN_SCRIPT = """
import sys
from mutants import barrier_mutant_sources, barrier_mutants
from support import BARRIER_CASES, BARRIER_CASES_OF, run_barrier_case
MUTANTS = barrier_mutants()
for name in [None] + {names!r}:
    sys.stderr.write(f"\\n@@MUTANT {{name}}\\n"); sys.stderr.flush()
    sources = barrier_mutant_sources(name) if name else None
    for case in BARRIER_CASES_OF[MUTANTS[name][0]] if name else BARRIER_CASES:
        run_barrier_case(case, sources, tsan=True)
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
    assert {"attention_fwd_simt.cu", "attention_fwd_mma.cu", "softmax.cu"} <= files
    assert sum(n.endswith(":cp_async_wait") for n in names) >= 3
    assert sum(n.endswith(":syncthreads") for n in names) >= 9
    for name, reason in barrier_skips().items():
        assert len(reason) >= 10, f"{name} is marked redundant without a reason: {reason!r}"
    assert set(BARRIER_CASES_OF) >= files


@needs_emulation
def test_the_real_kernels_pass_the_cases():
    for case in BARRIER_CASES:
        assert run_barrier_case(case) <= barrier_threshold(case) / 10, case


@needs_emulation
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_removing_the_barrier_is_caught(name):
    if oracle_catches(name):
        return
    if sys.platform != "linux":
        pytest.skip("the oracle passes it and ThreadSanitizer runs on Linux only")
    assert tsan_races()[name], f"{name}: neither the oracle nor TSan catches its removal"
