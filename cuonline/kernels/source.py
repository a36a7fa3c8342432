"""Kernel source text: ``#define`` lines + the family's headers + one family's ``.cu`` text.

The CuPy path, the emulation and the NVRTC listing all compile the string returned by
:func:`build_source`, so they always see the same text. Which files make up a variant's text
(headers such as ``common.cuh`` and ``tensor_core.cuh``, the included split-key combine, the
family's own source) is the family registry's to say
(:func:`cuonline.kernels.families.files_of`). Headers are pasted, not ``#include``'d: CuPy's
on-disk cache key hashes the source string and the options only.

The ``.cu`` files live in the repository's top-level ``kernels_cu/``; the wheel ships them as
the package data ``cuonline.kernels_cu``. From a source tree (no install) they are read from
``kernels_cu/`` next to the ``cuonline`` package.
"""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

from . import families

__all__ = ["build_source", "read_kernel_file"]


@functools.lru_cache(maxsize=None)
def read_kernel_file(name: str) -> str:
    """Return the text of ``kernels_cu/<name>`` (installed package data or source tree)."""
    try:
        resource = importlib.resources.files("cuonline.kernels_cu").joinpath(name)
        if resource.is_file():
            return resource.read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        pass
    path = Path(__file__).resolve().parents[2] / "kernels_cu" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"kernel source {name!r} not found in package data `cuonline.kernels_cu` nor at {path}"
        )
    return path.read_text(encoding="utf-8")


def build_source(spec, *, overrides: dict | None = None) -> str:
    """Full compilable text of ``spec``: its defines, then the texts of its family's files.

    ``overrides`` maps a file name (``"common.cuh"``, ``"attention_fwd_simt.cu"``) to a text that
    replaces it: tests compile deliberately broken copies through this same path.
    """
    overrides = overrides or {}

    def text(name):
        return overrides[name] if name in overrides else read_kernel_file(name)

    lines = [f"// cuonline kernel variant {spec.key}"]
    lines += [f"#define {name} {value}" for name, value in spec.defines().items()]
    files = families.files_of(spec)
    return "\n".join(["\n".join(lines)] + [text(name) for name in files])
