"""Environment variables: each one checked, a bad value named in the error, all documented.

The end-to-end cases run in a subprocess (a bad stack size used to segfault the interpreter),
in a temporary ``CUONLINE_CACHE_DIR`` holding one tiny kernel built once for the module.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import needs_emulation

from cuonline import _environment
from cuonline.engines import tuning_files
from cuonline.testing import emulate

ROOT = Path(__file__).resolve().parents[1]
KERNEL = 'extern "C" __global__ void iota(int* p) { p[threadIdx.x] = threadIdx.x; }\n'


def _launch_code(mode: str, *, skip_python_check: bool = False) -> str:
    """Python that builds KERNEL in `mode` and launches it once; prints DONE."""
    bypass = "emulate._check_runtime_settings = lambda mode: None\n" if skip_python_check else ""
    return (f"import numpy as np\nfrom cuonline.testing import emulate\n{bypass}"
            f"mod = emulate.compile_module({KERNEL!r}, mode={mode!r})\n"
            "out = np.zeros(64, np.int32)\nmod.get_function('iota')(1, 64, (out,))\n"
            "assert (out == np.arange(64)).all()\nprint('DONE')\n")


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    """A cache with KERNEL built in both modes (so the cases below compile nothing)."""
    root = tmp_path_factory.mktemp("cache")
    for mode in ("fibers", "threads"):
        proc = _run(_launch_code(mode), CUONLINE_CACHE_DIR=str(root))
        assert "DONE" in proc.stdout, proc.stderr
    return root


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in _environment.VARIABLES:
        full.pop(name, None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full, timeout=120, cwd=str(ROOT))


# ------------------------------------------------------------------------------------------------
# CUONLINE_EMULATE_STACK_KB and CUONLINE_EMULATE_WATCHDOG_S

BAD_STACK_KB = ["1", "-1", str(2**54), "abc", "63", "1048577", "1e3", " 256", "0x100"]


@pytest.mark.parametrize("value", BAD_STACK_KB)
def test_bad_stack_size_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("CUONLINE_EMULATE_STACK_KB", value)
    with pytest.raises(ValueError, match=rf"CUONLINE_EMULATE_STACK_KB={re.escape(repr(value))}"
                                         r".*integer from 64 to 1048576"):
        _environment.emulate_stack_kb()


@pytest.mark.parametrize("value, kb", [(None, 256), ("", 256), ("64", 64), ("1048576", 1048576)])
def test_stack_size_default_and_bounds(monkeypatch, value, kb):
    if value is None:
        monkeypatch.delenv("CUONLINE_EMULATE_STACK_KB", raising=False)
    else:
        monkeypatch.setenv("CUONLINE_EMULATE_STACK_KB", value)
    assert _environment.emulate_stack_kb() == kb


@needs_emulation
@pytest.mark.parametrize("value", ["1", "-1", str(2**54), "abc"])
def test_bad_stack_size_is_an_error_before_the_kernel_runs(cache_root, value):
    proc = _run(_launch_code("fibers"), CUONLINE_CACHE_DIR=str(cache_root),
                CUONLINE_EMULATE_STACK_KB=value)
    assert proc.returncode == 1, f"rc={proc.returncode}: {proc.stderr[-2000:]}"
    assert "ValueError" in proc.stderr and "CUONLINE_EMULATE_STACK_KB" in proc.stderr


@needs_emulation
@pytest.mark.parametrize("value", ["1", str(2**54)])
def test_header_refuses_a_bad_stack_size_that_reaches_it(cache_root, value):
    # Past the Python check, the header itself fails the launch with a message, never a crash.
    proc = _run(_launch_code("fibers", skip_python_check=True),
                CUONLINE_CACHE_DIR=str(cache_root), CUONLINE_EMULATE_STACK_KB=value)
    assert proc.returncode == 1, f"rc={proc.returncode}: {proc.stderr[-2000:]}"
    assert "EmulationError" in proc.stderr
    assert f"CUONLINE_EMULATE_STACK_KB={value} is not an integer from 64 to 1048576" in \
        proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", "1e999", "5 "])
def test_bad_watchdog_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("CUONLINE_EMULATE_WATCHDOG_S", value)
    with pytest.raises(ValueError, match=r"CUONLINE_EMULATE_WATCHDOG_S=.*finite number"):
        _environment.emulate_watchdog_s()


def test_watchdog_default_and_fractions(monkeypatch):
    monkeypatch.delenv("CUONLINE_EMULATE_WATCHDOG_S", raising=False)
    assert _environment.emulate_watchdog_s() == 20.0
    monkeypatch.setenv("CUONLINE_EMULATE_WATCHDOG_S", "0.5")
    assert _environment.emulate_watchdog_s() == 0.5


@needs_emulation
def test_bad_watchdog_is_an_error_in_threads_mode(cache_root):
    # It used to be read as 0 and replaced by the default without a word.
    proc = _run(_launch_code("threads"), CUONLINE_CACHE_DIR=str(cache_root),
                CUONLINE_EMULATE_WATCHDOG_S="abc")
    assert proc.returncode == 1 and "ValueError" in proc.stderr, proc.stderr[-2000:]
    assert "CUONLINE_EMULATE_WATCHDOG_S='abc'" in proc.stderr
    header = _run(_launch_code("threads", skip_python_check=True),
                  CUONLINE_CACHE_DIR=str(cache_root), CUONLINE_EMULATE_WATCHDOG_S="abc")
    assert "CUONLINE_EMULATE_WATCHDOG_S=abc is not a finite number" in header.stderr, \
        header.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# CXX


@pytest.fixture
def fresh_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(emulate, "_compiler_info", None)
    monkeypatch.setattr(emulate, "_modules", {})
    monkeypatch.setenv("CUONLINE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("value, why", [("/nonexistent", "no such file"),
                                        ("no-such-compiler", "not found on the PATH"),
                                        ("{tmp}/plain-file", "not executable"),
                                        ("{tmp}", "not a file"),
                                        ("ccache g++", "launcher")])
def test_bad_cxx_is_named(fresh_compiler, monkeypatch, tmp_path, value, why):
    (tmp_path / "plain-file").write_text("int main() {}\n")
    value = value.format(tmp=tmp_path)
    monkeypatch.setenv("CXX", value)
    with pytest.raises(ValueError, match=rf"CXX={re.escape(repr(value))}.*{why}"):
        emulate.compile_module(KERNEL)
    problem = emulate.compiler_problem()     # what the test suite's skips report
    assert problem is not None and "CXX=" in problem


@needs_emulation
def test_compiler_that_writes_nothing_is_a_clear_error(fresh_compiler, monkeypatch, tmp_path):
    # Passes the probes (exit status 0) but writes no library: this ended in a
    # FileNotFoundError from os.replace.
    script = tmp_path / "silent-c++"
    script.write_text('#!/bin/sh\ncase "$*" in *--version*) echo "silent 1.0";; esac\n'
                      "cat > /dev/null 2>&1 </dev/null\nexit 0\n")
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    with pytest.raises(emulate.EmulationError, match=r"exited with status 0 but wrote no "
                                                     r"library.*CXX="):
        emulate.compile_module(KERNEL)


@needs_emulation
def test_changing_cxx_is_seen(fresh_compiler, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    default, _ = emulate._compiler()
    monkeypatch.setenv("CXX", "/nonexistent")
    with pytest.raises(ValueError, match="CXX"):
        emulate._compiler()
    monkeypatch.setenv("CXX", default)
    assert emulate._compiler()[0] == default


# ------------------------------------------------------------------------------------------------
# CUONLINE_CACHE_DIR: one rule for the emulation cache and the tuning store


@pytest.mark.parametrize("value, why", [("relative/cache", "relative path"),
                                        ("~no-such-user-xyz/cache", "no user 'no-such-user-xyz'")])
def test_bad_cache_dir_is_explained(fresh_compiler, monkeypatch, value, why):
    monkeypatch.setenv("CUONLINE_CACHE_DIR", value)
    for reader in (_environment.cache_root, tuning_files.tuning_dir,
                   lambda: emulate.compile_module(KERNEL)):
        with pytest.raises(ValueError, match=rf"CUONLINE_CACHE_DIR={re.escape(repr(value))}"
                                             rf".*absolute path.*{why}"):
            reader()


def test_cache_dir_expands_home(monkeypatch):
    monkeypatch.setenv("CUONLINE_CACHE_DIR", "~/somewhere")
    assert _environment.cache_root() == Path.home() / "somewhere"


def test_emulation_cache_and_tuning_store_share_one_rule(monkeypatch, tmp_path):
    monkeypatch.delenv("CUONLINE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert emulate._cache_dir() == tmp_path / "xdg" / "cuonline" / "emulate"
    assert tuning_files.tuning_dir() == tmp_path / "xdg" / "cuonline" / "tuning"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")   # the XDG specification: ignored
    assert tuning_files.tuning_dir() == Path.home() / ".cache" / "cuonline" / "tuning"
    monkeypatch.setenv("CUONLINE_CACHE_DIR", str(tmp_path / "mine"))
    assert emulate._cache_dir() == tmp_path / "mine" / "emulate"
    assert tuning_files.tuning_dir() == tmp_path / "mine" / "tuning"


# ------------------------------------------------------------------------------------------------
# documented in one place

READS = re.compile(
    r"""(?:environ(?:\.get)?\s*[\[(]\s*|getenv\(\s*|_get\(\s*|env_text\(\s*)"""
    r"""["']([A-Z][A-Z0-9_]*)["']""")
# Read through a loop over names (toolchain/nvrtc.py), which the pattern above does not see.
INDIRECT = {"CUDA_PATH", "CUDA_HOME"}


def test_every_variable_the_package_reads_is_documented():
    doc = (ROOT / "docs" / "environment.md").read_text()
    read = set(INDIRECT) | set(_environment.VARIABLES)
    for path in (ROOT / "cuonline").rglob("*"):
        if path.suffix in (".py", ".h", ".cuh"):
            found = set(READS.findall(path.read_text()))
            read |= found
            # the C++ side reads only variables that Python checks first
            if path.suffix != ".py":
                assert found <= set(_environment.VARIABLES), (path.name, found)
    assert {"XDG_CACHE_HOME", "CUONLINE_EMULATE_STACK_KB", "CXX"} <= read
    for name in read:
        assert f"### `{name}`" in doc, f"{name} is read by cuonline but not in docs/environment.md"
    for name, (_, default, valid) in _environment.VARIABLES.items():
        section = doc.split(f"### `{name}`", 1)[1].split("###", 1)[0]
        assert default in section and valid in section, name
