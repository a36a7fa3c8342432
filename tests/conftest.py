"""Shared fixtures: seeded data, dtype tolerances and the engines available on this machine."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))   # tests import `oracle` as a plain module

ROOT = Path(__file__).resolve().parents[1]

try:
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:   # optional: bfloat16 cases are skipped without it
    BFLOAT16 = None


DTYPES = [np.float16, np.float32, np.float64] + ([BFLOAT16] if BFLOAT16 is not None else [])

# Absolute error allowed against the float64 oracle, relative to the scale of the output
# (values drawn from N(0, 1) so |out| <= a few). float32/float64: a few ulp of the inputs'
# precision amplified by the length of the dot products; 16-bit: output rounding dominates.
TOLERANCE = {
    np.dtype(np.float64): 1e-12,
    np.dtype(np.float32): 2e-5,
    np.dtype(np.float16): 4e-3,
}
if BFLOAT16 is not None:
    TOLERANCE[BFLOAT16] = 3e-2


def tolerance(dtype) -> float:
    return TOLERANCE[np.dtype(dtype)]


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


@functools.lru_cache(maxsize=None)
def emulation_available() -> str | None:
    """None when the emulation backend can run here, else the reason it cannot."""
    try:
        import cuonline.engines.cuda  # noqa: F401 - the engine that drives the emulation
        from cuonline.testing import emulate
    except ImportError as exc:
        return f"the emulation backend is not importable: {exc}"
    check = getattr(emulate, "compiler_problem", None)
    return check() if check is not None else None


@functools.lru_cache(maxsize=None)
def gpu_available() -> str | None:
    """None when a CUDA GPU and CuPy are usable, else the reason they are not."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # noqa: BLE001 - any failure means "no GPU here"
        return f"no usable CUDA GPU: {type(exc).__name__}: {exc}"
    return None


def engine_params():
    """pytest params for every engine: numpy always, emulate and cupy where they can run."""
    return [pytest.param("numpy", id="numpy")] + cuda_backend_params()


def cuda_backend_params():
    """pytest params for the CUDA engine's two module kinds: emulate (CPU) and cupy (GPU)."""
    emulate_reason = emulation_available()
    gpu_reason = gpu_available()
    return [
        pytest.param("emulate", id="emulate", marks=pytest.mark.skipif(
            emulate_reason is not None, reason=emulate_reason or "")),
        pytest.param("cupy", id="cupy", marks=[pytest.mark.gpu, pytest.mark.skipif(
            gpu_reason is not None, reason=gpu_reason or "")]),
    ]


class Engine:
    """Runs attention on one engine with NumPy data in and out, whatever the engine's arrays."""

    def __init__(self, name):
        self.name = name
        self.xp = np
        if name == "cupy":
            import cupy
            self.xp = cupy

    def put(self, x):
        return None if x is None else self.xp.asarray(x)

    def get(self, x):
        return x.get() if hasattr(x, "get") and self.xp is not np else np.asarray(x)

    def attention(self, q, k, v, **options):
        import cuonline
        for name in ("bias", "mask", "kv_lengths", "alibi_slopes"):
            if isinstance(options.get(name), np.ndarray):
                options[name] = self.put(options[name])
        backend = "auto" if self.name == "numpy" else self.name
        result = cuonline.attention(self.put(q), self.put(k), self.put(v), backend=backend,
                                    **options)
        if options.get("return_lse"):
            return self.get(result[0]), self.get(result[1])
        return self.get(result)


def check_races(code: str, *, expect_race: bool) -> None:
    """Run Python ``code`` under ThreadSanitizer (see :func:`run_under_tsan`); the code must
    print ``DONE`` at its end, and TSan must report a data race exactly when ``expect_race``."""
    proc, raced = run_under_tsan(code)
    assert "DONE" in proc.stdout, proc.stderr[-3000:]
    assert raced == expect_race, proc.stderr[-3000:]
    if not expect_race:
        assert proc.returncode == 0, proc.stderr[-3000:]


def run_under_tsan(code: str) -> tuple[subprocess.CompletedProcess, bool]:
    """Run Python ``code`` in a subprocess with ThreadSanitizer loaded.

    The code sees the repository root and ``tests/`` on ``sys.path`` and may compile emulated
    modules with ``emulate_options=dict(tsan=True)``. Skips the calling test where the emulation
    or libtsan is missing. Returns the finished process and whether TSan reported a data race.
    """
    reason = emulation_available()
    if reason is not None:
        pytest.skip(reason)
    from cuonline.testing import emulate

    try:
        env = emulate.tsan_environment()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    prelude = (f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
               "from cuonline.testing import emulate\nassert emulate.running_under_tsan()\n")
    proc = subprocess.run([emulate.tsan_python(), "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=str(ROOT))
    raced = "WARNING: ThreadSanitizer: data race" in proc.stderr
    return proc, raced


@pytest.fixture(params=engine_params())
def engine(request):
    return Engine(request.param)
