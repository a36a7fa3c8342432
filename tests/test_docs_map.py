"""docs/architecture.md names only files and objects that exist, so the map cannot drift.

Every backticked token of the map that is a repository path (``cuonline/...``, ``kernels_cu/...``,
``tests/...``, ``docs/...``, ``benchmarks/...``) must exist; every backticked dotted name rooted
at ``cuonline`` or at the tests' ``support`` module must import and resolve attribute by
attribute; every ``Class::member`` of the CUDA text must occur in ``kernels_cu/``.
"""

from __future__ import annotations

import importlib
import re

import pytest
from support import ROOT

MAP = ROOT / "docs" / "architecture.md"
TOKENS = re.findall(r"`([^`\n]+)`", MAP.read_text(encoding="utf-8"))
PATHS = sorted({t.rstrip("/") for t in TOKENS
                if re.fullmatch(r"(cuonline|kernels_cu|tests|docs|benchmarks)(/[\w.]+)*/?", t)})
NAMES = sorted({t for t in TOKENS if re.fullmatch(r"(cuonline|support)(\.\w+)+", t)})
MEMBERS = sorted({t for t in TOKENS if re.fullmatch(r"\w+::\w+", t)})


def resolve(dotted: str):
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)    # AttributeError: the map names something gone
        return obj
    raise ImportError(f"no module of {dotted!r} imports")


def test_the_map_names_files_and_objects():
    # the map is the newcomer's entry point: it must name the main places at all
    assert {"cuonline/kernels/families.py", "cuonline/kernels/features.py",
            "kernels_cu/attention_score.cuh"} <= set(PATHS)
    assert "cuonline.engines.target.overrides" in NAMES
    assert len(NAMES) >= 20 and MEMBERS


@pytest.mark.parametrize("path", PATHS)
def test_every_path_exists(path):
    assert (ROOT / path).exists(), f"docs/architecture.md names {path}, which does not exist"


@pytest.mark.parametrize("name", NAMES)
def test_every_name_resolves(name):
    resolve(name)


@pytest.mark.parametrize("member", MEMBERS)
def test_every_cuda_member_exists(member):
    cls, name = member.split("::")
    texts = [p.read_text(encoding="utf-8") for p in (ROOT / "kernels_cu").glob("*.cu*")]
    assert any(re.search(rf"\b(struct|class)\s+{cls}\b", t) and re.search(rf"\b{name}\s*\(", t)
               for t in texts), f"docs/architecture.md names {member}, not in kernels_cu/"


def test_resolve_fails_on_a_missing_name():
    # the check above can fail: a name that is gone raises
    with pytest.raises(AttributeError):
        resolve("cuonline.kernels.families.no_such_function")
