"""The stored ``python -m cuonline tune`` winners: files in the cache directory, and the
identity of the GPU they belong to.

One JSON document per (GPU name, compute capability, cuonline version) in
``$CUONLINE_CACHE_DIR/tuning/`` (the cache rule of :func:`cuonline._environment.cache_dir`),
written atomically (temporary file + ``os.replace``). :func:`current_device_winners` loads the
current GPU's file once per process and device (never at ``import cuonline``); a corrupt file,
or one written by another cuonline version or for another GPU, is ignored with a warning. The
document's content rules (what a valid entry is, how documents merge) are pure and live in
:mod:`cuonline.kernels.tuning`.
"""

from __future__ import annotations

import json
import re
import threading
import warnings
from pathlib import Path

from .. import _environment
from .._cache_files import write_json_atomically
from ..kernels import tuning

__all__ = ["clear_cache", "current_device_winners", "device_identity", "load_winners", "store",
           "tuning_dir", "tuning_path", "cuonline_version"]


def cuonline_version() -> str:
    """The running cuonline's version (the package is initialised before any engine runs)."""
    from .. import __version__  # noqa: PLC0415 - read at call time, not while cuonline imports

    return __version__


def tuning_dir() -> Path:
    """``$CUONLINE_CACHE_DIR/tuning``, else ``$XDG_CACHE_HOME/cuonline/tuning``, else
    ``~/.cache/cuonline/tuning``: the cache rule of :func:`cuonline._environment.cache_root`,
    which raises ValueError for a bad ``CUONLINE_CACHE_DIR``."""
    return _environment.cache_dir("tuning")


def tuning_path(gpu: str, arch: str, version: str | None = None) -> Path:
    """The file of one (GPU name, arch, cuonline version), e.g.
    ``nvidia-h200_sm_90_cuonline-0.1.0.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
    return tuning_dir() / f"{slug}_{arch}_cuonline-{version or cuonline_version()}.json"


def load_winners(path, *, gpu: str, arch: str, version: str | None = None) -> dict:
    """Read ``path`` into a winners table; ``{}`` when it does not exist. A corrupt, foreign or
    invalid file gives ``{}`` and a RuntimeWarning, never an exception."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warnings.warn(f"cuonline: ignoring tuning file {path}: {exc}", RuntimeWarning,
                      stacklevel=2)
        return {}
    try:
        return tuning.winners_from_document(json.loads(text), gpu=gpu, arch=arch,
                                            version=version or cuonline_version())
    except ValueError as exc:   # json.JSONDecodeError is a ValueError
        warnings.warn(f"cuonline: ignoring tuning file {path} (built-in tiles used): {exc}",
                      RuntimeWarning, stacklevel=2)
        return {}


def store(doc, path=None) -> Path:
    """Write ``doc`` atomically, merged with the valid document already at ``path`` (default:
    :func:`tuning_path` of ``doc``'s GPU, arch and version); return the path."""
    path = Path(path or tuning_path(doc["gpu"], doc["arch"], doc["cuonline"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        tuning.winners_from_document(old, gpu=doc["gpu"], arch=doc["arch"],
                                     version=doc["cuonline"])
    except (OSError, ValueError):
        old = None     # missing or unusable: replaced
    write_json_atomically(path, tuning.merge_documents(old, doc))
    clear_cache()
    return path


_cache: dict = {}
_cache_lock = threading.Lock()


def clear_cache():
    """Forget the tables loaded by :func:`current_device_winners` (after a new ``tune``)."""
    with _cache_lock:
        _cache.clear()


def device_identity(device_id=None) -> tuple:
    """``(GPU name, "sm_XY")`` of a CuPy device (default: the current one)."""
    import cupy  # noqa: PLC0415

    device = cupy.cuda.Device(device_id)
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return name, f"sm_{device.compute_capability}"


def current_device_winners() -> dict:
    """The stored winners for the current CuPy device, loaded once per process and device."""
    import cupy  # noqa: PLC0415

    device_id = cupy.cuda.Device().id
    with _cache_lock:
        if device_id in _cache:
            return _cache[device_id]
    try:
        gpu, arch = device_identity(device_id)
    except Exception:  # noqa: BLE001 - no identity, no winners: the built-in tiles
        table = {}
    else:
        table = load_winners(tuning_path(gpu, arch), gpu=gpu, arch=arch)
    with _cache_lock:
        _cache[device_id] = table
    return table
