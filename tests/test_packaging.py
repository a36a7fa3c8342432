"""What users install: the wheel's contents, the import, the command line."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support import needs_emulation

from cuonline.testing import emulate

pytestmark = pytest.mark.slow   # the fast tier (-m 'not slow') leaves it out

ROOT = Path(__file__).resolve().parents[1]


def run(*args, **kwargs):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True,
                          **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    out = tmp_path_factory.mktemp("wheel")
    run("-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
        "-w", str(out), cwd=out)
    (path,) = out.glob("cuonline-*.whl")
    return path


def test_wheel_ships_kernel_sources_and_every_emulation_header(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.name for p in (ROOT / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh")}
    for name in sources:
        assert f"cuonline/kernels_cu/{name}" in names, name
    headers = emulate.header_files()   # the entry and every part it includes
    assert "cuda_cpu.h" in headers and any(n.startswith("cuda_cpu/") for n in headers)
    for name in headers:
        assert f"cuonline/testing/{name}" in names, name
    assert "cuonline/engines/numpy.py" in names and "cuonline/__main__.py" in names
    assert "cuonline/py.typed" in names     # type checkers read the annotations (PEP 561)
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_import_loads_no_cupy_and_compiles_nothing():
    code = ("import sys, cuonline; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends')"
            " or m.startswith('cuonline.engines.cuda') or m.startswith('cuonline.testing')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    run("-c", code, cwd=ROOT)


def test_info_lists_engines():
    out = run("-m", "cuonline", "info", cwd=ROOT).stdout
    assert "numpy" in out and "engines" in out and "emulate" in out


def test_demo_runs_and_reports_a_small_error():
    out = run("-m", "cuonline", "demo", "--length", "300", "--heads", "2", cwd=ROOT).stdout
    assert "engine" in out and "(2, 300, 64) float32" in out
    error = float(out.split("max |error| :")[1].split()[0])
    assert error < 1e-5


@needs_emulation
def test_unpacked_wheel_runs_the_emulated_kernels_from_its_package_data(wheel, tmp_path):
    """The wheel alone (no source tree on the path) finds kernels_cu/ and the emulation header."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import numpy as np, cuonline, pathlib; "
        f"assert pathlib.Path(cuonline.__file__).is_relative_to({str(site)!r}); "
        "x = np.random.default_rng(0).standard_normal((2, 33, 8)).astype(np.float32); "
        "err = np.abs(cuonline.attention(x, x, x, backend='emulate')"
        " - cuonline.attention(x, x, x)); "
        "assert err.max() < 1e-5, err.max()"
    )
    run("-c", code, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)})
