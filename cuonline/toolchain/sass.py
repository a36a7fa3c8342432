"""What the GPU would execute, read without a GPU: the SASS of a kernel variant.

NVRTC compiles a variant to a CUBIN (:func:`compile_cubin`), ``nvdisasm`` (pip install
``"nvidia-cuda-nvdisasm==13.*"``, or a CUDA toolkit on the PATH) turns it into SASS text, and
:func:`key_tile_loop` finds the loop over key tiles: the innermost backward branch whose body
holds every tensor-core instruction (``HMMA``/``DMMA``) of the kernel. :func:`loop_mix` counts
that body's instructions by opcode.

The counts are static: each instruction of the loop body once, both sides of a branch
included (the masking of boundary tiles is a branch that interior tiles skip), and the body of
a loop nested inside once however often it runs (:func:`inner_loops` counts those; the shipped
kernels have none). They are a proxy for the issue slots one key tile costs a warp, not a
timing.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..kernels import families, source
from . import nvrtc

__all__ = ["LoopMix", "compile_cubin", "disassemble", "inner_loops", "key_tile_loop",
           "loop_mix", "nvdisasm_path", "variant_mix"]

#: Opcodes of the tensor-core instructions the kernels issue.
MMA_OPCODES = ("HMMA", "DMMA")
#: Opcodes counted as integer / address arithmetic.
INTEGER_OPCODES = ("IMAD", "IADD3", "IADD", "VIADD", "LEA", "LOP3", "SHF", "SEL", "ISETP",
                   "IMNMX", "VIMNMX", "PRMT", "MOV", "UIADD3", "UIMAD", "ULEA", "ULOP3", "UMOV")

_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def nvdisasm_path() -> str | None:
    """The ``nvdisasm`` binary: the PATH's, else the ``nvidia-cuda-nvdisasm`` wheel's."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    for entry in sys.path:
        for sub in ("nvidia/cu13/bin/nvdisasm", "nvidia/cuda_nvdisasm/bin/nvdisasm"):
            path = Path(entry) / sub
            if path.is_file():
                return str(path)
    return None


def compile_cubin(text: str, arch: str = "sm_90", *, name: str = "cuonline.cu") -> tuple:
    """Compile ``text`` for ``arch``; return ``(cubin bytes, ptxas log)``.

    CuPy's ``getCUBIN`` returns the image one byte short (CuPy 14, read as a C string); the
    ELF header says how long the image is, and the missing tail is zero-filled here.
    """
    ok, log, cubin = nvrtc.compiler().compile(text, name, nvrtc.compile_options(arch))
    if not ok:
        raise RuntimeError(f"NVRTC failed to compile {name} for {arch}:\n{log}")
    cubin = bytes(cubin)
    if cubin[:4] == b"\x7fELF" and len(cubin) >= 64:
        le: Literal["little"] = "little"
        end = max(int.from_bytes(cubin[40:48], le) +  # section headers: offset + count * size
                  int.from_bytes(cubin[60:62], le) * int.from_bytes(cubin[58:60], le),
                  int.from_bytes(cubin[32:40], le) +  # program headers: offset + count * size
                  int.from_bytes(cubin[56:58], le) * int.from_bytes(cubin[54:56], le))
        cubin += b"\0" * max(0, end - len(cubin))
    return cubin, log


def disassemble(cubin: bytes) -> str:
    """SASS text of a CUBIN (``nvdisasm -c``). Raises RuntimeError without nvdisasm."""
    tool = nvdisasm_path()
    if tool is None:
        raise RuntimeError('nvdisasm not found: pip install "nvidia-cuda-nvdisasm==13.*"')
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([tool, "-c", path], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr.strip()}")
    return proc.stdout


def opcode(line: str) -> str | None:
    """The opcode of one SASS line (``HMMA`` for ``HMMA.16816.F32 ...``), None if none."""
    m = _INSTRUCTION.match(line)
    return m.group(1) if m else None


def key_tile_loop(sass: str) -> list:
    """The lines of the innermost loop that encloses every mma instruction.

    A loop is a label and a later branch back to it. Raises ValueError when the text has no
    mma instruction or no loop around all of them.
    """
    lines = sass.splitlines()
    mma = [i for i, line in enumerate(lines) if opcode(line) in MMA_OPCODES]
    if not mma:
        raise ValueError("no HMMA/DMMA instruction in the SASS")
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    best = None
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if not m or m.group(1) not in labels:
            continue
        start = labels[m.group(1)]
        if start < mma[0] and i > mma[-1] and (best is None or start > best[0]):
            best = (start, i)
    if best is None:
        raise ValueError("no loop encloses all the mma instructions")
    return lines[best[0]:best[1] + 1]


def inner_loops(loop: list) -> int:
    """Loops nested in ``loop`` (lines from :func:`key_tile_loop`): branches back to a label
    inside it, other than the loop's own closing branch. Their bodies are counted once."""
    labels = {m.group(1): i for i, line in enumerate(loop) if (m := _LABEL.match(line))}
    return sum(1 for i, line in enumerate(loop[:-1])
               if (m := _BRANCH.search(line)) and labels.get(m.group(1), i) < i)


@dataclass(frozen=True)
class LoopMix:
    """The instruction mix of one variant's key-tile loop (static counts)."""

    key: str
    arch: str
    registers: int
    opcodes: dict            # opcode -> count in the loop body
    inner_loops: int = 0     # loops nested in the body, counted once (see inner_loops)

    @property
    def instructions(self) -> int:
        return sum(self.opcodes.values())

    @property
    def mma(self) -> int:
        return sum(self.opcodes.get(o, 0) for o in MMA_OPCODES)

    @property
    def integer(self) -> int:
        return sum(self.opcodes.get(o, 0) for o in INTEGER_OPCODES)

    @property
    def ldsm_per_mma(self) -> float:
        """ldmatrix instructions per mma: each ldmatrix.x4 reads 512 bytes of shared memory."""
        return self.opcodes.get("LDSM", 0) / self.mma

    @property
    def per_mma(self) -> float:
        return self.instructions / self.mma


def loop_mix(sass: str) -> dict:
    """``{opcode: count}`` over the key-tile loop of ``sass``."""
    return dict(collections.Counter(op for line in key_tile_loop(sass)
                                    if (op := opcode(line)) is not None))


def variant_mix(spec, arch: str = "sm_90", *, overrides: dict | None = None) -> LoopMix:
    """Compile ``spec`` (kernel files replaced by ``overrides``, as in
    :func:`source.build_source`) and return its :class:`LoopMix`."""
    cubin, log = compile_cubin(source.build_source(spec, overrides=overrides), arch,
                               name=f"{spec.key}.cu")
    entry = families.of(spec).entries[0]
    usage = next(u for u in nvrtc.parse_ptxas_log(log) if u.name == entry)
    text = disassemble(cubin)
    return LoopMix(spec.key, arch, usage.registers, loop_mix(text),
                   inner_loops(key_tile_loop(text)))
