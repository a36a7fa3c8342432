"""Run CUDA C kernel text on the CPU: a stand-in for ``cupy.RawModule`` in tests.

The kernel text that CuPy would hand to NVRTC is compiled by the system C++ compiler with the
CUDA-emulation header ``cuda_cpu.h`` force-included (it includes its parts, one role each, from
``cuda_cpu/``), into a shared library that is loaded with :mod:`ctypes`.  The objects returned
mirror ``cupy.RawModule`` / ``cupy.RawKernel`` so the CUDA engine drives both through one code
path::

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
    Root of the on-disk cache (default ``$XDG_CACHE_HOME/cuonline``, else
    ``~/.cache/cuonline``); libraries go in ``emulate/``.
``CXX``
    The C++20 compiler to use (default ``g++``, then ``c++``).
``CUONLINE_EMULATE_STACK_KB``
    Stack size of each fiber in KiB, 64 to 1048576 (default 256).
``CUONLINE_EMULATE_WATCHDOG_S``
    Seconds before a stuck barrier aborts in the threads mode (default 20).

A bad value raises :class:`ValueError` naming the variable (``docs/environment.md``).

The cache
---------
Only libraries that this user built are loaded.  The ``emulate/`` directory must belong to the
user (it is made private, mode 0700, when it is theirs); each library must belong to the user,
be writable by nobody else and match the SHA-256 recorded beside it (``KEY.sha256``, in
``sha256sum`` format) when it was built.  A library that fails a check is rebuilt (with a
:class:`RuntimeWarning` when it was foreign, open to others or damaged).  Libraries and records
are published with :func:`os.replace`, so a reader sees a whole file or none.  A cache directory
that cannot be made or is not the user's is replaced, for the process, by a private temporary
one, with a warning naming ``CUONLINE_CACHE_DIR``.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .. import _environment

__all__ = [
    "EmulationError",
    "EmulatedModule",
    "EmulatedKernel",
    "compile_module",
    "compiler_problem",
    "header_files",
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


class CompilerSettingError(ValueError, RuntimeError):
    """``$CXX`` names no usable C++20 compiler.

    A bad setting (:class:`ValueError`, naming the variable) that, like a machine with no
    compiler at all, leaves the emulation unable to build (:class:`RuntimeError`, which
    :func:`compiler_problem` and the test suite's skips look for).
    """


def header_path() -> Path:
    """Path of the CUDA-emulation header shipped with the package (the force-included entry)."""
    return Path(__file__).resolve().parent / "cuda_cpu.h"


def header_files() -> dict[str, Path]:
    """Every file of the CUDA-emulation header: name -> path, sorted by name.

    Names are relative to the directory of :func:`header_path`: ``"cuda_cpu.h"`` (the entry)
    and ``"cuda_cpu/<part>.h"`` (the parts it includes).  All of them enter the build-cache key.
    """
    entry = header_path()
    files = {entry.name: entry}
    for part in sorted((entry.parent / "cuda_cpu").glob("*.h")):
        files[f"cuda_cpu/{part.name}"] = part
    return dict(sorted(files.items()))


def _header_texts(replacements) -> dict[str, str]:
    """name -> text of every header file, with `replacements` (name -> text) substituted."""
    files = header_files()
    texts = {name: path.read_text(encoding="utf-8") for name, path in files.items()}
    if replacements is None:
        return texts
    if not isinstance(replacements, Mapping):
        raise TypeError("headers must be a mapping of header file name to text, got "
                        f"{type(replacements).__name__}")
    for name, text in replacements.items():
        if name not in texts:
            raise ValueError(f"headers: {name!r} is not a file of the emulation header; its "
                             f"files are {list(texts)}")
        if not isinstance(text, str):
            raise TypeError(f"headers[{name!r}] must be a str of C++, got "
                            f"{type(text).__name__}")
        texts[name] = text
    return texts


# ------------------------------------------------------------------------------------------------
# Compiler and cache


_compiler_lock = threading.Lock()
#: ($CXX as set, compiler path, version line) of the last successful probe.
_compiler_info: tuple[str | None, str, str] | None = None


def _compiler() -> tuple[str, str]:
    """(path, version line) of a C++20 compiler, or a RuntimeError saying what is needed.

    A ``$CXX`` that names nothing runnable, or a compiler that is not C++20, raises
    :class:`CompilerSettingError` naming the variable.  The probe is redone when ``$CXX``
    changes.
    """
    global _compiler_info
    setting = os.environ.get("CXX") or None
    with _compiler_lock:
        if _compiler_info is not None and _compiler_info[0] == setting:
            return _compiler_info[1:]
        try:
            chosen = _environment.cxx()
        except ValueError as exc:
            raise CompilerSettingError(
                f"{exc}. The CUDA emulation backend needs a C++20 compiler (g++ >= 11 or "
                "clang++ >= 14); point CXX at one or unset it to use g++ from the PATH."
            ) from None
        candidates = [chosen] if chosen else ["g++", "c++"]
        found = next((p for p in map(shutil.which, candidates) if p), None)
        if found is None:
            raise RuntimeError(
                "the CUDA emulation backend needs a C++20 compiler (g++ >= 11 or clang++ >= 14) "
                f"to build kernels for the CPU; none of {candidates} was found on the PATH. "
                "Install one or point $CXX at it."
            )
        # A failure of the compiler that $CXX chose is a bad setting; of the default, a missing
        # prerequisite.
        error = CompilerSettingError if chosen else RuntimeError
        named = f"CXX={setting!r}: " if chosen else ""
        try:
            version = _run_compiler([found, "--version"], timeout=30).stdout.splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError) as exc:
            raise error(f"{named}the C++ compiler {found!r} does not run: {exc!r}") from exc
        try:
            probe = _run_compiler(
                [found, "-std=c++20", "-fsyntax-only", "-x", "c++", "-"],
                input="#include <atomic>\n#include <bit>\nfloat f(unsigned x){return "
                "std::bit_cast<float>(x);}\nvoid g(float* p){std::atomic_ref<float>(*p)"
                ".fetch_add(1.0f);}\n",
                timeout=60,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise error(f"{named}the C++ compiler {found!r} does not run: {exc!r}") from exc
        if probe.returncode != 0:
            raise error(
                f"{named}the C++ compiler {found!r} ({version}) cannot compile C++20 "
                "(std::bit_cast, std::atomic_ref<float>); the CUDA emulation backend needs "
                "g++ >= 11 or clang++ >= 14. Point $CXX at one.\n" + _trim(probe.stderr)
            )
        _compiler_info = (setting, found, version)
        return found, version


def _run_compiler(cmd: list[str], *, input: str | None = None, timeout: float | None = None,
                  cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run a compiler command in a session of its own; on any exception, end all of it.

    ``g++`` is a driver: the work runs in its children (``cc1plus``, ``as``, ``collect2``).
    ``subprocess.run`` kills only the driver on Ctrl-C or a timeout, and an interrupt sent to
    this process alone (a notebook, a test runner's timeout) never reaches them.  In a new
    session the compiler's process group holds exactly its processes, so the group is ended on
    ``KeyboardInterrupt`` or any other exception, which is then re-raised.
    """
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException:
        _end_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _end_group(proc: subprocess.Popen) -> None:
    """End the process group that `proc` leads, then reap `proc`.

    SIGTERM first (the g++ driver then deletes its temporary files), SIGKILL a second later to
    whatever is left: children may outlive the driver or ignore SIGTERM.
    """
    for sig, grace in ((signal.SIGTERM, 1.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)   # the group id is the leader's pid (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass                       # no process of the group is left
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def compiler_problem() -> str | None:
    """None when a C++20 compiler for the emulation is available, else why it is not."""
    try:
        _compiler()
    except RuntimeError as exc:   # CompilerSettingError (a bad $CXX) included
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
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
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
    headers: Mapping[str, str] | None = None,
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
    headers : mapping of str to str, optional
        Texts that replace files of the emulation header, by their :func:`header_files` name
        (``{"cuda_cpu/tensor_core.h": text}``): for tests that check that a deliberately wrong
        emulation fails them.  The shipped files are used otherwise.

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
    _check_runtime_settings(mode)
    texts = _header_texts(headers)
    cxx, version = _compiler()
    flags = _flags(mode, tsan) + list(options)
    # Every header file, by name and content: an edit to any part rebuilds, and the build
    # compiles exactly the texts hashed here (it copies them, see _build).
    header_key = [f"{name}\0{text}" for name, text in texts.items()]
    key = hashlib.sha256(
        "\0".join([_GLUE_VERSION, source, *header_key, version, cxx, " ".join(flags)]).encode()
    ).hexdigest()[:32]
    with _modules_lock:
        mod = _modules.get(key)
        if mod is None:
            lib_path = _cached_library(
                key, lambda cache: _build(cache, key, _instrument_shared(source) + _glue(names),
                                          names, cxx, flags, texts))
            mod = EmulatedModule(lib_path, names, mode=mode, tsan=tsan)
            _modules[key] = mod
        return mod


def _check_runtime_settings(mode: str) -> None:
    """Raise ValueError for a bad $CUONLINE_EMULATE_STACK_KB (fibers) or
    $CUONLINE_EMULATE_WATCHDOG_S (threads) before the header reads it at a launch."""
    if mode == "fibers":
        _environment.emulate_stack_kb()
    else:
        _environment.emulate_watchdog_s()


# ------------------------------------------------------------------------------------------------
# The on-disk cache: only libraries this user built are loaded

_PRIVATE_BITS = stat.S_IWGRP | stat.S_IWOTH
_fallback_lock = threading.Lock()
_fallback_dirs: dict[str, Path] = {}   # refused cache directory -> this process's private one


def _cache_dir() -> Path:
    """The directory of compiled libraries: ``cache_root()/emulate`` when it is this user's,
    else a private temporary directory for the process (with a warning, once per directory).

    Raises ValueError for a bad ``$CUONLINE_CACHE_DIR`` (relative, unknown ``~user``).
    """
    wanted = _environment.cache_dir("emulate")
    problem = _private_dir_problem(wanted)
    if problem is None:
        return wanted
    with _fallback_lock:
        fallback = _fallback_dirs.get(str(wanted))
        if fallback is None:
            fallback = Path(tempfile.mkdtemp(prefix="cuonline-emulate-"))   # mode 0700
            atexit.register(shutil.rmtree, fallback, ignore_errors=True)
            _fallback_dirs[str(wanted)] = fallback
            warnings.warn(
                f"cuonline: not using the emulation cache {wanted}: {problem}. Compiled kernels "
                f"go to {fallback} for this process and are rebuilt in the next one; set "
                "CUONLINE_CACHE_DIR to a directory of your own (its emulate/ part is made "
                "private, mode 0700)",
                RuntimeWarning,
                stacklevel=4,
            )
        return fallback


def _private_dir_problem(path: Path) -> str | None:
    """None when `path` is (or is now made) a directory of this user's that only they can
    write, else why it is not usable."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        return f"it cannot be created ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & _PRIVATE_BITS:
        # Ours, but made with the umask's mode (earlier cuonline versions, umask 002): others
        # may have written to it, which the per-file checks catch; from now on they cannot.
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            return f"others can write to it and it cannot be made private ({exc.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "this user cannot write to it"
    return None


def _read_own_file(path: Path, limit: int | None = None) -> tuple[bytes | None, str | None]:
    """(content, None) of a regular file that this user owns and only they can write, else
    (None, why not); why is None when the file does not exist.  Read through one descriptor,
    so the checks apply to the bytes read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"it cannot be opened ({exc.strerror})"   # ELOOP: a symbolic link
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "it is not a regular file"
        if st.st_uid != os.getuid():
            return None, f"it belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
        if st.st_mode & _PRIVATE_BITS:
            return None, f"others can write to it (mode {stat.filemode(st.st_mode)})"
        return f.read() if limit is None else f.read(limit), None


def _verify(lib: Path, record: Path) -> str | None:
    """None when `lib` may be loaded, ``""`` when it is simply not there (or has no record:
    an earlier version's cache, a build cut short), else why it must not be loaded."""
    data, why = _read_own_file(lib)
    if data is None:
        return "" if why is None else f"{lib.name}: {why}"
    text, why = _read_own_file(record, limit=256)
    if text is None:
        return "" if why is None else f"{record.name}: {why}"
    expected = text.split(b" ", 1)[0].decode("ascii", "replace")
    if hashlib.sha256(data).hexdigest() != expected:
        return f"{lib.name} does not match the SHA-256 recorded when it was built (damaged)"
    return None


def _cached_library(key: str, build) -> Path:
    """The path of library `key` in the cache, verified; built first by ``build(cache)`` when
    it is missing, foreign, open to others or damaged."""
    cache = _cache_dir()
    lib, record = cache / f"{key}.so", cache / f"{key}.sha256"
    problem = _verify(lib, record)
    if problem is None:
        return lib
    if problem:
        warnings.warn(f"cuonline: rebuilding the cached emulation library in {cache}: {problem}",
                      RuntimeWarning, stacklevel=4)
    build(cache)
    problem = _verify(lib, record)
    if problem is not None:
        raise EmulationError(f"the library just built for kernel key {key} in {cache} does not "
                             f"verify: {problem or 'it is missing'}")
    return lib


def _build(cache: Path, key: str, text: str, names: list[str], cxx: str,
           flags: list[str], headers: dict[str, str]) -> None:
    """Compile `text` with `headers` (name -> text, see :func:`header_files`) and publish
    ``KEY.so`` and its ``KEY.sha256`` record in `cache`.

    The build runs in a private directory inside `cache` with relative file names (so the
    library's bytes do not depend on the directory's random name); the header files are
    written there too, so the library is built from the very texts its key hashes.  Each file
    is moved into place with :func:`os.replace`, the library first: a reader sees whole files
    only, and a library without its record, or with another build's, is rebuilt rather than
    loaded.
    """
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".build-{key[:8]}-") as tmp:
        Path(tmp, "kernel.cu").write_text(text)
        for name, header in headers.items():
            path = Path(tmp, name)
            path.parent.mkdir(exist_ok=True)
            path.write_text(header, encoding="utf-8")
        # -include looks in the working directory first; the parts are found next to it.
        cmd = [cxx, *flags, "-include", header_path().name, "-x", "c++", "kernel.cu",
               "-o", "kernel.so"]
        proc = _run_compiler(cmd, cwd=tmp)
        what = f"compiling kernel(s) {', '.join(names)} for CPU emulation"
        compiler = f"{Path(cxx).name}" + (" from $CXX" if os.environ.get("CXX") else "")
        if proc.returncode != 0:
            raise EmulationError(f"{what} failed ({compiler} exit status {proc.returncode}):\n"
                                 + _trim(proc.stderr))
        out = Path(tmp, "kernel.so")
        if not out.is_file() or out.stat().st_size == 0:
            raise EmulationError(
                f"{what}: {cxx} ({compiler}) exited with status 0 but wrote no library; "
                f"is CXX={os.environ.get('CXX', cxx)!r} a C++ compiler?\n" + _trim(proc.stderr))
        os.chmod(out, 0o755)   # whatever the umask: a group-writable library would be refused
        digest = hashlib.sha256(out.read_bytes()).hexdigest()
        record = Path(tmp, "kernel.sha256")
        record.write_text(f"{digest}  {key}.so\n")   # sha256sum -c reads it
        os.chmod(record, 0o644)
        os.replace(out, cache / f"{key}.so")
        os.replace(record, cache / f"{key}.sha256")


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
    values = value if isinstance(value, tuple) else (value,)
    if not 1 <= len(values) <= 3 or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{what} must be an int or a tuple of 1-3 ints, got {value!r}")
    x, y, z = (*(int(v) for v in values), 1, 1)[:3]
    if min(x, y, z) < 1:
        raise ValueError(f"{what} dimensions must be >= 1, got {value!r}")
    return x, y, z


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
        _check_runtime_settings(self.module.mode)   # the header reads them at the first launch
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
