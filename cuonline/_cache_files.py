"""Files in cuonline's on-disk cache (:func:`cuonline._environment.cache_dir`) written so that
a concurrent reader, another thread or process, never sees a torn one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["write_json_atomically"]


def write_json_atomically(path, doc) -> None:
    """Write ``doc`` as JSON to ``path`` (its folder created) through a temporary file and
    ``os.replace``: a reader sees the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
