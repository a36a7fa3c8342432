"""``python -m cuonline tune``: candidates, storage, lookup and the command line.

Everything here runs on a CPU in a few seconds, except the NVRTC compiles of a handful of
candidates (skipped without NVRTC) and the GPU-marked run of ``tune --quick`` (skipped without
a GPU). The measuring itself (CUDA events on a device) has only the GPU-marked test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from support import gpu_available, needs_gpu, needs_nvrtc

from cuonline.__main__ import main
from cuonline._validate import validate_attention
from cuonline.engines import cuda, target, tune, tuning_files
from cuonline.engines.target import overrides
from cuonline.kernels import families, heuristics, tuning
from cuonline.kernels.launch import Launch
from cuonline.toolchain import nvrtc
from cuonline.kernels.specs import AttentionMmaSpec

ROOT = Path(__file__).resolve().parents[1]
_gpu_reason = gpu_available()
ARCHS = ("sm_80", "sm_90")
KEYS = [(dtype, bucket, family) for dtype in tuning.DTYPES for bucket in heuristics.D_BUCKETS
        for family, _ in tuning.targets(dtype, bucket)]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CUONLINE_CACHE_DIR", str(tmp_path))
    return tmp_path / "tuning"


def problem(dtype, d, lq, lk=None, nbatch=2, precision="highest"):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((nbatch, lq, d)).astype(dtype)
    k = v = rng.standard_normal((nbatch, lk or lq, d)).astype(dtype)
    return validate_attention(q, k, v, scale=None, causal=False, window=None, bias=None,
                              mask=None, kv_lengths=None, alibi_slopes=None, softcap=None,
                              return_lse=False, backend="emulate", precision=precision)


# --------------------------------------------------------------------------------------------
# candidates (pure)


@pytest.mark.parametrize("arch", ARCHS)
def test_candidates_keep_the_budgets_and_start_with_the_builtin(arch):
    for dtype, bucket, family in KEYS:
        full = tuning.candidates(arch, dtype, bucket, family)
        quick = tuning.candidates(arch, dtype, bucket, family, quick=True)
        assert len(set(full)) == len(full) and set(quick) <= set(full), (dtype, bucket)
        if family == "attention_fwd_mma":
            assert full[0] == heuristics.MMA_TILES[(arch, dtype, bucket)]
        else:
            assert full[0] == heuristics.choose_tiles(dtype, bucket, bucket, 4096, 16)
        assert quick[0] == full[0]
        words = 2 if dtype == "float64" else 1
        for tiles in full:
            spec = tuning.spec_of(family, dtype, bucket, tiles)
            if family == "attention_fwd_mma":
                # fragments per lane; shared memory within the opt-in limit
                assert tuning.mma_register_words(spec) <= tuning.MMA_REGISTER_WORDS, spec.key
                assert spec.shared_bytes <= heuristics.SMEM_OPT_IN_LIMIT[arch], spec.key
            else:
                _, rows, keys = tiles
                assert rows * math.ceil(bucket / 32) * words <= heuristics.ACC_REGISTER_BUDGET
                assert rows * keys * words <= 16
                assert spec.shared_bytes <= heuristics.SMEM_MAX, spec.key


def test_register_estimate():
    # per query tile: O (16 x Dv / 32 lanes) + scores (16 x block_n / 32), x2 for f64; + Q
    # fragments in registers (4 words per k-step and query tile, when at most 32 words)
    cases = [(("float16", 128, 4, 64, 2, 1), 64 + 32 + 32),
             (("float16", 256, 4, 32, 2, 1), 128 + 16),
             (("float32", 64, 4, 32, 2, 1), 32 + 16 + 32), (("float64", 128, 2, 16, 1, 1), 144),
             (("float64", 32, 4, 32, 2, 1), (16 + 16) * 2 + 32),
             (("float16", 64, 4, 32, 2, 2), 2 * (32 + 16) + 2 * 16),
             (("float32", 64, 4, 32, 2, 2), 2 * (32 + 16))]          # Q (64 words) from sQ
    for (dtype, d, warps, block_n, stages, m_tiles), words in cases:
        spec = AttentionMmaSpec(dtype=dtype, d=d, dv=d, warps=warps, block_n=block_n, stages=stages,
                       m_tiles=m_tiles)
        assert tuning.mma_register_words(spec) == words, spec.key
    # what spilled in the sweeps is not a candidate: f16 D = 128 with 128-key tiles (160
    # words), f64 D = 64 with two stages of 64 keys (128 words + a second f64 stage), two query
    # tiles per warp with 64 keys at D = 64 or 32 keys at D = 128 (160 words)
    assert (4, 128, 2, 1) not in tuning.candidates("sm_80", "float16", 128)
    assert (4, 64, 2, 1) not in tuning.candidates("sm_90", "float64", 64)
    assert (4, 64, 2, 2) not in tuning.candidates("sm_90", "float16", 64)
    assert (4, 32, 2, 2) not in tuning.candidates("sm_80", "float16", 128)


def test_candidates_respect_a_device_shared_memory_limit():
    limit = 99 * 1024    # sm_86 / sm_89 opt-in
    cands = tuning.candidates("sm_90", "float16", 128, smem_limit=limit)
    assert len(cands) > 3
    assert all(tuning.spec_of("attention_fwd_mma", "float16", 128, t).shared_bytes <= limit
               for t in cands[1:])


def test_targets_cover_both_float32_families():
    assert tuning.targets("float32", 64) == [("attention_fwd_simt", "highest"),
                                             ("attention_fwd_mma", "tf32")]
    assert tuning.targets("float16", 256) == [("attention_fwd_mma", "highest")]
    assert tuning.targets("float64", 256) == [("attention_fwd_simt", "highest")]
    # below sm_80 the dispatcher runs SIMT for every dtype: tune measures that family only
    for arch in ("sm_70", "sm_75"):
        assert tuning.targets("float32", 64, arch) == [("attention_fwd_simt", "highest")]
        assert tuning.targets("float16", 64, arch) == [("attention_fwd_simt", "highest")]
        assert tuning.candidates(arch, "float16", 64)[0] == heuristics.choose_tiles(
            "float16", 64, 64, tuning.SHAPE["n"], tuning.SHAPE["nbatch"], arch=arch)
    with pytest.raises(ValueError, match="dtype"):
        tuning.candidates("sm_90", "int8", 64)


# A handful of compiles: the quick candidates of two keys, one per arch (the full sets were
# swept once by hand: see docs/kernels.md, "Tuning").
COMPILED = [(arch, dtype, d, tiles) for arch, dtype, d in (("sm_80", "float16", 128),
                                                            ("sm_90", "float64", 64))
            for tiles in tuning.candidates(arch, dtype, d, quick=True)]


@needs_nvrtc
@pytest.mark.parametrize("arch, dtype, d, tiles", COMPILED,
                         ids=[f"{a}-{tuning.spec_of('attention_fwd_mma', dt, d, t).key}"
                              for a, dt, d, t in COMPILED])
def test_candidates_compile_without_spills(arch, dtype, d, tiles):
    # as tune's causal run
    spec = tuning.spec_of("attention_fwd_mma", dtype, d, tiles, features=("window",))
    report = nvrtc.compile_spec(spec, arch)
    assert {k.name for k in report.kernels} == set(families.entries_of(spec)), report.log
    assert report.spills == 0 and report.stack_frame == 0, report.log


# --------------------------------------------------------------------------------------------
# storage


def document(entries, gpu="NVIDIA H200", arch="sm_90", version=None):
    return {"format": tuning.FORMAT, "cuonline": version or tuning_files.cuonline_version(), "gpu": gpu,
            "arch": arch, "updated": "2026-01-01T00:00:00", "entries": entries}


def entry(dtype="float16", d=64, tiles=(8, 32, 1, 1), family="attention_fwd_mma"):
    return {"family": family, "dtype": dtype, "d": d, "precision": "highest",
            "tiles": list(tiles), "builtin": [4, 64, 2, 1], "results": []}


def test_store_and_load_round_trip(cache_dir):
    path = tuning_files.store(document([entry()]))
    assert path.parent == cache_dir and path.name.startswith("nvidia-h200_sm_90_cuonline-")
    assert [p.name for p in cache_dir.iterdir()] == [path.name]       # no temporary left over
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = tuning_files.load_winners(path, gpu="NVIDIA H200", arch="sm_90")
    assert table == {("attention_fwd_mma", "float16", 64): (8, 32, 1, 1)}
    # a second tune adds its keys and replaces the same ones
    tuning_files.store(document([entry(d=128, tiles=(8, 64, 2, 1)), entry(tiles=(4, 32, 2, 1))]))
    table = tuning_files.load_winners(path, gpu="NVIDIA H200", arch="sm_90")
    assert table == {("attention_fwd_mma", "float16", 64): (4, 32, 2, 1),
                     ("attention_fwd_mma", "float16", 128): (8, 64, 2, 1)}
    # no file: no winners, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning_files.load_winners(cache_dir / "absent.json", gpu="x", arch="sm_90") == {}


@pytest.mark.parametrize("case, match", [
    ("version", "cuonline is '0.0.0-other'"),
    ("gpu", "gpu is 'NVIDIA H200'"),
    ("arch", "arch is 'sm_90'"),
    ("tiles", "not a candidate"),
    ("entry", "malformed entry"),
    ("corrupt", "Expecting"),
])
def test_foreign_or_corrupt_files_are_ignored_with_a_warning(cache_dir, case, match):
    path = cache_dir / "file.json"
    path.parent.mkdir(parents=True)
    doc = document([entry()])
    if case == "version":
        doc["cuonline"] = "0.0.0-other"
    elif case == "tiles":
        doc["entries"] = [entry(tiles=(8, 256, 2, 1))]
    elif case == "entry":
        doc["entries"] = [{"family": "attention_fwd_mma"}]
    text = "{not json" if case == "corrupt" else json.dumps(doc)
    path.write_text(text)
    gpu, arch = {"gpu": ("NVIDIA A100", "sm_90"), "arch": ("NVIDIA H200", "sm_80")}.get(
        case, ("NVIDIA H200", "sm_90"))
    with pytest.warns(RuntimeWarning, match=match):
        assert tuning_files.load_winners(path, gpu=gpu, arch=arch) == {}


def test_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("CUONLINE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning_files.tuning_dir() == tmp_path / "cuonline" / "tuning"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tuning_files.tuning_dir() == Path.home() / ".cache" / "cuonline" / "tuning"
    path = tuning_files.tuning_path("NVIDIA H100 80GB HBM3", "sm_90", "1.2.3")
    assert path.name == "nvidia-h100-80gb-hbm3_sm_90_cuonline-1.2.3.json"


def test_import_reads_no_tuning_file():
    code = ("import sys, cuonline; from cuonline.engines import tuning_files; "
            "assert not tuning_files._cache; assert 'cupy' not in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, CUONLINE_CACHE_DIR="/nonexistent"))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


# --------------------------------------------------------------------------------------------
# lookup: the heuristics honour a stored winner, else the built-in table


def test_mma_plan_takes_the_stored_winner():
    p = problem(np.float16, 64, 300)
    builtin = families.plan_attention(p, Launch()).spec
    assert (builtin.warps, builtin.block_n, builtin.stages, builtin.m_tiles) == (4, 32, 2, 2)
    table = {("attention_fwd_mma", "float16", 64): (8, 32, 1, 1)}
    spec = families.plan_attention(p, Launch(tuned=table)).spec
    assert (spec.warps, spec.block_n, spec.stages, spec.m_tiles) == (8, 32, 1, 1)
    # the winner of the bucket serves narrower heads; other dtypes/buckets keep the table
    narrow = families.plan_attention(problem(np.float16, 40, 300), Launch(tuned=table)).spec
    assert (narrow.warps, narrow.block_n, narrow.stages, narrow.m_tiles) == (8, 32, 1, 1)
    other = families.plan_attention(problem(np.float16, 128, 300), Launch(tuned=table)).spec
    assert (other.warps, other.block_n, other.stages, other.m_tiles) == (4, 64, 2, 1)
    assert families.plan_attention(p, Launch(tuned={})).spec == builtin
    # few queries: the winner's warps are still capped at one per 16 rows
    few = families.plan_attention(problem(np.float16, 64, 17, 300), Launch(tuned=table)).spec
    assert (few.warps, few.block_n, few.stages) == (2, 32, 1)


def test_simt_plan_takes_the_stored_winner():
    p = problem(np.float32, 64, 4096, nbatch=16)
    builtin = families.plan_attention(p, Launch()).spec
    table = {("attention_fwd_simt", "float32", 64): (8, 4, 1)}
    spec = families.plan_attention(p, Launch(tuned=table)).spec
    assert (spec.warps, spec.rows_per_warp, spec.keys_per_lane) == (8, 4, 1)
    # the TF32 winner is another family's: no effect on exact float32
    assert families.plan_attention(
        p, Launch(tuned={("attention_fwd_mma", "float32", 64): (8, 32, 1, 1)})).spec == builtin
    # decoding shapes keep the built-in rules
    assert families.plan_attention(problem(np.float32, 64, 1, 300), Launch(tuned=table)).spec == \
        families.plan_attention(problem(np.float32, 64, 1, 300), Launch()).spec
    table = {("attention_fwd_mma", "float32", 64): (8, 32, 1, 1)}
    tf32 = families.plan_attention(problem(np.float32, 64, 300, precision="tf32"),
                                   Launch(tuned=table))
    assert isinstance(tf32.spec, AttentionMmaSpec) and tf32.spec.block_n == 32


def test_engine_forwards_the_table(monkeypatch):
    """The target's ``tuned`` (set through the seam) reaches the planner; the emulation loads
    no file."""
    monkeypatch.setattr(target.Target, "module", lambda self, spec: None)
    monkeypatch.setattr(cuda, "_launch", lambda p, launch, plan, module: plan)

    def no_loading():
        raise AssertionError("the emulation must not load stored winners")

    monkeypatch.setattr(tuning_files, "current_device_winners", no_loading)
    p = problem(np.float16, 64, 300)
    table = {("attention_fwd_mma", "float16", 64): (2, 128, 1, 1)}
    with overrides(tuned=table):
        spec = cuda.attention(p).spec
    assert (spec.warps, spec.block_n, spec.stages, spec.m_tiles) == (2, 128, 1, 1)
    assert cuda.attention(p).spec == families.plan_attention(p, Launch()).spec


# --------------------------------------------------------------------------------------------
# command line


def test_dry_run_lists_the_candidates(capsys):
    assert main(["tune", "--dry-run", "--dtypes", "float16,float32", "--dims", "64",
                 "--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "candidates for sm_80" in out
    assert "attention_fwd_mma_f16_d64_dv64_bm64_bn64_s2" in out and "built-in" in out
    assert "attention_fwd_simt/float32/d64" in out and "attention_fwd_mma/tf32/d64" in out
    assert main(["tune", "--dry-run", "--quick", "--json", "--dtypes", "float64",
                 "--dims", "100", "--arch", "sm_90"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["candidates"]
    assert doc["arch"] == "sm_90" and {r["d"] for r in rows} == {128}
    assert [r["tiles"] for r in rows] == [list(t) for t in
                                          tuning.candidates("sm_90", "float64", 128, quick=True)]
    assert rows[0]["builtin"] and not any(r["builtin"] for r in rows[1:])


def test_tune_arguments_are_checked(capsys):
    for argv in (["--dtypes", "int8"], ["--dims", "0"], ["--dims", "x"]):
        with pytest.raises(SystemExit):
            main(["tune", "--dry-run", *argv])
    assert "dtypes must be among" in capsys.readouterr().err


@pytest.mark.skipif(_gpu_reason is None, reason="a GPU is present")
def test_tune_without_a_gpu_fails_with_one_clear_line(cache_dir):
    proc = subprocess.run([sys.executable, "-m", "cuonline", "tune", "--quick"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], proc.stderr
    assert not cache_dir.exists()


@pytest.mark.gpu
@needs_gpu
def test_tune_quick_on_the_gpu(cache_dir):
    proc = subprocess.run([sys.executable, "-m", "cuonline", "tune", "--quick", "--json",
                           "--dtypes", "float16", "--dims", "64"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    doc = result["document"]
    (ent,) = doc["entries"]
    assert ent["tiles"] in [r["tiles"] for r in ent["results"] if r["error"] is None]
    assert all(r["ms"] > 0 for r in ent["results"] if r["error"] is None)
    tuning_files.clear_cache()
    winners = tuning_files.current_device_winners()
    assert winners == {("attention_fwd_mma", "float16", 64): tuple(ent["tiles"])}
    assert Path(result["path"]) == tuning_files.tuning_path(doc["gpu"], doc["arch"])


def test_measuring_picks_the_fastest_agreeing_candidate(monkeypatch):
    """The selection logic of tune with the device parts stubbed: a candidate that raises,
    disagrees with the built-in tiles or spills is recorded and skipped; the fastest of the
    rest wins."""
    tiles = tuning.candidates("sm_90", "float16", 64, quick=True)
    builtin, broken, wrong, fast = tiles[0], tiles[1], tiles[2], tiles[3]
    ms = {t: 2.0 for t in tiles}
    ms[wrong] = ms[broken] = 0.1
    ms[fast] = 1.0
    current = {}

    spills = tiles[4]
    ms[spills] = 0.1

    class Runner:     # tune.DeviceRunner's methods, without a device
        @staticmethod
        def problems(dtype, d, shape, precision):
            return [None, None]            # causal off and on

        @staticmethod
        def run(p, table):
            (t,) = table.values()
            current["tiles"] = t
            if t == broken:
                raise RuntimeError("CUDA_ERROR_INVALID_VALUE: too many resources requested\n..")
            return np.full((2, 3), 0.5 if t == wrong else 0.25, dtype=np.float16)

        @staticmethod
        def usage(p, table):
            return (255, 16) if current["tiles"] == spills else (128, 0)

        @staticmethod
        def time_ms(fn, repeats):
            return (fn(), ms[current["tiles"]])[1]

    lines = []
    entry = tune.measure_one(Runner, "attention_fwd_mma", "highest", "float16", 64, "sm_90",
                             228 * 1024, tuning.SHAPE, True, lines.append)
    assert tuple(entry["tiles"]) == fast and tuple(entry["builtin"]) == builtin
    rows = {tuple(r["tiles"]): r for r in entry["results"]}
    assert rows[broken]["error"].startswith("RuntimeError: CUDA_ERROR_INVALID_VALUE")
    assert "differs from the built-in" in rows[wrong]["error"] and rows[wrong]["ms"] is None
    assert "local memory" in rows[spills]["error"] and rows[spills]["registers"] == 255
    assert rows[fast]["ms"] == 2 * 1.0 and rows[fast]["registers"] == 128  # causal off + on
    assert len(lines) == len(tiles) and "failed" in lines[1]
    # the entry is a valid stored document entry
    doc = document([entry])
    assert tuning.winners_from_document(doc, gpu="NVIDIA H200", arch="sm_90",
                                        version=doc["cuonline"]) == {
        ("attention_fwd_mma", "float16", 64): fast}


def test_tune_stores_and_reports(monkeypatch, cache_dir, capsys):
    """The command's path after measuring (measure stubbed: no GPU here)."""
    import cuonline.__main__ as cli

    seen = {}

    def fake_measure(dtypes, dims, *, quick, progress):
        seen.update(dtypes=dtypes, dims=dims, quick=quick)
        results = [{"tiles": [4, 64, 2, 1], "key": "a", "ms": 2.0, "error": None},
                   {"tiles": [8, 32, 1, 1], "key": "b", "ms": 1.0, "error": None},
                   {"tiles": [2, 64, 2, 1], "key": "c", "ms": None, "error": "CompileException"}]
        return document([dict(entry(), results=results)], gpu="Fake GPU")

    monkeypatch.setattr(cli, "_gpu_or_reason", lambda: ("Fake GPU", None))
    monkeypatch.setattr(tune, "measure", fake_measure)
    assert main(["tune", "--quick", "--dtypes", "float16", "--dims", "60"]) == 0
    assert seen == {"dtypes": ("float16",), "dims": (60,), "quick": True}
    out = capsys.readouterr().out
    assert "stored in" in out
    assert "(4, 64, 2, 1): 2.000 ms  ->  (8, 32, 1, 1): 1.000 ms  (2.00x)" in out
    (path,) = cache_dir.iterdir()
    table = tuning_files.load_winners(path, gpu="Fake GPU", arch="sm_90")
    assert table == {("attention_fwd_mma", "float16", 64): (8, 32, 1, 1)}
