"""The one module that knows array libraries.

It recognises the library of an argument (NumPy, CuPy, Dask, or any ``__dlpack__`` producer:
torch, JAX, TensorFlow, ...), brings a foreign array in without a copy as a NumPy array (host
memory) or a CuPy array (CUDA memory) through DLPack, and remembers how to hand results back
(:class:`Origin`: the library, the device and, for torch, the stream). Every other module asks
here: validation for the NumPy/CuPy namespace and the mixed-libraries error, the public
functions for :func:`adapt` and :meth:`Origin.back`, the framework bindings for the views of
their buffers. Nothing here imports CuPy, torch or JAX until an array of theirs arrives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

__all__ = ["Origin", "adapt", "buffer_view", "check_one_library", "host_or_cuda_view", "is_dask",
           "library", "namespace", "numpy_dtype", "on_cuda", "origin_of", "refuse_masked"]

# top-level module of an array type -> the library's name in messages
_LIBRARY_OF_MODULE = {"jaxlib": "jax", "cupy_backends": "cupy"}
# DLPack device types (dlpack.h: DLDeviceType) whose memory NumPy can read, and CUDA's
_DLPACK_HOST = (1, 3)          # kDLCPU, kDLCUDAHost (pinned)
_DLPACK_CUDA = (2, 13)         # kDLCUDA, kDLCUDAManaged
# how to move arrays between each pair of libraries, for the mixed-libraries message
_HINT_NUMPY_CUPY = "cupy.asarray / cupy.asnumpy"
_HINT_DLPACK = "e.g. numpy.from_dlpack, cupy.from_dlpack, torch.from_dlpack, jax.dlpack"


def library(x: Any) -> str | None:
    """The array library of ``x``: "numpy", "cupy", "dask", the top-level module of any other
    DLPack producer ("torch", "jax", "tensorflow", ...), or None for a non-array (a list, a
    scalar, None), which the engine's namespace converts."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if isinstance(x, np.generic):
        return None
    module = type(x).__module__
    top = module.partition(".")[0]
    top = _LIBRARY_OF_MODULE.get(top, top)
    if top == "cupy":
        return "cupy"
    if module.startswith("dask.array"):
        return "dask"
    if hasattr(type(x), "__dlpack__"):
        return top
    return None


def is_dask(x: Any) -> bool:
    """Whether ``x`` is a Dask array (recognised by its module, without importing Dask)."""
    return library(x) == "dask"


def refuse_masked(x: Any, name: str) -> None:
    """TypeError for a ``numpy.ma`` array: asarray would drop its mask without a word,
    computing with the masked-out values."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"`{name}` is a numpy.ma masked array, whose mask cuonline would ignore; pass its "
            f"data (numpy.ma.getdata) and the entries to keep as the boolean `mask=` argument "
            f"(True = keep, i.e. ~numpy.ma.getmaskarray(x))"
        )


def _one_library(named: Mapping[str, Any]) -> str | None:
    """The one library of the arrays among ``named`` (None when there is none); a TypeError
    naming two arguments of different libraries and their libraries otherwise."""
    seen: dict[str, str] = {}
    for name, x in named.items():
        refuse_masked(x, name)
        lib = library(x)
        if lib is not None:
            seen.setdefault(lib, name)
    if "dask" in seen and set(seen) <= {"dask", "numpy", "cupy"}:
        return "dask"                # Dask's graph builder takes in-memory arrays beside it
    if len(seen) > 1:
        (lib_a, arg_a), (lib_b, arg_b) = sorted(seen.items())[:2]
        hint = _HINT_NUMPY_CUPY if {lib_a, lib_b} == {"cupy", "numpy"} else _HINT_DLPACK
        raise TypeError(
            f"arrays from different libraries: `{arg_a}` is a {lib_a} array and `{arg_b}` is a "
            f"{lib_b} array; move them to one library first ({hint})"
        )
    return next(iter(seen), None)


def check_one_library(named: Mapping[str, Any]) -> str | None:
    """The one array library among the values of ``named`` (None: no arrays); a TypeError
    naming two arguments of different libraries and their libraries otherwise."""
    return _one_library(named)


def numpy_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype of any library's dtype (``torch.float32``, ``jnp.bfloat16``, ...),
    bfloat16 as ml_dtypes'."""
    name = str(dtype).rpartition(".")[2]
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(dtype)
    except TypeError:
        return np.dtype(name)


def namespace(**named: Any) -> Any:
    """numpy or cupy for the named arguments (NumPy/CuPy arrays, non-arrays or None), which
    must not mix array libraries; non-arrays are converted later with the namespace chosen by
    the arrays. Arrays of other libraries come here only through :func:`adapt`."""
    lib = _one_library(named)
    if lib == "cupy":
        import cupy

        return cupy
    if lib not in (None, "numpy", "dask"):
        name = next(n for n, x in named.items() if library(x) == lib)
        raise TypeError(f"`{name}` is a {lib} array; cuonline's engines take NumPy or CuPy "
                        f"arrays (the public functions convert {lib} arrays through DLPack)")
    return np


# --------------------------------------------------------------------------------------------
# foreign arrays in and out


@dataclass(frozen=True)
class Origin:
    """Where a call's arrays came from, so that results go back there.

    ``library`` is the caller's library ("torch", "jax", ...); ``device`` is "cpu" or "cuda"
    with ``device_id``; ``stream`` is the CUDA stream (a ``cudaStream_t`` as an int) the work
    runs on: torch's current stream for torch tensors, None for CuPy's current stream.
    """

    library: str
    device: str
    device_id: int = 0
    stream: int | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The context the call computes in: on CUDA, the device and the producer's stream
        as CuPy's current stream, so every kernel and copy is ordered after the producer's
        work; nothing on the host."""
        if self.device != "cuda":
            yield
            return
        import cupy

        with cupy.cuda.Device(self.device_id):
            if self.stream is None:
                yield
            else:
                with cupy.cuda.ExternalStream(self.stream, self.device_id):
                    yield

    def back(self, result: Any) -> Any:
        """``result`` (a NumPy/CuPy array, a tuple of them, a :class:`cuonline.Gradients` or
        None) in the caller's library on the caller's device, without a copy where the library
        can take the memory."""
        if result is None:
            return None
        if isinstance(result, tuple):
            return tuple(self.back(r) for r in result)
        if dataclasses.is_dataclass(result) and not isinstance(result, type):  # Gradients
            return dataclasses.replace(result, **{f.name: self.back(getattr(result, f.name))
                                                  for f in dataclasses.fields(result)})
        return _export(self.library, result)


def adapt(named: Mapping[str, Any]) -> tuple[dict[str, Any], Origin | None]:
    """The named arguments with foreign arrays brought in as NumPy (host) or CuPy (CUDA)
    arrays without a copy, and their :class:`Origin`; NumPy and CuPy calls come back as they
    are with origin None. Mixing libraries is a TypeError naming the arguments."""
    lib = _one_library(named)
    if lib in (None, "numpy", "cupy", "dask"):
        return dict(named), None
    devices: dict[tuple[str, int], str] = {}
    for name, x in named.items():
        if library(x) == lib:
            _refuse_tracer(x)
            devices.setdefault(_device_of(x, name), name)
    if len(devices) > 1:
        (dev_a, arg_a), (dev_b, arg_b) = list(devices.items())[:2]
        raise ValueError(f"`{arg_a}` is on {dev_a[0]}:{dev_a[1]} and `{arg_b}` on "
                         f"{dev_b[0]}:{dev_b[1]}; move them to one device first")
    device, device_id = next(iter(devices))
    origin = Origin(lib, device, device_id, _producer_stream(lib, device, device_id))
    with origin.running():
        arrays = {n: (host_or_cuda_view(x) if library(x) == lib else x)
                  for n, x in named.items()}
    return arrays, origin


def origin_of(x: Any, stream: int | None = None) -> Origin:
    """The :class:`Origin` of a DLPack producer's array ``x`` (its library and device), with
    the CUDA ``stream`` its producer orders work on (None: CuPy's current stream)."""
    device, device_id = _device_of(x, "array")
    return Origin(library(x) or type(x).__module__, device, device_id,
                  stream if device == "cuda" else None)


def on_cuda(x: Any) -> bool:
    """Whether the DLPack producer's array ``x`` lives in CUDA memory."""
    return _device_of(x, "array")[0] == "cuda"


def _device_of(x: Any, name: str) -> tuple[str, int]:
    kind, device_id = (int(v) for v in x.__dlpack_device__())
    if kind in _DLPACK_HOST:
        return "cpu", 0
    if kind in _DLPACK_CUDA:
        return "cuda", device_id
    raise TypeError(f"`{name}` is in memory of DLPack device type {kind}; cuonline runs on "
                    f"host memory (NumPy) and CUDA memory (CuPy)")


def _producer_stream(lib: str, device: str, device_id: int) -> int | None:
    # torch orders its work on a current stream per device; JAX and other producers make an
    # array ready for the consumer's stream when asked for it through __dlpack__(stream=...)
    if device == "cuda" and lib == "torch":
        import torch

        return int(torch.cuda.current_stream(device_id).cuda_stream)
    return None


def _is_bfloat16(x: Any) -> bool:
    return "bfloat16" in str(getattr(x, "dtype", ""))


def host_or_cuda_view(x: Any) -> Any:
    """A DLPack producer's array (a torch tensor, a JAX array or buffer, ...) as a NumPy array
    (host memory) or a CuPy array (CUDA memory, on CuPy's current stream) sharing its memory.
    Raises TypeError for a JAX tracer (a value inside jax.jit, grad or vmap)."""
    _refuse_tracer(x)
    lib = library(x)
    if lib == "torch" and x.requires_grad:
        x = x.detach()               # DLPack refuses tensors that require grad; same memory
    on_cuda = _device_of(x, "array")[0] == "cuda"
    if _is_bfloat16(x):
        # DLPack has bfloat16 but NumPy does not: read the bits as int16 and view them as
        # ml_dtypes' bfloat16 (CuPy reads the same view)
        import ml_dtypes

        if lib == "torch":
            import torch

            bits = x.view(torch.int16)
        elif not on_cuda and hasattr(x, "__array__"):
            return np.asarray(x)     # JAX on the host: __array__ shares the buffer
        else:
            raise TypeError(f"bfloat16 {lib} arrays on CUDA cannot be read without a copy; "
                            f"convert them to float32 or float16")
        return _import(bits, on_cuda).view(ml_dtypes.bfloat16)
    return _import(x, on_cuda)


def buffer_view(x: Any) -> Any:
    """A NumPy (host) or CuPy (CUDA) view of a buffer that is already ready on the current
    stream, such as a ``jax.experimental.buffer_callback`` buffer inside its callback (whose
    stream is made CuPy's current one): DLPack on the host, the CUDA array interface on CUDA,
    which hands over the pointer without a stream handshake. Outputs stay writable."""
    if _device_of(x, "buffer")[0] == "cuda":
        import cupy

        return cupy.asarray(x)
    return np.from_dlpack(x)


def _import(x: Any, on_cuda: bool) -> Any:
    if on_cuda:
        import cupy

        return cupy.from_dlpack(x)
    return np.from_dlpack(x)


def _refuse_tracer(x: Any) -> None:
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.core.Tracer):
        raise TypeError("a JAX value being traced (inside jax.jit, grad or vmap) has no "
                        "memory to read yet; call cuonline.jax.attention, which runs cuonline "
                        "inside the traced program")


def _export(lib: str, x: Any) -> Any:
    """A NumPy or CuPy array as an array of ``lib`` on the same device."""
    if library(x) not in ("numpy", "cupy"):
        x = np.asarray(x)            # a NumPy scalar from a reduction
    if lib == "torch":
        import torch

        if _is_bfloat16(x):
            return torch.from_dlpack(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(x)
    if lib == "jax":
        import jax

        if library(x) == "numpy":
            return jax.numpy.asarray(x)
        return jax.dlpack.from_dlpack(x)
    # any other DLPack consumer: the module that made the inputs has from_dlpack
    # (TensorFlow: tf.experimental.dlpack.from_dlpack takes a capsule)
    module: Any = sys.modules.get(lib)
    if hasattr(module, "from_dlpack"):
        return module.from_dlpack(x)
    if hasattr(getattr(module, "experimental", None), "dlpack"):
        return module.experimental.dlpack.from_dlpack(x.__dlpack__())
    return x
