"""Compiled element-wise kernels of the NumPy engine (numba), imported on first use.

The NumPy engine spends as long on the passes over each score tile (row max, subtract, exp,
row sum: one full pass each) as on its two matrix products. :func:`online_softmax_tile` does all
of them in two sweeps over each row while the row is in L1: one for the max, one that writes
``exp(s - m)`` in place and sums it; :func:`backward_tile` does the backward's ``P`` and ``dS``
in one sweep after a check of the row max; :func:`normalise_rows` divides a finished output by
its row sums. The matrix products stay in BLAS.

``math.exp`` compiles to a scalar libm call per element (LLVM vectorizes it only with Intel's
SVML), which is slower than NumPy's ufunc, so the exponential is written here in arithmetic that
LLVM vectorizes: Cody-Waite range reduction ``x = n ln2 + r`` with ``|r| <= ln2 / 2``, ``n`` and
the exponent bits of ``2^n`` both read off one rounding by a "magic" addition, a minimax
polynomial for ``e^r`` (degree 6 for float32, 11 for float64: truncation below a twentieth of an
ulp), and a single product of the polynomial, scaled by ``2^-64``, and ``2^(n + 64)`` (a normal
number down to the smallest subnormal result), so that results in the subnormal range round
once, as ``np.exp``'s do. About 15 vector operations per vector of results. It is only ever called
on ``x <= 0`` (a score minus its row max), ``-inf`` or NaN: ``exp(-inf)`` is exactly 0 and NaN
stays NaN. The attention tile kernels take it as a weight (``exp_weight``): 0 below
``WEIGHT_FLOOR`` (-87.3 in float32, -708.3 in float64), where the result would be subnormal or
close to it. A subnormal result costs a microcode assist on x86 cores (about 2.4 ns per float32
result on machine C, against 0.27 ns), and a weight that small changes no sum in its dtype
(each row's largest weight is 1). The softmax rows keep the subnormal results, as ``np.exp``
does.

Fast-math flags: ``reassoc`` lets the row sum vectorize (the order of a sum is not part of the
contract; NumPy's pairwise sum has its own) and ``contract`` allows FMAs, but neither ``nnan``
nor ``ninf``: NaN and ``-inf`` are values this code must get right, nor ``arcp``: a division
stays a division. Where an expression's order matters, the function that holds it is compiled
without ``reassoc`` (numba keeps a callee's own flags; LLVM does not vectorize a loop that
holds ``llvm.arithmetic.fence``).
The range reduction and the polynomial use explicit ``llvm.fma`` calls, which reassociation
cannot rewrite, and the max uses ``llvm.maximum``, which propagates NaN as ``np.maximum`` does
and still vectorizes.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

# the fast-math flags of the compiled kernels (the module docstring says why these)
FASTMATH = {"reassoc", "contract", "nsz"}


def _ll(t):
    return ir.FloatType() if t == types.float32 else ir.DoubleType()


def _llvm_call(name, nargs):
    """An intrinsic ``name(x, ...)`` on ``nargs`` floats of one dtype (float32 or float64)."""

    def typer(typingctx, *args):
        if len(args) != nargs or len(set(args)) != 1 or args[0] not in (types.float32,
                                                                          types.float64):
            return None
        t = args[0]

        def codegen(context, builder, sig, llargs):
            fnty = ir.FunctionType(_ll(t), [_ll(t)] * nargs)
            fn = builder.module.declare_intrinsic(name, [_ll(t)], fnty)
            return builder.call(fn, llargs)

        return t(*args), codegen

    typer.__name__ = name.replace(".", "_")
    return typer


# written out, not generated in a loop: @intrinsic needs a fixed Python signature per arity
@intrinsic
def _fma(typingctx, a, b, c):
    return _llvm_call("llvm.fma", 3)(typingctx, a, b, c)


@intrinsic
def _maximum(typingctx, a, b):
    return _llvm_call("llvm.maximum", 2)(typingctx, a, b)


@intrinsic
def _shift_into_exponent(typingctx, z):
    """The float whose bits are those of ``z`` shifted left by the dtype's mantissa width: the
    low bits of ``z``'s significand become the exponent field."""
    widths = {types.float32: 23, types.float64: 52}
    if z not in widths:
        return None

    def codegen(context, builder, sig, args):
        it = ir.IntType(32 if z == types.float32 else 64)
        bits = builder.shl(builder.bitcast(args[0], it), it(widths[z]))
        return builder.bitcast(bits, _ll(z))

    return z(z), codegen


def _widest_vector_bits():
    """512 where numba compiles for a CPU with AVX-512 (``avx512f``), else None.

    LLVM's tuning for most Intel AVX-512 cores prefers 256-bit vectors (``prefer-256-bit``: the
    frequency cost of 512-bit instructions on Skylake-X), so numba's loops come out as ymm code
    even where the BLAS underneath already runs zmm kernels and the cost is paid. The tile
    kernels ask for the full width (measured: 1.5x on the forward tile kernel of a 2-core
    AVX-512 Xeon with SkylakeX OpenBLAS kernels; docs/performance.md).
    """
    from numba.core import config

    features = config.CPU_FEATURES
    if features is None:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features().flatten()
    return 512 if "+avx512f" in features.split(",") else None


_VECTOR_BITS = _widest_vector_bits()


@intrinsic
def full_vector_width(typingctx):
    """Called first in a kernel: its loops are vectorized at the machine's widest vector width
    (LLVM's function attribute ``prefer-vector-width``), where that is wider than LLVM's default.

    llvmlite's attribute set admits only enum attributes through ``add``; a string attribute is
    one more member of the same set, written out as-is in the function's definition. Where that
    fails (another llvmlite), the kernel keeps LLVM's default width: same results, slower."""

    def codegen(context, builder, sig, args):
        if _VECTOR_BITS is not None:
            try:
                set.add(builder.function.attributes, f'"prefer-vector-width"="{_VECTOR_BITS}"')
            except TypeError:
                pass
        return context.get_dummy_value()

    return types.none(), codegen


def _x86():
    """True where numba compiles for x86-64 (whose SSE control register ``MXCSR`` holds the
    flush-to-zero and denormals-are-zero bits)."""
    import llvmlite.binding as llvm

    return llvm.get_process_triple().split("-")[0] in ("x86_64", "amd64")


_X86 = _x86()
# MXCSR's flush-to-zero (15) and denormals-are-zero (6) bits
_FTZ_DAZ = (1 << 15) | (1 << 6)


@intrinsic
def _swap_mxcsr(typingctx, value):
    """``MXCSR`` set to the bits of ``value`` (an int64), returning the bits it held: this
    thread's SSE rounding and flush modes, which the C library's functions, BLAS included,
    run under. A no-op returning 0 where numba does not compile for x86-64."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        if not _X86:
            return i64(0)
        slot = builder.alloca(i32)
        pointer = builder.bitcast(slot, ir.IntType(8).as_pointer())
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()])
        store = builder.module.declare_intrinsic("llvm.x86.sse.stmxcsr", fnty=fnty)
        load = builder.module.declare_intrinsic("llvm.x86.sse.ldmxcsr", fnty=fnty)
        builder.call(store, [pointer])
        old = builder.zext(builder.load(slot), i64)
        builder.store(builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64),
                                    i32), slot)
        builder.call(load, [pointer])
        return old

    return types.int64(value), codegen


@numba.njit
def flush_subnormals():
    """Set this thread's x86 flush-to-zero and denormals-are-zero modes; returns the ``MXCSR``
    to give back to :func:`restore_subnormals` (compiled code only; a no-op elsewhere).

    A subnormal result (or, without denormals-are-zero, operand) costs a microcode assist of
    about 100 cycles per vector instruction on x86 cores. Inside the compiled walks that meant
    BLAS's products of tiny weights: ``P v`` ran 3x slower for an ALiBi head whose weights fall
    off to 1e-38 over a few hundred keys. Under these modes a result below 2^-126 (2^-1022)
    is 0, an absolute change below that, in sums whose terms are up to 1.

    LLVM keeps calls and memory accesses in order around the switch, not arithmetic on
    values held in registers (it moved a product of two scalar arguments past it): what is
    to run under the modes reads and writes arrays or calls BLAS, as the walks do."""
    old = _swap_mxcsr(0)
    _swap_mxcsr(old | _FTZ_DAZ)
    return old


@numba.njit
def restore_subnormals(old):
    """Give back the ``MXCSR`` that :func:`flush_subnormals` returned."""
    _swap_mxcsr(old)


def exp_nonpositive(x):
    """``exp(x)`` for ``x <= 0``, ``-inf`` or NaN, in the dtype of ``x`` (compiled code only)."""
    raise NotImplementedError("exp_nonpositive runs inside numba-compiled code")


def exp_weight(x):
    """:func:`exp_nonpositive` as an attention weight: 0 where ``exp(x)`` is below
    ``exp(WEIGHT_FLOOR)``, just above the dtype's smallest normal number (compiled code only)."""
    raise NotImplementedError("exp_weight runs inside numba-compiled code")


def _exp_impl(ft, low, floor, ln2_hi, ln2_lo, coefficients, bias, mantissa):
    """``(exp_nonpositive, exp_weight)`` for the float type ``ft``: the exponential of ``x >=
    low`` (below, 0), and that of ``x >= floor`` (below, 0, with no subnormal step)."""
    low, floor, log2e, zero = ft(low), ft(floor), ft(1.4426950408889634), ft(0)
    neg_hi, neg_lo = ft(-ln2_hi), ft(-ln2_lo)
    # e^r comes out scaled by 2^-64 (each coefficient is scaled: exact, and no step of the
    # evaluation is subnormal), so that 2^(n + 64) is normal for every n down to the smallest
    # subnormal result
    c = tuple(ft(x * 2.0 ** -64) for x in coefficients)     # highest degree first
    # floats near 1.5 2^mantissa are the integers: adding it rounds x log2e to the integer n and
    # leaves n + bias + 64 (in [1, 2 bias]) in the significand's low bits: the exponent field
    # of 2^(n + 64), once shifted up
    magic = ft(1.5 * 2.0 ** mantissa + bias + 64)

    @numba.njit(fastmath=FASTMATH)
    def core(x):
        z = _fma(x, log2e, magic)
        # n, exactly; reassociation has no rule that rewrites this (tested), and an arithmetic
        # fence on z kept LLVM from vectorizing the loop
        t = z - magic
        r = _fma(t, neg_hi, x)                      # x - n ln2, n ln2_hi exact
        r = _fma(t, neg_lo, r)
        # one product: exact where the result is normal, rounded once where it is subnormal.
        # A NaN x gives a NaN r and so a NaN polynomial, whatever the bits of z hold
        return _horner(r, c) * _shift_into_exponent(z)

    def exact(x):
        # below `low` the result rounds to 0 (and -inf lands here); NaN fails the test and stays
        return core(low if x < low else x)

    def weight(x):
        # a subnormal (or underflowing) product costs a microcode assist on x86 cores, about
        # 100 cycles for each vector that holds one: below the floor the core runs on the floor
        # and the result is replaced by 0 (-inf too; NaN fails the test and stays)
        small = x < floor
        y = core(floor if small else x)
        return zero if small else y

    return exact, weight


@numba.njit(fastmath=FASTMATH)
def _horner(r, c):
    p = c[0]
    for i in numba.literal_unroll(range(1, len(c))):
        p = _fma(p, r, c[i])
    return p


# Minimax polynomials 1 + r + r^2 q(r) for e^r in relative error on |r| <= 0.3466 (ln2 / 2 =
# 0.34657), q's coefficients by the Remez exchange in 60-digit arithmetic (mpmath), highest
# degree first. float32, degree 6: truncation 3.1e-9 (0.05 ulp); float64, degree 11: 3.6e-18
# (0.03 ulp). Taylor polynomials need degrees 7 and 13 for the same.
_POLY32 = (1.3814602223545587e-03, 8.368715198443222e-03, 4.166838788142754e-02,
           1.6666520645571534e-01, 4.999999344872659e-01, 1.0, 1.0)
_POLY64 = (2.5000061372803405e-08, 2.7630244948447145e-07, 2.755758635658188e-06,
           2.480149310774891e-05, 1.9841269506617828e-04, 1.3888888943622427e-03,
           8.333333333494435e-03, 4.166666666653018e-02, 1.6666666666666413e-01,
           5.000000000000011e-01, 1.0, 1.0)
# The arguments below which exp_weight gives 0, by dtype: exp(-87.3) is 1.037 2^-126 and
# exp(-708.3) 1.10 2^-1022, normal numbers however the last step rounds
WEIGHT_FLOOR = {np.dtype(np.float32): -87.3, np.dtype(np.float64): -708.3}
# float32: exp(-104) rounds to 0 (the smallest subnormal is exp(-103.28)); ln2_hi has 9
# significant bits so n * ln2_hi is exact for |n| <= 150
_EXP32 = _exp_impl(np.float32, -104.0, WEIGHT_FLOOR[np.dtype(np.float32)], 0.693359375,
                   -2.12194440e-4, _POLY32, 127, 23)
# float64: exp(-746) rounds to 0; fdlibm's split of ln2 (ln2_hi's low 32 bits are zero)
_EXP64 = _exp_impl(np.float64, -746.0, WEIGHT_FLOOR[np.dtype(np.float64)],
                   6.93147180369123816490e-01, 1.90821492927058770002e-10, _POLY64, 1023, 52)


@overload(exp_nonpositive, jit_options={"fastmath": FASTMATH})
def _exp_overload(x):
    return {types.float32: _EXP32[0], types.float64: _EXP64[0]}.get(x)


@overload(exp_weight, jit_options={"fastmath": FASTMATH})
def _exp_weight_overload(x):
    return {types.float32: _EXP32[1], types.float64: _EXP64[1]}.get(x)


def compiled(fn):
    """``numba.njit`` with the cache in the package's ``__pycache__``, else NUMBA_CACHE_DIR or
    the user's cache directory (numba's own order), else no cache: compiled once per process."""
    options = dict(nogil=True, fastmath=FASTMATH, boundscheck=False, error_model="numpy")
    try:
        return numba.njit(cache=True, **options)(fn)
    except RuntimeError:                            # no writable cache location
        return numba.njit(cache=False, **options)(fn)


def _exp_array(x, out):
    full_vector_width()
    for i in range(x.shape[0]):
        out[i] = exp_nonpositive(x[i])


def _weight_array(x, out):
    full_vector_width()
    for i in range(x.shape[0]):
        out[i] = exp_weight(x[i])


exp_array = compiled(_exp_array)
exp_array.__doc__ = """``out[:] = exp(x)`` for a 1-d array ``x`` of values ``<= 0``, ``-inf`` or
NaN (the exponential of the softmax rows, exposed for its tests)."""
weight_array = compiled(_weight_array)
weight_array.__doc__ = """``out[:] = exp_weight(x)`` (the exponential of the attention tile
kernels, exposed for their tests)."""


@numba.njit
def clip(x, low, high):
    """``x`` clipped to ``[low, high]``."""
    return min(max(x, low), high)


# Rows are summed in chunks: within a chunk the vectorized loop keeps 64 partial sums of a few
# terms each, and the chunk sums are added in order, so the error grows with len / _CHUNK, not
# with len / 64 as one vectorized loop over a long row would.
_CHUNK = 512


@numba.njit(fastmath=FASTMATH)
def _row_max(row):
    """``max(row)`` (``-inf`` for an empty row), NaN if any element is NaN."""
    full_vector_width()
    t = row.dtype.type(-np.inf)
    for j in range(row.shape[0]):
        t = _maximum(t, row[j])
    return t


@numba.njit(fastmath=FASTMATH)
def _exp_sum(row, shift, out):
    """``out[:] = exp(row - shift)`` (an empty ``out``: write nothing) and return
    ``sum(exp(row - shift))``. Every ``row - shift`` must be <= 0, -inf or NaN.

    ``row`` is only read, so a read-only array types; ``out`` is never a view of ``row``."""
    full_vector_width()
    total = row.dtype.type(0)
    for c in range(0, row.shape[0], _CHUNK):
        part = row[c:c + _CHUNK]
        acc = row.dtype.type(0)
        if out.shape[0] == 0:
            for j in range(part.shape[0]):
                acc += exp_nonpositive(part[j] - shift)
        else:
            dest = out[c:c + _CHUNK]
            for j in range(part.shape[0]):
                y = exp_nonpositive(part[j] - shift)
                dest[j] = y
                acc += y
        total += acc
    return total


def _online_softmax_tile(s, m, l, o, lo, hi):
    full_vector_width()
    n, k = s.shape
    zero = s.dtype.type(0)
    # Every inner loop runs from 0 over a view of the visible columns: with a start LLVM cannot
    # prove >= 0, numba's negative-index wraparound stays in the loop and the exp loop ran
    # 10x slower. All row maxima come first, then the exponentials: written as one loop per
    # row, LLVM vectorized the pair worse (measured 1.4x slower at 256 x 512).
    top = np.empty(n, dtype=s.dtype)
    for i in range(n):
        top[i] = _maximum(m[i], _row_max(s[i, clip(lo[i], 0, k):clip(hi[i], 0, k)]))
    for i in range(n):
        a = clip(lo[i], 0, k)                      # row i sees [a, b); 0 <= a <= b <= k
        b = clip(hi[i], a, k)
        shift = zero if top[i] == -np.inf else top[i]  # nothing visible: no -inf - -inf
        s[i, :a] = zero
        s[i, b:] = zero
        # one loop, not _exp_sum's chunks (10% slower here): rows of at most 16384 keys keep
        # the 64 partial sums of the vectorized loop to 256 terms each
        row = s[i, a:b]
        total = zero
        for j in range(row.shape[0]):
            y = exp_weight(row[j] - shift)
            row[j] = y
            total += y
        # the old state rescaled by exp(m - shift), which is 1 where the max stays; a row that
        # saw nothing before has a sum and output of 0 (whatever its output held: the walks'
        # outputs need not be zeroed, and a 0 * NaN of a value it could not see stays out).
        # Neither goes through the exponential: exp(-inf) costs a product with an
        # underflowing result, a microcode assist of about 140 cycles a row on Intel cores
        # (40% of a first 128 x 128 tile)
        orow = o[i]
        if m[i] == -np.inf:
            l[i] = total
            for d in range(orow.shape[0]):
                orow[d] = zero
        elif m[i] != top[i]:                        # NaN too
            alpha = exp_weight(m[i] - shift)
            l[i] = l[i] * alpha + total
            for d in range(orow.shape[0]):
                orow[d] *= alpha
        else:
            l[i] += total
        m[i] = top[i]


online_softmax_tile = compiled(_online_softmax_tile)
online_softmax_tile.__doc__ = """One key tile of the online softmax, in place.

Parameters
----------
s : (n, k) array, float32 or float64
    Scores of ``n`` query rows against ``k`` keys (``-inf`` where masked); overwritten with
    ``p = exp(s - m_new)`` (with ``m_new`` taken as 0 in a row with nothing visible).
m, l : (n,) arrays of the dtype of ``s``
    Running max and running sum ``sum(exp(s - m))``; updated to include the tile.
o : (n, dv) array of the dtype of ``s``
    Unnormalised output ``sum(exp(s - m) v)``; rescaled by ``exp(m_old - m_new)``, and set to
    0 in a row with ``m = -inf`` (it saw nothing: what it holds is not read). The caller adds
    ``p @ v`` (BLAS).
lo, hi : (n,) int64 arrays
    Row ``i`` sees columns ``[lo[i], hi[i])`` (clipped to ``[0, k)``): the others count as
    ``-inf`` whatever ``s`` holds there (a causal or sliding-window band without a masking
    pass over the tile).

Notes
-----
``m_new = maximum(m, max_j s)`` propagates NaN as ``np.maximum`` does. Equal to the NumPy
engine's ufunc passes up to the rounding of the exponential (about 1 ulp) and of the row sum,
and for weights below ``exp(WEIGHT_FLOOR)``, which are 0 here (:func:`exp_weight`).
"""


def _backward_tile(s, lse, ds, delta, row_sums):
    full_vector_width()
    n, k = s.shape
    zero = s.dtype.type(0)
    # every argument of the exponential must be <= 0 (the kernel's exp covers no more): a
    # row whose max exceeds its lse, or is NaN, leaves the tile to the caller's ufunc passes
    for i in range(n):
        if not _row_max(s[i]) <= lse[i]:
            return 0
    check = zero
    for i in range(n):
        row, grad = s[i], ds[i]
        shift, d = lse[i], delta[i]
        total = zero
        for j in range(k):
            y = exp_weight(row[j] - shift)
            row[j] = y
            total += y
            g = y * (grad[j] - d)
            grad[j] = g
            check += g * zero                   # NaN once any g is NaN or infinite
        row_sums[i] = total
    return 1 if check == zero else 2


backward_tile = compiled(_backward_tile)
backward_tile.__doc__ = """The element-wise part of one backward tile, in place, in one sweep.

Parameters
----------
s : (n, k) array, float32 or float64
    Logits of ``n`` query rows against ``k`` keys (``-inf`` where masked); overwritten with
    ``P = exp(s - lse)``.
lse : (n,) array of the dtype of ``s``
    Each row's log-sum-exp (``+inf`` for a row that sees nothing: its P is 0).
ds : (n, k) array of the dtype of ``s``
    ``dP = dO V^T`` of the tile; overwritten with ``dS = P * (dP - delta)``.
delta, row_sums : (n,) arrays of the dtype of ``s``
    ``Delta_i = dO_i . O_i``; ``row_sums`` receives each row's sum of P.

Returns
-------
int
    1: done, every ``dS`` finite. 2: done, some ``dS`` NaN or infinite (the caller clears
    the places no row sees). 0: nothing written, since a row's max exceeds its ``lse`` or is
    NaN (the caller runs its ufunc passes).

Notes
-----
``exp`` within 1 ulp, and 0 below ``exp(WEIGHT_FLOOR)`` (the forward kernel's
:func:`exp_weight`); the sums in the vectorised order.
"""


@numba.njit(fastmath=FASTMATH)
def _divide(row, scale):
    full_vector_width()
    for j in range(row.shape[0]):
        row[j] = row[j] / scale


# no reassoc: (x - m) - log(total) in that order, never x - (m + log(total)), which rounds at
# the magnitude of m. Set here since numba gives a callee its caller's flags only where it sets
# none; an arithmetic fence held the order too but left the loop scalar
@numba.njit(fastmath=FASTMATH - {"reassoc"})
def _shift_twice(row, shift, log_total, out):
    full_vector_width()
    for j in range(row.shape[0]):
        out[j] = (row[j] - shift) - log_total


def _softmax_rows(x, out, mode):
    full_vector_width()
    n = x.shape[0]
    zero = x.dtype.type(0)
    # the empty output of the sum-only passes: a view of the writable out, not of x, since x
    # may be read-only (a memmap, a view of another library's buffer)
    nothing = out.reshape(-1)[:0]
    for i in range(n):
        row = x[i]
        top = _row_max(row)
        shift = zero if top == -np.inf else top     # nothing visible: no -inf - -inf
        if mode == 0:                               # softmax: exp(x - m) / total
            total = _exp_sum(row, shift, out[i])
            _divide(out[i], total if total != zero else x.dtype.type(1))  # empty: stays 0
        elif mode == 1:                             # log_softmax: (x - m) - log(total)
            total = _exp_sum(row, shift, nothing)
            _shift_twice(row, shift, np.log(total if total != zero else x.dtype.type(1)),
                         out[i])
        else:                                       # logsumexp: m + log(total)
            total = _exp_sum(row, shift, nothing)
            out[i, 0] = shift + np.log(total)


softmax_rows = compiled(_softmax_rows)
softmax_rows.__doc__ = """softmax (``mode`` 0), log_softmax (1) or logsumexp (2) of each row of the
2-d float32 or float64 array ``x`` (read only; it may be a read-only array), written to the
C-contiguous ``out`` (same shape; ``(n, 1)`` for logsumexp).

The formulas of :mod:`cuonline.engines.softmax` (max subtracted first; a row with nothing
visible gives 0, ``-inf``, ``-inf``), in three sweeps over each row (max; exp and sum; write)
instead of five or more full-array passes.
"""


@numba.njit(fastmath=FASTMATH)
def normalise_rows(l, o):
    """``o[i] / l[i]`` for each row ``i`` of the 2-d ``o``, in place, as
    :func:`cuonline.engines.numpy._normalised` divides (0 where ``l`` is 0, NaN where it is
    NaN): a division, never a product by the reciprocal (no ``arcp``), so the same bits.
    Returns True when every ``o`` was finite before. ``o`` C-ordered. The last step of each
    element of the forward stacks (:func:`._task_kernels.forward_stack`)."""
    full_vector_width()
    n, dv = o.shape
    zero = o.dtype.type(0)
    check = zero
    flat = o.reshape(n * dv)            # one vector sum, not one per row (16-row tiles: 10%)
    for t in range(n * dv):
        check += flat[t] * zero         # NaN once any value is NaN or infinite
    for i in range(n):
        row, total = o[i], l[i]
        if total > zero:
            for c in range(dv):
                row[c] = row[c] / total
        else:
            fill = zero if total == zero else o.dtype.type(np.nan)
            for c in range(dv):
                row[c] = fill
    return check == zero


def _warm_up_tile(dtype):
    s = np.zeros((2, 3), dtype)
    m, l = np.zeros(2, dtype), np.zeros(2, dtype)
    lo, hi = np.zeros(2, np.int64), np.full(2, 3, np.int64)
    online_softmax_tile(s, m, l, np.zeros((2, 1), dtype), lo, hi)


def _warm_up_backward(dtype):
    s, ds = np.zeros((2, 3), dtype), np.zeros((2, 3), dtype)
    backward_tile(s, np.zeros(2, dtype), ds, np.zeros(2, dtype), np.zeros(2, dtype))


def _warm_up_rows(dtype):
    x = np.zeros((2, 3), dtype)
    softmax_rows(x, np.empty_like(x), 0)
    x.flags.writeable = False                       # numba types read-only arrays apart
    softmax_rows(x, np.empty_like(x), 0)


_WARM_UP = {"online_softmax_tile": (online_softmax_tile, _warm_up_tile),
            "backward_tile": (backward_tile, _warm_up_backward),
            "softmax_rows": (softmax_rows, _warm_up_rows)}


def compile_for(name, dtype):
    """The kernel ``name`` compiled for ``dtype`` (float32 or float64) by calling it once on
    tiny arrays of the layout the engines pass; raises whatever numba raises if it cannot."""
    kernel, warm_up = _WARM_UP[name]
    warm_up(np.dtype(dtype))
    return kernel
