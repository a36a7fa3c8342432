"""Run CUDA C kernel text on the CPU: a stand-in for ``cupy.RawModule`` in tests.

The kernel text that CuPy would hand to NVRTC is compiled by the system C++ compiler with the
CUDA-emulation header ``cuda_cpu.h`` force-included, into a shared library that is loaded with
:mod:`ctypes`.  The objects returned mirror ``cupy.RawModule`` / ``cupy.RawKernel`` so the CUDA
engine drives both through one code path::

    from cuonline.testing import emulate
    mod = emulate.compile_module(source)                 # cached in memory and on disk
    fn = mod.get_function("cuonline_attention_fwd")
    fn(grid, block, (q, k, v, out, np.int32(n)), shared_mem=0)

Arguments are NumPy arrays (their data pointer is passed, as CuPy passes a device pointer),
``None`` (a null pointer) or NumPy scalars of an explicit C type.  Unlike CuPy, the emulation
checks every argument against the kernel's parameter types (read from the compiled signature):
a Python ``int``/``float``, a wrong scalar type, a float64 array for a ``float*`` or a read-only
array for a non-const pointer raise :class:`TypeError`.

Modes
-----
``"fibers"`` (default)
    The threads of a block are user-space contexts on one OS thread, switched at barriers and
    warp collectives.  Fast; deadlocks and misuse (partial shuffle masks, bad widths) raise
    :class:`EmulationError`.
``"threads"``
    One OS thread per CUDA thread; needed for ThreadSanitizer (``tsan=True``).  Misuse aborts
    the process with a message; a watchdog aborts a barrier stuck for
    ``$CUONLINE_EMULATE_WATCHDOG_S`` seconds (default 20).

ThreadSanitizer builds (``tsan=True``) can only be loaded into an interpreter that was started
with libtsan preloaded: run the tests that use them in a subprocess with the environment from
:func:`tsan_environment`, and check :func:`running_under_tsan` first.

Environment
-----------
``CUONLINE_CACHE_DIR``
    Root of the on-disk cache (default ``~/.cache/cuonline``); libraries go in ``emulate/``.
``CXX``
    The C++20 compiler to use (default ``g++``, then ``c++``).
``CUONLINE_EMULATE_STACK_KB``
    Stack size of each fiber (default 256).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

__all__ = [
    "EmulationError",
    "EmulatedModule",
    "EmulatedKernel",
    "compile_module",
    "compiler_problem",
    "header_path",
    "running_under_tsan",
    "tsan_environment",
    "tsan_python",
]

#: Bumped whenever the generated launcher code changes, to invalidate cached libraries.
_GLUE_VERSION = "2"

#: Per-block limits of the target GPUs (sm_80/sm_90); launches beyond them fail on hardware.
_MAX_THREADS_PER_BLOCK = 1024
_MAX_GRID = (2**31 - 1, 65535, 65535)
_MAX_BLOCK = (1024, 1024, 64)
_DEFAULT_DYNAMIC_SHARED = 48 * 1024
_MAX_DYNAMIC_SHARED = 227 * 1024

_MODES = ("fibers", "threads")

_SCALAR_CODES = {
    np.int32: "i4",
    np.int64: "i8",
    np.uint32: "u4",
    np.uint64: "u8",
    np.float32: "f4",
    np.float64: "f8",
    np.float16: "h2",
}
_CTYPES = {
    "i4": ctypes.c_int32,
    "i8": ctypes.c_int64,
    "u4": ctypes.c_uint32,
    "u8": ctypes.c_uint64,
    "f4": ctypes.c_float,
    "f8": ctypes.c_double,
    "h2": ctypes.c_uint16,
}
_C_NAMES = {
    "i1": "signed char",
    "i2": "short",
    "i4": "int",
    "i8": "long long",
    "u1": "unsigned char",
    "u2": "unsigned short",
    "u4": "unsigned int",
    "u8": "unsigned long long",
    "f4": "float",
    "f8": "double",
    "h2": "__half",
    "b2": "__nv_bfloat16",
}

_ENTRY_RE = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?([A-Za-z_]\w*)\s*\("
)
_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
# Spans where `__shared__` is not a declaration: comments, string/char literals, directives.
_SKIP_RE = re.compile(
    r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'|^[ \t]*#(?:\\\n|[^\n])*",
    re.S | re.M,
)
_SHARED_RE = re.compile(r"\b__shared__\b")
_EXTERN_SHARED_RE = re.compile(
    r"extern\s+__shared__\s+((?:__align__\s*\(\s*\d+\s*\)\s*)*)([\w:<>\s\*]+?)\s*"
    r"\b([A-Za-z_]\w*)\s*\[\s*\]\s*;"
)


class EmulationError(RuntimeError):
    """A kernel failed under emulation (deadlock, partial mask, ``__trap``) or did not build."""


def header_path() -> Path:
    """Path of the CUDA-emulation header shipped with the package."""
    return Path(__file__).resolve().parent / "cuda_cpu.h"


# ------------------------------------------------------------------------------------------------
# Compiler and cache


def _cache_dir() -> Path:
    root = os.environ.get("CUONLINE_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "cuonline"
    return base / "emulate"


_compiler_lock = threading.Lock()
_compiler_info: tuple[str, str] | None = None


def _compiler() -> tuple[str, str]:
    """(path, version line) of a C++20 compiler, or a RuntimeError saying what is needed."""
    global _compiler_info
    with _compiler_lock:
        if _compiler_info is not None:
            return _compiler_info
        candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++"]
        found = None
        for name in candidates:
            path = shutil.which(name)
            if path:
                found = path
                break
        if found is None:
            raise RuntimeError(
                "the CUDA emulation backend needs a C++20 compiler (g++ >= 11 or clang++ >= 14) "
                f"to build kernels for the CPU; none of {candidates} was found on the PATH. "
                "Install one or point $CXX at it."
            )
        try:
            version = subprocess.run(
                [found, "--version"], capture_output=True, text=True, timeout=30
            ).stdout.splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError) as exc:
            raise RuntimeError(f"the C++ compiler {found!r} does not run: {exc}") from exc
        probe = subprocess.run(
            [found, "-std=c++20", "-fsyntax-only", "-x", "c++", "-"],
            input="#include <atomic>\n#include <bit>\nfloat f(unsigned x){return "
            "std::bit_cast<float>(x);}\nvoid g(float* p){std::atomic_ref<float>(*p)"
            ".fetch_add(1.0f);}\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        if probe.returncode != 0:
            raise RuntimeError(
                f"the C++ compiler {found!r} ({version}) cannot compile C++20 "
                "(std::bit_cast, std::atomic_ref<float>); the CUDA emulation backend needs "
                "g++ >= 11 or clang++ >= 14. Point $CXX at one.\n" + _trim(probe.stderr)
            )
        _compiler_info = (found, version)
        return _compiler_info


def compiler_problem() -> str | None:
    """None when a C++20 compiler for the emulation is available, else why it is not."""
    try:
        _compiler()
    except RuntimeError as exc:
        return str(exc)
    return None


def _flags(mode: str, tsan: bool) -> list[str]:
    flags = [
        "-std=c++20",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        "-fvisibility-inlines-hidden",
        "-Wno-unknown-pragmas",
        "-pthread",
        f"-DCUEMU_MODE_{mode.upper()}=1",
    ]
    flags += ["-fsanitize=thread", "-O1", "-g"] if tsan else ["-O2"]
    return flags


def _trim(text: str, limit: int = 4000) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    return text[: limit // 2] + "\n[...]\n" + text[-limit // 2 :]


def _entry_points(source: str) -> list[str]:
    names = _ENTRY_RE.findall(_COMMENT_RE.sub(" ", source))
    return list(dict.fromkeys(names))


def _instrument_shared(source: str) -> str:
    """Make every static ``__shared__`` variable register itself with the runtime.

    ``__shared__ float s[N], t;`` gets ``static ::cuemu::SharedVar cuemu_sv_K{&s, sizeof(s)};``
    (and one for ``t``) appended on the same line, so the runtime can poison it before each
    block.  ``extern __shared__ T name[];`` becomes a pointer to the launch's dynamic shared
    buffer.  Occurrences inside comments, literals and preprocessor directives are left alone.
    """
    skip = [m.span() for m in _SKIP_RE.finditer(source)]

    def skipped(pos: int) -> bool:
        return any(a <= pos < b for a, b in skip)

    out, last, counter = [], 0, 0
    for m in _SHARED_RE.finditer(source):
        if m.start() < last or skipped(m.start()):
            continue
        ext = source.rfind("extern", 0, m.start())
        if ext >= 0 and not source[ext + 6 : m.start()].strip():
            d = _EXTERN_SHARED_RE.match(source, ext)
            if d is None:
                continue  # left as is: the compiler will point at it
            ctype, name = d.group(2).strip(), d.group(3)
            out.append(source[last:ext])
            out.append(
                f"{ctype}* const {name} = "
                f"reinterpret_cast<{ctype}*>(::cuemu::dynamic_shared_base());"
            )
            last = d.end()
            continue
        end = _declaration_end(source, m.end(), skipped)
        if end is None:
            continue
        names = _declarator_names(source[m.end() : end])
        regs = []
        for name in names:
            counter += 1
            regs.append(
                f" static ::cuemu::SharedVar cuemu_sv_{counter}{{&{name}, sizeof({name})}};"
            )
        out.append(source[last : end + 1] + "".join(regs))
        last = end + 1
    out.append(source[last:])
    return "".join(out)


def _declaration_end(source: str, pos: int, skipped) -> int | None:
    """Index of the ``;`` that ends the declaration starting at `pos` (depth 0)."""
    depth = 0
    for i in range(pos, len(source)):
        c = source[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth < 0:
                return None
        elif c == ";" and depth == 0 and not skipped(i):
            return i
    return None


def _declarator_names(decl: str) -> list[str]:
    """Names declared by ``float a[4][N], b`` (the text after ``__shared__``)."""
    parts, depth, cur = [], 0, []
    for c in decl:
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    names = []
    for part in parts:
        part = part.split("=")[0]
        prev = None
        while prev != part:  # drop [..], (..), <..> groups innermost first
            prev = part
            part = re.sub(r"\[[^\[\]]*\]|\([^()]*\)|<[^<>]*>", " ", part)
        idents = re.findall(r"[A-Za-z_]\w*", part)
        if idents:
            names.append(idents[-1])
    return names


def _glue(names: list[str]) -> str:
    lines = ["\n// ---- cuonline emulation launchers (generated) ----"]
    for name in names:
        lines.append(
            f'extern "C" __attribute__((visibility("default"))) int cuemu_launch_{name}('
            "unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, "
            "size_t smem, void** args) {\n"
            f"    return ::cuemu::launch(&{name}, gx, gy, gz, bx, by, bz, smem, args);\n}}\n"
            f'extern "C" __attribute__((visibility("default"))) const char* '
            f"cuemu_signature_{name}() {{ return ::cuemu::signature(&{name}); }}"
        )
    return "\n".join(lines) + "\n"


_modules: dict[str, "EmulatedModule"] = {}
_modules_lock = threading.Lock()


def compile_module(
    source: str,
    *,
    mode: str = "fibers",
    tsan: bool = False,
    options: tuple[str, ...] = (),
) -> "EmulatedModule":
    """Compile CUDA C kernel text for the CPU and load it (cached in memory and on disk).

    Parameters
    ----------
    source : str
        The kernel text, exactly as given to ``cupy.RawModule(code=...)``.  Every
        ``extern "C" __global__ void NAME(...)`` becomes callable through ``get_function``.
    mode : {"fibers", "threads"}
        How CUDA threads are run (see the module docstring).  ``tsan=True`` requires
        ``"threads"`` (the default ``"fibers"`` is switched to it).
    tsan : bool
        Build with ThreadSanitizer.  Only possible in a process started with
        :func:`tsan_environment`; raises :class:`RuntimeError` otherwise.
    options : tuple of str
        ``-DNAME[=VALUE]`` / ``-UNAME`` definitions, as in ``RawModule(options=...)``.  Other
        NVRTC options are refused: they have no CPU meaning.

    Returns
    -------
    EmulatedModule
    """
    if not isinstance(source, str):
        raise TypeError(f"source must be a str of CUDA C, got {type(source).__name__}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if tsan:
        mode = "threads"
        if not running_under_tsan():
            raise RuntimeError(
                "tsan=True needs ThreadSanitizer's runtime loaded before Python starts: run "
                "this code in a subprocess with env=emulate.tsan_environment() (it sets "
                "LD_PRELOAD to libtsan and OPENBLAS_NUM_THREADS=1) and the real interpreter "
                f"{_real_python()!r}."
            )
    options = tuple(options)
    for opt in options:
        if not isinstance(opt, str) or not re.fullmatch(r"-[DU][A-Za-z_]\w*(=.*)?", opt):
            raise ValueError(
                f"options may hold only -DNAME[=VALUE] or -UNAME definitions, got {opt!r}"
            )
    names = _entry_points(source)
    if not names:
        raise ValueError('source defines no extern "C" __global__ void function')
    cxx, version = _compiler()
    header = header_path().read_text()
    flags = _flags(mode, tsan) + list(options)
    key = hashlib.sha256(
        "\0".join([_GLUE_VERSION, source, header, version, cxx, " ".join(flags)]).encode()
    ).hexdigest()[:32]
    with _modules_lock:
        mod = _modules.get(key)
        if mod is None:
            lib_path = _build(key, _instrument_shared(source) + _glue(names), names, cxx, flags)
            mod = EmulatedModule(lib_path, names, mode=mode, tsan=tsan)
            _modules[key] = mod
        return mod


def _build(key: str, text: str, names: list[str], cxx: str, flags: list[str]) -> Path:
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"{key}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".build-{key[:8]}-") as tmp:
        src = Path(tmp) / "kernel.cu"
        src.write_text(text)
        out = Path(tmp) / "kernel.so"
        cmd = [cxx, *flags, "-include", str(header_path()), "-x", "c++", str(src), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise EmulationError(
                f"compiling kernel(s) {', '.join(names)} for CPU emulation failed "
                f"({Path(cxx).name} exit status {proc.returncode}):\n" + _trim(proc.stderr)
            )
        os.replace(out, lib)  # atomic: concurrent builders of the same key are harmless
    return lib


# ------------------------------------------------------------------------------------------------
# Modules and kernels


class EmulatedModule:
    """A compiled module; the counterpart of ``cupy.RawModule``."""

    def __init__(self, path: Path, names: list[str], *, mode: str, tsan: bool):
        self.path = path
        self.mode = mode
        self.tsan = tsan
        self.names = tuple(names)
        self._lib = ctypes.CDLL(str(path))
        self._lib.cuemu_last_error.restype = ctypes.c_char_p
        self._lib.cuemu_static_shared_bytes.restype = ctypes.c_size_t
        self._lock = threading.Lock()  # static __shared__ is per module: one launch at a time
        self._kernels: dict[str, EmulatedKernel] = {}

    def get_function(self, name: str) -> "EmulatedKernel":
        if name not in self.names:
            raise ValueError(
                f"kernel {name!r} is not defined in this module; its extern \"C\" __global__ "
                f"functions are {list(self.names)}"
            )
        fn = self._kernels.get(name)
        if fn is None:
            fn = self._kernels[name] = EmulatedKernel(self, name)
        return fn

    @property
    def static_shared_bytes(self) -> int:
        """Bytes of ``__shared__`` variables in the module (all kernels together)."""
        return int(self._lib.cuemu_static_shared_bytes())

    def __repr__(self) -> str:
        return f"<EmulatedModule {list(self.names)} mode={self.mode} tsan={self.tsan}>"


def _dims(value, what: str) -> tuple[int, int, int]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        dims = (int(value),)
    elif isinstance(value, tuple) and 1 <= len(value) <= 3:
        dims = tuple(int(v) if isinstance(v, (int, np.integer)) else None for v in value)
        if None in dims or any(isinstance(v, bool) for v in value):
            raise TypeError(f"{what} must be an int or a tuple of 1-3 ints, got {value!r}")
    else:
        raise TypeError(f"{what} must be an int or a tuple of 1-3 ints, got {value!r}")
    dims = dims + (1,) * (3 - len(dims))
    if any(d < 1 for d in dims):
        raise ValueError(f"{what} dimensions must be >= 1, got {value!r}")
    return dims


class EmulatedKernel:
    """One ``extern "C" __global__`` function; the counterpart of ``cupy.RawKernel``.

    ``max_dynamic_shared_size_bytes`` mirrors the CuPy attribute: launches asking for more than
    48 KiB of dynamic shared memory fail unless it was raised first, as on the GPU.
    """

    def __init__(self, module: EmulatedModule, name: str):
        self.module = module
        self.name = name
        self.max_dynamic_shared_size_bytes = _DEFAULT_DYNAMIC_SHARED
        self._launch = getattr(module._lib, f"cuemu_launch_{name}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_size_t, ctypes.c_void_p]
        sig = getattr(module._lib, f"cuemu_signature_{name}")
        sig.restype = ctypes.c_char_p
        self.signature = tuple(c for c in sig().decode().split(",") if c)

    def __repr__(self) -> str:
        return f"<EmulatedKernel {self.name}({', '.join(self.signature)})>"

    def __call__(self, grid, block, args, *, shared_mem: int = 0) -> None:
        grid = _dims(grid, "grid")
        block = _dims(block, "block")
        if any(g > m for g, m in zip(grid, _MAX_GRID)):
            raise ValueError(f"grid {grid} exceeds the CUDA limits {_MAX_GRID}")
        if any(b > m for b, m in zip(block, _MAX_BLOCK)) or np.prod(block) > _MAX_THREADS_PER_BLOCK:
            raise ValueError(
                f"block {block} exceeds the CUDA limits ({_MAX_THREADS_PER_BLOCK} threads, "
                f"{_MAX_BLOCK} per dimension)"
            )
        shared_mem = int(shared_mem)
        if shared_mem < 0:
            raise ValueError(f"shared_mem must be >= 0, got {shared_mem}")
        if shared_mem > _MAX_DYNAMIC_SHARED:
            raise ValueError(
                f"shared_mem={shared_mem} exceeds the 227 KiB per block of sm_90 hardware"
            )
        if shared_mem > max(self.max_dynamic_shared_size_bytes, _DEFAULT_DYNAMIC_SHARED):
            raise ValueError(
                f"shared_mem={shared_mem} exceeds 48 KiB: set "
                f"kernel.max_dynamic_shared_size_bytes first, as CUDA requires "
                f"(it is {self.max_dynamic_shared_size_bytes})"
            )
        if not isinstance(args, tuple):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self.signature):
            raise TypeError(
                f"{self.name} takes {len(self.signature)} arguments ({', '.join(self.signature)}),"
                f" got {len(args)}"
            )
        keep = []
        ptrs = (ctypes.c_void_p * max(1, len(args)))()
        for i, (arg, code) in enumerate(zip(args, self.signature)):
            value = self._convert(i, arg, code)
            keep.append(value)
            ptrs[i] = ctypes.cast(ctypes.pointer(value), ctypes.c_void_p)
        with self.module._lock:
            rc = self._launch(*grid, *block, shared_mem, ctypes.cast(ptrs, ctypes.c_void_p))
        if rc != 0:
            msg = self.module._lib.cuemu_last_error().decode(errors="replace")
            raise EmulationError(f"kernel {self.name}: {msg}")

    def _convert(self, i: int, arg, code: str):
        kind, elem = code[0], code[1:]
        where = f"argument {i} of {self.name}"
        if kind in "pc":
            if arg is None:
                return ctypes.c_void_p(None)
            if not isinstance(arg, np.ndarray):
                raise TypeError(
                    f"{where} is a pointer ({_c_name(elem)}*): pass a numpy array or None, got "
                    f"{type(arg).__name__}"
                )
            if kind == "p" and not arg.flags.writeable:
                raise TypeError(
                    f"{where} is a non-const pointer ({_c_name(elem)}*) but the array is "
                    "read-only"
                )
            if not _dtype_matches(arg.dtype, elem):
                raise TypeError(
                    f"{where} is a {_c_name(elem)}* but the array has dtype {arg.dtype}"
                )
            return ctypes.c_void_p(arg.ctypes.data)
        # by value
        if code.startswith("vx") and isinstance(arg, (ctypes.Structure, ctypes.Array)):
            if ctypes.sizeof(arg) != int(elem[1:]):
                raise TypeError(
                    f"{where} is a {elem[1:]}-byte struct but got a {ctypes.sizeof(arg)}-byte "
                    f"{type(arg).__name__}"
                )
            return arg
        if not isinstance(arg, np.generic):  # np.float64 subclasses float: test this first
            raise TypeError(
                f"{where} is a {_c_name(elem)} passed by value: give an explicit NumPy scalar "
                f"(np.int32, np.int64, np.uint32, np.uint64, np.float32, np.float64), got "
                f"{type(arg).__name__} {arg!r} (CuPy would pass a Python int as long long and "
                "a float as double)"
            )
        got = _SCALAR_CODES.get(type(arg))
        if got is None:
            raise TypeError(f"{where}: unsupported scalar type {type(arg).__name__}")
        if got != elem:
            raise TypeError(
                f"{where} is a {_c_name(elem)} but got {type(arg).__name__} ({_c_name(got)})"
            )
        if got == "h2":
            return ctypes.c_uint16(int(arg.view(np.uint16)))
        return _CTYPES[got](arg.item())


def _c_name(code: str) -> str:
    if code.startswith("x"):
        return "void" if code == "x0" else f"<{code[1:]}-byte type>"
    return _C_NAMES.get(code, code)


def _dtype_matches(dtype: np.dtype, code: str) -> bool:
    """Whether an array of `dtype` may back a pointer to the C element type `code`."""
    if code.startswith("x"):  # void, char, bool, structs, vector types: bytes, no check
        return True
    if code == "h2":
        return dtype == np.float16
    if code == "b2":  # NumPy has no bfloat16 without ml_dtypes: uint16 arrays carry the bits
        return dtype.name == "bfloat16" or dtype == np.uint16
    if code[0] in "iu" and code[1] == "1":
        return dtype.itemsize == 1
    expected = np.dtype(f"{code[0]}{code[1:]}")
    return dtype == expected


# ------------------------------------------------------------------------------------------------
# ThreadSanitizer


def _real_python() -> str:
    """The interpreter binary itself (a pyenv shim crashes under LD_PRELOAD)."""
    return os.path.realpath(sys.executable)


def _libtsan() -> str | None:
    try:
        cxx, _ = _compiler()
    except RuntimeError:
        return None
    try:
        out = subprocess.run(
            [cxx, "-print-file-name=libtsan.so"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out or not os.path.isabs(out) or not os.path.exists(out):
        return None
    return os.path.realpath(out)


def running_under_tsan() -> bool:
    """Whether ThreadSanitizer's runtime is loaded in this process."""
    try:
        with open("/proc/self/maps") as f:
            return "libtsan" in f.read()
    except OSError:
        return False


def tsan_environment() -> dict[str, str]:
    """Environment for a subprocess that may load ``tsan=True`` modules.

    Returns a copy of ``os.environ`` with libtsan preloaded, ``OPENBLAS_NUM_THREADS=1`` (OpenBLAS's
    own threads give false reports) and ``TSAN_OPTIONS`` that keep reports readable.  Start the
    subprocess with :func:`tsan_python` (the real interpreter binary: a pyenv shim crashes under
    ``LD_PRELOAD``).  Raises :class:`RuntimeError` when libtsan is not available.

    Examples
    --------
    >>> import subprocess
    >>> env = tsan_environment()                                      # doctest: +SKIP
    >>> subprocess.run([tsan_python(), "check_races.py"], env=env)    # doctest: +SKIP
    """
    lib = _libtsan()
    if lib is None:
        raise RuntimeError(
            "ThreadSanitizer is not available: the C++ compiler has no libtsan.so "
            "(on Debian/Ubuntu: apt-get install libtsan2 or the gcc package that ships it)"
        )
    env = dict(os.environ)
    env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TSAN_OPTIONS", "halt_on_error=0 report_signal_unsafe=0")
    return env


def tsan_python() -> str:
    """The interpreter to start under :func:`tsan_environment`."""
    return _real_python()
