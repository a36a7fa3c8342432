"""Compile-time parameters of each kernel variant, with a readable key.

A spec (:class:`AttentionSimtSpec`, :class:`AttentionMmaSpec`, :class:`SoftmaxSpec`: one
class per kernel family, see :mod:`cuonline.kernels.families`) is the one object that names a
compiled variant: the CuPy module cache, the emulation, the NVRTC listing, logs and error
messages all use its ``key``, which starts with the family's name. Its ``defines()`` are pasted
as ``#define`` lines at the top of the source text (see :mod:`cuonline.kernels.source`), so
every variant is the same ``.cu`` text specialised by constants, never a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from .. import _semantics
from . import features as _features

__all__ = ["AttentionBwdMmaSpec", "AttentionBwdSimtSpec", "AttentionMmaSpec", "AttentionSimtSpec",
           "AttentionSpec", "MAX_HEAD_DIM", "MMA_BWD_MAX_HEAD_DIM", "MMA_INSTRUCTIONS",
           "MMA_MAX_HEAD_DIM", "SOFTMAX_MODES", "SoftmaxSpec", "acc_name", "dtype_name",
           "dtype_tag", "probe_shared_bytes"]

#: Largest D and Dv the SIMT kernel family is compiled for (registers and shared memory).
MAX_HEAD_DIM = 256

_TAGS = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}
_C_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
            "float64": "double"}


def dtype_name(dtype) -> str:
    """The name of a dtype given as a name or a dtype (``"bfloat16"`` needs no ml_dtypes)."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def acc_name(dtype) -> str:
    """Name of the accumulation dtype of ``dtype``: :func:`cuonline._semantics.accumulation_dtype`,
    with ``"bfloat16"`` judged by float16 (a 16-bit float NumPy knows without ml_dtypes)."""
    name = dtype_name(dtype)
    return _semantics.accumulation_dtype("float16" if name == "bfloat16" else name).name


def bwd_bias_tile(names) -> bool:
    """Whether a backward dQ kernel with features ``names`` reduces dS in shared memory
    (rel_bias, block bias: their gradients are sums of dS); a plain bias writes dS itself."""
    return "rel_bias" in names or "bias_block" in names


def probe_shared_bytes(spec_class, *, dr=0, bias_tile=False, **tiles) -> int:
    """Shared memory of a block of ``spec_class`` with these ``tiles`` (its dtype, widths and
    tile fields), counted by the spec itself (:attr:`shared_bytes`) with the only options that
    take shared memory: rel_qk's staging at width ``dr`` and, with ``bias_tile``, a backward
    dQ kernel's dS reduction tile (:func:`bwd_bias_tile`). The tile choosers size their
    candidates with it, so that a chosen block and its planned spec agree."""
    names = (("rel_bias",) if bias_tile else ()) + (("rel_qk",) if dr else ())
    return spec_class(**tiles, features=names, dr=dr).shared_bytes


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """What every attention variant has: the option flags of
    :data:`cuonline.kernels.features.FEATURES` and the key split, keyword-only fields of
    :class:`AttentionSimtSpec` and :class:`AttentionMmaSpec`, with what derives from them.

    Attributes
    ----------
    features : tuple of str
        Names of the compiled-in options, a subset of the feature table in its order (causal is
        folded into ``window``).
    split : bool
        Keys are split across ``grid.z``; partial states go to a workspace and the
        ``attention_combine`` family's kernel merges them.
    dr : int
        Width of ``rel_q`` and ``rel_k`` (``CUONLINE_DR``, compile-time like D): positive
        exactly when the ``rel_qk`` feature is compiled in, 0 otherwise.
    """

    features: tuple = ()
    split: bool = False
    dr: int = 0

    def _check_simt_shape(self):
        """The element/accumulation pair and the heads a SIMT family takes: any dtype, D and
        Dv up to MAX_HEAD_DIM (the tensor-core specs have per-dtype limits of their own)."""
        if self.dtype not in _TAGS or self.acc not in ("float32", "float64"):
            raise ValueError(f"unsupported dtype/acc pair {self.dtype}/{self.acc}")
        for name in ("d", "dv"):
            value = getattr(self, name)
            if not 1 <= value <= MAX_HEAD_DIM:
                raise ValueError(f"{name} must be in 1..{MAX_HEAD_DIM}, got {value}")

    def _check_features(self, names=None, split=True):
        """Check ``features`` (distinct names among ``names``, default the rows the family
        supports; their requirements present; ``split`` only where allowed) and ``dr``, and
        put the features in the table's order."""
        if names is None:
            names = tuple(f.name for f in _features.supported_by(self.family))
        if (not isinstance(self.features, tuple) or len(set(self.features)) != len(self.features)
                or any(n not in names for n in self.features) or (self.split and not split)):
            raise ValueError(f"features of {self.family} must be a tuple of distinct names "
                             f"among {names}{'' if split else ' (no split)'}, got "
                             f"{self.features!r}")
        for n in self.features:
            lacking = [r for r in _features.by_name(n).requires if r not in self.features]
            if lacking:
                raise ValueError(f"features of {self.family}: {n} requires "
                                 f"{', '.join(lacking)}, got {self.features!r}")
        # one order for keys and equality: the table's
        order = tuple(f.name for f in _features.FEATURES)
        object.__setattr__(self, "features", tuple(n for n in order if n in self.features))
        if "varlen" in self.features and self.split:
            raise ValueError(f"features of {self.family}: a packed batch (varlen) is never "
                             f"split across grid.z, got split=True")
        if (not isinstance(self.dr, int) or self.dr < 0
                or (self.dr > 0) != ("rel_qk" in self.features) or self.dr > MAX_HEAD_DIM):
            raise ValueError(f"dr of {self.family} must be in 1..{MAX_HEAD_DIM} with the rel_qk "
                             f"feature and 0 without it, got dr={self.dr!r} with features "
                             f"{self.features!r}")

    if TYPE_CHECKING:
        # What every family's spec declares (a field, or a property where derived), read by
        # the shared methods below; declared here for the type checker only, so that the
        # dataclass fields and their order stay the families' own.
        @property
        def dtype(self) -> str: ...
        @property
        def acc(self) -> str: ...
        @property
        def d(self) -> int: ...
        @property
        def dv(self) -> int: ...
        @property
        def warps(self) -> int: ...
        @property
        def block_m(self) -> int: ...
        @property
        def block_n(self) -> int: ...
        @property
        def block_r(self) -> int: ...
        @property
        def block_c(self) -> int: ...

    def _tile_defines(self) -> dict:
        """The family's tile parameters as ``#define`` name -> value."""
        raise NotImplementedError(f"{type(self).__name__} defines no tile parameters")

    def _rel_shared_bytes(self) -> int:
        """Shared memory of the rel_qk staging, in the accumulation type: the query tile's
        rel_q rows (block_m, dr + 1) and the key tile's band of rel_k (block_m + block_n - 1,
        dr + 1); odd row strides keep the per-score reads free of bank conflicts."""
        if not self.dr:
            return 0
        return (2 * self.block_m + self.block_n - 1) * (self.dr + 1) * self.acc_itemsize

    def _grad_tile_bytes(self) -> int:
        """Shared memory of a backward dQ kernel's in-kernel gradient reductions: one (block_r,
        block_c + 1) accumulation-type tile of dS with rel_bias or a block bias
        (:func:`bwd_bias_tile`) and one of dC with rel_qk."""
        tiles = int(bwd_bias_tile(self.features)) + int(self.dr > 0)
        return tiles * self.block_r * (self.block_c + 1) * self.acc_itemsize

    def _dim_parts(self) -> list:
        """``d64``, ``dv64`` and, with rel_qk, ``dr32``: the head widths in a key."""
        return [f"d{self.d}", f"dv{self.dv}"] + ([f"dr{self.dr}"] if self.dr else [])

    @property
    def acc_itemsize(self) -> int:
        """Bytes of one accumulation-dtype element."""
        return np.dtype(self.acc).itemsize

    def has(self, name: str) -> bool:
        """Whether option ``name`` (a row of the feature table) is compiled in."""
        _features.by_name(name)
        return name in self.features

    def _flag_key(self) -> list:
        """The end of the key: the features, then ``split``."""
        return list(self.features) + (["split"] if self.split else [])

    def defines(self) -> dict:
        """``#define`` name -> value, in a fixed order: element and accumulation types, head
        dims and warps (fields every attention spec has), the family's tile parameters, then
        one define per row of the feature table, then the split."""
        out = {
            "CUONLINE_T": _C_TYPES[self.dtype],
            "CUONLINE_ACC": _C_TYPES[self.acc],
            "CUONLINE_D": self.d,
            "CUONLINE_DV": self.dv,
            "CUONLINE_WARPS": self.warps,
            "CUONLINE_DR": self.dr,
        }
        out.update(self._tile_defines())
        for f in _features.FEATURES:
            out[f.define] = int(f.name in self.features)
        out["CUONLINE_SPLIT"] = int(self.split)
        return out

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def dtype_tag(dtype) -> str:
    """Short tag of a floating dtype name: ``float16`` -> ``f16``."""
    return _TAGS[dtype_name(dtype)]


class _SimtBlock:
    """The block of the SIMT families (forward and statistics): ``warps`` warps of
    ``rows_per_warp`` owned rows each, streaming tiles of ``32 * keys_per_lane`` rows."""

    warps: int
    rows_per_warp: int
    keys_per_lane: int

    @property
    def block_m(self) -> int:
        return self.warps * self.rows_per_warp

    @property
    def block_n(self) -> int:
        return 32 * self.keys_per_lane

    @property
    def threads(self) -> int:
        return 32 * self.warps


@dataclass(frozen=True)
class AttentionSimtSpec(_SimtBlock, AttentionSpec):
    """One variant of the SIMT attention forward family ``attention_fwd_simt``.

    Attributes
    ----------
    dtype, acc : str
        Element and accumulation dtype names (``"float16"``, ..., ``"float64"``).
    d, dv : int
        Head dimensions of q/k and of v (1..256).
    warps, rows_per_warp, keys_per_lane : int
        Block shape: ``block_m = warps * rows_per_warp`` query rows per block and
        ``block_n = 32 * keys_per_lane`` keys per tile.
    features, split
        Keyword-only: see :class:`AttentionSpec`.
    """

    dtype: str
    acc: str
    d: int
    dv: int
    warps: int
    rows_per_warp: int
    keys_per_lane: int

    family = "attention_fwd_simt"

    def __post_init__(self):
        self._check_simt_shape()
        self._check_features()

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of one block: sQ (block_m, d) + sKV (block_n, max(d, dv) + 1),
        then with rel_qk the rel_q rows and the rel_k band (:meth:`_rel_shared_bytes`)."""
        return (self.block_m * self.d + self.block_n * (max(self.d, self.dv) + 1)) * (
            self.acc_itemsize
        ) + self._rel_shared_bytes()

    @property
    def key(self) -> str:
        """Readable unique name, e.g.
        ``attention_fwd_simt_f32_d64_dv64_bm16_bn64_w4_window_bias``."""
        parts = [
            self.family, dtype_tag(self.dtype), *self._dim_parts(),
            f"bm{self.block_m}", f"bn{self.block_n}", f"w{self.warps}",
        ]
        if self.acc != acc_name(self.dtype):
            parts.append(f"acc{dtype_tag(self.acc)}")
        return "_".join(parts + self._flag_key())

    def _tile_defines(self) -> dict:
        return {"CUONLINE_ROWS_PER_WARP": self.rows_per_warp,
                "CUONLINE_KEYS_PER_LANE": self.keys_per_lane}


#: Modes of the softmax family: public function name -> (key tag, CUONLINE_SOFTMAX_MODE).
SOFTMAX_MODES = {"softmax": ("softmax", 0), "log_softmax": ("logsoftmax", 1),
                 "logsumexp": ("logsumexp", 2)}


@dataclass(frozen=True)
class SoftmaxSpec:
    """One variant of the ``softmax`` family (``kernels_cu/softmax.cu``).

    Attributes
    ----------
    dtype, acc : str
        Element and accumulation dtype names.
    mode : str
        ``"softmax"``, ``"log_softmax"`` or ``"logsumexp"``.
    mask : bool
        A boolean mask is read (through its own strides).

    Threads per row and rows per block are launch parameters, not compile-time ones: one
    compiled variant serves every row length.
    """

    dtype: str
    acc: str
    mode: str
    mask: bool = False

    family = "softmax"
    #: Largest block (``__launch_bounds__`` in softmax.cu).
    threads = 256
    #: No dynamic shared memory (the per-warp states are static).
    shared_bytes = 0

    def __post_init__(self):
        if self.dtype not in _TAGS or self.acc not in ("float32", "float64"):
            raise ValueError(f"unsupported dtype/acc pair {self.dtype}/{self.acc}")
        if self.mode not in SOFTMAX_MODES:
            raise ValueError(f"mode must be one of {tuple(SOFTMAX_MODES)}, got {self.mode!r}")

    @property
    def key(self) -> str:
        """Readable unique name, e.g. ``softmax_f32_logsoftmax_mask``."""
        parts = [self.family, dtype_tag(self.dtype), SOFTMAX_MODES[self.mode][0]]
        if self.acc != acc_name(self.dtype):
            parts.append(f"acc{dtype_tag(self.acc)}")
        if self.mask:
            parts.append("mask")
        return "_".join(parts)

    def defines(self) -> dict:
        """``#define`` name -> value, in a fixed order."""
        return {
            "CUONLINE_T": _C_TYPES[self.dtype],
            "CUONLINE_ACC": _C_TYPES[self.acc],
            "CUONLINE_SOFTMAX_MODE": SOFTMAX_MODES[self.mode][1],
            "CUONLINE_HAS_MASK": int(self.mask),
        }

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: Largest max(D, Dv) of the tensor-core family per element dtype: the O accumulator lives in
#: registers (16 rows x Dv / 32 lanes per thread, in f32 or f64); beyond it the SIMT family runs.
MMA_MAX_HEAD_DIM = {"float16": 256, "bfloat16": 256, "float32": 256, "float64": 128}
#: The mma instruction of each element dtype, and its k (the head dim is padded to it).
MMA_INSTRUCTIONS = {
    "float16": ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", 16),
    "bfloat16": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", 16),
    "float32": ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", 8),
    "float64": ("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64", 4),
}


def _smem_stride(cols: int, itemsize: int) -> int:
    """Elements per stored row of tensor_core.cuh's SmemTile: swizzled (no padding) when a row
    is a power-of-two number of 16-byte chunks, else padded to an odd number of chunks."""
    per_chunk = 16 // itemsize
    chunks = cols // per_chunk
    return cols if chunks & (chunks - 1) == 0 else (chunks | 1) * per_chunk


@dataclass(frozen=True)
class AttentionMmaSpec(AttentionSpec):
    """One variant of the tensor-core attention forward family ``attention_fwd_mma``.

    Attributes
    ----------
    dtype : str
        Element dtype: ``float16``/``bfloat16`` (mma.m16n8k16, f32 accumulation), ``float32``
        (TF32 mma.m16n8k8, f32 accumulation: ``precision="tf32"``) or ``float64``
        (mma.m8n8k4, f64 accumulation).
    d, dv : int
        Head dimensions of q/k and of v; padded in shared memory to the mma k and to 16.
    warps, block_n, stages : int
        Warps per block, ``block_n`` keys per tile, and the number of K/V tiles in flight (2:
        tile j + 1 loads while tile j computes).
    cp_async : bool
        q, k and v rows are 16-byte aligned with unit column stride: cp.async copies them.
        False: an element-wise loader (any strides) fills the same shared-memory layout.
    m_tiles : int
        16-row query tiles per warp, 1 or 2: ``block_m = 16 * m_tiles * warps``. With 2, each
        K and V fragment a warp reads from shared memory feeds twice the mmas (half the
        shared-memory traffic per flop, FlashAttention-2's 32 rows per warp), for twice the
        accumulator registers.
    features, split
        Keyword-only: see :class:`AttentionSpec`.
    """

    dtype: str
    d: int
    dv: int
    warps: int
    block_n: int
    stages: int
    cp_async: bool = True
    m_tiles: int = 1

    family = "attention_fwd_mma"

    def __post_init__(self):
        if self.dtype not in MMA_MAX_HEAD_DIM:
            raise ValueError(f"unsupported dtype {self.dtype}")
        limit = MMA_MAX_HEAD_DIM[self.dtype]
        for name in ("d", "dv"):
            value = getattr(self, name)
            if not 1 <= value <= limit:
                raise ValueError(f"{name} must be in 1..{limit} for {self.dtype}, got {value}")
        if (not 1 <= self.warps <= 8 or self.block_n % 16 or self.stages not in (1, 2)
                or self.m_tiles not in (1, 2)):
            raise ValueError(f"bad tile shape: warps={self.warps}, block_n={self.block_n}, "
                             f"stages={self.stages}, m_tiles={self.m_tiles}")
        self._check_features()

    @property
    def acc(self) -> str:
        return acc_name(self.dtype)

    @property
    def block_m(self) -> int:
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def instruction(self) -> str:
        """The PTX mma instruction this variant issues."""
        return MMA_INSTRUCTIONS[self.dtype][0]

    @property
    def padded_dims(self) -> tuple:
        """``(Dp, Dvp)``: D rounded up to the mma k, Dv to 16 (pairs of 8-column n-tiles)."""
        k = MMA_INSTRUCTIONS[self.dtype][1]
        return -(-self.d // k) * k, -(-self.dv // 16) * 16

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of one block: sQ + stages x (sK + sV), element type, then with
        rel_qk the rel_q rows and the rel_k band in the accumulation type
        (:meth:`AttentionSpec._rel_shared_bytes`)."""
        itemsize = np.dtype(self.dtype).itemsize if self.dtype != "bfloat16" else 2
        dp, dvp = self.padded_dims
        qk, vv = _smem_stride(dp, itemsize), _smem_stride(dvp, itemsize)
        tiles = (self.block_m * qk + self.stages * self.block_n * (qk + vv)) * itemsize
        return tiles + self._rel_shared_bytes()

    @property
    def key(self) -> str:
        """Readable unique name, e.g. ``attention_fwd_mma_f16_d64_dv64_bm64_bn64_s2_window``
        (``_mt2`` after ``bm`` for two query tiles per warp)."""
        tag = "tf32" if self.dtype == "float32" else dtype_tag(self.dtype)
        parts = [self.family, tag, *self._dim_parts(), f"bm{self.block_m}"]
        if self.m_tiles > 1:
            parts.append(f"mt{self.m_tiles}")
        parts += [f"bn{self.block_n}", f"s{self.stages}"]
        if not self.cp_async:
            parts.append("plainload")
        return "_".join(parts + self._flag_key())

    def _tile_defines(self) -> dict:
        return {"CUONLINE_M_TILES": self.m_tiles, "CUONLINE_BLOCK_N": self.block_n,
                "CUONLINE_STAGES": self.stages, "CUONLINE_CP_ASYNC": int(self.cp_async)}


# --------------------------------------------------------------------------------------------
# the attention backward (issue 13)


@dataclass(frozen=True)
class AttentionBwdSimtSpec(AttentionSpec):
    """One variant of the SIMT attention backward family ``attention_bwd_simt``
    (``kernels_cu/attention_bwd_simt.cu``: a dK/dV kernel and a dQ kernel in one module).

    Attributes
    ----------
    dtype, acc : str
        Element and accumulation dtype names.
    d, dv : int
        Head dimensions of q/k and of v (1..256).
    warps, rows_per_warp, items_per_lane : int
        Block shape: a block owns ``block_r = warps * rows_per_warp`` rows (keys in the dK/dV
        kernel, queries in the dQ kernel) and streams tiles of ``block_c = 32 *
        items_per_lane`` rows of the other kind.
    write_ds : bool
        The dQ kernel writes each logit's gradient dS into a ``(nbatch, lq, lk)`` workspace:
        the gradient of a (plain) bias. The other gradients are reduced in the kernel
        (attention_grads.cuh): a block bias's into slots of per-block sums, rel_bias's and
        rel_k's into per-query-tile partials, rel_q's per row.
    features, dr
        Keyword-only: the options compiled in, among
        :data:`cuonline.kernels.features.BACKWARD_FEATURES`, and the width of rel_q / rel_k
        (positive exactly with ``rel_qk``: the dQ kernel then also reduces the content
        gradient dC into the rel_q / rel_k gradients). ``split`` is always False.
    """

    dtype: str
    acc: str
    d: int
    dv: int
    warps: int
    rows_per_warp: int
    items_per_lane: int
    write_ds: bool = False

    family = "attention_bwd_simt"

    def __post_init__(self):
        self._check_simt_shape()
        self._check_features(split=False)

    @property
    def block_r(self) -> int:
        return self.warps * self.rows_per_warp

    @property
    def block_c(self) -> int:
        return 32 * self.items_per_lane

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of one block (both kernels launch with it): the owned rows
        (block_r, d + dv), a streamed tile (block_c, d + 1 + dv + 1) and the dK/dV kernel's
        lse and Delta (block_c each), then with rel_qk the rel_q rows and the rel_k band of
        the larger kernel (block_c or block_r rows of rel_q, block_r + block_c - 1 of rel_k,
        at dr + 1 per row), in the accumulation type."""
        r, c = self.block_r, self.block_c
        rel = (max(r, c) + r + c - 1) * (self.dr + 1) if self.dr else 0
        return ((r * (self.d + self.dv) + c * (self.d + self.dv + 4) + rel)
                * self.acc_itemsize + self._grad_tile_bytes())

    @property
    def key(self) -> str:
        """Readable unique name, e.g.
        ``attention_bwd_simt_f32_d64_dv64_br16_bc32_w4_ds_bias``."""
        parts = [self.family, dtype_tag(self.dtype), *self._dim_parts(),
                 f"br{self.block_r}", f"bc{self.block_c}", f"w{self.warps}"]
        if self.acc != acc_name(self.dtype):
            parts.append(f"acc{dtype_tag(self.acc)}")
        if self.write_ds:
            parts.append("ds")
        return "_".join(parts + list(self.features))

    def _tile_defines(self) -> dict:
        return {"CUONLINE_ROWS_PER_WARP": self.rows_per_warp,
                "CUONLINE_ITEMS_PER_LANE": self.items_per_lane,
                "CUONLINE_WRITE_DS": int(self.write_ds)}


#: Largest D and Dv of the tensor-core backward: dK and dV of 16 keys stay in registers, 128
#: float32 accumulators per lane at 128 (docs/kernels.md, "Tile tables": why TF32 stops at 64).
MMA_BWD_MAX_HEAD_DIM = {"float16": 128, "bfloat16": 128, "float32": 64, "float64": 64}


@dataclass(frozen=True)
class AttentionBwdMmaSpec(AttentionSpec):
    """One variant of the tensor-core attention backward family ``attention_bwd_mma``
    (``kernels_cu/attention_bwd_mma.cu``: a dK/dV kernel and a dQ kernel in one module).

    Attributes
    ----------
    dtype : str
        Element dtype, a key of :data:`MMA_BWD_MAX_HEAD_DIM`: ``float16``/``bfloat16``
        (mma.m16n8k16, float32 accumulation), ``float32`` (TF32 mma.m16n8k8:
        ``precision="tf32"``) or ``float64`` (mma.m8n8k4, float64 accumulation).
    d, dv : int
        Head dimensions of q/k and of v, padded to multiples of 16 in shared memory.
    warps, block_c : int
        A block owns ``block_r = 16 * warps`` rows (keys in the dK/dV kernel, queries in the
        dQ kernel) and streams tiles of ``block_c`` rows of the other kind (a multiple of 16).
    cp_async : bool
        q, k, v and dout rows are 16-byte aligned with unit column stride (cp.async); False:
        the element-wise loader.
    write_ds : bool
        As :class:`AttentionBwdSimtSpec`: the dQ kernel writes dS for the host's reductions.
    features, dr
        Keyword-only: options among
        :data:`cuonline.kernels.features.MMA_BACKWARD_FEATURES`, and the rel_q / rel_k width.
    """

    dtype: str
    d: int
    dv: int
    warps: int
    block_c: int
    cp_async: bool = True
    write_ds: bool = False

    family = "attention_bwd_mma"

    def __post_init__(self):
        if self.dtype not in MMA_BWD_MAX_HEAD_DIM:
            raise ValueError(f"dtype of {self.family} must be one of "
                             f"{', '.join(MMA_BWD_MAX_HEAD_DIM)}, got {self.dtype!r}")
        limit = MMA_BWD_MAX_HEAD_DIM[self.dtype]
        for name in ("d", "dv"):
            value = getattr(self, name)
            if not 1 <= value <= limit:
                raise ValueError(f"{name} of {self.family} must be in 1..{limit} for "
                                 f"{self.dtype}, got {value}")
        if not 1 <= self.warps <= 8 or self.block_c % 16 or not 16 <= self.block_c <= 128:
            raise ValueError(f"bad tile shape of {self.family}: warps={self.warps}, "
                             f"block_c={self.block_c}")
        self._check_features(split=False)

    @property
    def acc(self) -> str:
        return acc_name(self.dtype)

    @property
    def block_r(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def instruction(self) -> str:
        """The PTX mma instruction this variant issues."""
        return MMA_INSTRUCTIONS[self.dtype][0]

    @property
    def padded_dims(self) -> tuple:
        """``(Dp, Dvp)``: D and Dv rounded up to 16."""
        return -(-self.d // 16) * 16, -(-self.dv // 16) * 16

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of one block (both kernels launch with it): the owned rows
        and a streamed tile, (block_r + block_c) x (Dp + Dvp) in the element type
        (tensor_core.cuh's layouts), then in the accumulation type the dK/dV kernel's lse and
        Delta (block_c each) and with rel_qk the larger kernel's rel_q rows and rel_k band
        (as :class:`AttentionBwdSimtSpec`)."""
        dp, dvp = self.padded_dims
        itemsize = 2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize
        tiles = ((self.block_r + self.block_c)
                 * (_smem_stride(dp, itemsize) + _smem_stride(dvp, itemsize)) * itemsize)
        r, c = self.block_r, self.block_c
        rel = (max(r, c) + r + c - 1) * (self.dr + 1) if self.dr else 0
        return tiles + (2 * c + rel) * self.acc_itemsize + self._grad_tile_bytes()

    @property
    def key(self) -> str:
        """Readable unique name, e.g. ``attention_bwd_mma_f16_d64_dv64_br64_bc64_ds_bias``."""
        tag = "tf32" if self.dtype == "float32" else dtype_tag(self.dtype)
        parts = [self.family, tag, *self._dim_parts(), f"br{self.block_r}",
                 f"bc{self.block_c}"]
        if not self.cp_async:
            parts.append("plainload")
        if self.write_ds:
            parts.append("ds")
        return "_".join(parts + list(self.features))

    def _tile_defines(self) -> dict:
        return {"CUONLINE_BLOCK_C": self.block_c, "CUONLINE_CP_ASYNC": int(self.cp_async),
                "CUONLINE_WRITE_DS": int(self.write_ds)}


# --------------------------------------------------------------------------------------------
# the statistics of the attention weights (issue 21): attention_stats

__all__ += ["AttentionStatsSpec", "STATS_MAX_TOP_K"]

#: Largest ``top_k`` the CUDA statistics kernels keep (one entry per lane of a warp).
STATS_MAX_TOP_K = 32


@dataclass(frozen=True)
class AttentionStatsSpec(_SimtBlock, AttentionSpec):
    """One variant of the statistics family ``attention_stats``
    (``kernels_cu/attention_stats.cu``: pass 1, the key-owned ``received`` pass and the rows of
    ``P``, three kernels in one module).

    Attributes
    ----------
    dtype, acc : str
        Element and accumulation dtype names.
    d : int
        Head dimension of q and k (1..256).
    warps, rows_per_warp, keys_per_lane : int
        Block shape: a block owns ``block_m = warps * rows_per_warp`` rows (queries in pass 1
        and the rows kernel, keys in the ``received`` pass) and streams tiles of ``block_n =
        32 * keys_per_lane`` rows of the other kind.
    top_k : bool
        Pass 1 keeps the running top-k selection (up to :data:`STATS_MAX_TOP_K` keys; the
        number is a kernel argument).
    features, dr
        Keyword-only: the score options compiled in (the rows of
        :data:`cuonline.kernels.features.FEATURES` whose ``families`` name ``attention_stats``)
        and the width of rel_q / rel_k. ``split`` is always False.
    """

    dtype: str
    acc: str
    d: int
    warps: int
    rows_per_warp: int
    keys_per_lane: int
    top_k: bool = False

    family = "attention_stats"

    def __post_init__(self):
        self._check_simt_shape()
        self._check_features(split=False)

    @property
    def dv(self) -> int:
        """The kernels read no values; CUONLINE_DV is the head width (unused)."""
        return self.d

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of one block, the largest of the three kernels (all launch
        with it): the owned rows (block_m, d), a streamed tile (block_n, d + 1), the
        ``received`` pass's lse and weights (block_n each), then with rel_qk the rel_q rows
        (max(block_m, block_n)) and the rel_k band (block_m + block_n - 1), at dr + 1 per
        row, in the accumulation type."""
        m, n = self.block_m, self.block_n
        rel = (max(m, n) + m + n - 1) * (self.dr + 1) if self.dr else 0
        return (m * self.d + n * (self.d + 1) + 2 * n + rel) * self.acc_itemsize

    @property
    def key(self) -> str:
        """Readable unique name, e.g. ``attention_stats_f32_d64_bm16_bn64_w4_topk_window``."""
        parts = [self.family, dtype_tag(self.dtype), f"d{self.d}"]
        parts += [f"dr{self.dr}"] if self.dr else []
        parts += [f"bm{self.block_m}", f"bn{self.block_n}", f"w{self.warps}"]
        if self.acc != acc_name(self.dtype):
            parts.append(f"acc{dtype_tag(self.acc)}")
        if self.top_k:
            parts.append("topk")
        return "_".join(parts + list(self.features))

    def _tile_defines(self) -> dict:
        return {"CUONLINE_ROWS_PER_WARP": self.rows_per_warp,
                "CUONLINE_KEYS_PER_LANE": self.keys_per_lane,
                "CUONLINE_STATS_TOP_K": int(self.top_k)}
