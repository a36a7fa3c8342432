"""Write the deliberately broken kernel copies in this folder from the current kernel sources.

Each mutant is the real file with one textual edit; ``tests/test_cuda_engine.py`` checks that
the copies here are up to date (rerun ``python tests/mutants/make_mutants.py`` after editing a
kernel) and that the tests catch every one of them.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNELS = HERE.parents[1] / "kernels_cu"

# mutant name -> (kernel file, text to find (exactly once), replacement)
MUTANTS = {
    # Keys past Lk / kv_lengths / the split's range are scored as visible (zero-filled keys
    # then take softmax weight).
    "no_tail_mask": (
        "attention_fwd.cu",
        "bool visible = i < lq && j < key_end && j >= j_lo && j < j_hi;",
        "bool visible = i < lq && j >= j_lo;",
    ),
    # The accumulator is not rescaled when the running max grows (the denominator still is).
    "no_rescale": (
        "common.cuh",
        "        l *= alpha;\n#pragma unroll\n        for (int c = 0; c < kCols; ++c) o[c] *= alpha;\n",
        "        l *= alpha;\n",
    ),
    # No barrier between the P·V reads of one tile and the K load of the next: a race.
    "no_sync": (
        "attention_fwd.cu",
        "            __syncthreads();\n            load_kv_tile<kD>(",
        "            load_kv_tile<kD>(",
    ),
}


def mutant_path(name: str) -> Path:
    return HERE / f"{name}.{MUTANTS[name][0]}"


def mutant_text(name: str) -> str:
    """The mutant's text, built from the current kernel file."""
    file, find, replace = MUTANTS[name]
    text = (KERNELS / file).read_text(encoding="utf-8")
    if text.count(find) != 1:
        raise ValueError(f"mutant {name}: the edited text occurs {text.count(find)} times in {file}")
    return text.replace(find, replace)


def main():
    for name in MUTANTS:
        mutant_path(name).write_text(mutant_text(name), encoding="utf-8")
        print("wrote", mutant_path(name).relative_to(HERE.parents[1]))


if __name__ == "__main__":
    main()
