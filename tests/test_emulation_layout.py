"""Where the CPU emulation lives: none of it in the shipped kernels, all of it in the cache key.

The kernel text in ``kernels_cu/`` is what NVRTC compiles and what the wheel ships; the CPU
emulation (``cuonline/testing/cuda_cpu.h`` and its parts in ``cuda_cpu/``) is force-included
before the same text when g++ compiles it. "Device code only" is checked here as a rule on the
preprocessor directives and names of every shipped file (see :func:`emulation_code`).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from support import needs_emulation

from cuonline.testing import emulate

pytestmark = pytest.mark.slow   # the fast tier (-m 'not slow') leaves it out

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted(p for p in (ROOT / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))
HEADER_DIR = emulate.header_path().parent


# ------------------------------------------------------------------------------------------------
# The rule

#: Macros that only a CUDA compiler defines (NVRTC defines __CUDACC__ and __CUDA_ARCH__).
DEVICE_MACROS = ("__CUDA_ARCH__", "__CUDACC__", "__CUDACC_RTC__", "__NVCC__")
_DEVICE = "|".join(DEVICE_MACROS)
#: `#ifdef M` / `#if defined(M)` / `#if defined M` for a device macro M, and nothing else.
_PRESENCE_RE = re.compile(rf"^(?:ifdef\s+(?:{_DEVICE})|if\s+defined\s*\(?\s*(?:{_DEVICE})\s*\)?)$")
_MENTIONS_DEVICE_RE = re.compile(rf"\b(?:{_DEVICE})\b")
#: Names that belong to the emulation: its runtime namespace and macros, its header, the
#: namespace the tensor-core emulation keeps its helpers in.
_EMULATION_NAME_RE = re.compile(
    r"\bcuemu\w*|\bCUEMU_\w+|\bCUONLINE_EMULATION\b|\bcuda_cpu\b|\bnamespace\s+emu\b|\bemu::")
_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def emulation_code(text: str) -> list[str]:
    """Why `text` is not device code only: one ``"line N: reason"`` per violation.

    Device code only means that no part of the text is compiled by the host compiler alone:

    * a conditional on a device macro (``__CUDA_ARCH__``, ``__CUDACC__``, ``__CUDACC_RTC__``,
      ``__NVCC__``) must be a plain presence test (``#ifdef M`` or ``#if defined(M)``) with no
      ``#else``/``#elif`` branch, for that branch is what only a host compiler reads; a
      negated test (``#ifndef M``, ``#if !defined(M)``) is a host branch itself;
    * other tests of a device macro (``#if __CUDA_ARCH__ >= 800`` with an ``#else``) are
      allowed only inside such a presence test, where every branch is device code;
    * no name of the emulation appears outside comments (``cuemu``, ``CUEMU_*``,
      ``CUONLINE_EMULATION``, ``cuda_cpu``, the namespace ``emu``).
    """
    problems = []
    stack = []   # per open conditional: (kind, line) with kind "presence", "inside" or "other"
    lines = _COMMENT_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text).split("\n")
    for number, line in enumerate(lines, 1):
        for name in _EMULATION_NAME_RE.findall(line):
            problems.append(f"line {number}: emulation name {name.strip()!r}")
        directive = re.match(r"\s*#\s*(\w+)\s*(.*?)\s*$", line)
        if not directive:
            continue
        word, rest = directive.groups()
        full = f"{word} {rest}".strip()
        in_device = any(kind == "presence" for kind, _ in stack)
        if word in ("if", "ifdef", "ifndef"):
            if not _MENTIONS_DEVICE_RE.search(full):
                stack.append(("other", number))
            elif _PRESENCE_RE.match(full):
                stack.append(("presence", number))
            elif in_device and word != "ifndef" and "!" not in rest:
                stack.append(("inside", number))
            else:
                problems.append(f"line {number}: #{full}: a branch for the host compiler")
                stack.append(("other", number))
        elif word in ("else", "elif"):
            if not stack:
                problems.append(f"line {number}: #{word} without #if")
            elif stack[-1][0] == "presence":
                problems.append(f"line {number}: #{word} of the device test on line "
                                f"{stack[-1][1]}: a branch for the host compiler")
            elif word == "elif" and _MENTIONS_DEVICE_RE.search(rest) and not in_device:
                problems.append(f"line {number}: #{full}: a device test outside device code")
        elif word == "endif":
            if stack:
                stack.pop()
    return problems


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_shipped_kernel_text_is_device_code_only(path):
    problems = emulation_code(path.read_text(encoding="utf-8"))
    assert not problems, f"kernels_cu/{path.name} holds emulation code:\n" + "\n".join(problems)


@pytest.mark.parametrize("text, found", [
    ("#ifndef __CUDA_ARCH__\nint f();\n#endif\n", "#ifndef __CUDA_ARCH__"),
    ("#if !defined(__CUDACC__)\n#endif\n", "#if !defined(__CUDACC__)"),
    ("#ifdef __CUDA_ARCH__\nasm(\"\");\n#else\nhost();\n#endif\n", "#else of the device test"),
    ("#if defined(__CUDA_ARCH__)\n#elif 1\n#endif\n", "#elif of the device test"),
    ("#if __CUDA_ARCH__ >= 800\nnew();\n#else\nold();\n#endif\n", "#if __CUDA_ARCH__ >= 800"),
    ("int x = cuemu::self->lane;\n", "'cuemu'"),
    ("namespace emu { int y; }\n", "'namespace emu'"),
    ("#ifdef CUONLINE_EMULATION\n#endif\n", "'CUONLINE_EMULATION'"),
])
def test_the_rule_finds_host_branches_and_emulation_names(text, found):
    problems = emulation_code(text)
    assert any(found in p for p in problems), problems


@pytest.mark.parametrize("text", [
    "#ifdef __CUDA_ARCH__\nasm(\"\");\n#endif\n",
    "#ifdef __CUDACC__\n#include <cuda_fp16.h>\n#endif\n",
    "#ifdef __CUDA_ARCH__\n#if __CUDA_ARCH__ >= 800\nnew();\n#else\nold();\n#endif\n#endif\n",
    "#if CUONLINE_HAS_BIAS\nbias();\n#else\nnone();\n#endif\n",
    "// the emulation (cuemu, cuda_cpu.h) defines this helper for the host compiler\n",
])
def test_the_rule_accepts_device_only_code(text):
    assert emulation_code(text) == []


# ------------------------------------------------------------------------------------------------
# The emulation supplies what the kernel text leaves to it

def _parameter_types(params: str) -> tuple:
    """``"float (&d)[4], int n = 16"`` -> ``("float (&)[4]", "int")``: defaults and parameter
    names dropped, so a declaration and its definition elsewhere compare equal."""
    types = []
    for param in filter(None, (p.strip() for p in params.split(","))):
        param = param.split("=")[0]
        if "(" in param:   # a reference or pointer to an array: float (&d)[4]
            param = re.sub(r"\(\s*([&*]+)\s*\w+\s*\)", r"(\1)", param)
        else:
            param = re.sub(r"\w+\s*$", "", param)
        types.append(" ".join(param.replace("*", " * ").replace("&", " & ").split()))
    return tuple(types)


def _functions(text: str) -> tuple[set, set]:
    """(declared without a body, defined) `__device__ __forceinline__` functions of `text`,
    as (name, parameter types); comments are ignored, explicit specializations count as
    definitions of their template."""
    text = _COMMENT_RE.sub(" ", text)
    declared, defined = set(), set()
    for m in re.finditer(r"__device__\s+__forceinline__\s", text):
        paren = text.index("(", m.end())
        head = re.sub(r"<[^<>]*>\s*$", "", text[m.end():paren].rstrip())
        depth, i = 1, paren + 1
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        signature = (re.findall(r"\w+", head)[-1], _parameter_types(text[paren + 1:i - 1]))
        follow = re.match(r"[^;{]*([;{])", text[i:])
        (declared if follow and follow.group(1) == ";" else defined).add(signature)
    return declared, defined


def _host_view(text: str) -> str:
    """`text` as a host compiler reads it: the blocks of device presence tests
    (``#ifdef __CUDA_ARCH__``, ``#ifdef __CUDACC__``...) dropped, nested ones included."""
    out, depth = [], 0
    for line in text.split("\n"):
        directive = re.match(r"\s*#\s*(\w+)\s*(.*?)\s*$", line)
        word = directive.group(1) if directive else ""
        if depth:
            depth += word in ("if", "ifdef", "ifndef")
            depth -= word == "endif"
        elif directive and _PRESENCE_RE.match(f"{word} {directive.group(2)}".strip()):
            depth = 1
        else:
            out.append(line)
    return "\n".join(out)


def test_emulation_defines_every_helper_the_kernel_text_only_declares():
    """A helper that the host view of kernels_cu/ declares but does not define (its body is
    inline PTX) must be defined by a part of the emulation header."""
    declared, defined = set(), set()
    for path in KERNEL_FILES:
        d, f = _functions(_host_view(path.read_text(encoding="utf-8")))
        declared |= d
        defined |= f
    left = declared - defined
    names = {name for name, _ in left}
    assert {"mma_m16n8k16", "ldmatrix", "cp_async_16", "exp2_weight"} <= names   # seen
    emulated = set()
    for path in emulate.header_files().values():
        emulated |= _functions(path.read_text(encoding="utf-8"))[1]
    assert left <= emulated, f"no emulation body for {sorted(left - emulated)}"


# ------------------------------------------------------------------------------------------------
# The emulation header's parts

def test_header_files_are_every_header_under_testing():
    """Every .h beside emulate.py (at any depth) is a header file: hashed, copied, shipped."""
    on_disk = {p.relative_to(HEADER_DIR).as_posix() for p in HEADER_DIR.rglob("*.h")}
    assert set(emulate.header_files()) == on_disk
    assert "cuda_cpu.h" in on_disk and len(on_disk) > 10


def _includes(name: str, texts: dict) -> list[str]:
    here = Path(name).parent
    return [(here / inc).as_posix()
            for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', texts[name], re.M)]


def test_the_entry_reaches_every_part_and_only_system_h_includes_system_headers():
    texts = {name: path.read_text(encoding="utf-8")
             for name, path in emulate.header_files().items()}
    reached, todo = set(), ["cuda_cpu.h"]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        for inc in _includes(name, texts):
            assert inc in texts, f"{name} includes {inc!r}, which is not a header file"
            todo.append(inc)
    assert reached == set(texts), f"not included by cuda_cpu.h: {sorted(set(texts) - reached)}"
    # The CUDA qualifiers are macros that break libstdc++'s headers read after them.
    for name, text in texts.items():
        system = re.findall(r"^\s*#\s*include\s+<([^>]+)>", text, re.M)
        assert not system or name == "cuda_cpu/system.h", (name, system)


# ------------------------------------------------------------------------------------------------
# The build cache covers every part


def test_every_header_file_is_in_the_cache_key(monkeypatch, tmp_path):
    """Changing any one header file (to the same text plus a comment) changes the key."""
    monkeypatch.setattr(emulate, "_compiler", lambda: ("/usr/bin/g++", "g++ (test) 12"))
    built = []
    monkeypatch.setattr(emulate, "_cached_library",
                        lambda key, build: built.append(key) or tmp_path / f"{key}.so")
    monkeypatch.setattr(emulate, "EmulatedModule", lambda *a, **k: object())
    monkeypatch.setattr(emulate, "_modules", {})
    source = 'extern "C" __global__ void k() {}\n'
    emulate.compile_module(source)
    for name, path in emulate.header_files().items():
        emulate.compile_module(source, headers={name: path.read_text() + "// edited\n"})
    assert len(set(built)) == len(built) == 1 + len(emulate.header_files()), built


def test_unknown_header_replacements_are_refused():
    with pytest.raises(ValueError, match="'cuda_cpu/nope.h' is not a file of the emulation"):
        emulate.compile_module('extern "C" __global__ void k() {}\n',
                               headers={"cuda_cpu/nope.h": ""})
    with pytest.raises(TypeError, match=r"headers\['cuda_cpu.h'\] must be a str"):
        emulate.compile_module('extern "C" __global__ void k() {}\n',
                               headers={"cuda_cpu.h": b""})


PROBE = """
extern "C" __global__ void probe(int* out) {
#ifdef CUEMU_LAYOUT_PROBE
    out[0] = CUEMU_LAYOUT_PROBE;
#else
    out[0] = -1;
#endif
}
"""


@needs_emulation
def test_an_edit_to_a_part_on_disk_rebuilds(monkeypatch, tmp_path):
    """A part edited in place (a copy of the header tree) is compiled in, not a stale library."""
    tree = tmp_path / "testing"
    for name, path in emulate.header_files().items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(path.read_text())
    monkeypatch.setattr(emulate, "header_path", lambda: tree / "cuda_cpu.h")
    monkeypatch.setenv("CUONLINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(emulate, "_modules", {})

    def run():
        out = np.zeros(1, np.int32)
        emulate.compile_module(PROBE).get_function("probe")((1,), (1,), (out,))
        return int(out[0])

    assert run() == -1
    part = tree / "cuda_cpu" / "atomics.h"
    part.write_text(part.read_text() + "#define CUEMU_LAYOUT_PROBE 7\n")
    assert run() == 7
