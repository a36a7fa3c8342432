"""softmax, log_softmax and logsumexp on the CUDA kernel (kernels_cu/softmax.cu), emulated on the
CPU and, marked ``gpu``, on CuPy arrays; a ThreadSanitizer build of the emulated kernel.

Every case runs through the public functions (``backend="emulate"`` / ``"cupy"``), or the
engine :func:`cuonline.engines.cuda_softmax.run` under the named seam
:func:`cuonline.engines.target.overrides` (to force the kernel's row loop and the host's row
chunking), and is compared with a float64 oracle built on ``scipy.special`` and with the
NumPy engine (``backend="numpy"``). Emulated variants cost ~2 s each to build cold, so the
dtype x mode x mask grid is sampled, not crossed (NVRTC compiles all of it:
test_kernels_nvrtc.py).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import scipy.special
from support import BFLOAT16, check_races, cuda_backend_params, needs_emulation

import cuonline
from cuonline._validate import validate_axis_input
from cuonline.engines import cuda_softmax
from cuonline.engines.target import overrides
from cuonline.kernels import families, softmax_plan, source
from cuonline.kernels.launch import Launch
from cuonline.kernels.specs import SOFTMAX_MODES, SoftmaxSpec

pytestmark = pytest.mark.slow   # the fast tier (-m 'not slow') leaves it out

MODES = tuple(SOFTMAX_MODES)   # "softmax", "log_softmax", "logsumexp"
FUNCTIONS = {"softmax": cuonline.softmax, "log_softmax": cuonline.log_softmax,
             "logsumexp": cuonline.logsumexp}

BACKENDS = cuda_backend_params()


# --------------------------------------------------------------------------------------------
# running and checking


def _put(backend, a):
    if a is None or backend != "cupy":
        return a
    import cupy  # noqa: PLC0415

    return cupy.asarray(a)


def _get(a):
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a


def run(backend, mode, x, axis=-1, mask=None, **kwargs):
    """The public function on ``backend``; NumPy result."""
    return _get(FUNCTIONS[mode](_put(backend, x), axis=axis, mask=_put(backend, mask),
                                backend=backend, **kwargs))


def run_seam(backend, mode, x, axis=-1, mask=None, scale=1.0, **seams):
    """:func:`cuda_softmax.run` with the target's ``seams`` (:func:`overrides`) and the
    problem's ``scale``; NumPy result."""
    p = validate_axis_input(_put(backend, x), axis, _put(backend, mask), backend, mode=mode)
    with overrides(**seams):
        return _get(cuda_softmax.run(dataclasses.replace(p, scale=scale)))


def plan(dtype, mode, has_mask, n, nrows, **knobs):
    """:func:`softmax_plan.plan_softmax` of a problem with rows of ``n`` columns."""
    x = np.broadcast_to(np.zeros((), dtype), (1, n))     # the planner reads shapes and dtypes
    mask = np.broadcast_to(True, (1, n)) if has_mask else None
    return softmax_plan.plan_softmax(validate_axis_input(x, -1, mask, "emulate", mode=mode),
                                     Launch(nrows=nrows, **knobs))


def oracle(mode, x, axis=-1, mask=None, keepdims=False, scale=1.0):
    """float64 reference from scipy.special; empty slices give 0 / -inf (not NaN)."""
    x = scale * np.asarray(x, dtype=np.float64)
    if mask is not None:
        x = np.where(mask, x, -np.inf)
    if x.shape[axis] == 0:   # nothing visible; scipy's softmax cannot reduce an empty axis
        lse = np.full(x.shape[:axis % x.ndim] + (1,) + x.shape[axis % x.ndim + 1:], -np.inf)
        if mode == "logsumexp":
            return lse if keepdims else np.squeeze(lse, axis)
        return np.empty(x.shape)
    with np.errstate(all="ignore"):
        lse = scipy.special.logsumexp(x, axis=axis, keepdims=True)
        empty = np.isneginf(lse)
        if mode == "logsumexp":
            return lse if keepdims else np.squeeze(lse, axis)
        if mode == "softmax":
            return np.where(empty, 0.0, scipy.special.softmax(x, axis=axis))
        return np.where(empty, -np.inf, scipy.special.log_softmax(x, axis=axis))


# The softmax family's error allowed against scipy's float64 softmax, relative to the value
# (absolute below 1): a few ulp of float32 accumulation, and the output's rounding for 16-bit.
# oracle.py has no naive softmax yet to hold these to the attention's accuracy rule.
SOFTMAX_TOLERANCE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 2e-5,
                     np.dtype(np.float16): 4e-3}
if BFLOAT16 is not None:
    SOFTMAX_TOLERANCE[BFLOAT16] = 3e-2


def assert_matches(got, want, dtype, slack=0.0):
    """Same shape, dtype; NaN and infinities at the same places; finite values within the
    dtype's tolerance (relative for large values) plus ``slack``."""
    got = np.asarray(got)
    assert got.dtype == np.dtype(dtype), (got.dtype, dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    got = got.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), "NaN positions differ")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), "+inf positions differ")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), "-inf positions differ")
    finite = np.isfinite(want)
    tol = SOFTMAX_TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(got[finite], want[finite], rtol=tol, atol=tol + slack)


def check(backend, mode, x, axis=-1, mask=None, **kwargs):
    """Kernel vs the scipy oracle and vs the NumPy engine."""
    got = run(backend, mode, x, axis, mask, **kwargs)
    assert_matches(got, oracle(mode, x, axis, mask, **kwargs), x.dtype)
    assert_matches(got, numpy_engine(mode, x, axis, mask, **kwargs), x.dtype,
                   slack=_numpy_engine_error(x))
    return got


def numpy_engine(mode, x, axis=-1, mask=None, **kwargs):
    with np.errstate(all="ignore"):   # its +inf rows warn (inf - inf); the values are the contract
        return FUNCTIONS[mode](x, axis=axis, mask=mask, backend="numpy",
                               **kwargs).astype(np.float64)


def _numpy_engine_error(x):
    """The NumPy engine forms log_softmax as x - (m + log l): at |x| ~ 1e4 in float32 that
    rounds to ~1e-3, where the kernel's (x - m) - log l stays exact."""
    finite = np.abs(x[np.isfinite(x)].astype(np.float64))
    acc = np.float64 if x.dtype == np.float64 else np.float32
    return 4 * np.finfo(acc).eps * float(finite.max(initial=0.0))


def data(shape, dtype=np.float32, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale).astype(dtype)


# --------------------------------------------------------------------------------------------
# row lengths: one warp per row up to 1024 columns, then 2, 4, 8 warps merged in shared memory


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [1, 17, 31, 32, 33, 1000, 1500, 3000, 4097])
def test_row_lengths(backend, mode, n):
    check(backend, mode, data((3, n), seed=n))


def test_row_lengths_cover_every_block_shape():
    shapes = {plan(np.float32, "softmax", False, n, 3).warps_per_row
              for n in (1, 17, 31, 32, 33, 1000, 1500, 3000, 4097)}
    assert shapes == {1, 2, 4, 8}


# --------------------------------------------------------------------------------------------
# long rows, few of them: cut into segments (statistics per segment, then merge and write)


def test_long_rows_are_cut_only_when_the_grid_would_be_too_small():
    few = plan(np.float32, "softmax", False, 10**6, 2, num_sms=132)
    assert few.segments == 61 and few.seg_len * few.segments >= 10**6   # 2 x 132 blocks
    assert (few.segments - 1) * few.seg_len < 10**6                     # no empty segment
    assert plan(np.float32, "softmax", False, 10**6, 10**4).segments == 1   # rows fill the GPU
    assert plan(np.float32, "softmax", False, 30000, 2).segments == 1       # too short to cut
    assert plan(np.float32, "softmax", False, 10**9, 1).segments == 264


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_segmented_rows_match_the_oracle(backend, mode):
    """Rows cut into 5 segments of 820 columns (3 rows of 4097, 8 SMs): masked and -inf
    columns, a segment with nothing visible, a fully masked row."""
    x = data((3, 4097), seed=5)
    x[0, 820:1640] = -np.inf                # segment 1 of row 0 sees only -inf
    mask = np.ones(x.shape, bool)
    mask[1, ::3] = False
    mask[2] = False                         # nothing visible: 0 / -inf
    seams = dict(min_segment=700, num_sms=8)
    cut = plan(np.float32, mode, True, 4097, 3, num_sms=8, min_segment=700)
    assert cut.segments == 5 and cut.seg_len == 820
    for m in (None, mask):
        got = run_seam(backend, mode, x, -1, m, **seams)
        assert_matches(got, oracle(mode, x, -1, m), x.dtype)


# --------------------------------------------------------------------------------------------
# axes and views: the kernel reads x through its strides (no copy)


def _views():
    base = data((6, 5, 40), seed=1)
    return {
        "contiguous": base,
        "transposed": base.transpose(2, 0, 1),
        "reversed": base[::-1, :, ::-1],
        "stepped": base[::2, 1:, ::3],
        "broadcast": np.broadcast_to(base[:1, :1, :], (3, 4, 40)),   # zero strides
    }


VIEWS = _views()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_axes_and_strided_views(backend, mode, view, axis):
    check(backend, mode, VIEWS[view], axis=axis)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("axis", [0, 2])
def test_logsumexp_keepdims(backend, axis):
    x = data((4, 3, 50), seed=2)
    got = check(backend, "logsumexp", x, axis=axis, keepdims=True)
    assert got.shape == x.shape[:axis] + (1,) + x.shape[axis + 1:]


# --------------------------------------------------------------------------------------------
# dtypes (float32 throughout the rest of the file)

DTYPE_MODES = [(np.float64, mode) for mode in MODES] + [(np.float16, "softmax")]
if BFLOAT16 is not None:
    DTYPE_MODES.append((BFLOAT16, "log_softmax"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, mode", DTYPE_MODES,
                         ids=[f"{np.dtype(t).name}-{m}" for t, m in DTYPE_MODES])
def test_dtypes(backend, dtype, mode):
    # one short and one multi-warp row length; axis 0 is a strided column
    for shape, axis in (((5, 33), -1), ((2100, 3), 0)):
        check(backend, mode, data(shape, dtype, seed=len(shape)), axis=axis)


# --------------------------------------------------------------------------------------------
# masks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_broadcast_masks_and_all_masked_rows(backend, mode):
    rng = np.random.default_rng(3)
    x = data((4, 6, 70), seed=3)
    row_mask = rng.random((4, 1, 70)) < 0.6      # broadcast over axis 1
    row_mask[1] = False                          # every row of x[1] fully masked
    check(backend, mode, x, axis=-1, mask=row_mask)
    col_mask = rng.random((6, 1)) < 0.5          # broadcast over axes 0 and 2
    col_mask[0] = False
    check(backend, mode, x, axis=1, mask=col_mask)
    # a long masked row: several warps, one of which sees only masked values
    long_x = data((2, 3000), seed=4)
    long_mask = np.ones((2, 3000), bool)
    long_mask[0, :2500] = False
    long_mask[1] = False
    check(backend, mode, long_x, mask=long_mask)


# --------------------------------------------------------------------------------------------
# special values and magnitudes


def _special_rows(n):
    x = data((9, n), seed=5)
    x[0] = -np.inf                    # empty: softmax 0, log_softmax/logsumexp -inf
    x[1, ::3] = -np.inf               # some -inf: weight 0
    x[2, n // 2] = np.nan             # NaN: the row is NaN
    x[3, -1] = np.inf                 # +inf: NaN, as NumPy's max-then-exp gives
    x[4, 0], x[4, -1] = np.inf, -np.inf
    x[5] = np.inf
    x[6] = np.nan
    x[7, 0], x[7, 1:] = np.nan, -np.inf
    return x                          # row 8 stays ordinary


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [5, 1500])
def test_inf_and_nan_rows(backend, mode, n):
    x = _special_rows(n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run(backend, mode, x)
    assert_matches(got, numpy_engine(mode, x), x.dtype)  # the contract: max-then-exp
    if mode == "softmax":
        assert np.all(got[0] == 0) and np.isfinite(got[[1, 8]]).all()
        assert np.isnan(got[2:8]).all()
        np.testing.assert_allclose(got[[1, 8]].sum(axis=-1), 1, rtol=1e-5)
    # scipy agrees on softmax; its log_softmax/logsumexp give -inf/+inf where NumPy's
    # max-then-exp gives NaN (rows with +inf), so compare it on the other rows only
    ordinary = [0, 1, 2, 6, 7, 8]
    assert_matches(got[ordinary], oracle(mode, x[ordinary]), x.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_huge_magnitudes_in_float32(backend, mode):
    spread = data((4, 300), seed=6, scale=1e4)                    # gaps of thousands
    offset = (1e4 + data((4, 300), seed=7, scale=1.0)).astype(np.float32)   # x - m is small
    for x in (spread, offset, -offset):
        check(backend, mode, x)


# --------------------------------------------------------------------------------------------
# seams: the kernel's row loop, the host's row chunking, scale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [40, 3000], ids=["warp-rows", "block-rows"])
def test_grid_stride_row_loop(backend, mode, n):
    x = data((21, n), seed=8)
    got = run_seam(backend, mode, x, max_blocks=1)   # one block walks all 21 rows
    assert_matches(got, oracle(mode, x), x.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("limit", [1, 4, 7])
def test_row_chunks_across_launches(backend, limit):
    rng = np.random.default_rng(9)
    x = data((3, 5, 4, 20), seed=9).transpose(1, 0, 3, 2)
    mask = rng.random((5, 1, 20, 1)) < 0.7
    for mode in MODES:
        got = run_seam(backend, mode, x, axis=2, mask=mask, max_rows_per_launch=limit)
        want = oracle(mode, x, axis=2, mask=np.broadcast_to(mask, x.shape))
        assert_matches(got, want, x.dtype)


def test_row_chunks_cover_every_row_once():
    for shape in ((3, 5, 4, 20), (1, 7, 2), (11, 2)):
        for limit in (1, 2, 3, 7, 10**9):
            seen = np.zeros(shape[:-1], int)
            for index in cuda_softmax._row_chunks(shape, limit):
                block = seen[index]
                assert block.size <= limit
                seen[index] += 1
            assert np.all(seen == 1), (shape, limit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_is_folded_into_the_exponent(backend):
    x = data((3, 50), seed=10)
    for mode in MODES:
        got = run_seam(backend, mode, x, scale=0.37)
        assert_matches(got, oracle(mode, x, scale=0.37), x.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, axis", [((3, 0), 1), ((0, 4), 1), ((2, 0, 3), 0)])
def test_empty_arrays_launch_nothing(backend, shape, axis):
    x = np.zeros(shape, np.float32)
    for mode in MODES:
        got = run(backend, mode, x, axis=axis)
        assert_matches(got, oracle(mode, x, axis=axis), x.dtype)


# --------------------------------------------------------------------------------------------
# dispatch, plan, listing, a broken kernel


def test_numpy_arrays_keep_the_numpy_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the CUDA engine ran for a NumPy array without backend='emulate'")

    monkeypatch.setattr(cuda_softmax, "run", refuse)
    x = data((3, 7))
    for mode in MODES:
        for backend in ("auto", "numpy"):
            FUNCTIONS[mode](x, backend=backend)


def test_plan_is_a_pure_function_of_the_shape():
    for n in (1, 1024, 1025, 2049, 4097, 10**6):
        for dtype in (np.float16, np.float64):
            launch = plan(dtype, "log_softmax", True, n, 10**7)
            assert launch.warps_per_row * launch.rows_per_block * 32 == launch.block[0] == 256
            assert n <= 1024 * launch.warps_per_row or launch.warps_per_row == 8
            assert launch.grid == (softmax_plan.MAX_BLOCKS, 1, 1)
            tag = "f16" if dtype == np.float16 else "f64"
            assert launch.spec.key == f"softmax_{tag}_logsoftmax_mask"
    assert plan(np.float32, "softmax", False, 10, 3).grid == (1, 1, 1)


def test_every_variant_is_in_the_nvrtc_listing():
    keys = {s.key for s in families.listing_specs()}
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        acc = "float64" if dtype == "float64" else "float32"
        for mode in MODES:
            for mask in (False, True):
                assert SoftmaxSpec(dtype=dtype, acc=acc, mode=mode, mask=mask).key in keys
    assert "softmax_f32_logsoftmax_mask" in keys


def test_source_has_the_variant_defines():
    text = source.build_source(SoftmaxSpec("float16", "float32", "logsumexp", True))
    assert "#define CUONLINE_T __half" in text and "#define CUONLINE_SOFTMAX_MODE 2" in text
    assert "struct OnlineNormalizer" in text and 'extern "C" __global__' in text


@needs_emulation
def test_a_kernel_without_the_rescale_fails():
    """The tests above catch a normalizer that never rescales l when the maximum grows."""
    common = source.read_kernel_file("common.cuh")
    rescale = "        l *= exp2_((m - m_use) * scale_log2);\n"
    assert common.count(rescale) == 1
    broken = {"common.cuh": common.replace(rescale, "")}
    x = np.sort(data((3, 300), seed=11), axis=-1)   # the maximum grows at every chunk
    got = run_seam("emulate", "softmax", x, kernel_sources=broken)
    assert np.abs(got - oracle("softmax", x)).max() > 100 * SOFTMAX_TOLERANCE[np.dtype(np.float32)]


# --------------------------------------------------------------------------------------------
# races: ThreadSanitizer on the cross-warp merge, and on a copy without its first barrier

_TSAN_SCRIPT = """
import numpy as np
import cuonline
from cuonline.engines.target import overrides
x = np.random.default_rng(0).standard_normal((3, 3000)).astype(np.float32)  # 4 warps per row
with overrides(max_blocks=1, kernel_sources={sources!r}, emulate_options=dict(tsan=True)):
    out = cuonline.softmax(x, axis=1, backend="emulate")
print("DONE", float(np.abs(out.sum(axis=1) - 1).max()))
"""
# Without it, a warp can overwrite its s_m/s_l slot for the next row while another warp of the
# block still merges the previous row's.
_FIRST_BARRIER = "                __syncthreads();      // the previous row's reads of s_m/s_l are done\n"


@pytest.mark.parametrize("broken", [False, True], ids=["correct", "no_first_barrier"])
def test_thread_sanitizer(broken):
    sources = None
    if broken:
        text = source.read_kernel_file("softmax.cu")
        assert text.count(_FIRST_BARRIER) == 1
        sources = {"softmax.cu": text.replace(_FIRST_BARRIER, "")}
    check_races(_TSAN_SCRIPT.format(sources=sources), expect_race=broken)
