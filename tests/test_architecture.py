"""The package's shape: no import circle, a pure kernels layer, no module using another's private
names, one registry of kernel families, one table of attention options, one seam for the
engines."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cuonline._validate import validate_attention
from cuonline.engines import target
from cuonline.kernels import arguments, features, families, source, stats_plan
from cuonline.kernels.launch import Launch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cuonline"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    """``{module: {modules it imports}}`` over every module under cuonline/, from the AST:
    imports at module level and inside functions alike (a lazy import closes a circle too)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports pkg.mod when that is a module, else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict):
    """One import circle of ``graph`` as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "cuonline.engines.cuda" in graph and "cuonline.kernels.families" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_the_circle_the_package_had():
    """engines/cuda.py imported kernels/tuning.py, which imported engines/cuda.py back."""
    graph = import_graph()
    graph["cuonline.kernels.tuning"] = graph["cuonline.kernels.tuning"] | {
        "cuonline.engines.cuda"}
    graph["cuonline.engines.cuda"] = graph["cuonline.engines.cuda"] | {"cuonline.kernels.tuning"}
    assert find_cycle(graph) is not None


def test_kernels_layer_imports_neither_engines_nor_tools():
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith("cuonline.kernels"):
            bad = {e for e in edges if e.startswith(("cuonline.engines", "cuonline.toolchain",
                                                      "cuonline.testing", "cuonline._validate",
                                                      "cuonline._api"))}
            assert not bad, (name, bad)


# --------------------------------------------------------------------------------------------
# private names stay in their module


# Spelled private, but another library's public interface: namedtuple's methods, and the
# metadata array of a Dask array (no public spelling exists).
FOREIGN_INTERFACE = {"_asdict", "_replace", "_fields", "_make", "_meta"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(module: str, text: str, modules) -> list:
    """``[(line, use)]``: where the module ``module`` (source ``text``) imports a private name
    of another cuonline module (``from .x import _y``; private modules themselves may be
    imported) or reads an attribute ``obj._y`` that it does not define itself (so belongs to
    another module: ``x._y``, ``instance._method``)."""
    tree = ast.parse(text)
    package = module if module.endswith("__init__") else module.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    own = set()                                # names this module defines, at any level
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
            own.add(node.attr)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "cuonline":
                continue
            for alias in node.names:
                if _private(alias.name) and f"{base}.{alias.name}" not in modules:
                    uses.append((node.lineno, f"from {base} import {alias.name}"))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
              and _private(node.attr) and node.attr not in own
              and node.attr not in FOREIGN_INTERFACE):
            uses.append((node.lineno, ast.unparse(node)))
    return uses


def _package_private_uses():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    found = {}
    for name, path in sorted(modules.items()):
        rel = path.relative_to(ROOT).as_posix()
        for line, use in private_uses(name if path.name != "__init__.py" else name + ".__init__",
                                      path.read_text(encoding="utf-8"), modules):
            found.setdefault((rel, use), []).append(line)
    return found


def test_no_module_uses_another_modules_private_names():
    found = _package_private_uses()
    bad = sorted(f"{path}:{lines[0]}: {use}" for (path, use), lines in found.items())
    assert not bad, "give the shared piece a public name:\n" + "\n".join(bad)


def test_the_private_name_finder_finds_what_the_numpy_backward_did():
    """engines/numpy_backward.py imported the forward's _run and _ScoreTerms and called
    terms._band; a private module, a name defined here and a namedtuple's method are fine."""
    text = ("from .numpy import _run, workers\n"
            "from . import _tile_kernels\n"
            "def f(terms, t):\n"
            "    t._asdict()\n"
            "    _tile_kernels.compile_for(1)\n"
            "    return terms._band(0, 1), terms._mine\n"
            "class A:\n"
            "    def __init__(self):\n"
            "        self._mine = 1\n")
    modules = {"cuonline.engines.numpy", "cuonline.engines._tile_kernels"}
    uses = [use for _, use in private_uses("cuonline.engines.numpy_backward", text, modules)]
    assert uses == ["from cuonline.engines.numpy import _run", "terms._band"]


_NO_CUPY = r"""
import importlib, pkgutil, sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cupy", "cupy_backends"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Blocker())
import cuonline            # the package itself brings the NumPy engines (cuonline.attention)
before = set(sys.modules)
import cuonline.kernels
names = [m.name for m in pkgutil.iter_modules(cuonline.kernels.__path__, "cuonline.kernels.")]
for name in names:
    importlib.import_module(name)
from cuonline.kernels import families
families.listing_specs("sm_90")                  # the registry's listing runs too
added = set(sys.modules) - before
bad = sorted(m for m in added if m.startswith(("cuonline.engines", "cuonline.toolchain",
                                               "cuonline.testing", "cuonline._api", "cupy")))
cuda = sorted(m for m in sys.modules if m.startswith(("cuonline.engines.cuda",
                                                      "cuonline.engines.target", "cupy")))
print(len(names), bad, cuda)
sys.exit(1 if bad or cuda or len(names) < 8 else 0)
"""


def test_kernels_import_without_cupy_and_without_an_engine():
    proc = subprocess.run([sys.executable, "-c", _NO_CUPY], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------------------------
# the registry and the feature table


def test_every_family_names_existing_files_and_entries():
    for family in families.FAMILIES:
        for name in family.headers + (family.source,):
            source.read_kernel_file(name)
        text = source.read_kernel_file(family.source)
        for entry in family.entries:
            assert f"{entry}(" in text, (family.name, entry)
        if family.spec is not None:
            assert family.spec.family == family.name
            listed = family.listing("sm_90")
            assert listed and all(s.key.startswith(family.name + "_") for s in listed)


def _one_call_of_every_family():
    """``{family name: (problem, launch, buffers)}``: one small call of every family, on
    NumPy arrays (the planners and argument builders are pure: no GPU, no compiler)."""
    from cuonline._validate import validate_axis_input

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 20, 8)).astype(np.float16) for _ in range(3))
    p = validate_attention(q, k, v, causal=True, backend="emulate")
    out, lse = np.zeros((2, 20, 8), np.float16), np.zeros((2, 20), np.float32)
    ws_out, ws_lse = np.zeros((2, 2, 20, 8), np.float32), np.zeros((2, 2, 20), np.float32)
    grads = {name: np.zeros((2, 20, 8), np.float32) for name in ("dq", "dk", "dv")}
    stats = {name: None for name in stats_plan.STATS_BUFFERS}
    stats.update(lse=lse, entropy=lse, max_weight=lse, argmax=np.zeros((2, 20), np.int64))
    x = rng.standard_normal((3, 50))
    sm = validate_axis_input(x, -1, None, "emulate", mode="softmax")
    backward = (p, Launch(), dict(dout=out, lse=lse, delta=lse, **grads, ds=None,
                                  drel_bias=None, drel_q=None, drel_k=None, row_sums=lse))
    return {
        "attention_fwd_simt": (p, Launch(family="attention_fwd_simt"), dict(out=out, lse=None)),
        "attention_fwd_mma": (p, Launch(family="attention_fwd_mma"), dict(out=out, lse=None)),
        "attention_combine": (p, Launch(n_splits=2),
                              dict(ws_out=ws_out, ws_lse=ws_lse, out=out, lse=None)),
        "attention_bwd_simt": backward,
        "attention_bwd_mma": backward,
        "softmax": (sm, Launch(), dict(x=x, mask=None, out=np.empty_like(x))),
        "attention_stats": (validate_attention(q, k, v[..., :0], return_lse=True,
                                               backend="emulate"), Launch(top_k=2), stats),
    }


def test_every_family_plans_and_builds_its_arguments_through_one_signature():
    # the engines call any family the same way: planner(problem, launch) -> plan (with its
    # spec), arguments(problem, plan, buffers) -> the kernels' argument tuples
    calls = _one_call_of_every_family()
    assert set(calls) == {f.name for f in families.FAMILIES}
    for family in families.FAMILIES:
        assert list(inspect.signature(family.planner).parameters) == ["problem", "launch"]
        assert list(inspect.signature(family.arguments).parameters) == ["problem", "plan",
                                                                       "buffers"]
        problem, launch, buffers = calls[family.name]
        plan = family.planner(problem, launch)
        assert (plan.spec is None) == (family.spec is None), family.name
        if family.spec is not None:
            assert type(plan.spec) is family.spec
        args = family.arguments(problem, plan, buffers)
        # one tuple per entry point (the statistics' three kernels), or one for all of them
        for tuple_ in (args.values() if isinstance(args, dict) else [args]):
            assert isinstance(tuple_, tuple) and not any(
                type(a) in (int, float) for a in tuple_), family.name   # explicit C types
        with pytest.raises(TypeError, match="buffers"):
            family.arguments(problem, plan, dict(buffers, unknown=None))


def test_the_backward_has_one_dispatch_rule():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 20, 8)).astype(np.float16) for _ in range(3))
    p = validate_attention(q, k, v, causal=True, backend="emulate")
    simt, mma = "attention_bwd_simt", "attention_bwd_mma"

    def family(**launch):
        return families.plan_backward(p, Launch(**launch)).spec.family

    # tensor cores on sm_80+ for finite inputs; non-finite ones, and older archs, take SIMT
    for arch in ("sm_80", "sm_86", "sm_90"):
        assert family(arch=arch) == mma
        assert family(arch=arch, finite_inputs=False) == simt
        assert family(arch=arch, finite_inputs=lambda: False) == simt
    assert family(arch="sm_75") == simt
    # the scan of the inputs runs only where it decides: not for exact float32, not when pinned
    exact = validate_attention(q.astype(np.float32), k.astype(np.float32),
                               v.astype(np.float32), backend="emulate")

    def no_scan():
        raise AssertionError("the inputs were scanned where the family did not depend on it")

    assert families.plan_backward(exact, Launch(finite_inputs=no_scan)).spec.family == simt
    assert family(family=simt, finite_inputs=no_scan) == simt
    # a pinned forward family pins the forward only; a pinned tensor-core backward that
    # cannot run the call says so (no fallback)
    assert family(family="attention_fwd_simt") == mma
    with pytest.raises(ValueError, match="attention_bwd_mma does not run"):
        families.plan_backward(p, Launch(family=mma, arch="sm_75"))
    with pytest.raises(ValueError, match="family must be one of"):
        families.plan_backward(p, Launch(family="attention_bwd"))
    # the forward refuses a family that is not a forward one
    with pytest.raises(ValueError, match="attention forward family"):
        families.plan_attention(p, Launch(family=simt))


def test_every_feature_has_its_define_and_its_arguments_in_every_family_that_supports_it():
    # the forward families, and the statistics family on the same score pipeline
    names = {f.name for f in families.forward_families()} | set(features.STATS_FAMILIES)
    for feature in features.FEATURES:
        assert set(feature.families) <= names
        assert set(feature.arguments) <= set(arguments.ATTENTION_FWD_SIGNATURE), feature.name
        for family in feature.families:
            spec = families.get(family).listing("sm_90")[0]
            assert f"#define {feature.define} 0" in source.build_source(spec)
            # rel_qk also compiles in its width Dr (the spec's dr)
            on = type(spec)(**{**spec.as_dict(),
                                "features": features.with_required((feature.name,)),
                                "dr": 16 if feature.name == "rel_qk" else 0})
            text = source.build_source(on)
            assert f"#define {feature.define} 1" in text and on.key.endswith(feature.name)
            assert feature.define in source.read_kernel_file(families.get(family).source) or \
                any(feature.define in source.read_kernel_file(h)
                    for h in families.files_of(spec)[:-1]), (family, feature.define)


def _problem(**options):
    q = np.zeros((2, 20, 8), np.float32)
    return validate_attention(q, q, q, backend="emulate", **options)


def test_the_plan_takes_its_flags_from_the_feature_table():
    p = _problem(causal=True, softcap=5.0, return_lse=True, mask=np.ones((20, 20), bool))
    spec = families.plan_attention(p, Launch()).spec
    assert spec.features == ("window", "mask", "softcap", "return_lse")
    assert families.plan_attention(_problem(), Launch()).spec.features == ()
    with pytest.raises(ValueError, match="features of attention_fwd_simt"):
        type(spec)(**{**spec.as_dict(), "features": ("causal",)})


# --------------------------------------------------------------------------------------------
# one seam: the target


def test_emulation_target_defaults_and_overrides():
    base = target.current("emulate")
    assert (base.arch, base.num_sms, dict(base.tuned)) == ("sm_90", 132, {})
    with target.overrides(arch="sm_75", num_sms=40):
        inner = target.current("emulate")
        with target.overrides(num_sms=8):
            assert (target.current("emulate").arch, target.current("emulate").num_sms) == (
                "sm_75", 8)
        assert (inner.arch, inner.num_sms) == ("sm_75", 40)
    assert target.current("emulate") == base
    with pytest.raises(TypeError, match="overrides\\(\\) takes .*got bogus"):
        with target.overrides(bogus=1):
            pass
    with pytest.raises(ValueError, match="arch must look like"):
        with target.overrides(arch="ampere"):
            target.current("emulate")


def test_overrides_stay_in_the_thread_that_set_them():
    seen = {}
    inside, release = threading.Event(), threading.Event()

    def other():
        inside.wait()
        seen["other"] = target.current("emulate").arch
        release.set()

    worker = threading.Thread(target=other)
    worker.start()
    with target.overrides(arch="sm_80"):
        inside.set()
        release.wait(10)
        seen["self"] = target.current("emulate").arch
    worker.join()
    assert seen == {"self": "sm_80", "other": "sm_90"}


def test_engine_signatures_take_only_the_problem():
    import inspect

    from cuonline.engines import cuda, cuda_softmax

    for fn in (cuda.attention, cuda_softmax.run):
        assert list(inspect.signature(fn).parameters) == ["problem"], fn.__qualname__
