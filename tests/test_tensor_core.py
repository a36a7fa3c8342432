"""The tensor-core building blocks of kernels_cu/tensor_core.cuh, checked without a GPU.

Under the CPU emulation, one-warp kernels (tests/tensor_core_kernels/) run each helper the way
an attention kernel will: cp.async into swizzled shared memory, ldmatrix into fragments, several
accumulating mma k-steps, the fragments written back by the PTX layout; the results are held to
NumPy matrix products. Deliberately wrong layouts (tests/tensor_core_kernels/tc_mutants.py) must
fail the same checks. NVRTC compiles every test kernel for sm_80 and sm_90 with no spill, and
the PTX holds the intended instructions.

The emulation's C++ bodies (cuonline/testing/cuda_cpu/tensor_core.h and cp_async.h) follow the
PTX ISA's fragment tables; that they match the hardware is what one run of these kernels on a GPU
would confirm.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from support import needs_emulation, needs_gpu, needs_nvrtc

from cuonline.kernels import source
from cuonline.toolchain import nvrtc
from cuonline.testing import emulate

pytestmark = pytest.mark.slow   # the fast tier (-m 'not slow') leaves it out

HERE = Path(__file__).resolve().parent
KERNEL_DIR = HERE / "tensor_core_kernels"
HEADER = "tensor_core.cuh"


def _load_mutants():
    """tests/tensor_core_kernels/tc_mutants.py, loaded by path (sys.path stays as it is)."""
    spec = importlib.util.spec_from_file_location("tc_mutants", KERNEL_DIR / "tc_mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tc_mutants", mod)   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


mutants = _load_mutants()

KERNEL_FILES = ("gemm16.cu", "gemm_tf32_f64.cu", "probes.cu")



# ------------------------------------------------------------------------------------------------
# Sources


def base_texts() -> dict:
    """File name -> text of everything a test kernel source is made of, and of the emulation
    header part that defines its PTX helpers on the CPU."""
    texts = {
        "common.cuh": source.read_kernel_file("common.cuh"),
        HEADER: source.read_kernel_file(HEADER),
        mutants.EMULATION: emulate.header_files()[mutants.EMULATION].read_text(encoding="utf-8"),
    }
    for name in KERNEL_FILES:
        texts[name] = (KERNEL_DIR / name).read_text(encoding="utf-8")
    return texts


ALL = "all"   # every kernel of the file: the unmutated tests share one compile per file

_ENTRY_RE = re.compile(r'^extern "C" __global__ void (\w+)\(.*?^}\n', re.S | re.M)


def kernel_source(kernel_file: str, texts: dict | None = None, entries=ALL) -> str:
    """common.cuh + tensor_core.cuh + the kernel file, pasted as source.py pastes common.cuh.

    ``entries`` keeps only those ``extern "C"`` kernels (a mutant builds just what it runs);
    ``ALL`` keeps every one.
    """
    texts = texts or base_texts()
    body = texts[kernel_file]
    if entries is not ALL:
        body = _ENTRY_RE.sub(lambda m: m.group(0) if m.group(1) in entries else "", body)
    return "\n".join([texts["common.cuh"], texts[HEADER], body])


_modules: dict = {}

# Where the checks run: "emulate" (the CPU emulation), or "cupy" for the one run on a GPU that
# confirms the emulated layouts (test_same_checks_on_gpu sets it).
BACKEND = {"name": "emulate"}


class _GpuKernel:
    """A cupy.RawKernel called like an EmulatedKernel: NumPy arrays in, results copied back."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, grid, block, args, shared_mem=0):
        import cupy

        dev = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        self.fn(grid, block, tuple(dev), shared_mem=shared_mem)
        cupy.cuda.Device().synchronize()
        for host, d in zip(args, dev):
            if isinstance(host, np.ndarray) and host.flags.writeable:
                host[...] = d.get()


class _GpuModule:
    def __init__(self, text):
        import cupy

        options = tuple(o for o in nvrtc.compile_options("sm_90", verbose=False)
                        if not o.startswith("-arch"))
        self.mod = cupy.RawModule(code=text, options=options)

    def get_function(self, name):
        return _GpuKernel(self.mod.get_function(name))


def module(kernel_file: str, texts: dict | None = None, entries=ALL):
    texts = texts or base_texts()
    text = kernel_source(kernel_file, texts, entries)
    emulation = {mutants.EMULATION: texts[mutants.EMULATION]}   # the GPU has its own
    key = (BACKEND["name"], text) + ((emulation[mutants.EMULATION],)
                                     if BACKEND["name"] == "emulate" else ())
    if key not in _modules:
        if BACKEND["name"] == "cupy":
            _modules[key] = _GpuModule(text)
        else:
            _modules[key] = emulate.compile_module(text, headers=emulation)
    return _modules[key]


# ------------------------------------------------------------------------------------------------
# Number formats


def bf16_round(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bits as uint16, values as float32) of x rounded to bfloat16, nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


def tf32_round(x: np.ndarray) -> np.ndarray:
    """cvt.rna.tf32.f32 as float32 values: nearest, ties away from zero, 10 mantissa bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    finite = (u & 0x7F800000) != 0x7F800000
    r = np.where(finite, (u + 0x1000) & 0xFFFFE000, u).astype(np.uint32)
    return r.view(np.float32)


def inputs16(rng, dtype, shape):
    """(array passed to the kernel, its values as float64) for float16 / bfloat16."""
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "f16":
        h = x.astype(np.float16)
        return h, h.astype(np.float64)
    bits, vals = bf16_round(x)
    return bits, vals.astype(np.float64)


def rel_err(got, ref) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


# ------------------------------------------------------------------------------------------------
# Checks: each returns (error, tolerance); the tests assert error <= tolerance, the mutant tests
# assert the opposite (NaN counts as failing).

# f16/bf16 (and tf32) products are exact in float32 and summed there over K <= 64: a few float32
# ulp of the largest partial sums (~4e-7 measured under the emulation). The margin is for the
# tensor cores' adders, which are not IEEE-exact; still far below the 1e-3 the field quotes for
# 16-bit inputs with f32 sums, and 4 orders below the errors of a wrong layout (~1).
TOL_F32_SUM = 1e-4
M16, N16, K16 = 16, 32, 64


def check_gemm16(texts=None, *, dtype="f16", b_form="nk", k_valid=K16, entries=None, seed=1):
    rng = np.random.default_rng(seed)
    a, a64 = inputs16(rng, dtype, (M16, K16))
    b, b64 = inputs16(rng, dtype, (K16, N16))       # B as (K, N)
    b_arg = b if b_form == "kn" else np.ascontiguousarray(b.T)
    d = np.full((M16, N16), np.nan, np.float32)
    name = f"tc_gemm_{dtype}_{b_form}"
    fn = module("gemm16.cu", texts, entries or [name]).get_function(name)
    fn((1,), (32,), (a, b_arg, d, np.int32(k_valid)))
    a64 = a64.copy()
    a64[:, k_valid:] = 0.0          # the cp.async zero-fill
    return rel_err(d, a64 @ b64), TOL_F32_SUM


def check_chain(texts=None, *, dtype="f16", entries=None, seed=2):
    rng = np.random.default_rng(seed)
    q, q64 = inputs16(rng, dtype, (16, 64))
    k, k64 = inputs16(rng, dtype, (16, 64))
    v, v64 = inputs16(rng, dtype, (16, 32))
    o = np.full((16, 32), np.nan, np.float32)
    name = f"tc_chain_{dtype}"
    module("gemm16.cu", texts, entries or [name]).get_function(name)((1,), (32,), (q, k, v, o))
    s = (q64 @ k64.T).astype(np.float32)
    p = s.astype(np.float16) if dtype == "f16" else bf16_round(s)[1]
    ref = p.astype(np.float64) @ v64
    # The scores are rounded to 16 bits: a score that lands next to a rounding boundary may round
    # the other way after a differently ordered f32 sum (one 16-bit ulp of one term).
    ulp = 2.0**-10 if dtype == "f16" else 2.0**-7
    bound = ulp * np.max(np.abs(s)) * np.max(np.abs(v64)) / np.max(np.abs(ref)) + TOL_F32_SUM
    return rel_err(o, ref), bound


TF_M, TF_N, TF_K = 16, 16, 32


def tf32_inputs(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((TF_M, TF_K)).astype(np.float32),
            rng.standard_normal((TF_K, TF_N)).astype(np.float32))


def run_tf32(texts=None, entries=None, seed=3):
    a, b = tf32_inputs(seed)
    d = np.full((TF_M, TF_N), np.nan, np.float32)
    module("gemm_tf32_f64.cu", texts, entries or ["tc_gemm_tf32"]).get_function("tc_gemm_tf32")(
        (1,), (32,), (a, b, d))
    return a, b, d


def check_tf32(texts=None, entries=None):
    """Against the product of the tf32-rounded inputs: float32 summation error only."""
    a, b, d = run_tf32(texts, entries)
    ref = tf32_round(a).astype(np.float64) @ tf32_round(b).astype(np.float64)
    return rel_err(d, ref), TOL_F32_SUM


F64_M, F64_N, F64_K = 8, 16, 16


def check_f64(texts=None, entries=None, seed=4):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((F64_M, F64_K))
    b = rng.standard_normal((F64_K, F64_N))
    d = np.full((F64_M, F64_N), np.nan)
    module("gemm_tf32_f64.cu", texts, entries or ["tc_gemm_f64"]).get_function("tc_gemm_f64")(
        (1,), (32,), (a, b, d))
    return rel_err(d, a @ b), 1e-13


LDMATRIX_VARIANTS = [(1, False), (2, False), (4, False), (1, True), (2, True), (4, True)]


def ldmatrix_expected(tile: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Registers per the PTX ISA: lane 8i+r addresses row r of matrix i; lane (g, t) gets
    M_i[g][2t], M_i[g][2t+1] (low, high), or with .trans M_i[2t][g], M_i[2t+1][g]."""
    out = np.zeros((6, 32, 4), np.uint32)
    for v, (num, trans) in enumerate(LDMATRIX_VARIANTS):
        for lane in range(32):
            g, t = divmod(lane, 4)
            for i in range(num):
                mat = tile[rows[8 * i: 8 * i + 8]].astype(np.uint32)   # (8, 8): M_i
                lo, hi = (mat[2 * t, g], mat[2 * t + 1, g]) if trans else (mat[g, 2 * t],
                                                                           mat[g, 2 * t + 1])
                out[v, lane, i] = lo | (hi << 16)
    return out


def check_ldmatrix(texts=None, entries=None, seed=5):
    """Number of wrong registers (tolerance 0)."""
    rng = np.random.default_rng(seed)
    tile = rng.integers(0, 2**16, size=(32, 8), dtype=np.uint16)
    rows = rng.permutation(32).astype(np.int32)    # lanes address the rows in a shuffled order
    out = np.zeros((6, 32, 4), np.uint32)
    module("probes.cu", texts, entries or ["tc_ldmatrix_probe"]).get_function(
        "tc_ldmatrix_probe")((1,), (32,), (tile, rows, out))
    expected = ldmatrix_expected(tile, rows)
    wrong = sum(int(np.sum(out[v, :, :num] != expected[v, :, :num]))
                for v, (num, _) in enumerate(LDMATRIX_VARIANTS))
    return float(wrong), 0.0


# (columns, element bytes, expected stride) of each layout written by tc_swizzle_offsets
LAYOUTS = [(8, 2, 8), (16, 2, 16), (32, 2, 32), (64, 2, 64), (128, 2, 128), (256, 2, 256),
           (32, 4, 32), (16, 8, 16), (96, 2, 104), (40, 2, 40), (24, 4, 28), (64, 2, 64)]


def check_swizzle(texts=None, entries=None):
    """Number of violated properties (tolerance 0) of the shared-memory tile layouts: rows
    stored at their stride without overlap, 16-byte chunks kept whole and aligned, and 8
    consecutive rows at one logical chunk in 8 different 16-byte bank groups (an ldmatrix
    phase, or 8 lanes' 16-byte accesses, without bank conflicts), split_offset agreeing
    with offset, and offsets repeating every kRowPeriod rows (8 or 1) one stride apart."""
    out = np.full((len(LAYOUTS), 16, 256), -1, np.int32)
    split = np.full((len(LAYOUTS), 16, 256), -2, np.int32)
    stride = np.zeros(len(LAYOUTS), np.int32)
    period = np.zeros(len(LAYOUTS), np.int32)
    module("probes.cu", texts, entries or ["tc_swizzle_offsets"]).get_function(
        "tc_swizzle_offsets")((1,), (128,), (out, split, stride, period))
    bad = 0
    for c, (cols, elem, expected_stride) in enumerate(LAYOUTS):
        off = out[c, :, :cols].astype(np.int64)
        bad += int(np.sum(split[c, :, :cols] != off))  # split_offset agrees with offset
        p = int(period[c])                             # load_tile steps by it
        bad += int(p not in (1, 8) or np.any(off[p:] != off[:16 - p] + p * stride[c]))
        per_chunk = 16 // elem
        bad += int(stride[c] != expected_stride)
        row_start = np.arange(16)[:, None] * stride[c]
        bad += int(np.any(off < row_start) or np.any(off >= row_start + cols))
        bad += int(np.unique(off).size != off.size)
        chunks = off.reshape(16, cols // per_chunk, per_chunk)
        bad += int(np.any(chunks - chunks[:, :, :1] != np.arange(per_chunk)))  # contiguous
        bad += int(np.any(chunks[:, :, 0] % per_chunk))                         # aligned
        groups = (chunks[:, :, 0] * elem // 16) % 8                             # bank group
        for r0 in (0, 8):
            for ch in range(groups.shape[1]):
                bad += int(len(set(groups[r0:r0 + 8, ch])) != 8)
    return float(bad), 0.0


CHECKS = {
    "gemm16_f16_nk": lambda texts: check_gemm16(texts, dtype="f16", b_form="nk"),
    "gemm16_f16_kn": lambda texts: check_gemm16(texts, dtype="f16", b_form="kn"),
    "chain_f16": lambda texts: check_chain(texts, dtype="f16"),
    "gemm_tf32": lambda texts: check_tf32(texts),
    "gemm_f64": lambda texts: check_f64(texts),
    "ldmatrix_probe": lambda texts: check_ldmatrix(texts),
    "swizzle": lambda texts: check_swizzle(texts),
}


# ------------------------------------------------------------------------------------------------
# Emulated tests


@needs_emulation
@pytest.mark.parametrize("b_form", ["nk", "kn"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("k_valid", [64, 37])
def test_mma_m16n8k16_gemm(dtype, b_form, k_valid):
    err, tol = check_gemm16(dtype=dtype, b_form=b_form, k_valid=k_valid,
                            entries=ALL)
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


@needs_emulation
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_scores_feed_pv_through_acc_to_a_frag(dtype):
    err, tol = check_chain(dtype=dtype,
                           entries=ALL)
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


@needs_emulation
def test_mma_m16n8k8_tf32_gemm():
    err, tol = check_tf32(entries=ALL)
    assert err <= tol, f"relative error {err:.3g} against the tf32-rounded product"


@needs_emulation
def test_tf32_error_bound_against_float32_inputs():
    """The documented bound for precision="tf32": each input is rounded to nearest with a
    10-bit mantissa (relative error <= 2^-11), so |D - A B| <= (2^-10 + 2^-22) |A| |B| plus the
    float32 summation error K 2^-24 |A| |B|; elementwise, against the unrounded inputs."""
    a, b, d = run_tf32(entries=ALL)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    bound = (2.0**-10 + 2.0**-22 + TF_K * 2.0**-24) * (np.abs(a64) @ np.abs(b64))
    err = np.abs(d - a64 @ b64)
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"
    # and tf32 is really used: float32 inputs would give errors ~1e-7, tf32 ones ~1e-3
    assert np.max(err / (np.abs(a64) @ np.abs(b64))) > 2.0**-16


@needs_emulation
def test_mma_m8n8k4_f64_gemm():
    err, tol = check_f64(entries=ALL)
    assert err <= tol, f"relative error {err:.3g}"


@needs_emulation
def test_ldmatrix_lane_map_all_variants():
    wrong, _ = check_ldmatrix(entries=ALL)
    assert wrong == 0, f"{int(wrong)} registers differ from the PTX ISA's ldmatrix layout"


@needs_emulation
def test_misaligned_ldmatrix_row_traps():
    from cuonline.testing import emulate

    fn = module("probes.cu").get_function("tc_ldmatrix_misaligned")
    with pytest.raises(emulate.EmulationError, match="__trap"):
        fn((1,), (32,), (np.zeros(32, np.uint32),))


@needs_emulation
def test_to_tf32_rounds_like_cvt_rna():
    special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38,
                        1e-45, -1e-40, 1.17549435e-38], np.float32)
    ones = np.float32(1.0).view(np.uint32)
    ties = np.array([ones + 0x1000, ones + 0x3000, ones + 0x0FFF, ones + 0x1001],
                    np.uint32).view(np.float32)                      # ties go away from zero
    x = np.concatenate([special, ties, -ties,
                        np.random.default_rng(6).standard_normal(200).astype(np.float32) * 1e3])
    out = np.zeros(x.size, np.uint32)
    module("probes.cu", entries=ALL).get_function("tc_to_tf32")(
        (2,), (128,), (x, out, np.int32(x.size)))
    np.testing.assert_array_equal(out, tf32_round(x).view(np.uint32))
    assert out[np.flatnonzero(x == ties[0])[0]] == ones + 0x2000  # 1 + 2^-11 -> 1 + 2^-10
    assert np.isinf(out.view(np.float32)[6])                      # FLT_MAX rounds up to inf
    nan = np.zeros(1, np.uint32)
    module("probes.cu", entries=ALL).get_function("tc_to_tf32")(
        (1,), (32,), (np.array([np.nan], np.float32), nan, np.int32(1)))
    assert np.isnan(nan.view(np.float32)[0])


@needs_emulation
def test_smem_layouts_are_conflict_free():
    bad, _ = check_swizzle(entries=ALL)
    assert bad == 0


@needs_emulation
def test_cp_async_zero_fill():
    src = np.random.default_rng(7).integers(1, 256, size=32 * 16, dtype=np.uint8)
    out = np.zeros_like(src)
    module("probes.cu", entries=ALL).get_function("tc_cp_async_zfill")((1,), (32,), (src, out))
    expected = src.reshape(32, 16).copy()
    for lane in range(32):
        expected[lane, lane % 17:] = 0
    np.testing.assert_array_equal(out.reshape(32, 16), expected)


@needs_emulation
def test_cp_async_groups_complete_in_order():
    src = np.arange(256, dtype=np.float32)
    fn = module("probes.cu", entries=ALL).get_function("tc_cp_async_groups")
    out = np.zeros(256, np.float32)
    fn((1,), (32,), (src, out, np.int32(0)))
    np.testing.assert_array_equal(out, src)
    # Reading stage 1 before its wait_group is a race on the GPU; the emulation lands copies
    # only at the wait, so the early read sees the poison (NaN), while stage 0 is complete.
    out[:] = 0
    fn((1,), (32,), (src, out, np.int32(1)))
    np.testing.assert_array_equal(out[:128], src[:128])
    assert np.all(np.isnan(out[128:]))



@needs_emulation
@pytest.mark.parametrize("name", sorted(mutants.MUTANTS))
def test_mutant_layout_fails(name):
    m = mutants.MUTANTS[name]
    texts = mutants.apply(name, base_texts())
    err, tol = CHECKS[m.check](texts)
    assert not err <= tol, (
        f"mutant {name} ({m.why}) passed check {m.check}: error {err:.3g} <= {tol:.3g}"
    )


# ------------------------------------------------------------------------------------------------
# GPU: the same kernels and checks on real tensor cores (the one check the emulation cannot make)

GPU_CHECKS = {
    **{f"gemm16_{dt}_{bf}_k{kv}": (lambda dt=dt, bf=bf, kv=kv: check_gemm16(
        dtype=dt, b_form=bf, k_valid=kv, entries=ALL))
       for dt in ("f16", "bf16") for bf in ("nk", "kn") for kv in (64, 37)},
    "chain_f16": lambda: check_chain(dtype="f16", entries=ALL),
    "chain_bf16": lambda: check_chain(dtype="bf16", entries=ALL),
    "gemm_tf32": lambda: check_tf32(entries=ALL),
    "gemm_f64": lambda: check_f64(entries=ALL),
    "ldmatrix_probe": lambda: check_ldmatrix(entries=ALL),
    "smem_layouts": lambda: check_swizzle(entries=ALL),
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", sorted(GPU_CHECKS))
def test_same_checks_on_gpu(name):
    BACKEND["name"] = "cupy"
    try:
        err, tol = GPU_CHECKS[name]()
    finally:
        BACKEND["name"] = "emulate"
    assert err <= tol, f"{name} on the GPU: {err:.3g} > {tol:.3g}"


@pytest.mark.gpu
@needs_gpu
def test_tf32_rounding_and_bound_on_gpu():
    BACKEND["name"] = "cupy"
    try:
        test_to_tf32_rounds_like_cvt_rna()
        test_tf32_error_bound_against_float32_inputs()
        test_cp_async_zero_fill()
    finally:
        BACKEND["name"] = "emulate"


# ------------------------------------------------------------------------------------------------
# NVRTC

EXPECTED_PTX = {
    "gemm16.cu": [
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
        "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16",
        "cp.async.cg.shared.global",
        "cp.async.commit_group",
        "cp.async.wait_group",
        "cp.async.wait_all",
    ],
    "gemm_tf32_f64.cu": [
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
        "cvt.rna.tf32.f32",
        "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64",
    ],
    "probes.cu": [
        f"ldmatrix.sync.aligned.m8n8.x{n}{'.trans' if t else ''}.shared.b16"
        for n, t in LDMATRIX_VARIANTS
    ] + ["cvt.rna.tf32.f32", "cp.async.cg.shared.global", "cp.async.wait_all"],
}


def compile_ptx(text: str, arch: str, name: str) -> tuple[str, str]:
    """(PTX, ptxas log) of one NVRTC compile, with the engine's options."""
    try:
        return nvrtc.compile_ptx(text, arch, name=name)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None


#: mma.sync (f16/bf16/tf32/f64) and cp.async need sm_80: the listing's older archs run SIMT only
TENSOR_CORE_ARCHS = tuple(a for a in nvrtc.DEFAULT_ARCHS if int(a.removeprefix("sm_")) >= 80)


@needs_nvrtc
@pytest.mark.parametrize("arch", TENSOR_CORE_ARCHS)
@pytest.mark.parametrize("kernel_file", KERNEL_FILES)
def test_nvrtc_compiles_to_the_intended_instructions(kernel_file, arch):
    ptx, log = compile_ptx(kernel_source(kernel_file), arch, kernel_file)
    for instruction in EXPECTED_PTX[kernel_file]:
        assert instruction in ptx, f"{instruction} not in the PTX of {kernel_file} ({arch})"
    usage = nvrtc.parse_ptxas_log(log)
    entries = set(_ENTRY_RE.findall(base_texts()[kernel_file]))
    assert {k.name for k in usage} == entries, log
    for k in usage:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills:\n{log}"
        assert k.stack_frame == 0, f"{k.name} has a stack frame:\n{log}"


@needs_nvrtc
def test_header_compiles_alone_after_common():
    """tensor_core.cuh needs nothing but common.cuh before it (no entry point: PTX only)."""
    text = "\n".join([source.read_kernel_file("common.cuh"), source.read_kernel_file(HEADER)])
    ptx, _ = compile_ptx(text + '\nextern "C" __global__ void noop() {}\n', "sm_80", "hdr.cu")
    assert ".entry noop" in ptx
