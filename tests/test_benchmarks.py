"""The benchmark scripts run on a machine like CI's: the CPU one end to end on a tiny case,
the GPU one's report on made-up measurements (it needs a GPU to measure)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # the fast tier (-m 'not slow') leaves it out

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_benchmark_prints_side_by_side_figures(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_cpu.py"), "--quick", "--few-queries",
         "--softmax", "--plot", str(tmp_path / "plot.svg")],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = result.stdout.splitlines()
    assert lines[1].startswith("BLAS: ") and lines[2].startswith("cuonline's products: ")
    assert lines[3].startswith("BLAS ceiling") and "GFLOP/s" in lines[3]
    # the ceiling names each library it measured: NumPy's and the engine's at least
    assert "(numpy " in lines[3] and ", cuonline " in lines[3]
    rows = [line for line in lines if line.startswith("|   256 |")]
    assert len(rows) == 4                               # 2 dtypes x causal or not
    for row in rows:
        cuonline_gflops = float(row.split("|")[5])
        assert cuonline_gflops > 0
    if importlib.util.find_spec("torch") is not None:  # the path torch took is printed
        assert all("flash_attention" in row for row in rows)
        assert "geometric mean" in result.stdout
    assert "memory: N=1024" in result.stdout
    assert any(line.startswith("BLAS ceiling again after the cases: float32 ")
               for line in lines)
    assert sum(line.startswith("| softmax") or line.startswith("| log") for line in lines) == 6
    assert sum(line.startswith("|  16 |") or line.startswith("|   1 |") for line in lines) == 2
    svg = (tmp_path / "plot.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") >= 2   # cuonline and naive


def test_backward_benchmark_prints_side_by_side_figures():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_backward.py"), "--quick",
         "--causal", "both"],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = result.stdout.splitlines()
    assert lines[3].startswith("BLAS ceiling") and lines[6].startswith("times: ")
    rows = [line for line in lines if line.startswith("|   256 |")]
    assert len(rows) == 4 and all(float(row.split("|")[5]) > 0 for row in rows)
    assert [row.split("|")[4].strip() for row in rows] == ["no", "yes"] * 2
    if importlib.util.find_spec("torch") is not None:  # torch's autograd node is printed
        assert all("FlashAttention" in row for row in rows)
    assert any(line.startswith("BLAS ceiling again after the cases: ") for line in lines)
    assert "memory: N=1024" in result.stdout


@pytest.mark.parametrize("again, steady", [(90.0, True), (40.0, False), (130.0, False)])
def test_a_ceiling_that_moved_during_a_run_marks_its_figures(monkeypatch, capsys, again,
                                                             steady):
    """The ceiling measured after the cases (here 90, 40 or 130 GFLOP/s against 100 before):
    within CEILING_DRIFT the run is steady; else the report says not to quote it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_cpu

    monkeypatch.setattr(bench_cpu, "blas_ceiling", lambda dtype, repeat: again)
    assert bench_cpu.check_ceilings({"float32": 100.0}, 1) is steady
    out = capsys.readouterr().out
    assert out.startswith(f"BLAS ceiling again after the cases: float32 {again:.1f} GFLOP/s "
                          "(first 100.0)")
    assert ("steady" in out) is steady and ("do not quote" in out) is not steady


def test_gpu_report_table():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu_bench.py")
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    case = dict(dtype="float16", d=64, n=4096, bh=16, causal=True)
    rows = [dict(case, engine="cuonline", ms=2.0, tflops=300.0, max_error=1e-3),
            dict(case, engine="naive-cupy", ms=9.0, tflops=60.0, max_error=2e-3),
            dict(case, engine="torch-flash", ms=2.5, tflops=250.0, max_error=1e-3),
            dict(case, engine="torch-math", error="RuntimeError: refused")]
    table = gpu_bench.markdown(rows)
    assert "| float16 | 64 | 4096 | yes | 300.0 | 60.0 | 250.0 | - | 1.20 | 1.0e-03 |" in table
    assert len(list(gpu_bench.cases(quick=False))) == 36
    # the cuonline-mt column times the other number of query tiles per warp, at every D
    from cuonline.kernels import heuristics
    for d in {d for _, d, _, _ in gpu_bench.cases(quick=False)}:
        builtin = heuristics.MMA_TILES[("sm_90", "float16", d)]
        assert heuristics.MmaTiles(*gpu_bench.OTHER_M_TILES[d]).m_tiles != builtin.m_tiles


def test_genomics_benchmark_prints_native_beside_dense(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_genomics.py"), "--quick"],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    rows = [line.split("|") for line in result.stdout.splitlines()
            if line.startswith("| enformer") or line.startswith("| alphagenome")]
    assert len(rows) == 2
    for cells in rows:
        native_ms, dense_ms, build_ms = float(cells[3]), float(cells[4]), float(cells[6])
        assert native_ms > 0 and dense_ms > 0 and 0 <= build_ms < float("inf")
        assert float(cells[11]) < 1e-4                   # both compute the same logits


@pytest.mark.parametrize("compare, forms", [("loops", "compiled form against the Python loop"),
                                            ("stacks", "stacks form against the task per")])
def test_task_loops_prints_both_forms_of_each_pass(compare, forms):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "task_loops.py"), "--quick", "--one-core",
         "--dtypes", "float32", "--compare", compare],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = result.stdout.splitlines()
    assert lines[1].startswith("BLAS: ") and "one core" in lines[0] and forms in lines[0]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines
            if line.startswith(("| forward |", "| backward |"))]
    assert sorted((r[0], r[4]) for r in rows) == [("backward", "no"), ("backward", "yes"),
                                                   ("forward", "no"), ("forward", "yes")]
    assert all(float(r[5]) > 0 and float(r[6]) > 0 and float(r[7]) > 0 for r in rows)


def test_tile_profile_prints_each_step_of_a_tile():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tile_profile.py"), "--quick",
         "--dims", "64", "--dtypes", "float32"],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = result.stdout.splitlines()
    assert lines[1].startswith("BLAS: ") and "one core" in lines[3]
    (row,) = [line for line in lines if line.startswith("| float32 |")]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert float(cells[3]) > 0 and float(cells[5]) > 0        # both products timed
    if importlib.util.find_spec("torch") is not None:
        assert float(cells[7]) > 0 and float(cells[10]) > 0   # torch's products beside them
