"""Compile kernel variants with NVRTC on a machine without a GPU, and report what ptxas saw.

Used by ``python -m cuonline kernels`` (:func:`listing`) and by the compile tests. It needs only
the NVRTC library (``pip install "nvidia-cuda-nvrtc==13.*" "nvidia-cuda-runtime==13.*"`` plus
either ``cupy-cuda13x`` or ``cuda-bindings``); no driver, no GPU.

CUDA 13's NVRTC compiles for sm_75 and newer only. For sm_70 (V100, run with ``cupy-cuda12x``)
the listing uses a CUDA 12 NVRTC where one is installed (``pip install
"nvidia-cuda-nvrtc-cu12==12.*" "nvidia-cuda-runtime-cu12==12.*"``), loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..kernels import families, source
from ..kernels.heuristics import DEFAULT_ARCH, arch_number

__all__ = ["CompileReport", "NvrtcUnavailable", "arch_unavailable", "compile_options",
           "compile_ptx", "compile_source", "compile_spec", "compiler", "cuda_include_dir",
           "listing", "nvrtc_available"]

#: The archs the compile tests cover: V100 (sm_70) and T4 (sm_75) run the SIMT and softmax
#: families only, A100 (sm_80) and H100/H200 (sm_90) every family.
DEFAULT_ARCHS = ("sm_70", "sm_75", "sm_80", "sm_90")


class NvrtcUnavailable(RuntimeError):
    """NVRTC (or the CUDA headers) is not installed."""


@dataclass(frozen=True)
class KernelUsage:
    """ptxas's resource report for one entry point."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_bytes: int


@dataclass(frozen=True)
class CompileReport:
    """Result of compiling one variant for one architecture."""

    key: str
    arch: str
    seconds: float
    kernels: tuple          # KernelUsage per entry point
    log: str

    @property
    def registers(self) -> int:
        return max(k.registers for k in self.kernels)

    @property
    def spills(self) -> int:
        return sum(k.spill_stores + k.spill_loads for k in self.kernels)

    @property
    def stack_frame(self) -> int:
        return max(k.stack_frame for k in self.kernels)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.pop("log")
        out.update(registers=self.registers, spills=self.spills, stack_frame=self.stack_frame,
                   stack_bytes=self.stack_frame,
                   spill_stores=sum(k.spill_stores for k in self.kernels),
                   spill_loads=sum(k.spill_loads for k in self.kernels))
        return out


def cuda_include_dir() -> str | None:
    """Directory of cuda_fp16.h etc. from the ``nvidia-cuda-runtime`` wheel (or CUDA_PATH)."""
    candidates = []
    for entry in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
            candidates.append(Path(entry) / sub)
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for path in candidates:
        if (path / "cuda_fp16.h").is_file():
            return str(path)
    return None


class _Backend:
    """The two NVRTC bindings that work without a driver, behind one small interface."""

    #: CUDA headers for this NVRTC (None: :func:`cuda_include_dir`).
    include = None

    def __init__(self):
        self.kind = None
        try:
            from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415

            nvrtc.getVersion()
            self.kind, self.lib = "cupy", nvrtc
            return
        except Exception:  # noqa: BLE001 - try the next binding
            pass
        try:
            from cuda.bindings import nvrtc  # noqa: PLC0415

            err, *_ = nvrtc.nvrtcVersion()
            if err == nvrtc.nvrtcResult.NVRTC_SUCCESS:
                self.kind, self.lib = "cuda-bindings", nvrtc
        except Exception:  # noqa: BLE001
            pass

    def supported_archs(self) -> tuple:
        """The compute capabilities this NVRTC compiles for, e.g. ``(75, 80, ..., 121)``."""
        if self.kind == "cupy":
            return tuple(self.lib.getSupportedArchs())
        err, archs = self.lib.nvrtcGetSupportedArchs()
        return tuple(archs) if err == self.lib.nvrtcResult.NVRTC_SUCCESS else ()

    def compile(self, text, name, options, output="cubin"):
        """Return ``(ok, log, binary)``: the CUBIN, or with ``output="ptx"`` the PTX text."""
        if self.kind == "cupy":
            lib = self.lib
            prog = lib.createProgram(text, name, (), ())
            try:
                try:
                    lib.compileProgram(prog, list(options))
                    ok = True
                except lib.NVRTCError:
                    ok = False
                log = lib.getProgramLog(prog)
                if not ok:
                    return ok, log, b""
                if output == "ptx":
                    ptx = lib.getPTX(prog)
                    return ok, log, ptx.decode() if isinstance(ptx, bytes) else ptx
                return ok, log, lib.getCUBIN(prog)
            finally:
                lib.destroyProgram(prog)
        lib = self.lib
        ok_code = lib.nvrtcResult.NVRTC_SUCCESS
        err, prog = lib.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], [])
        if err != ok_code:
            raise RuntimeError(f"nvrtcCreateProgram failed: {err}")
        try:
            opts = [o.encode() for o in options]
            (err,) = lib.nvrtcCompileProgram(prog, len(opts), opts)
            _, size = lib.nvrtcGetProgramLogSize(prog)
            buf = b" " * size
            lib.nvrtcGetProgramLog(prog, buf)
            log = buf.rstrip(b"\x00 ").decode(errors="replace")
            cubin = b""
            if err == ok_code and output == "ptx":
                _, size = lib.nvrtcGetPTXSize(prog)
                ptx = b" " * size
                lib.nvrtcGetPTX(prog, ptx)
                return True, log, ptx.rstrip(b"\x00").decode()
            if err == ok_code:
                _, size = lib.nvrtcGetCUBINSize(prog)
                cubin = b" " * size
                lib.nvrtcGetCUBIN(prog, cubin)
            return err == ok_code, log, cubin
        finally:
            lib.nvrtcDestroyProgram(prog)


class _CtypesBackend:
    """A CUDA 12 NVRTC from the ``nvidia-cuda-nvrtc-cu12`` wheel, through ctypes: the NVRTC of
    ``cupy-cuda12x`` users, and the only one here that still compiles for sm_70."""

    kind = "ctypes"

    def __init__(self, path: Path, include: str | None):
        self.lib = ctypes.CDLL(str(path))
        self.path, self.include = path, include

    @classmethod
    def find(cls):
        """The first CUDA 12 NVRTC wheel on ``sys.path``, or None."""
        for entry in sys.path:
            root = Path(entry or ".") / "nvidia"
            lib = root / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"
            if lib.is_file():
                include = root / "cuda_runtime" / "include"
                try:
                    return cls(lib, str(include) if (include / "cuda_fp16.h").is_file() else None)
                except OSError:
                    continue
        return None

    def supported_archs(self) -> tuple:
        count = ctypes.c_int()
        if self.lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)) != 0:
            return ()
        archs = (ctypes.c_int * count.value)()
        return tuple(archs) if self.lib.nvrtcGetSupportedArchs(archs) == 0 else ()

    def compile(self, text, name, options, output="cubin"):
        """As :meth:`_Backend.compile`."""
        lib, prog = self.lib, ctypes.c_void_p()
        if lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), name.encode(), 0, None,
                                  None) != 0:
            raise RuntimeError(f"nvrtcCreateProgram failed for {name}")
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            ok = lib.nvrtcCompileProgram(prog, len(options), opts) == 0
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            if not ok:
                return ok, log, b""
            get_size, get = ((lib.nvrtcGetPTXSize, lib.nvrtcGetPTX) if output == "ptx"
                             else (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN))
            get_size(prog, ctypes.byref(size))
            out = ctypes.create_string_buffer(size.value)
            get(prog, out)
            return ok, log, (out.value.decode() if output == "ptx" else out.raw)
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


_BACKEND = None
_FALLBACK: list = []   # [] not looked for yet, [None] none installed, [backend]


def compiler(arch: str | None = None):
    """The NVRTC that compiles for ``arch`` (None: the default one); raises NvrtcUnavailable."""
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = _Backend()
    if _BACKEND.kind is None:
        raise NvrtcUnavailable(
            "NVRTC is not available: install it with "
            "pip install cupy-cuda13x \"nvidia-cuda-nvrtc==13.*\" \"nvidia-cuda-runtime==13.*\" "
            "(or the cuda-bindings package)"
        )
    if arch is None:
        return _BACKEND
    number = arch_number(arch)
    supported = _BACKEND.supported_archs()
    if not supported or number in supported:
        return _BACKEND
    if not _FALLBACK:
        _FALLBACK.append(_CtypesBackend.find())
    if _FALLBACK[0] is not None and number in _FALLBACK[0].supported_archs():
        return _FALLBACK[0]
    raise NvrtcUnavailable(
        f"the installed NVRTC compiles for sm_{min(supported)} and newer, not {arch} (CUDA 13 "
        f"dropped sm_70 and sm_72); for {arch} install a CUDA 12 NVRTC: pip install "
        f"\"nvidia-cuda-nvrtc-cu12==12.*\" \"nvidia-cuda-runtime-cu12==12.*\""
    )


def nvrtc_available() -> bool:
    try:
        compiler()
    except NvrtcUnavailable:
        return False
    return cuda_include_dir() is not None


def arch_unavailable(arch: str) -> str | None:
    """Why variants cannot be compiled for ``arch`` here, or None when they can."""
    try:
        backend = compiler(arch)
    except NvrtcUnavailable as exc:
        return str(exc)
    if (backend.include or cuda_include_dir()) is None:
        return ('the CUDA headers (cuda_fp16.h) were not found: '
                'pip install "nvidia-cuda-runtime==13.*"')
    return None


def compile_options(arch: str | None = None, *, verbose: bool = True,
                    include: str | None = None) -> tuple:
    """The NVRTC options of every compile of kernel text: the CuPy engine's
    (``cupy.RawModule``, ``arch=None``: CuPy adds the device's ``-arch``; ``verbose=False``)
    and the listing's and tests' (``arch`` given; ``verbose`` adds ptxas's report).

    ``include``: the CUDA headers' directory (default :func:`cuda_include_dir`; where none is
    found the option is left out, and CuPy uses its own)."""
    include = include or cuda_include_dir()
    opts = [] if arch is None else [f"-arch={arch}"]
    opts.append("-std=c++17")
    if include is not None:
        opts.append(f"-I{include}")
    if verbose:
        opts.append("-Xptxas=-v")
    return tuple(opts)


def _offline_options(arch: str, include: str | None) -> tuple:
    """:func:`compile_options` for a compile without CuPy, which needs the CUDA headers."""
    if (include or cuda_include_dir()) is None:
        raise NvrtcUnavailable(
            "the CUDA headers (cuda_fp16.h) were not found: pip install \"nvidia-cuda-runtime==13.*\""
        )
    return compile_options(arch, include=include)


_USAGE_RE = re.compile(r"Compiling entry function '(\w+)'")
_NUM = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "shared_bytes": re.compile(r"(\d+) bytes smem"),
}


def parse_ptxas_log(log: str) -> tuple:
    """Split a ``-Xptxas=-v`` log into one :class:`KernelUsage` per entry function."""
    kernels = []
    pieces = _USAGE_RE.split(log)
    # pieces: [preamble, name1, text1, name2, text2, ...]
    for name, text in zip(pieces[1::2], pieces[2::2]):
        values = {}
        for field, pattern in _NUM.items():
            m = pattern.search(text)
            values[field] = int(m.group(1)) if m else 0
        kernels.append(KernelUsage(name=name, **values))
    return tuple(kernels)


def compile_source(text: str, arch: str = "sm_90", *, name: str = "cuonline.cu") -> tuple:
    """Compile ``text`` for ``arch``; return ``(log, seconds)``; raise RuntimeError on errors."""
    backend = compiler(arch)
    t0 = time.perf_counter()
    ok, log, _ = backend.compile(text, name, _offline_options(arch, backend.include))
    seconds = time.perf_counter() - t0
    if not ok:
        raise RuntimeError(f"NVRTC failed to compile {name} for {arch}:\n{log}")
    return log, seconds


def compile_ptx(text: str, arch: str = "sm_90", *, name: str = "cuonline.cu") -> tuple:
    """Compile ``text`` for ``arch`` with the engine's options; return ``(ptx, log)``.

    The PTX is the text ptxas assembled (``log`` holds its ``-v`` report): tests read it to
    check which instructions a kernel really issues. Raises RuntimeError on compile errors.
    """
    backend = compiler(arch)
    ok, log, ptx = backend.compile(text, name, _offline_options(arch, backend.include),
                                   output="ptx")
    if not ok:
        raise RuntimeError(f"NVRTC failed to compile {name} for {arch}:\n{log}")
    return ptx, log


def compile_spec(spec, arch: str = "sm_90") -> CompileReport:
    """Compile one variant and parse ptxas's report."""
    log, seconds = compile_source(source.build_source(spec), arch, name=f"{spec.key}.cu")
    return CompileReport(key=spec.key, arch=arch, seconds=round(seconds, 3),
                         kernels=parse_ptxas_log(log), log=log)


def listing(arch: str = DEFAULT_ARCH) -> list:
    """Compile every listed variant for ``arch``; one dict per variant.

    Keys: ``key``, ``arch``, ``registers`` (max over entry points), ``spill_stores``,
    ``spill_loads``, ``spills`` (their sum), ``stack_bytes`` (= ``stack_frame``),
    ``shared_bytes`` (dynamic, per block), ``static_shared_bytes`` (ptxas), ``threads``,
    ``seconds`` (compile time) and ``kernels`` (per entry point usage).
    """
    rows = []
    for spec in families.listing_specs(arch):
        report = compile_spec(spec, arch)
        row = report.as_dict()
        row["kernels"] = [asdict(k) for k in report.kernels]
        row["threads"] = spec.threads
        row["shared_bytes"] = spec.shared_bytes
        row["static_shared_bytes"] = max((k.shared_bytes for k in report.kernels), default=0)
        rows.append(row)
    return rows
