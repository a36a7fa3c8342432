"""Every environment variable that cuonline reads, parsed and checked in one place.

Nothing is read at ``import cuonline``: each function reads its variable when called, so a
value set later in the process is seen, and a bad value only matters to the code that needs it.
A bad value raises :class:`ValueError` naming the variable, the value received and what is
expected; an unset or empty variable means its default.  ``docs/environment.md`` lists the
variables for users; :data:`VARIABLES` is the same list for code and tests.

The one cache-directory rule (:func:`cache_root`) serves the emulation's compiled libraries
(``emulate/``) and the tuning store (``tuning/``) alike.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

__all__ = ["VARIABLES", "STACK_KB_RANGE", "CPU_BLAS_CHOICES", "cache_root", "cache_dir",
           "cpu_blas", "cxx", "emulate_stack_kb", "emulate_watchdog_s"]

#: name -> (meaning, default, valid values); docs/environment.md says the same for users.
VARIABLES = {
    "CUONLINE_CACHE_DIR": (
        "root of the on-disk cache: compiled emulation libraries in emulate/, tuning results "
        "in tuning/, the CPU engines' BLAS choice in cpu/",
        "$XDG_CACHE_HOME/cuonline, else ~/.cache/cuonline",
        "an absolute path, or one starting with ~ or ~user",
    ),
    "CUONLINE_CPU_BLAS": (
        "the library that runs the CPU engines' matrix products: measured once per machine "
        "(auto, the choice kept in cpu/ of the cache), or named",
        "auto",
        "auto, numpy, openblas or mkl",
    ),
    "CUONLINE_EMULATE_STACK_KB": (
        "stack size of each emulated CUDA thread in the fibers mode, in KiB",
        "256",
        "an integer from 64 to 1048576",
    ),
    "CUONLINE_EMULATE_WATCHDOG_S": (
        "seconds an emulated barrier may wait in the threads mode before the process is "
        "aborted with a report",
        "20",
        "a finite number of seconds > 0",
    ),
    "CXX": (
        "the C++20 compiler that builds kernels for the emulation",
        "g++, else c++, from the PATH",
        "the name of an executable on the PATH, or a path to one",
    ),
}

#: Bounds of CUONLINE_EMULATE_STACK_KB (KiB). Below 64 KiB a kernel's own frames (register
#: arrays of a tile, printf) risk reaching the guard page below each stack (SIGSEGV);
#: above 1 GiB per thread, 1024 threads of a block would need a TiB of address space.
STACK_KB_RANGE = (64, 1024 * 1024)
# the defaults, taken from the table so the documented and the used value cannot drift apart
_DEFAULT_STACK_KB = int(VARIABLES["CUONLINE_EMULATE_STACK_KB"][1])
_DEFAULT_WATCHDOG_S = float(VARIABLES["CUONLINE_EMULATE_WATCHDOG_S"][1])


def _get(name: str) -> str | None:
    """The variable's value, or None when it is unset or empty (both mean the default)."""
    value = os.environ.get(name)
    return value if value else None


def _bad(name: str, value: str, expected: str, why: str = "") -> ValueError:
    return ValueError(f"environment variable {name}={value!r} is not valid: expected "
                      f"{expected}{'; ' + why if why else ''}")


def cache_root() -> Path:
    """The root of cuonline's on-disk cache.

    ``$CUONLINE_CACHE_DIR`` (``~`` and ``~user`` expanded), else ``$XDG_CACHE_HOME/cuonline``
    (ignored unless absolute, as the XDG specification asks), else ``~/.cache/cuonline``.
    The directory is not created here.

    Raises
    ------
    ValueError
        ``CUONLINE_CACHE_DIR`` is relative, names a user that does not exist, or the home
        directory cannot be found for the default.

    Examples
    --------
    >>> cache_root().is_absolute()
    True
    """
    name = "CUONLINE_CACHE_DIR"
    value = _get(name)
    expected = VARIABLES[name][2]
    if value is not None:
        path = Path(os.path.expanduser(value))   # the text stays as is for an unknown user
        if value.startswith("~"):
            if str(path).startswith("~"):
                user = value[1:].split("/", 1)[0]
                who = f"there is no user {user!r}" if user else "the home directory is unknown"
                raise _bad(name, value, expected, f"{who} to expand it")
        if not path.is_absolute():
            raise _bad(name, value, expected,
                       f"a relative path would move with the working directory (now "
                       f"{os.getcwd()}); give e.g. {str(Path.cwd() / value)!r}")
        return path
    xdg = _get("XDG_CACHE_HOME")
    if xdg is not None and Path(xdg).is_absolute():
        return Path(xdg) / "cuonline"
    try:
        home = Path.home()
    except (RuntimeError, KeyError) as exc:   # no $HOME and no passwd entry
        raise ValueError(f"cannot find the home directory for the default cache ({exc}); set "
                         f"{name} to an absolute path") from None
    return home / ".cache" / "cuonline"


def cache_dir(part: str) -> Path:
    """``cache_root() / part``: ``"emulate"`` (compiled libraries), ``"tuning"`` or ``"cpu"``
    (the CPU engines' BLAS choice)."""
    return cache_root() / part


#: The values of CUONLINE_CPU_BLAS.
CPU_BLAS_CHOICES = ("auto", "numpy", "openblas", "mkl")


def cpu_blas() -> str:
    """``$CUONLINE_CPU_BLAS`` (default ``auto``): the CPU engines' matrix-product library.

    Raises
    ------
    ValueError
        The value is not one of :data:`CPU_BLAS_CHOICES` (case and spaces as given count).
    """
    name = "CUONLINE_CPU_BLAS"
    value = _get(name)
    if value is None:
        return VARIABLES[name][1]
    if value not in CPU_BLAS_CHOICES:
        raise _bad(name, value, VARIABLES[name][2])
    return value


def _integer(name: str, value: str, expected: str) -> int:
    # Digits only, as the header's own parser takes them: no sign, space, "1e3", "0x10", "1_000".
    if not (value.isascii() and value.isdigit()):
        raise _bad(name, value, expected)
    return int(value)


def emulate_stack_kb() -> int:
    """``$CUONLINE_EMULATE_STACK_KB`` (default 256): KiB of stack per emulated thread.

    Raises
    ------
    ValueError
        The value is not an integer in :data:`STACK_KB_RANGE` (64 to 1048576).
    """
    name = "CUONLINE_EMULATE_STACK_KB"
    value = _get(name)
    if value is None:
        return _DEFAULT_STACK_KB
    expected = VARIABLES[name][2]
    kb = _integer(name, value, expected)
    low, high = STACK_KB_RANGE
    if not low <= kb <= high:
        why = ("smaller stacks risk a segmentation fault in ordinary kernels" if kb < low else
               "1024 threads of a block would not fit in the address space")
        raise _bad(name, value, expected, why)
    return kb


def emulate_watchdog_s() -> float:
    """``$CUONLINE_EMULATE_WATCHDOG_S`` (default 20): seconds before a stuck barrier aborts.

    Raises
    ------
    ValueError
        The value is not a finite number greater than 0.
    """
    name = "CUONLINE_EMULATE_WATCHDOG_S"
    value = _get(name)
    if value is None:
        return _DEFAULT_WATCHDOG_S
    expected = VARIABLES[name][2]
    try:
        seconds = float(value) if value == value.strip() else math.nan   # as strtod reads it
    except ValueError:
        raise _bad(name, value, expected) from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise _bad(name, value, expected)
    return seconds


def cxx() -> str | None:
    """The absolute path of the compiler that ``$CXX`` names, or None when it is unset.

    Raises
    ------
    ValueError
        ``CXX`` names nothing executable (on the PATH, or as a path).
    """
    name = "CXX"
    value = _get(name)
    if value is None:
        return None
    path = shutil.which(value)
    if path is None:
        if os.sep in value and os.path.exists(value):
            why = "the file exists but is not executable" if os.path.isfile(value) else \
                "it is not a file"
        elif os.sep in value:
            why = "no such file"
        elif " " in value.strip():
            why = "a compiler with options or a launcher (ccache g++) is not supported"
        else:
            why = "not found on the PATH"
        raise _bad(name, value, VARIABLES[name][2], why)
    return os.path.abspath(path)
