"""``python -m cuonline``: clean errors, bounded demos, progress and reasons on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import support
from support import needs_nvrtc

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "cuonline", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


def python(code, timeout=120):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


# --------------------------------------------------------------------------------------------
# demo


@pytest.mark.parametrize("args", [("--length", "0"), ("--heads", "0"), ("--length", "-3"),
                                  ("--heads", "two")])
def test_demo_rejects_sizes_that_are_not_positive_with_a_usage_error(args):
    proc = cli("demo", *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"argument {args[0]}: must be a positive integer, got {args[1]!r}" in proc.stderr


def test_demo_checks_sampled_rows_in_bounded_memory():
    # a dense float64 reference at L = 4000 alone is 4000^2 x 8 bytes = 122 MiB per matrix
    # (the old demo grew by ~400 MiB here); checking 256 rows needs a few MiB
    proc = python("""
        import resource, sys
        import numpy as np
        try:
            import cupy  # noqa: F401 - the demo imports it to look for a GPU
        except ImportError:
            pass
        from cuonline.__main__ import main
        np.ones((64, 64)) @ np.ones((64, 64))         # BLAS's buffers, before the baseline
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        code = main(["demo", "--length", "4000", "--heads", "1"])
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(f"grew {grown:.0f} MiB")
        sys.exit(code)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "against a float64 reference (256 sampled rows of each head)" in proc.stdout
    error = float(proc.stdout.split("max |error| :")[1].split()[0])
    assert error < 1e-5
    grown = float(proc.stdout.split("grew")[1].split()[0])
    if sys.platform.startswith("linux"):              # ru_maxrss is in KiB on Linux only
        assert grown < 150, proc.stdout


def test_short_demo_checks_every_row():
    proc = cli("demo", "--length", "100", "--heads", "1")
    assert proc.returncode == 0, proc.stderr
    assert "(every row of each head)" in proc.stdout
    # the relative bias the library's own way: a table of 2L - 1 distances, not an L x L view
    assert "rel_bias (199,)" in proc.stdout


def _info_lines(**env):
    import os

    proc = subprocess.run([sys.executable, "-m", "cuonline", "info"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env=dict(os.environ, **env))
    assert proc.returncode == 0, proc.stderr
    return {name.strip(): value.strip() for name, _, value in
            (line.partition(":") for line in proc.stdout.splitlines() if ":" in line)}


def test_info_says_what_decides_cpu_speed():
    import importlib.util

    import numba
    from threadpoolctl import threadpool_info

    lines = _info_lines()
    assert lines["numba"].startswith(f"{numba.__version__}, on"), lines["numba"]
    # every BLAS library loaded: implementation, version, kernel set, threads
    blas = [value for name, value in lines.items() if name.split()[0] == "blas"]
    assert blas, lines
    # a library info loads may not be loaded here yet: compare against this process's own
    for lib in threadpool_info():
        if lib["user_api"] == "blas" and lib.get("architecture"):
            assert any(v.startswith(f"{lib['internal_api']} {lib['version']} "
                                    f"({lib['architecture']} kernels, ") for v in blas), blas
    # the library the engine's products take, and how it was chosen
    assert lines["products"].endswith("(measured on this machine)"), lines["products"]
    for module in ("dask", "distributed", "zarr", "ml_dtypes"):
        if importlib.util.find_spec(module) is None:
            assert lines[module] == "not installed"
        else:
            assert lines[module] == importlib.import_module(module).__version__


@pytest.mark.slow   # a second `info` process; the fast tier runs one
def test_info_says_a_bad_cpu_blas_variable_and_goes_on():
    line = _info_lines(CUONLINE_CPU_BLAS="fastest")["products"]
    assert line.startswith("unknown: environment variable CUONLINE_CPU_BLAS='fastest'"), line


@pytest.mark.slow   # a second `info` process; the fast tier runs one
def test_info_says_when_numba_is_off():
    assert "off (NUMBA_DISABLE_JIT=1)" in _info_lines(NUMBA_DISABLE_JIT="1")["numba"]


# --------------------------------------------------------------------------------------------
# kernels


def test_kernels_without_nvrtc_says_so_in_one_line():
    # both NVRTC bindings made unimportable, as on a machine without them
    proc = python("""
        import sys
        sys.modules["cupy_backends.cuda.libs.nvrtc"] = None
        sys.modules["cuda.bindings.nvrtc"] = None
        from cuonline.__main__ import main
        sys.exit(main(["kernels"]))
    """)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "NVRTC is not available" in lines[0], proc.stderr
    assert proc.stdout == ""


@needs_nvrtc
def test_kernels_reports_progress_per_variant_on_stderr():
    # the listing cut to two small variants: the progress lines, not the minute, under test
    proc = python("""
        import sys
        from cuonline.kernels import families
        specs = [s for s in families.listing_specs() if type(s).__name__ == "SoftmaxSpec"][:2]
        families.listing_specs = lambda *args, **kwargs: specs
        from cuonline.__main__ import main
        sys.exit(main(["kernels", "--json"]))
    """)
    assert proc.returncode == 0, proc.stderr
    keys = [row["key"] for row in json.loads(proc.stdout)]
    lines = proc.stderr.strip().splitlines()
    assert len(keys) == len(lines) == 2, proc.stderr
    for n, (key, line) in enumerate(zip(keys, lines), 1):
        assert line.startswith(f"compiled {n}/2 for sm_90: {key} ("), proc.stderr


# --------------------------------------------------------------------------------------------
# info


@pytest.mark.slow   # `info` and `tune` processes; the fast tier runs one `info`
def test_info_says_why_there_is_no_gpu():
    if support.gpu_available() is None:
        pytest.skip("a GPU is present")
    info = cli("info")
    assert info.returncode == 0, info.stderr
    # without a GPU the cupy line must say unavailable (a missing line fails, not skips)
    (line,) = [x.strip() for x in info.stdout.splitlines() if x.strip().startswith("cupy:")]
    assert "unavailable" in line, line
    # `tune` reports the reason it found; `info` must give the same one
    tune = cli("tune", "--quick")
    assert tune.returncode == 1
    reason = tune.stderr.split("needs a CUDA GPU (", 1)[1].rsplit("); --dry-run", 1)[0]
    assert line == f"cupy: unavailable ({reason})"
