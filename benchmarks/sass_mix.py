"""Instructions per key tile of the tensor-core kernels, read from their SASS (no GPU needed).

    python benchmarks/sass_mix.py [--arch sm_90] [--against REV] [--json]

Compiles the main tensor-core variants with NVRTC, disassembles them with nvdisasm
(pip install "nvidia-cuda-nvdisasm==13.*") and prints, for the loop over key tiles: the
instructions in its body, the mma instructions among them, instructions per mma, the integer
(address and index) share, ldmatrix instructions per mma, and the registers ptxas gave the
kernel. ``--against REV`` compiles the kernel files of git revision REV in the same run, for a
before/after table.

The counts are static (see cuonline/toolchain/sass.py): a proxy for the issue slots one key tile
costs a warp. On an H100/H200 a warp issues one instruction per cycle and an m16n8k16 HMMA
occupies its tensor core for several, so a loop far above a few instructions per mma is bound
by issue, not by the tensor cores. Each ldmatrix.x4 reads 512 bytes of shared memory, which an
SM delivers at 128 bytes a clock: ldmatrix per mma is the shared-bandwidth side. The static
count takes both branches of the loop (interior and boundary tiles) once, and inner loops once
(the tile loads are fully unrolled since 92b7c6e, so they count per chunk). Speed itself is
measured by gpu_check.sh on a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from cuonline.kernels import families, heuristics
from cuonline.kernels.specs import AttentionMmaSpec
from cuonline.toolchain import sass

ROOT = Path(__file__).resolve().parents[1]



def shipped(dtype, d, *features):
    """The variant the heuristics ship for sm_90 at head size ``d`` and a long sequence, with
    the named options of the feature table."""
    tiles = heuristics.choose_mma_tiles(dtype, d, d, 4096, "sm_90")
    return AttentionMmaSpec(dtype=dtype, d=d, dv=d, **tiles._asdict(), features=features)


#: (label, spec): the shipped tiles at each dtype's common head sizes, and (``mt1``) the
#: one-query-tile-per-warp tiles that the two-tile built-ins replaced.
VARIANTS = [
    ("f16 d64", shipped("float16", 64)),
    ("f16 d64 mt1", AttentionMmaSpec(dtype="float16", d=64, dv=64, warps=4, block_n=64,
                                     stages=2)),
    ("f16 d128", shipped("float16", 128)),
    ("bf16 d128 lse", shipped("bfloat16", 128, "return_lse")),
    ("f16 d128 mask", shipped("float16", 128, "mask")),
    ("tf32 d64", shipped("float32", 64)),
    ("tf32 d64 mt1", AttentionMmaSpec(dtype="float32", d=64, dv=64, warps=4, block_n=32,
                                      stages=2)),
    ("f64 d64", shipped("float64", 64)),
    ("f64 d128", shipped("float64", 128)),
]


def files_at(rev):
    """The kernel files of git revision ``rev`` (those that exist there)."""
    out = {}
    for name in families.files_of(VARIANTS[0][1]):
        proc = subprocess.run(["git", "show", f"{rev}:kernels_cu/{name}"], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            # pasting REV's files into today's list would mix two layouts of the kernel text
            raise SystemExit(f"{rev} has no kernels_cu/{name}: its kernel files differ from "
                             f"today's; run this script from a checkout of {rev} instead")
        out[name] = proc.stdout
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--against", metavar="REV", help="git revision to compare with")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", nargs="*", help="labels to run (default: all)")
    args = parser.parse_args(argv)

    before = files_at(args.against) if args.against else None
    rows = []
    for label, spec in VARIANTS:
        if args.only and label not in args.only:
            continue
        row = {"variant": label, "key": spec.key, "arch": args.arch}
        now = sass.variant_mix(spec, args.arch)
        row.update(registers=now.registers, loop=now.instructions, mma=now.mma,
                   per_mma=round(now.per_mma, 2), integer=now.integer,
                   ldsm_per_mma=round(now.ldsm_per_mma, 3),
                   inner_loops=now.inner_loops)
        # a revision without CUONLINE_M_TILES would compile one query tile per warp
        if before is not None and (spec.m_tiles == 1
                                   or "CUONLINE_M_TILES" in before["attention_fwd_mma.cu"]):
            then = sass.variant_mix(spec, args.arch, overrides=before)
            row.update(before_registers=then.registers, before_loop=then.instructions,
                       before_per_mma=round(then.per_mma, 2), before_integer=then.integer)
        rows.append(row)
        if not args.json:
            print(line(row), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


def line(row):
    text = (f"{row['variant']:28s} {row['arch']}  regs {row['registers']:3d}  loop "
            f"{row['loop']:5d}  mma {row['mma']:4d}  per mma {row['per_mma']:5.2f}  integer "
            f"{row['integer']:4d}  ldsm/mma {row['ldsm_per_mma']:5.3f}")
    if "before_loop" in row:
        text += (f"  | before: regs {row['before_registers']:3d}  loop {row['before_loop']:5d}"
                 f"  per mma {row['before_per_mma']:5.2f}  integer {row['before_integer']:4d}")
    return text


if __name__ == "__main__":
    main()
