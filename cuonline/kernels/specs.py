"""Compile-time parameters of each kernel variant, with a readable key.

A :class:`KernelSpec` is the one object that names a compiled variant: the CuPy module cache,
the emulation, the NVRTC listing, logs and error messages all use its :attr:`KernelSpec.key`.
Its :meth:`KernelSpec.defines` are pasted as ``#define`` lines at the top of the source text
(see :mod:`cuonline.kernels.source`), so every variant is the same ``.cu`` text specialised by
constants, never a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

__all__ = ["FEATURES", "KernelSpec", "MAX_HEAD_DIM", "SOFTMAX_MODES", "SoftmaxSpec", "dtype_tag"]

#: Largest D and Dv the SIMT kernel family is compiled for (registers and shared memory).
MAX_HEAD_DIM = 256

#: Feature flags in key order; each maps to a ``CUONLINE_<FLAG>`` define.
FEATURES = ("window", "bias", "mask", "kv_lengths", "alibi", "softcap", "return_lse")

_TAGS = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}
_C_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
            "float64": "double"}


def dtype_tag(dtype) -> str:
    """Short tag of a floating dtype name: ``float16`` -> ``f16``."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    return _TAGS[name]


@dataclass(frozen=True)
class KernelSpec:
    """One variant of the ``attention_fwd`` family.

    Attributes
    ----------
    dtype, acc : str
        Element and accumulation dtype names (``"float16"``, ..., ``"float64"``).
    d, dv : int
        Head dimensions of q/k and of v (1..256).
    warps, rows_per_warp, keys_per_lane : int
        Block shape: ``block_m = warps * rows_per_warp`` query rows per block and
        ``block_n = 32 * keys_per_lane`` keys per tile.
    window, bias, mask, kv_lengths, alibi, softcap, return_lse : bool
        Compile-time feature flags (causal is folded into ``window``).
    split : bool
        Keys are split across ``grid.z``; partial states go to a workspace and a second kernel
        (``cuonline_attention_combine``) merges them.
    """

    dtype: str
    acc: str
    d: int
    dv: int
    warps: int
    rows_per_warp: int
    keys_per_lane: int
    window: bool = False
    bias: bool = False
    mask: bool = False
    kv_lengths: bool = False
    alibi: bool = False
    softcap: bool = False
    return_lse: bool = False
    split: bool = False

    family = "attention_fwd"
    entry = "cuonline_attention_fwd"
    combine_entry = "cuonline_attention_combine"

    def __post_init__(self):
        if self.dtype not in _TAGS or self.acc not in ("float32", "float64"):
            raise ValueError(f"unsupported dtype/acc pair {self.dtype}/{self.acc}")
        for name in ("d", "dv"):
            value = getattr(self, name)
            if not 1 <= value <= MAX_HEAD_DIM:
                raise ValueError(f"{name} must be in 1..{MAX_HEAD_DIM}, got {value}")

    @property
    def block_m(self) -> int:
        return self.warps * self.rows_per_warp

    @property
    def block_n(self) -> int:
        return 32 * self.keys_per_lane

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def acc_itemsize(self) -> int:
        return np.dtype(self.acc).itemsize

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of one block: sQ (block_m, d) + sKV (block_n, max(d, dv) + 1)."""
        return (self.block_m * self.d + self.block_n * (max(self.d, self.dv) + 1)) * (
            self.acc_itemsize
        )

    @property
    def features(self) -> tuple:
        return tuple(f for f in FEATURES if getattr(self, f))

    @property
    def key(self) -> str:
        """Readable unique name, e.g. ``attention_fwd_f32_d64_dv64_bm16_bn64_w4_window_bias``."""
        parts = [
            self.family, dtype_tag(self.dtype), f"d{self.d}", f"dv{self.dv}",
            f"bm{self.block_m}", f"bn{self.block_n}", f"w{self.warps}",
        ]
        if self.acc != ("float64" if self.dtype == "float64" else "float32"):
            parts.append(f"acc{dtype_tag(self.acc)}")
        parts.extend(self.features)
        if self.split:
            parts.append("split")
        return "_".join(parts)

    def defines(self) -> dict:
        """``#define`` name -> value, in a fixed order."""
        out = {
            "CUONLINE_T": _C_TYPES[self.dtype],
            "CUONLINE_ACC": _C_TYPES[self.acc],
            "CUONLINE_D": self.d,
            "CUONLINE_DV": self.dv,
            "CUONLINE_WARPS": self.warps,
            "CUONLINE_ROWS_PER_WARP": self.rows_per_warp,
            "CUONLINE_KEYS_PER_LANE": self.keys_per_lane,
        }
        for f in FEATURES:
            name = "CUONLINE_RETURN_LSE" if f == "return_lse" else f"CUONLINE_HAS_{f.upper()}"
            out[name] = int(getattr(self, f))
        out["CUONLINE_SPLIT"] = int(self.split)
        return out

    def entries(self) -> tuple:
        """Kernel symbols this variant defines."""
        return (self.entry, self.combine_entry)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
    entry = "cuonline_softmax"
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
        if self.acc != ("float64" if self.dtype == "float64" else "float32"):
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

    def entries(self) -> tuple:
        """Kernel symbols this variant defines."""
        return (self.entry,)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
