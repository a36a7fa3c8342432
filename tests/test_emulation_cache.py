"""The emulation's on-disk cache loads only what this user built, and compiles end cleanly.

Every load runs in a subprocess: a damaged or planted library that got loaded would crash it
or run its constructor there, and the test fails instead of pytest dying. All of it works in a
temporary ``CUONLINE_CACHE_DIR`` with one tiny kernel, built once for the module; each test
damages a copy of that cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support import needs_emulation

from cuonline.testing import emulate

ROOT = Path(__file__).resolve().parents[1]
KERNEL = 'extern "C" __global__ void iota(int* p) { p[threadIdx.x] = 3 * threadIdx.x; }\n'
OTHER_UID = 54321

pytestmark = [needs_emulation, pytest.mark.slow]   # the fast tier leaves it out

# Compiles and runs KERNEL from the cache at $CUONLINE_CACHE_DIR; prints the library's path.
LOAD = f"""
import warnings
import numpy as np
from cuonline.testing import emulate
warnings.simplefilter("always")
mod = emulate.compile_module({KERNEL!r})
out = np.zeros(32, np.int32)
mod.get_function("iota")(1, 32, (out,))
assert (out == 3 * np.arange(32)).all(), out
print("LOADED", mod.path)
"""


def _run(code: str, cache: Path, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUONLINE_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=str(ROOT))


def _loaded(proc: subprocess.CompletedProcess) -> Path:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    return Path(proc.stdout.split("LOADED", 1)[1].strip())


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A cache root holding the one library of KERNEL, as this version builds it."""
    root = tmp_path_factory.mktemp("pristine")
    _loaded(_run(LOAD, root))
    return root


@pytest.fixture
def cache(pristine, tmp_path) -> tuple[Path, Path]:
    """(cache root, the library in it): a copy of the pristine cache for one test."""
    root = tmp_path / "cache"
    shutil.copytree(pristine, root)
    (lib,) = (root / "emulate").glob("*.so")
    return root, lib


def _recorded_digest(lib: Path) -> str:
    return lib.with_suffix(".sha256").read_text().split()[0]


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[Path, Path]:
    """(library, marker): a shared library whose constructor creates the marker file, i.e.
    code that runs in the process the moment the library is loaded."""
    where = tmp_path_factory.mktemp("planted")
    marker = where / "constructor-ran"
    src = where / "evil.c"
    src.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void evil(void) '
                   f'{{ FILE* f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    cxx, _ = emulate._compiler()
    subprocess.run([cxx, "-x", "c", "-shared", "-fPIC", str(src), "-o", str(where / "evil.so")],
                   check=True, capture_output=True)
    return where / "evil.so", marker


def _plant(evil: Path, lib: Path, mode: int, uid: int | None = None) -> None:
    """Put `evil` in place of `lib`, with a matching checksum record (whoever can write the
    library can write its record too)."""
    shutil.copyfile(evil, lib)
    record = lib.with_suffix(".sha256")
    record.write_text(f"{hashlib.sha256(evil.read_bytes()).hexdigest()}  {lib.name}\n")
    for path in (lib, record):
        os.chmod(path, mode)
        if uid is not None:
            os.chown(path, uid, -1)


needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="giving files to another user needs root")


# ------------------------------------------------------------------------------------------------
# damaged libraries are rebuilt


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_library_is_rebuilt_not_loaded(cache, damage):
    root, lib = cache
    data = lib.read_bytes()
    if damage == "truncate":
        lib.write_bytes(data[: len(data) // 2])     # what a full disk or a killed copy leaves
    else:
        flipped = bytearray(data)
        for i in range(0, len(data), 997):          # bytes flipped all over the file
            flipped[i] ^= 0xFF
        lib.write_bytes(bytes(flipped))
    proc = _run(LOAD, root)
    assert _loaded(proc) == lib
    assert "damaged" in proc.stderr and "rebuilding" in proc.stderr, proc.stderr
    assert hashlib.sha256(lib.read_bytes()).hexdigest() == _recorded_digest(lib)
    # the next process loads the rebuilt library silently
    again = _run(LOAD, root)
    assert _loaded(again) == lib and "rebuilding" not in again.stderr, again.stderr


def test_library_without_checksum_record_is_rebuilt(cache):
    root, lib = cache
    lib.with_suffix(".sha256").unlink()
    lib.write_bytes(b"\x7fELF" + b"\0" * 60)         # a torn file of an interrupted publish
    assert _loaded(_run(LOAD, root)) == lib
    assert hashlib.sha256(lib.read_bytes()).hexdigest() == _recorded_digest(lib)


def test_a_build_publishes_the_library_and_its_record_atomically(tmp_path):
    # Nothing but the two published files is left behind, each private to the user.
    _loaded(_run(LOAD, tmp_path))
    names = sorted(p.name for p in (tmp_path / "emulate").iterdir())
    assert len(names) == 2 and names[0].endswith(".sha256") and names[1].endswith(".so")
    for name in names:
        assert not os.stat(tmp_path / "emulate" / name).st_mode & 0o022
    assert stat.S_IMODE(os.stat(tmp_path / "emulate").st_mode) == 0o700


# ------------------------------------------------------------------------------------------------
# foreign or open libraries and directories are refused


def test_library_writable_by_others_is_not_loaded(cache, planted):
    root, lib = cache
    evil, marker = planted
    marker.unlink(missing_ok=True)
    _plant(evil, lib, 0o666)
    proc = _run(LOAD, root)
    assert _loaded(proc) == lib
    assert not marker.exists(), "the planted library's constructor ran"
    assert "others can write" in proc.stderr, proc.stderr
    assert hashlib.sha256(lib.read_bytes()).hexdigest() != hashlib.sha256(
        evil.read_bytes()).hexdigest()                # replaced by this user's build


@needs_root
def test_library_of_another_user_is_not_loaded(cache, planted):
    root, lib = cache
    evil, marker = planted
    marker.unlink(missing_ok=True)
    _plant(evil, lib, 0o644, uid=OTHER_UID)
    proc = _run(LOAD, root)
    assert _loaded(proc) == lib
    assert not marker.exists(), "the planted library's constructor ran"
    assert f"belongs to uid {OTHER_UID}" in proc.stderr, proc.stderr
    assert os.stat(lib).st_uid == os.getuid()


@needs_root
def test_cache_directory_of_another_user_is_replaced_by_a_private_one(cache, planted):
    root, lib = cache
    evil, marker = planted
    marker.unlink(missing_ok=True)
    _plant(evil, lib, 0o644, uid=OTHER_UID)
    os.chmod(lib.parent, 0o777)
    os.chown(lib.parent, OTHER_UID, -1)
    proc = _run(LOAD, root)
    path = _loaded(proc)
    assert not marker.exists(), "the planted library's constructor ran"
    assert path.parent != lib.parent and "cuonline-emulate-" in path.parent.name
    assert "CUONLINE_CACHE_DIR" in proc.stderr and f"uid {OTHER_UID}" in proc.stderr, proc.stderr
    assert not path.parent.exists(), "the private fallback directory outlived the process"


def test_own_cache_directory_open_to_others_is_made_private(cache):
    root, lib = cache
    os.chmod(lib.parent, 0o777)
    assert _loaded(_run(LOAD, root)) == lib
    assert stat.S_IMODE(os.stat(lib.parent).st_mode) == 0o700


def test_unusable_cache_directory_falls_back_with_a_warning(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = _run(LOAD, blocker / "cache")      # cannot be created, even by root
    path = _loaded(proc)
    assert "cuonline-emulate-" in path.parent.name
    assert "CUONLINE_CACHE_DIR" in proc.stderr and "cannot be created" in proc.stderr


# ------------------------------------------------------------------------------------------------
# an interrupted compile ends the compiler's children too


FAKE_CXX = """#!/bin/sh
# Answers the probes like a compiler; a build starts a child (as g++ starts cc1plus) and waits.
case "$*" in
  *--version*) echo "fake-c++ 1.0"; exit 0 ;;
  *-fsyntax-only*) cat > /dev/null; exit 0 ;;
esac
sleep 300 &
echo $! > "$CHILD_PID_FILE"
wait
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")     # a zombie has ended; only its parent has not reaped it


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    """(compiler script, file where its build child writes its pid); kills the child after."""
    script = tmp_path / "fake-c++"
    script.write_text(FAKE_CXX)
    script.chmod(0o755)
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("CHILD_PID_FILE", str(pid_file))
    yield script, pid_file
    if pid_file.exists() and pid_file.read_text().strip():
        pid = int(pid_file.read_text())
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _child_pid(pid_file: Path) -> int:
    assert _wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 60), \
        "the fake compiler never started its child"
    return int(pid_file.read_text())


def _start_compile(tmp_path, script, sigint):
    """A Python process compiling KERNEL with the fake compiler, its SIGINT disposition set
    first: a shell starts background jobs and ``nohup`` with SIGINT ignored, and a child
    inherits that, so a test may not rely on the disposition pytest itself was given."""
    env = dict(os.environ, CUONLINE_CACHE_DIR=str(tmp_path / "cache"), CXX=str(script),
               PYTHONPATH=str(ROOT))
    code = (f"import signal\nsignal.signal(signal.SIGINT, signal.{sigint})\n"
            f"from cuonline.testing import emulate\nemulate.compile_module({KERNEL!r})\n")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_ctrl_c_during_a_compile_ends_the_compilers_children(tmp_path, fake_cxx):
    script, pid_file = fake_cxx
    proc = _start_compile(tmp_path, script, "default_int_handler")
    try:
        child = _child_pid(pid_file)
        assert _alive(child)
        proc.send_signal(signal.SIGINT)      # to Python only, as a notebook's interrupt does
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err, err
    assert _wait_until(lambda: not _alive(child), 5), "the compiler's child still runs"


def test_an_ignored_sigint_stays_ignored_during_a_compile(tmp_path, fake_cxx):
    # cuonline installs no SIGINT handler of its own: a process that ignores SIGINT (nohup, a
    # background job) goes on compiling, and Python still waits for the compiler it started
    script, pid_file = fake_cxx
    proc = _start_compile(tmp_path, script, "SIG_IGN")
    try:
        child = _child_pid(pid_file)
        proc.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
        assert _alive(child)
    finally:
        proc.kill()
        proc.communicate()


def test_any_exception_during_a_compile_ends_the_compilers_children(tmp_path, fake_cxx,
                                                                    monkeypatch):
    script, pid_file = fake_cxx
    monkeypatch.setenv("CUONLINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setattr(emulate, "_modules", {})
    monkeypatch.setattr(emulate, "_compiler_info", None)
    communicate = subprocess.Popen.communicate

    def failing_communicate(self, *args, **kwargs):
        if not any(str(a).endswith("kernel.cu") for a in self.args):   # the probes run as usual
            return communicate(self, *args, **kwargs)
        _child_pid(pid_file)
        raise MemoryError("raised while waiting for the compiler")

    monkeypatch.setattr(subprocess.Popen, "communicate", failing_communicate)
    with pytest.raises(MemoryError, match="waiting for the compiler"):
        emulate.compile_module(KERNEL)
    child = int(pid_file.read_text())
    assert _wait_until(lambda: not _alive(child), 5), "the compiler's child still runs"
