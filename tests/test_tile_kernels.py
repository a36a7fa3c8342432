"""The NumPy engine's compiled tile kernel (cuonline/engines/_tile_kernels.py, numba).

Its exponential against ``np.exp`` and a higher-precision reference, its special values, the
whole tile update and the softmax rows against the engines' ufunc passes, and the engines' use
of them (and their fallback where numba is missing or a kernel does not compile).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import cuonline
from cuonline.engines import _tile_kernels as tk  # numba is a core dependency
from cuonline.engines import cpu_runtime
from cuonline.engines import numpy as numpy_engine
from cuonline.engines.numpy_scores import ScorePipeline, group_rows

# the dtype, the input range, and how far the result may be from the reference, in ulps
EXP_CASES = [(np.float32, -104.0, 1.0), (np.float64, -745.0, 1.0)]


def exp_of(x):
    out = np.empty_like(x)
    tk.exp_array(x, out)
    return out


def ulps(got, ref, dtype):
    """|got - ref| in units of the dtype's spacing at ref (ref in a wider type)."""
    spacing = np.spacing(np.abs(ref.astype(dtype))).astype(ref.dtype)
    return np.abs(got.astype(ref.dtype) - ref) / spacing


@pytest.mark.parametrize("dtype, low, max_ulps", EXP_CASES, ids=["float32", "float64"])
def test_exp_accurate_to_one_ulp(dtype, low, max_ulps):
    """Over [low, 0] (the whole range where exp is not 0), including the subnormal results."""
    rng = np.random.default_rng(0)
    x = np.concatenate([
        np.linspace(low, 0, 1_000_001),
        -np.abs(rng.standard_normal(200_000)) * 30,       # typical s - m of attention
        -rng.random(100_000) * 1e-3,                          # near 0, where exp ~ 1 + x
    ]).astype(dtype)
    wide = np.longdouble if np.finfo(np.longdouble).nmant > 52 else np.float64
    if dtype == np.float64 and wide is np.float64:
        pytest.skip("no wider float than float64 here for the reference")
    ref = np.exp(x.astype(wide))
    got = exp_of(x)
    assert ulps(got, ref, dtype).max() <= max_ulps
    # and within 2 ulp of NumPy's own exp (which is itself up to 2.4 ulp off in float32 here)
    assert ulps(got, np.exp(x).astype(wide), dtype).max() <= 2


def test_exp_float32_over_every_binade():
    """Every 256th float32 in [-104, 0] by bit pattern: each binade, from subnormal inputs
    (where the result is 1 or just below) to the subnormal results, against the float64
    exponential (exact to far below a float32 ulp)."""
    bits = np.arange(0, np.float32(104).view(np.int32) + 1, 256, dtype=np.int32)
    x = -bits.view(np.float32)
    assert ulps(exp_of(x), np.exp(x.astype(np.float64)), np.float32).max() <= 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_polynomial_truncation_is_far_below_an_ulp(dtype):
    """The polynomial for e^r, with its coefficients rounded to the dtype and evaluated in a
    wider type, over the whole reduced range |r| <= ln2 / 2: its error leaves the roundings of
    the evaluation almost all of the 1-ulp budget (one degree less fails this)."""
    wide = np.float64 if dtype == np.float32 else np.longdouble
    if np.finfo(wide).nmant <= np.finfo(dtype).nmant:
        pytest.skip("no wider float than float64 here to evaluate in")
    coefficients = tk._POLY32 if dtype == np.float32 else tk._POLY64
    r = np.linspace(-0.3466, 0.3466, 100_001).astype(wide)
    p = np.zeros_like(r)
    for c in coefficients:                              # highest degree first
        p = p * r + wide(dtype(c))
    assert (np.abs(p / np.exp(r) - 1) < np.finfo(dtype).eps / 16).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_special_values(dtype):
    x = np.array([-np.inf, np.nan, 0.0, -0.0, -1e30, -800.0, -np.finfo(dtype).max], dtype)
    got = exp_of(x)
    assert got[0] == 0 and not np.signbit(got[0])      # exactly 0: a masked key weighs nothing
    assert np.isnan(got[1])                             # NaN propagates
    assert got[2] == 1 and got[3] == 1
    assert (got[4:] == 0).all()


def weight_array(x):
    out = np.empty_like(x)
    tk.weight_array(x, out)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weight_exp_is_the_exp_down_to_its_floor_and_0_below(dtype):
    """The attention kernels' exponential: the same bits as the exact one from its floor up,
    every nonzero result a normal number (no subnormal step, which costs a microcode assist on
    x86 cores), and 0 below the floor, -inf included; NaN stays NaN."""
    floor = dtype(tk.WEIGHT_FLOOR[np.dtype(dtype)])
    above = np.concatenate([np.linspace(floor, 0, 200_001, dtype=dtype),
                            np.nextafter(floor, dtype(0), dtype=dtype)[None]])
    got = weight_array(above)
    np.testing.assert_array_equal(got, exp_of(above))
    assert got.min() >= np.finfo(dtype).tiny
    below = np.array([np.nextafter(floor, dtype(-np.inf), dtype=dtype), floor - 1,
                      floor - 17, -np.finfo(dtype).max, -np.inf], dtype)
    got = weight_array(below)
    assert (got == 0).all() and not np.signbit(got).any()
    assert np.isnan(weight_array(np.array([np.nan], dtype))).all()
    # the floor sits just above the smallest normal result: little is given up
    assert np.exp(np.float64(floor)) < 1.2 * np.finfo(dtype).tiny


def weight_atol(dtype):
    """How far a tile kernel's weight may be from ``np.exp``'s: the kernels give 0 below
    ``exp(WEIGHT_FLOOR)``, where ``np.exp`` rounds a subnormal result (or one just above the
    smallest normal number)."""
    return float(np.exp(np.float64(tk.WEIGHT_FLOOR[np.dtype(dtype)])))


def ufunc_tile(s, m, l, o):
    s, m, l, o = s.copy(), m.copy(), l.copy(), o.copy()
    with np.errstate(invalid="ignore"):
        m = numpy_engine._softmax_tile_ufuncs(s, m, l, o)
    return s, m, l, o


def everything(s):
    """``(lo, hi)``: every row sees every column of ``s``."""
    return np.zeros(len(s), np.int64), np.full(len(s), s.shape[1], np.int64)


def kernel_tile(s, m, l, o, lo=None, hi=None):
    if lo is None:
        lo, hi = everything(s)
    s, m, l, o = s.copy(), m.copy(), l.copy(), o.copy()
    tk.online_softmax_tile(s, m, l, o, lo, hi)
    return s, m, l, o


def tile_case(dtype, rng, n=37, k=75, dv=9):
    """A tile with a running state, -inf entries, a fully masked row, a row whose max grows and
    one whose max does not, a NaN score and a +inf score."""
    s = (rng.standard_normal((n, k)) * 20).astype(dtype)
    s[rng.random((n, k)) < 0.2] = -np.inf
    s[3] = -np.inf                                      # nothing visible in this tile
    s[5, 7] = np.nan
    s[6, 2] = np.inf
    m = (rng.standard_normal(n) * 20).astype(dtype)
    m[3] = m[8] = -np.inf                               # no key seen yet
    s[8] = -np.inf                                      # ... and none now: stays empty
    m[9] = 1e4                                          # the old max stays the max
    l = rng.random(n).astype(dtype) * 5
    l[[3, 8]] = 0
    o = rng.standard_normal((n, dv)).astype(dtype)
    o[[3, 8]] = 0
    return s, m, l, o


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tile_matches_ufunc_passes(dtype, rng):
    case = tile_case(dtype, rng)
    want = ufunc_tile(*case)
    got = kernel_tile(*case)
    rtol = 8 * np.finfo(dtype).eps
    atol = weight_atol(dtype)
    for name, g, w in zip("smlo", got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)
    np.testing.assert_array_equal(got[1], want[1])      # the max is exact
    assert (got[0][3] == 0).all() and got[2][8] == 0 and (got[3][8] == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tile_sets_the_output_of_a_row_that_saw_nothing(dtype, rng):
    """A row whose running max is -inf has seen no key: its output is 0 whatever the array
    held (the compiled walks do not zero their outputs first), NaN and inf included; a row
    that has seen keys keeps a NaN of its output."""
    s, m, l, o = tile_case(dtype, rng)
    held = o.copy()
    held[3] = np.nan
    held[8] = np.inf
    held[10, 0] = np.nan                                # a row that has seen keys
    got = kernel_tile(s, m, l, held)
    want = kernel_tile(s, m, l, o)
    rows = np.arange(len(s)) != 10
    np.testing.assert_array_equal(got[3][rows], want[3][rows])
    assert (got[3][[3, 8]] == 0).all() and np.isnan(got[3][10, 0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tile_band_is_masking(dtype, rng):
    """Columns outside [lo, hi) count as -inf whatever the scores hold there (NaN included),
    for bounds before, inside and past the tile, and empty or inverted ranges."""
    s, m, l, o = tile_case(dtype, rng)
    n, k = s.shape
    lo = rng.integers(-10, k + 10, n)
    hi = lo + rng.integers(-5, k, n)
    lo[:4], hi[:4] = [0, k + 3, 5, -7], [k, k + 9, 5, -2]
    s[10, :] = np.nan
    lo[10], hi[10] = 3, 9
    s[10, 3:9] = 1.0                                    # NaN only where row 10 cannot see
    masked = s.copy()
    cols = np.arange(k)
    masked[(cols < lo[:, None]) | (cols >= hi[:, None])] = -np.inf
    want = ufunc_tile(masked, m, l, o)
    got = kernel_tile(s, m, l, o, lo, hi)
    for name, g, w in zip("smlo", got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
        np.testing.assert_allclose(g, w, rtol=8 * np.finfo(dtype).eps,
                                   atol=weight_atol(dtype), err_msg=name)
    assert np.isfinite(got[3][10]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tile_empty_and_strided(dtype, rng):
    # no rows; no keys (the state is unchanged but for -inf rows staying empty)
    s, m, l, o = tile_case(dtype, rng)
    tk.online_softmax_tile(s[:0], m[:0], l[:0], o[:0], *everything(s[:0]))
    s, m, l, o = tile_case(dtype, rng)
    got = kernel_tile(s[:, :0], m, l, o)
    np.testing.assert_array_equal(got[1], m)
    np.testing.assert_allclose(got[2], l, rtol=0)
    # strided views compute what contiguous copies do (up to the order of the row sums)
    s, m, l, o = tile_case(dtype, rng, n=20, k=40)
    want = kernel_tile(s[::2, ::2].copy(), m[::2].copy(), l[::2].copy(), o[::2].copy())
    sv, mv, lv, ov = s.copy(), m.copy(), l.copy(), o.copy()
    tk.online_softmax_tile(sv[::2, ::2], mv[::2], lv[::2], ov[::2], *everything(sv[::2, ::2]))
    for g, w in zip((sv[::2, ::2], mv[::2], lv[::2], ov[::2]), want):
        np.testing.assert_allclose(g, w, rtol=8 * np.finfo(dtype).eps, atol=0)
    np.testing.assert_array_equal(sv[1], s[1])          # rows outside the view untouched


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_engine_uses_the_kernel(dtype):
    assert cpu_runtime.tile_kernel(dtype) is tk.online_softmax_tile
    assert cpu_runtime.tile_kernel(dtype, "softmax_rows") is tk.softmax_rows


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (5, 3)},
                                     {"softcap": 2.0}], ids=["plain", "causal", "window",
                                                             "softcap"])
def test_kernel_and_ufunc_engines_agree(dtype, options, rng, monkeypatch):
    """The engine with the kernel and with its ufunc fallback, on non-contiguous inputs with
    several key tiles (Lk not a tile multiple)."""
    q = rng.standard_normal((70, 2, 16)).astype(dtype).transpose(1, 0, 2)[:, ::2] * 3
    k = rng.standard_normal((1200, 2, 16)).astype(dtype).transpose(1, 0, 2)
    v = rng.standard_normal((2, 16, 1200)).astype(dtype).transpose(0, 2, 1)
    got, got_lse = cuonline.attention(q, k, v, return_lse=True, **options)
    monkeypatch.setattr(cpu_runtime, "use_compiled_kernels", False)
    want, want_lse = cuonline.attention(q, k, v, return_lse=True, **options)
    rtol = 50 * np.finfo(dtype).eps
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(got_lse, want_lse, rtol=rtol, atol=rtol)


def test_without_numba_the_ufunc_passes_run(monkeypatch, rng):
    import cuonline.engines

    monkeypatch.setitem(sys.modules, "numba", None)       # import numba fails
    monkeypatch.setitem(sys.modules, "cuonline.engines._tile_kernels", None)
    monkeypatch.delattr(cuonline.engines, "_tile_kernels")
    monkeypatch.setattr(cpu_runtime, "compiled_kernels", {})
    q = rng.standard_normal((3, 40, 8)).astype(np.float32)
    with pytest.warns(RuntimeWarning, match="online_softmax_tile for float32 is unavailable"):
        out = cuonline.attention(q, q, q)
    q64 = q.astype(np.float64)
    with pytest.warns(RuntimeWarning, match="for float64 is unavailable"):
        want = cuonline.attention(q64, q64, q64)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    with pytest.warns(RuntimeWarning, match="softmax_rows"):
        np.testing.assert_allclose(cuonline.softmax(q).sum(-1), 1, rtol=1e-6)


def test_kernel_that_does_not_compile_falls_back(monkeypatch, rng):
    def broken(name, dtype):
        raise RuntimeError("LLVM says no")

    monkeypatch.setattr(tk, "compile_for", broken)
    monkeypatch.setattr(cpu_runtime, "compiled_kernels", {})
    q = rng.standard_normal((2, 30, 8))
    with pytest.warns(RuntimeWarning, match="LLVM says no"):
        out = cuonline.attention(q, q, q)
    monkeypatch.setattr(cpu_runtime, "use_compiled_kernels", False)
    np.testing.assert_array_equal(out, cuonline.attention(q, q, q))


def test_no_writable_cache_compiles_without_one(monkeypatch):
    """numba raises RuntimeError at decoration when no cache directory is writable: the kernel
    is then compiled in each process instead of failing."""
    import numba

    real = numba.njit

    def njit(*args, cache=False, **kwargs):
        if cache:
            raise RuntimeError("cannot cache function: no locator available")
        return real(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", njit)
    fn = tk.compiled(tk._exp_array)
    x = np.array([-1.0, -np.inf], np.float32)
    out = np.empty_like(x)
    fn(x, out)
    np.testing.assert_allclose(out, [np.exp(np.float64(-1.0)), 0.0], rtol=1e-7, atol=0)


def test_compiled_code_is_cached_across_processes(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    code = ("import numpy as np, cuonline; q = np.ones((1, 3, 8), np.float32); "
            "cuonline.attention(q, q, q)")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    index = [f for _, _, files in os.walk(tmp_path) for f in files
             if f.startswith("_tile_kernels._online_softmax_tile") and f.endswith(".nbi")]
    assert index


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normalise_rows_divides_as_the_engine_normalises(dtype, rng):
    """The forward stacks' last step: the bits of numpy._normalised's division (rows that saw
    nothing are 0, a NaN sum gives NaN), and whether the output was finite before."""
    o = rng.standard_normal((6, 13)).astype(dtype)
    l = (rng.random(6) * 40 + 0.5).astype(dtype)
    l[2], o[2] = 0, 0                                 # a row that saw no key
    l[4] = np.nan
    want, _ = numpy_engine._normalised(np.zeros(6, dtype), l.copy(), o.copy(), dtype)
    got = o.copy()
    assert tk.normalise_rows(l, got)
    np.testing.assert_array_equal(got, want)
    for bad in (np.inf, -np.inf, np.nan):
        o[5, 3] = bad
        assert not tk.normalise_rows(l, o.copy())


_CACHE_USE = ("import json, numpy as np; from cuonline.engines import _task_kernels as t; "
              "t.compile_for('forward_stack', np.float32); s = t.forward_stack.stats; "
              "print(json.dumps([sum(s.cache_hits.values()), sum(s.cache_misses.values())]))")


@pytest.mark.slow
def test_the_task_loops_cache_goes_stale_with_the_tile_kernels_file(tmp_path):
    """numba drops a cached function when its own file changes; the task loops inline the
    tile kernels, so an edit of _tile_kernels.py (or cblas.py) must drop theirs too, or they
    run the old tile kernel. A copy of the package is edited, not the one under test."""
    import shutil

    package = tmp_path / "src" / "cuonline"
    shutil.copytree(os.path.dirname(cuonline.__file__), package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(tmp_path / "src"))

    def hits_and_misses():
        run = subprocess.run([sys.executable, "-c", _CACHE_USE], env=env, check=True,
                             timeout=300, capture_output=True, text=True, cwd=tmp_path)
        return json.loads(run.stdout.splitlines()[-1])

    assert hits_and_misses() == [0, 1]                # compiled and saved
    assert hits_and_misses() == [1, 0]                # loaded
    for name in ("_tile_kernels.py", "cblas.py"):
        edited = package / "engines" / name
        edited.write_text(edited.read_text() + "\n# an edit\n")
        assert hits_and_misses() == [0, 1], name      # stale: compiled again
        assert hits_and_misses() == [1, 0], name


# the bits of every compiled path (the forward's stacks and long walks, the backward's, the
# softmax rows; plain, causal, window and ALiBi; float32 and float64), as sha256 digests
_BITS = r"""
import hashlib, json
import numpy as np
import cuonline
from cuonline.engines import _task_kernels
rng = np.random.default_rng(7)
digests = {}
for dtype in (np.float32, np.float64):
    for shape in ((48, 16, 64), (2, 700, 64)):  # stacks of short sequences; long walks
        q, k, v, dout = (rng.standard_normal(shape).astype(dtype) * 3 for _ in range(4))
        slopes = np.linspace(0.05, 0.5, shape[0]).astype(dtype)
        for name, kw in (('plain', {}), ('causal', dict(causal=True)),
                         ('window', dict(window=(200, 5))), ('alibi', dict(alibi_slopes=slopes))):
            out, lse = cuonline.attention(q, k, v, return_lse=True, **kw)
            grads = cuonline.attention_backward(dout, q, k, v, out, lse, **kw)
            h = hashlib.sha256()
            for a in (out, lse, grads.dq, grads.dk, grads.dv):
                h.update(np.ascontiguousarray(a).tobytes())
            digests[f'{np.dtype(dtype).name} {shape} {name}'] = h.hexdigest()
    x = (rng.standard_normal((3, 5, 1300)) * 30).astype(dtype)
    digests[f'{np.dtype(dtype).name} softmax'] = hashlib.sha256(
        cuonline.softmax(x).tobytes()).hexdigest()
stats = _task_kernels.forward_stack.stats
print(json.dumps([digests, sum(stats.cache_hits.values()), sum(stats.cache_misses.values())]))
"""


@pytest.mark.slow
def test_the_bits_are_the_same_in_a_process_that_loads_the_kernels_from_the_cache(tmp_path):
    """A process that compiles the kernels and one that loads them from numba's on-disk cache
    give the same bits on every compiled path. LLVM's code for a kernel can differ between the
    two (an uncached helper with a sum, called from a cached kernel, once summed rows in
    another order there): Dask's worker processes and their client then disagree by an ulp,
    which no test within one process sees."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    def run():
        done = subprocess.run([sys.executable, "-c", _BITS], env=env, check=True, timeout=600,
                              capture_output=True, text=True, cwd=tmp_path)
        return json.loads(done.stdout.splitlines()[-1])

    compiling, loading = run(), run()
    assert compiling[1:] == [0, 2] and loading[1:] == [2, 0]     # one of each dtype
    differ = [case for case in compiling[0] if compiling[0][case] != loading[0][case]]
    assert not differ, differ


def softmax_rows_case(dtype, rng):
    x = (rng.standard_normal((2, 7, 1300)) * 30).astype(dtype)
    x[0, 0] = -np.inf                                   # nothing visible: 0, -inf, -inf
    x[0, 1, 5] = np.nan                                 # NaN row
    x[0, 2, 9] = np.inf                                 # +inf: NaN row, as documented
    x[1, 0] += np.finfo(dtype).max / 4                  # large magnitude: x - m exact
    x[1, 1, :] = x[1, 1, 0]                             # all equal
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp"])
def test_softmax_rows_match_the_ufunc_passes(name, dtype, rng, monkeypatch):
    x = softmax_rows_case(dtype, rng)
    fn = getattr(cuonline, name)
    got = fn(x)
    rtol = 16 * np.finfo(dtype).eps
    # log(total) is exact to a few ulp of total ~ 1 (sums in another order round another way):
    # absolute, where the result is near 0
    atol = np.finfo(dtype).smallest_subnormal if name == "softmax" else 8 * np.finfo(dtype).eps
    # another axis, or a strided last axis: the ufunc passes run, and agree with the kernel
    moved = fn(np.swapaxes(x, 1, 2), axis=1)
    np.testing.assert_allclose(moved if name == "logsumexp" else np.swapaxes(moved, 1, 2), got,
                               rtol=rtol, atol=atol)
    strided = x[:, :, ::2]
    np.testing.assert_allclose(fn(strided), fn(np.ascontiguousarray(strided)), rtol=rtol,
                               atol=atol)
    monkeypatch.setattr(cpu_runtime, "use_compiled_kernels", False)
    want = fn(x)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    if name == "softmax":
        assert (got[0, 0] == 0).all()
    else:
        assert (got[0, 0] == -np.inf).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_log_softmax_rows_subtract_the_max_first(dtype, rng):
    """log_softmax is (x - m) - log(total), not x - (m + log(total)): with every x - m exact
    (x on a grid of 1/8 below m = 2^20), adding m to a row changes nothing, bit for bit, where
    m + log(total) would round at the magnitude of m (an ulp of 1/8 in float32)."""
    kernel = cpu_runtime.tile_kernel(dtype, "softmax_rows")
    d = -rng.integers(0, 200, (5, 300)).astype(dtype) / 8
    d[:, 0] = 0                                         # row max 0 here, 2^20 below
    got, want = np.empty_like(d), np.empty_like(d)
    kernel(d + dtype(2.0 ** 20), got, 1)
    kernel(d, want, 1)
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------------------------
# tile shapes from the machine's caches


@pytest.mark.parametrize("l2", [256 << 10, 512 << 10, 1 << 20, 1280 << 10, 2 << 20, 32 << 20])
@pytest.mark.parametrize("itemsize", [4, 8])
@pytest.mark.parametrize("live", [1, 2])
def test_score_tile_fills_the_l2_and_no_more(l2, itemsize, live):
    rows, keys = cpu_runtime.score_tile(l2, itemsize, live)
    assert rows in (64, 128, 256, 512) and keys in (128, 256, 512, 1024)
    budget = min(l2, cpu_runtime.TILE_L2_BYTES)          # past 1 MiB, 1 MiB of it
    assert rows * keys * itemsize * live <= budget        # the live tiles stay in L2
    # and no larger tile of the same family would: rows first (up to 512), then keys
    if keys < 1024:
        assert rows * keys * 2 * itemsize * live > budget or rows == 64


@pytest.mark.parametrize("l2", [1 << 20, 2 << 20])
def test_score_tile_on_a_1_or_2_mib_l2(l2):
    """The shapes measured on a 1 MiB-L2 core and a 2 MiB-L2 one (docs/performance.md)."""
    assert cpu_runtime.score_tile(l2, 4, 1) == (512, 512)      # forward float32
    assert cpu_runtime.score_tile(l2, 8, 1) == (512, 256)      # forward float64
    assert cpu_runtime.score_tile(l2, 4, 2) == (512, 256)      # backward float32
    assert cpu_runtime.score_tile(l2, 8, 2) == (256, 256)      # backward float64


def test_cache_sizes_are_what_linux_reports():
    caches = cpu_runtime.cache_sizes()
    assert 0 < caches["L1d"] <= caches["L2"] <= caches["L3"]
    index2 = "/sys/devices/system/cpu/cpu0/cache/index2"
    if not os.path.exists(index2):
        pytest.skip("no cache information in /sys here")
    with open(os.path.join(index2, "size")) as f:
        text = f.read().strip()
    units = {"K": 1024, "M": 1024 ** 2}
    size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    with open(os.path.join(index2, "level")) as f:
        assert f.read().strip() == "2"
    assert caches["L2"] == size


def test_block_constants_are_the_float32_tiles():
    """Other engines (the statistics) read BLOCK_Q and BLOCK_K as ints."""
    from cuonline.engines import numpy_backward

    for module in (numpy_engine, numpy_backward):
        assert isinstance(module.BLOCK_Q, int) and isinstance(module.BLOCK_K, int)
        assert module.blocks(np.float32) == (module.BLOCK_Q, module.BLOCK_K)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_engines_take_their_tiles_from_the_l2(dtype, monkeypatch, rng):
    from cuonline.engines import numpy_backward

    small = {"L1d": 32 << 10, "L2": 256 << 10, "L3": 8 << 20}
    for module in (numpy_engine, numpy_backward):
        monkeypatch.setattr(module, "cache_sizes", lambda: dict(small))
    size = np.dtype(dtype).itemsize
    assert numpy_engine.blocks(dtype) == cpu_runtime.score_tile(256 << 10, size, 1)
    assert numpy_backward.blocks(dtype) == cpu_runtime.score_tile(256 << 10, size, 2)
    monkeypatch.setattr(numpy_engine, "BLOCK_K", 32)        # a fixed shape wins
    assert numpy_engine.blocks(dtype)[1] == 32
    # the results on this shape are the oracle's (several query blocks and key tiles)
    q, k, v = (rng.standard_normal((2, 300, 16)).astype(dtype) for _ in range(3))
    out = cuonline.attention(q, k, v, causal=True)
    s = np.einsum("bqd,bkd->bqk", q.astype(np.float64), k.astype(np.float64)) / 4
    s[:, np.triu(np.ones((300, 300), bool), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bqk,bkd->bqd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=1e-4 if dtype == np.float32 else 1e-12,
                               atol=1e-5 if dtype == np.float32 else 1e-12)


def test_finite_tiles_take_the_plain_product(monkeypatch, rng):
    """The per-tile path for non-finite values runs only when one got into the output."""
    calls = []
    careful = numpy_engine.visible_product

    def counted(a, b, visible, *args, **kwargs):
        calls.append(a.shape)
        return careful(a, b, visible, *args, **kwargs)

    monkeypatch.setattr(numpy_engine, "visible_product", counted)
    monkeypatch.setattr(numpy_engine, "BLOCK_K", 32)
    q, k, v = (rng.standard_normal((1, 100, 8)) for _ in range(3))
    cuonline.attention(q, k, v, causal=True)
    assert calls == []
    v[0, 70] = np.nan                                      # seen by rows 70.. only
    out = cuonline.attention(q, k, v, causal=True)
    assert calls                                           # the careful pass ran
    assert np.isfinite(out[0, :70]).all() and np.isnan(out[0, 70:]).all()


# --------------------------------------------------------------------------------------------
# the backward tile


def backward_case(dtype, rng, n=9, k=70):
    s = (rng.standard_normal((n, k)) * 4).astype(dtype)
    s[1, :30] = -np.inf                                  # masked keys
    lse = (np.log(np.exp(s.astype(np.float64)).sum(1)) + 0.25).astype(dtype)   # >= row max
    lse[2] = np.inf                                      # a row that sees nothing
    dp = rng.standard_normal((n, k)).astype(dtype)
    delta = rng.standard_normal(n).astype(dtype)
    return s, lse, dp, delta


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_tile_matches_the_ufunc_passes(dtype, rng):
    s, lse, dp, delta = backward_case(dtype, rng)
    p, ds, sums = s.copy(), dp.copy(), np.empty(len(s), dtype)
    assert tk.backward_tile(p, lse, ds, delta, sums) == 1
    want_p = np.exp(s - lse[:, None])
    want_ds = want_p * (dp - delta[:, None])
    eps = np.finfo(dtype).eps
    np.testing.assert_allclose(p, want_p, rtol=4 * eps, atol=0)
    np.testing.assert_allclose(ds, want_ds, rtol=8 * eps, atol=np.finfo(dtype).tiny)
    np.testing.assert_allclose(sums, want_p.sum(1), rtol=8 * eps)
    assert (p[1, :30] == 0).all() and (p[2] == 0).all() and (ds[2] == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_tile_leaves_rows_above_their_lse_to_the_caller(dtype, rng):
    """exp of a positive argument is outside the kernel's exponential: nothing is written."""
    s, lse, dp, delta = backward_case(dtype, rng)
    for bad in (s.max(1)[4] - 1, np.nan):
        lse_bad = lse.copy()
        lse_bad[4] = bad
        p, ds = s.copy(), dp.copy()
        assert tk.backward_tile(p, lse_bad, ds, delta, np.empty(len(s), dtype)) == 0
        np.testing.assert_array_equal(p, s)
        np.testing.assert_array_equal(ds, dp)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_tile_reports_a_non_finite_gradient(dtype, rng):
    s, lse, dp, delta = backward_case(dtype, rng)
    dp[1, 3] = np.nan                                      # behind the mask: 0 * NaN
    assert tk.backward_tile(s.copy(), lse, dp.copy(), delta, np.empty(len(s), dtype)) == 2
    dp[1, 3] = 0
    dp[5, 7] = np.inf
    assert tk.backward_tile(s.copy(), lse, dp.copy(), delta, np.empty(len(s), dtype)) == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"softcap": 2.0}],
                         ids=["plain", "causal", "softcap"])
def test_backward_with_and_without_the_kernel_agree(dtype, options, rng, monkeypatch):
    q, k, v = (rng.standard_normal((2, 300, 16)).astype(dtype) for _ in range(3))
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(dtype)
    got = cuonline.attention_backward(dout, q, k, v, out, lse, **options)
    monkeypatch.setattr(cpu_runtime, "use_compiled_kernels", False)
    want = cuonline.attention_backward(dout, q, k, v, out, lse, **options)
    tol = 200 * np.finfo(dtype).eps
    for g, w in zip((got.dq, got.dk, got.dv), (want.dq, want.dk, want.dv)):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())


def spans_of_crossed_tiles(engine, monkeypatch):
    """64 x 64 tiles and groups of 16 rows in ``engine``; returns the list that receives what
    every ``ScorePipeline.row_spans`` call returns."""
    monkeypatch.setattr(engine, "BLOCK_Q", 64)
    monkeypatch.setattr(engine, "BLOCK_K", 64)
    monkeypatch.setattr(engine, "SPAN_ROWS", 16)
    spans = []
    real = ScorePipeline.row_spans

    def recorded(self, *args):
        out = real(self, *args)
        spans.append(out)
        return out

    monkeypatch.setattr(ScorePipeline, "row_spans", recorded)
    return spans


@pytest.mark.parametrize("options", [{"causal": True}, {"window": (40, 9)},
                                     {"causal": True, "q_offset": 50}],
                         ids=["causal", "window", "offset"])
def test_products_over_the_visible_columns_only(options, rng, monkeypatch):
    """Tiles the window band crosses multiply each group of rows by the keys it may see
    only; the result is the whole-tile products' (up to the order of P·V's sums). The
    engine's Python loop (the compiled walk takes the same spans: test_task_kernels.py)."""
    monkeypatch.setattr(numpy_engine, "_compiled_walk", lambda *args: None)
    spans = spans_of_crossed_tiles(numpy_engine, monkeypatch)
    q, k, v = (rng.standard_normal((2, 200, 8)) for _ in range(3))
    got = cuonline.attention(q, k, v, **options)
    used = [s for s in spans if s is not None]
    assert used                                           # some tile took the spans
    assert all(c0 <= c1 for s in used for _, _, c0, c1 in s)
    assert any(c1 - c0 < 64 for s in used for _, _, c0, c1 in s)
    monkeypatch.setattr(ScorePipeline, "row_spans", lambda *args: None)  # one product a tile
    np.testing.assert_allclose(got, cuonline.attention(q, k, v, **options), rtol=1e-13,
                               atol=1e-13)


@pytest.mark.parametrize("rows, most, want", [(512, 128, 128), (256, 128, 64), (128, 128, 32),
                                              (64, 128, 16), (40, 128, 16), (16, 128, 16),
                                              (512, 16, 16), (100, 10**9, 25)])
def test_a_crossed_tile_is_cut_into_four_groups_of_rows(rows, most, want):
    assert group_rows(rows, most) == want


def test_a_short_causal_tile_multiplies_each_quarter_of_its_rows_by_the_keys_it_sees(
        rng, monkeypatch):
    # 128 queries and keys: one tile, the causal diagonal; four groups of 32 rows, group g
    # multiplied by keys [0, 32 (g + 1)) (one group of 128 rows, before: the whole tile)
    monkeypatch.setattr(numpy_engine, "_compiled_walk", lambda *args: None)  # the Python loop
    monkeypatch.setattr(numpy_engine, "BLOCK_Q", 512)
    monkeypatch.setattr(numpy_engine, "BLOCK_K", 512)
    spans = []
    real = ScorePipeline.row_spans
    monkeypatch.setattr(ScorePipeline, "row_spans",
                        lambda self, *args: spans.append(real(self, *args)) or spans[-1])
    q, k, v = (rng.standard_normal((128, 16)).astype(np.float32) for _ in range(3))
    out = cuonline.attention(q, k, v, causal=True)
    assert spans == [[(32 * g, 32 * g + 32, 0, 32 * g + 32) for g in range(4)]]
    monkeypatch.setattr(ScorePipeline, "row_spans", lambda *args: None)  # one product a tile
    np.testing.assert_allclose(out, cuonline.attention(q, k, v, causal=True), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("options", [{"causal": True}, {"window": (40, 9)}],
                         ids=["causal", "window"])
def test_backward_products_over_the_visible_columns_only(options, rng, monkeypatch):
    """The backward's five products over the spans of a crossed tile: the whole-tile
    products' gradients (up to the order of sums), and the same bits for every workers and
    every plan (one task per group, or key-block and query-block tasks)."""
    from cuonline.engines import numpy_backward

    # the Python loop (the compiled blocks take the same spans: test_task_kernels.py)
    monkeypatch.setattr(numpy_backward, "_compiled_block", lambda *args: 0)
    spans = spans_of_crossed_tiles(numpy_backward, monkeypatch)
    q, k, v = (rng.standard_normal((2, 200, 8)) for _ in range(3))
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape)
    runs = {}
    for cores, workers in ((1, 1), (1, 2), (64, 2)):
        monkeypatch.setattr(numpy_backward, "workers", lambda cores=cores: cores)
        runs[cores, workers] = cuonline.attention_backward(dout, q, k, v, out, lse,
                                                           workers=workers, **options)
    assert any(s is not None for s in spans)
    first = runs[1, 1]
    for other in runs.values():
        for name in ("dq", "dk", "dv"):
            assert getattr(first, name).tobytes() == getattr(other, name).tobytes(), name
    monkeypatch.setattr(ScorePipeline, "row_spans", lambda *args: None)  # one product a tile
    whole = cuonline.attention_backward(dout, q, k, v, out, lse, **options)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(getattr(first, name), getattr(whole, name), rtol=1e-12,
                                   atol=1e-12)


def test_machine_names_what_a_figure_depends_on():
    import llvmlite.binding as llvm
    from threadpoolctl import threadpool_info

    info = cpu_runtime.machine()
    assert info["cpu"] and info["cores"] == cpu_runtime.workers()
    assert info["numba"].startswith(llvm.get_host_cpu_name())
    assert info["caches"] == cpu_runtime.cache_sizes()
    for lib in threadpool_info():
        if lib["user_api"] == "blas":
            assert f"({lib.get('architecture') or 'unknown'} kernels" in info["blas"]


def test_benchmark_preamble_prints_the_machine(monkeypatch, capsys):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    import bench_cpu

    bench_cpu.print_machine("test", {"float32": 1.0, "float64": 2.0}, with_torch=False)
    lines = capsys.readouterr().out.splitlines()
    assert "CPU " in lines[0] and "load average" in lines[0]
    assert lines[1].startswith("BLAS: ") and lines[2].startswith("cuonline's products: ")
    assert lines[3].startswith("BLAS ceiling")
    assert "numba target" in lines[4]
    rows, keys = numpy_engine.blocks(np.float32)
    assert lines[5].startswith("caches per core: L1d")
    assert f"float32 forward {rows}x{keys}" in lines[5]
    assert lines[6].startswith("times: the best of")



# For each kernel and dtype, each compiled function's {mnemonic: number of basic blocks that
# run it on zmm registers}, for the mnemonics that mark one loop each: the exponential's shift
# of n into the exponent field (vpslld), the row max (vmaxp), softmax's division (vdivp) and
# log_softmax's two subtractions (vsubp: in _softmax_rows itself, since _exp_sum is a separate
# function). Printed as JSON by a fresh process: numba shows no assembly of cached code.
_ZMM_BLOCKS = r"""
import json, re, sys
import numpy as np
from cuonline.engines import cpu_runtime
counts = {}
for dtype in (np.float32, np.float64):
    for name in ('online_softmax_tile', 'backward_tile', 'softmax_rows', 'backward_block',
                 'forward_stack', 'backward_stack'):
        asm = ''.join(cpu_runtime.tile_kernel(dtype, name).inspect_asm().values())
        functions = counts.setdefault(f'{name} {np.dtype(dtype).name}', {})
        function = block = None
        for line in asm.splitlines():
            label = re.match(r'(\S+):', line)
            if label and not label[1].startswith('.'):
                # numba's mangled names: _ZN8cuonline7engines13_tile_kernels13_softmax_rowsB...
                named = re.search(r'^_ZN8cuonline.*?_t(?:ile|ask)_kernels(\d+)', label[1])
                function = (label[1][named.end():named.end() + int(named[1])] if named
                            else None)
            if label:
                block = label[1]
            ops = re.match(r'\s+(vpslld|vmaxp|vdivp|vsubp)', line)
            if function and ops and '%zmm' in line:
                seen = functions.setdefault(function, {}).setdefault(ops[1], [])
                seen.append(block) if block not in seen else None
json.dump({k: {f: {op: len(b) for op, b in ops.items()} for f, ops in fs.items()}
           for k, fs in counts.items()}, sys.stdout)
"""


@pytest.mark.slow
@pytest.mark.skipif(tk._VECTOR_BITS is None, reason="numba compiles for a CPU without AVX-512")
def test_kernels_use_the_full_vector_width(tmp_path):
    """On an AVX-512 CPU the kernels' loops run on 512-bit registers, not on the 256 bits LLVM
    prefers for Intel cores (1.5x on the forward tile, docs/performance.md), and not scalar:
    each loop's own arithmetic is on zmm registers in the assembly numba makes. An arithmetic
    fence once left the exponential's loop scalar, and another the log_softmax loop."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", _ZMM_BLOCKS], env=env, check=True,
                         timeout=300, capture_output=True, text=True)
    counts = json.loads(run.stdout)
    for dtype in ("float32", "float64"):
        for name in ("online_softmax_tile", "backward_tile"):
            found = counts[f"{name} {dtype}"]
            assert any(ops.get("vpslld") for ops in found.values()), (name, dtype, found)
        # the task loops (_task_kernels.py) call them: inlined or not, still at full width
        for name in ("backward_block", "forward_stack", "backward_stack"):
            found = counts[f"{name} {dtype}"]
            assert any(ops.get("vpslld") for ops in found.values()), (name, dtype, found)
        rows = counts[f"softmax_rows {dtype}"]
        assert rows["_softmax_rows"].get("vmaxp"), rows            # row max: every mode
        assert rows["_softmax_rows"].get("vdivp"), rows            # softmax: x / total
        assert rows["_softmax_rows"].get("vsubp"), rows            # log_softmax
        # _exp_sum's two loops: exp written out (softmax), exp summed only (the other two)
        assert rows["_exp_sum"].get("vpslld", 0) >= 2, rows


def test_the_walks_flush_subnormals_and_give_the_mode_back(rng):
    """Within flush_subnormals a product whose result is below the smallest normal number is
    0 (on x86-64; elsewhere the modes are left alone); after restore_subnormals, and after
    a call of the engine on either thread count, this thread rounds to subnormals again."""
    import numba

    @numba.njit
    def products(x, y, out):
        # arrays, as in the kernels: LLVM keeps memory in order around the mode's switches
        # (a product of two scalars it moved past them)
        old = tk.flush_subnormals()
        for i in range(x.shape[0]):
            out[0, i] = x[i] * y[i]
        tk.restore_subnormals(old)
        for i in range(x.shape[0]):
            out[1, i] = x[i] * y[i]

    x, y = np.full(40, 1e-30, np.float32), np.full(40, 1e-10, np.float32)
    out = np.empty((2, 40), np.float32)
    products(x, y, out)
    assert (out[1] == x * y).all() and (out[1] > 0).all()          # 1e-40: subnormal
    assert (out[0] == (0 if tk._X86 else out[1])).all()
    q = (rng.standard_normal((4, 300, 16)) * 6).astype(np.float32)   # sharp: tiny weights
    for workers in (1, 2):
        cuonline.attention(q, q, q, workers=workers)
        cuonline.attention_backward(q, q, q, q, *cuonline.attention(q, q, q, return_lse=True),
                                    workers=workers)
        assert np.float32(1e-30) * np.float32(1e-10) > 0
