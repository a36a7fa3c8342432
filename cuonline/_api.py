"""The public functions: documentation, validation, dispatch. No numerics live here."""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable, TypeVar

import numpy as np

from . import _arrays, _options, _validate
from ._gradients import Gradients
from ._stats import AttentionStats
from .engines import dask as _dask      # recognises Dask arrays; imports Dask only when used
from .engines import merge as _merge
from .engines import softmax as _softmax

__all__ = ["attention", "attention_backward", "attention_stats", "attention_vjp", "merge",
           "softmax", "log_softmax", "logsumexp"]

# backend name -> module under cuonline.engines implementing ``attention(problem)``, and the
# one implementing ``attention_backward(backward_problem)``
_ENGINES = {"numpy": "numpy", "cupy": "cuda", "emulate": "cuda"}
_BACKWARD_ENGINES = {"numpy": "numpy_backward", "cupy": "cuda_backward",
                     "emulate": "cuda_backward"}
#: packed variable-length batches (cu_seqlens) on the NumPy engines: the varlen driver (the
#: CUDA engine's kernels take them themselves)
_VARLEN_ENGINE = "numpy_varlen"
#: A NumPy, CuPy or Dask array (or anything the engine of the call converts: lists, scalars).
Array = Any
F = TypeVar("F", bound=Callable[..., Any])

#: backends that run the softmax family on cuonline's CUDA kernels (cuonline.engines.cuda_softmax)
_CUDA_BACKENDS = ("cupy", "emulate")


# arguments that are no other library's arrays: a NumPy call passes them through as they are
_PLAIN_TYPES = (np.ndarray, int, float, bool, str, type(None))


def _plain(values: Any) -> bool:
    """True when every value is a NumPy array or a plain Python scalar, None or a tuple of
    them (a window): no array of another library among them."""
    return all(type(x) in _PLAIN_TYPES or (type(x) is tuple and _plain(x)) for x in values)


def _adapts(*names: str) -> Callable[[F], F]:
    """Let ``function`` take the arrays of any library: its array arguments ``names`` (and
    every array option it takes) are brought in as NumPy or CuPy arrays without a copy
    (:func:`cuonline._arrays.adapt`), the call runs on the caller's device and stream, and
    the results go back in the caller's library. NumPy, CuPy and Dask calls pass through."""
    def decorate(function: F) -> F:
        signature = inspect.signature(function)
        # cu_seqlens are host integers read by the planner, of any library (NumPy with
        # torch inputs included): validation brings them in, not the inputs' adapter
        array_names = names + tuple(n for n in _options.array_options()
                                    if n in signature.parameters
                                    and n not in _validate.CU_SEQLENS)

        @functools.wraps(function)
        def adapted(*args: Any, **kwargs: Any) -> Any:
            if _plain(args) and _plain(kwargs.values()):
                return function(*args, **kwargs)      # nothing to bring in (0.05 ms less)
            bound = signature.bind(*args, **kwargs)
            arrays, origin = _arrays.adapt({n: bound.arguments[n] for n in array_names
                                            if n in bound.arguments})
            if origin is None:
                return function(*args, **kwargs)
            bound.arguments.update(arrays)
            with origin.running():
                return origin.back(function(*bound.args, **bound.kwargs))
        return adapted                # type: ignore[return-value]
    return decorate


@_adapts("q", "k", "v")
def attention(
    q: Array, k: Array, v: Array, *, scale: float | None = None, causal: bool = False,
    window: tuple[int | None, int | None] | None = None, bias: Array | None = None,
    mask: Array | None = None, kv_lengths: Array | None = None,
    alibi_slopes: Array | None = None, softcap: float | None = None, softcap_bias: bool = False,
    q_offset: int | None = None, k_offset: int = 0,
    bias_block: int | tuple[int, int] | None = None, rel_bias: Array | None = None,
    rel_q: Array | None = None, rel_k: Array | None = None,
    cu_seqlens_q: Array | None = None, cu_seqlens_k: Array | None = None,
    return_lse: bool = False, precision: str = "highest",
    backend: str = "auto", workers: int | None = None,
) -> Any:   # out, or (out, lse) with return_lse
    r"""Exact scaled dot-product attention, computed in tiles with an online softmax.

    Computes ``softmax(scale * q @ k.T + bias) @ v`` per batch element without ever holding
    the ``Lq x Lk`` score matrix: keys and values are visited in tiles while each query row
    keeps a running max, a running sum and an unnormalised output.

    Parameters
    ----------
    q : array, shape (..., Lq, D)
        Queries. NumPy or CuPy array of float16, bfloat16 (with ``ml_dtypes``), float32 or
        float64. Any strides, including negative and zero (broadcast) ones. Torch tensors,
        JAX arrays and other DLPack arrays are read in place as NumPy (host memory) or CuPy
        (CUDA memory) arrays, and the results come back in their library and on their
        device (docs/frameworks.md; ``cuonline.jax`` and ``cuonline.torch`` differentiate).
    k : array, shape (..., Lk, D)
        Keys, same dtype and library as `q`.
    v : array, shape (..., Lk, Dv)
        Values, same dtype and library as `q`. ``Dv`` may differ from ``D``.
        The leading dimensions of `q`, `k` and `v` broadcast together (NumPy rules) into the
        batch shape ``S``; grouped-query attention is such a broadcast, e.g. `q` of shape
        (B, Hkv, G, Lq, D) with `k` and `v` of shape (B, Hkv, 1, Lk, D).
    scale : float, optional
        Multiplies ``q @ k.T``. Default ``1 / sqrt(D)``.
    causal : bool, optional
        Query ``i`` sees key ``j`` only if ``delta <= 0``, where ``delta`` is the key's
        position minus the query's (see `q_offset`): with the default offsets,
        ``j <= i + (Lk - Lq)``, the causal diagonal aligned to the bottom-right corner, so
        the last query sees every key.
    window : (int or None, int or None), optional
        ``(left, right)``: key ``j`` is visible only if ``-left <= delta <= right`` (with the
        default offsets and ``d = i + (Lk - Lq)``: ``d - left <= j <= d + right``); ``None``
        leaves a side unbounded. Combines with `causal` by intersection.
    bias : array, optional
        Real floating array broadcastable to ``S + (Lq, Lk)``, added to the scores (or, with
        `bias_block`, to ``S + (ceil(Lq / r), ceil(Lk / c))``). It is read through its
        broadcast strides, never expanded to the full shape.
    mask : bool array, optional
        Broadcastable to ``S + (Lq, Lk)``; ``True`` means the query may attend to the key.
    kv_lengths : int array, optional
        Broadcastable to ``S``: keys ``j >= kv_lengths`` are padding and are never read, so
        they may hold anything (NaN included). Values above ``Lk`` mean all keys.
    alibi_slopes : array, optional
        Real floating array broadcastable to ``S``: adds ``-slope * |delta|`` to the scores
        (``-slope * |i + (Lk - Lq) - j|`` with the default offsets).
    softcap : float, optional
        ``c > 0``: the content score ``s`` (``scale * q . k``, plus the `rel_q` term) becomes
        ``c * tanh(s / c)`` before `bias`, `rel_bias` and ALiBi are added (Gemma 2,
        FlashAttention).
    softcap_bias : bool, optional
        With `softcap`: apply the cap to the whole logit instead, after `bias`, `rel_bias` and
        ALiBi are added, ``c * tanh((s + bias - slope * |delta|) / c)`` (AlphaGenome). Then a
        ``-inf`` bias gives the logit ``-c``, not a masked key: mask with `mask`. Default False.
    q_offset : int, optional
        Position of query 0: query ``i`` sits at ``q_offset + i``. Default ``Lk - Lq`` (the
        last query faces the last key). Causal, window and ALiBi read the distance
        ``delta = (k_offset + j) - (q_offset + i)``, so attention over chunks of the queries
        and keys, each called with its chunk's offsets, merges exactly with :func:`merge`.
        Any int (NumPy ints included); ``q_offset - k_offset`` is clamped to
        ``+-(2**53 - Lq - Lk)``.
    k_offset : int, optional
        Position of key 0: key ``j`` sits at ``k_offset + j``. Default 0.
    bias_block : int or (int, int), optional
        ``r`` or ``(r, c)``: `bias` is given per block of ``r`` queries by ``c`` keys, and score
        ``(i, j)`` gets ``bias[..., i // r, j // c]`` (local indices): a pair map repeated over
        blocks (AlphaGenome), read from the small array and never expanded.
    rel_bias : array, optional
        Real floating array broadcastable to ``S + (R,)``, ``R`` odd: score ``(i, j)`` gets
        ``rel_bias[..., rb + clip(delta, -rb, rb)]`` with ``rb = (R - 1) // 2``, a bias that
        depends on the distance only (T5-style), never expanded.
    rel_q, rel_k : arrays, optional
        Given together: `rel_q` broadcastable to ``S + (Lq, Dr)``, `rel_k` to ``S + (R, Dr)``
        with ``R`` odd. Score ``(i, j)`` gets ``rel_q[..., i, :] . rel_k[..., rk +
        clip(delta, -rk, rk), :]`` with ``rk = (R - 1) // 2``: relative-position logits that
        depend on the query (Transformer-XL, Enformer, Borzoi), computed tile by tile, never as
        an ``Lq x Lk`` array. `scale` does not multiply this term (pass `rel_q` scaled, as
        Enformer scales ``q`` before both terms).
    cu_seqlens_q, cu_seqlens_k : 1-D int arrays, optional
        Given together: a packed batch of ``B`` sequences of different lengths, end to end
        along the length axes (FlashAttention's varlen convention; :func:`pack` builds it).
        Both have ``B + 1`` boundaries, 0 first, non-decreasing, ``Lq`` (``total_q``) and
        ``Lk`` (``total_k``) last; sequence ``b`` owns queries ``cu_seqlens_q[b]:
        cu_seqlens_q[b + 1]`` and keys ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``, and a query
        sees only its own sequence's keys. Positions restart in each sequence (local
        indices): the default `q_offset` is ``len_k - len_q`` per sequence, an explicit one
        applies to every sequence; `causal`, `window`, `alibi_slopes`, `softcap`,
        `rel_bias` and `rel_q` (packed like `q`, ``S + (Lq, Dr)``) / `rel_k` apply per
        sequence. Empty sequences on either side are allowed. Any integer dtype and array
        library (read on the host). Work is ``sum_b len_q(b) * len_k(b)``. Not with `bias`,
        `mask`, `bias_block` or `kv_lengths`; the NumPy and CUDA engines run them, forward
        and backward, Dask arrays of NumPy chunks included (docs/semantics.md, "Packed
        variable-length batches").
    return_lse : bool, optional
        Also return the log-sum-exp of the visible scores of each query.
    precision : {"highest", "tf32"}, optional
        ``"highest"`` (default) computes in the accumulation dtype. ``"tf32"``, for float32
        inputs only, allows the CUDA engine to use TF32 tensor cores (inputs rounded to a
        10-bit mantissa); engines without such a path compute in full float32, which is at
        least as accurate.
    backend : {"auto", "numpy", "cupy", "emulate"}, optional
        ``"auto"`` picks the engine of the array library of the inputs: NumPy arrays run on
        the NumPy engine, CuPy arrays on the CUDA engine. ``"emulate"`` runs the CUDA kernels
        on the CPU with NumPy arrays (needs a C++20 compiler; meant for testing).
        Dask arrays (any argument) give Dask arrays, lazily: one task per pair of a query
        chunk and a key chunk that can see each other, on its chunks' engine, merged by a
        fixed tree (docs/scale.md; needs Dask: ``pip install ".[dask]"``).
    workers : int, optional
        Threads of the NumPy engine, as in ``scipy.fft``: None (default) uses every core this
        process may run on (its CPU affinity), a positive int that many threads, a negative
        int counts back from ``os.cpu_count()`` (-1 = all, -2 = all but one). While a call
        runs, BLAS is held to one thread per worker and then given back its own count; a
        call too small to split (one batch element, at most 256 queries and 512 keys) runs
        in the calling thread and leaves BLAS alone. Results are the same for every
        `workers`. No effect on the ``"cupy"`` and ``"emulate"`` engines.

    Returns
    -------
    out : array, shape S + (Lq, Dv)
        Same dtype and library as `q`.
    lse : array, shape S + (Lq,)
        Only when `return_lse`: ``log(sum_j exp(s_ij))`` over the visible keys; float64 for
        float64 inputs, float32 otherwise. ``-inf`` for a query that sees no key.

    Raises
    ------
    TypeError
        Non-floating or mismatched dtypes of `q`, `k`, `v`, a non-floating `bias`,
        `rel_bias`, `rel_q` or `rel_k`, a non-boolean `mask`, arrays from different
        libraries, a `backend` that does not take the inputs' library, a `workers` that
        is not an int or None, offsets or `bias_block` sizes that are not ints, or a Dask
        `cu_seqlens_q`/`cu_seqlens_k` (boundaries shape the graph: compute them first).
    ValueError
        Shapes that do not agree or broadcast, a negative window side or `kv_lengths`, a
        `scale` or `softcap` that is not finite (or ``softcap <= 0``), ``softcap_bias=True``
        without `softcap`, `bias_block` without `bias` or with sizes below 1, a relative
        table of even length ``R``, `rel_q` without `rel_k` (or the reverse) or with another
        ``Dr``, an unknown `backend` or `precision`, ``precision="tf32"`` with
        inputs other than float32, ``workers=0`` or ``workers < -os.cpu_count()``, bad
        `cu_seqlens_q`/`cu_seqlens_k` (not 1-D, not from 0, decreasing, not ending at the
        packed length, of different counts, one without the other; a non-integer one is a
        TypeError), either with `bias`, `mask`, `bias_block` or `kv_lengths`. Dask arrays
        take packed batches chunked anywhere along the length axis (docs/scale.md).

    See Also
    --------
    merge : combine results computed on disjoint sets of keys.
    pack, unpack : build and split packed batches for `cu_seqlens_q` and `cu_seqlens_k`.

    Notes
    -----
    With scores :math:`s_{ij} = \mathrm{scale}\, q_i \cdot k_j` plus the `rel_q` term (then
    softcap, bias, `rel_bias`, ALiBi, or bias, `rel_bias`, ALiBi, softcap with `softcap_bias`,
    and masking; docs/semantics.md gives the order), the result is :math:`o_i = \sum_j p_{ij} v_j` with
    :math:`p_{ij} = e^{s_{ij}} / \sum_{j'} e^{s_{ij'}}`. Keys are visited in tiles; each
    query keeps :math:`m` (the running max), :math:`l = \sum e^{s - m}` and the unnormalised
    :math:`O = \sum e^{s - m} v`, and on each tile with new max :math:`m'` rescales
    :math:`l` and :math:`O` by :math:`e^{m - m'}` [1]_ [2]_. Scores and the running max stay
    in natural units; only :math:`s - m \le 0` is multiplied by :math:`\log_2 e` before a
    base-2 exponential, so no finite score overflows. Accumulation is in float64 for
    float64 inputs and in float32 otherwise. A query that sees no key gets output 0 and
    ``lse = -inf``, without a warning.

    References
    ----------
    .. [1] M. Milakov and N. Gimelshein, "Online normalizer calculation for softmax",
       arXiv:1805.02867, 2018.
    .. [2] T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
       Partitioning", arXiv:2307.08691, 2023.

    Examples
    --------
    >>> import numpy as np, cuonline
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 100, 32), dtype=np.float32)   # (batch, heads, Lq, D)
    >>> k = rng.standard_normal((2, 4, 120, 32), dtype=np.float32)
    >>> v = rng.standard_normal((2, 4, 120, 16), dtype=np.float32)   # Dv != D
    >>> out, lse = cuonline.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((2, 4, 100, 16), (2, 4, 100))

    Causal attention over two chunks of keys, each at its own position, merged:

    >>> a = cuonline.attention(q, k[..., :64, :], v[..., :64, :], causal=True,
    ...                        q_offset=20, return_lse=True)
    >>> b = cuonline.attention(q, k[..., 64:, :], v[..., 64:, :], causal=True,
    ...                        q_offset=20, k_offset=64, return_lse=True)
    >>> bool(np.allclose(cuonline.merge(a, b)[0], out, atol=1e-5))
    True

    Sequences of different lengths packed end to end, each attending to itself only:

    >>> x, cu = cuonline.pack([rng.standard_normal((4, n, 32)) for n in (300, 20, 170)])
    >>> out = cuonline.attention(x, x, x, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    >>> alone = cuonline.attention(x[:, 300:320], x[:, 300:320], x[:, 300:320], causal=True)
    >>> bool(np.allclose(out[:, 300:320], alone))
    True
    """
    if _dask.is_dask_call(locals()):   # Dask arrays: a lazy graph of calls on the chunks
        return _dask.attention(attention, **locals())
    options = _options.from_call(locals())
    problem = _validate.validate_attention(q, k, v, options, return_lse=return_lse)
    engine = importlib.import_module(f"cuonline.engines.{_engine(_ENGINES, problem)}")
    out, lse = engine.attention(problem)
    return (out, lse) if return_lse else out


def _engine(engines: dict, problem: Any) -> str:
    """The module under cuonline.engines that runs ``problem``, from ``engines`` (backend ->
    module) or, for a packed variable-length batch, the varlen driver (which does both)."""
    if problem.cu_seqlens_q is not None and problem.backend == "numpy":
        return _VARLEN_ENGINE
    return engines[problem.backend]


def _documents_score_options(function: F) -> F:
    """Write the score options of the table (every option but the engine's) into
    ``function``'s docstring, where its Parameters section says ``SCORE_OPTIONS``."""
    if function.__doc__:           # None under python -OO
        score = [n for n in _options.names() if _options.option_kind(n) != "engine"]
        function.__doc__ = function.__doc__.replace("    SCORE_OPTIONS\n",
                                                    f"    {', '.join(score)}\n")
    return function


def _documents_options(function: F) -> F:
    """Write the option names of the table into ``function``'s docstring, where its Parameters
    section says ``OPTIONS`` (numpydoc wants the names of a shared entry on one line)."""
    if function.__doc__:           # None under python -OO
        function.__doc__ = function.__doc__.replace("    OPTIONS\n",
                                                    f"    {', '.join(_options.names())}\n")
    return function


@_documents_options
@_adapts("dout", "q", "k", "v", "out", "lse")
def attention_backward(
    dout: Array | float, q: Array, k: Array, v: Array, out: Array, lse: Array, *, scale: float | None = None, causal: bool = False,
    window: tuple[int | None, int | None] | None = None, bias: Array | None = None,
    mask: Array | None = None, kv_lengths: Array | None = None,
    alibi_slopes: Array | None = None, softcap: float | None = None, softcap_bias: bool = False,
    q_offset: int | None = None, k_offset: int = 0,
    bias_block: int | tuple[int, int] | None = None, rel_bias: Array | None = None,
    rel_q: Array | None = None, rel_k: Array | None = None,
    cu_seqlens_q: Array | None = None, cu_seqlens_k: Array | None = None,
    precision: str = "highest",
    backend: str = "auto", workers: int | None = None,
) -> Gradients:
    r"""Gradients of :func:`attention` for an output gradient `dout`: the backward pass.

    Given ``out, lse = attention(q, k, v, **options, return_lse=True)`` and the gradient
    `dout` of a scalar loss with respect to ``out``, returns the loss's gradients with respect
    to `q`, `k`, `v` and the differentiable score terms (`bias`, `rel_bias`, `rel_q`,
    `rel_k`). Deterministic: two calls give bitwise-identical gradients, whatever `workers`.

    Parameters
    ----------
    dout : array, broadcastable to S + (Lq, Dv)
        Gradient of the loss with respect to ``out``, in the dtype of `q`.
    q, k, v : arrays
        The inputs of the forward call, as :func:`attention` takes them.
    out : array, shape S + (Lq, Dv)
        The output of the forward call.
    lse : array, shape S + (Lq,)
        The log-sum-exp the forward call returned with ``return_lse=True`` (float64 for float64
        inputs, float32 otherwise).
    OPTIONS
        The options of the forward call, as :func:`attention` takes them (pass the same).
        `mask`, `kv_lengths`, the positions, `alibi_slopes` and `softcap` are constants: they
        receive no gradient. The engine follows the arrays, as in :func:`attention`: the
        NumPy engine for NumPy arrays, cuonline's CUDA kernels for CuPy arrays (and for
        ``backend="emulate"``).

    Returns
    -------
    Gradients
        A frozen dataclass: ``dq``, ``dk``, ``dv`` of the shapes of `q`, `k`, `v` as passed and
        the dtype of `q`; ``dbias``, ``drel_bias``, ``drel_q``, ``drel_k`` of the shape and dtype
        of their input as passed, None for a term not given. An input broadcast over some
        dimensions (a bias shared by every head, `k` and `v` shared by a group of query heads)
        gets the sum of the gradients over them, added in C order of the broadcast indices.
        With `cu_seqlens_q`/`cu_seqlens_k` every gradient is packed like its input; the
        tables `rel_bias` and `rel_k` get the sum over the sequences.

    Raises
    ------
    TypeError
        As :func:`attention`; also `dout` or `out` of a dtype other than that of `q`, or `lse`
        of a dtype other than attention's (float64 for float64 inputs, else float32).
    ValueError
        As :func:`attention`; also `out` or `lse` of another shape than attention returns, or a
        `dout` that does not broadcast to it.

    See Also
    --------
    attention_vjp : the forward call and a function that maps `dout` to the gradients.

    Notes
    -----
    With the logits :math:`s` of the forward call, :math:`P = e^{s - \mathrm{lse}}` is
    recomputed tile by tile and, with :math:`\Delta_i = \sum_d dO_{id} O_{id}` (which equals
    :math:`\sum_j P_{ij} dP_{ij}`) [1]_,

    .. math::

        dV = P^\top dO, \quad dP = dO\, V^\top, \quad dS = P \circ (dP - \Delta), \quad
        dQ = \mathrm{scale}\, dS\, K, \quad dK = \mathrm{scale}\, dS^\top Q,

    where :math:`dS` passes through the soft cap's derivative :math:`1 - \tanh^2` for the
    terms under the cap. The gradient of `bias` is :math:`dS` (summed over each block with
    `bias_block`), of `rel_bias` the sum of :math:`dS` along each clamped distance, of the
    relative logits :math:`dS` times the other factor. A query that sees no key gets zero
    gradients; keys at or past `kv_lengths` are never read and get zero gradients; invisible
    places contribute exactly zero, so NaN stays in the rows and keys it belongs to. Memory is
    the gradients plus a few tiles: no ``Lq x Lk`` array.

    References
    ----------
    .. [1] T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
       Partitioning", arXiv:2307.08691, 2023.

    Examples
    --------
    >>> import numpy as np, cuonline
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 50, 16))            # (batch, heads, Lq, D)
    >>> k = rng.standard_normal((2, 1, 60, 16))            # shared by the 4 heads
    >>> v = rng.standard_normal((2, 1, 60, 8))
    >>> bias = rng.standard_normal((50, 60))               # shared by every batch and head
    >>> out, lse = cuonline.attention(q, k, v, bias=bias, causal=True, return_lse=True)
    >>> g = cuonline.attention_backward(np.ones_like(out), q, k, v, out, lse, bias=bias,
    ...                                 causal=True)
    >>> g.dq.shape, g.dk.shape, g.dbias.shape
    ((2, 4, 50, 16), (2, 1, 60, 16), (50, 60))

    The gradient of ``sum(out)`` with respect to one entry of `q`, against a finite
    difference:

    >>> h = 1e-6
    >>> qh = q.copy(); qh[0, 0, 7, 3] += h
    >>> fd = (cuonline.attention(qh, k, v, bias=bias, causal=True).sum() - out.sum()) / h
    >>> bool(abs(fd - g.dq[0, 0, 7, 3]) < 1e-4)
    True
    """
    if _dask.is_dask_call(locals()):   # Dask arrays: a lazy graph of calls on the chunks
        return _dask.attention_backward(attention_backward, **locals())
    options = _options.from_call(locals())
    bp = _validate.validate_attention_backward(dout, q, k, v, out, lse, options)
    engine = importlib.import_module(
        f"cuonline.engines.{_engine(_BACKWARD_ENGINES, bp.forward)}")
    return engine.attention_backward(bp)


@_documents_options
def attention_vjp(
    q: Array, k: Array, v: Array, *, scale: float | None = None, causal: bool = False,
    window: tuple[int | None, int | None] | None = None, bias: Array | None = None,
    mask: Array | None = None, kv_lengths: Array | None = None,
    alibi_slopes: Array | None = None, softcap: float | None = None, softcap_bias: bool = False,
    q_offset: int | None = None, k_offset: int = 0,
    bias_block: int | tuple[int, int] | None = None, rel_bias: Array | None = None,
    rel_q: Array | None = None, rel_k: Array | None = None,
    cu_seqlens_q: Array | None = None, cu_seqlens_k: Array | None = None,
    precision: str = "highest",
    backend: str = "auto", workers: int | None = None,
) -> tuple[Array, Callable[[Array | float], Gradients]]:
    r""":func:`attention` and its vector-Jacobian product: ``out, vjp = attention_vjp(...)``.

    Parameters
    ----------
    q, k, v
        As :func:`attention`.
    OPTIONS
        As :func:`attention`.

    Returns
    -------
    out : array, shape S + (Lq, Dv)
        ``attention(q, k, v, **options)``.
    vjp : callable
        ``vjp(dout) -> Gradients``: :func:`attention_backward` of these inputs and options
        with the forward's ``out`` and ``lse``, for any number of output gradients.

    Examples
    --------
    Saliency of a sequence score: the gradient of the score of one position with respect to
    the (one-hot) input of an attention layer whose queries, keys and values are projections
    of it.

    >>> import numpy as np, cuonline
    >>> rng = np.random.default_rng(3)
    >>> x = np.eye(4)[rng.integers(0, 4, size=40)]         # one-hot DNA, (L, 4)
    >>> wq, wk, wv = (rng.standard_normal((4, 8)) for _ in range(3))
    >>> out, vjp = cuonline.attention_vjp(x @ wq, x @ wk, x @ wv)
    >>> dout = np.zeros_like(out); dout[20] = 1.0          # score = sum(out[20])
    >>> g = vjp(dout)
    >>> saliency = g.dq @ wq.T + g.dk @ wk.T + g.dv @ wv.T  # d score / d x, (L, 4)
    >>> attribution = (saliency * x).sum(axis=1)           # gradient x input, per position
    >>> attribution.shape
    (40,)
    """
    options = _options.from_call(locals()).asdict()
    out, lse = attention(q, k, v, return_lse=True, **options)

    def vjp(dout: Array | float) -> Gradients:
        """:class:`cuonline.Gradients` of the forward call for the output gradient `dout`."""
        return attention_backward(dout, q, k, v, out, lse, **options)

    return out, vjp


@_adapts("q", "k", "query_weights", "rows")
@_documents_score_options
def attention_stats(
    q: Array, k: Array, *, scale: float | None = None, causal: bool = False,
    window: tuple[int | None, int | None] | None = None, bias: Array | None = None,
    mask: Array | None = None, kv_lengths: Array | None = None,
    alibi_slopes: Array | None = None, softcap: float | None = None, softcap_bias: bool = False,
    q_offset: int | None = None, k_offset: int = 0,
    bias_block: int | tuple[int, int] | None = None, rel_bias: Array | None = None,
    rel_q: Array | None = None, rel_k: Array | None = None,
    cu_seqlens_q: Array | None = None, cu_seqlens_k: Array | None = None,
    entropy: bool = True, received: bool = False, query_weights: Array | None = None,
    top_k: int = 0, rows: Array | None = None,
    backend: str = "auto", workers: int | None = None,
) -> AttentionStats:
    r"""Statistics of the attention weights ``P = softmax(scores)``, without the ``Lq x Lk``
    matrix: what each query looks at, and what each key receives.

    With the logits ``s`` of :func:`attention` (every term, in the documented order, the
    positions included), ``p_ij = exp(s_ij - lse_i)`` over the keys query ``i`` sees; keys
    it cannot see weigh 0. `v` is taken nowhere: ``P`` depends on the scores only.

    Parameters
    ----------
    q : array, shape (..., Lq, D)
        Queries, as :func:`attention` takes them.
    k : array, shape (..., Lk, D)
        Keys, same dtype as `q`. The leading dimensions of `q` and `k` broadcast together into
        the batch shape ``S``.
    SCORE_OPTIONS
        As :func:`attention`: the statistics are those of the ``P`` that attention applies
        with these options.
        With `cu_seqlens_q` and `cu_seqlens_k` (a packed batch) the row statistics are
        packed like the queries, ``S + (total_q,)``, with key indices of the packed keys;
        `received` like the keys, ``S + (total_k,)``; `weights` ``S + (len(rows),
        total_k)``, 0 outside each row's sequence; on Dask arrays too.
    entropy : bool, optional
        Compute the entropy of each row of ``P``. Default True.
    received : bool, optional
        Compute the attention each key receives, ``sum_i w_i p_ij``. Default False.
    query_weights : array, optional
        Real array broadcastable to ``S + (Lq,)``: the weights ``w_i`` of `received` (ones by
        default), e.g. 1 on a gene's promoter bins and 0 elsewhere. Only with
        ``received=True``; finite.
    top_k : int, optional
        The number of keys with the largest weights to return per query. Default 0 (none).
        May exceed the keys a query sees: the rest are -1 with weight 0. At most 32 on the
        CUDA engine.
    rows : 1-D int array, optional
        Query indices (negative ones count from the end) whose full rows of ``P`` are
        returned, exactly; memory ``S + (len(rows), Lk)``.
    backend : {"auto", "numpy", "cupy", "emulate"}, optional
        As :func:`attention`: ``"auto"`` runs NumPy arrays on the NumPy engine and CuPy
        arrays on the CUDA engine (the kernels of ``kernels_cu/attention_stats.cu``);
        ``"emulate"`` runs those kernels on the CPU (tests). Dask arrays run the NumPy engine
        on each chunk.
    workers : int, optional
        Threads, as in :func:`attention`. Results are the same for every `workers`.

    Returns
    -------
    AttentionStats
        A frozen dataclass with ``lse``, ``entropy``, ``max_weight``, ``argmax`` (S + (Lq,)),
        ``received`` (S + (Lk,)), ``top_indices``, ``top_weights`` (S + (Lq, top_k)) and
        ``weights`` (S + (len(rows), Lk)); a field not asked for is None. Statistics in the
        accumulation dtype (float64 for float64 inputs, float32 otherwise), indices int64.
        A query that sees no key has ``lse = -inf``, entropy 0, ``max_weight`` 0, ``argmax``
        -1, top indices -1 with weights 0 and a zero row; no NaN and no warning.

    Raises
    ------
    TypeError
        As :func:`attention`; also `entropy` or `received` not a bool, a `top_k` that is not an
        int, a non-real `query_weights`, or a non-integer `rows`.
    ValueError
        As :func:`attention`; also ``top_k < 0``, `query_weights` that do not broadcast to
        ``S + (Lq,)``, are not finite or come without ``received=True``, `rows` that are not
        1-D or hold an index outside ``[-Lq, Lq)``, and ``top_k > 32`` on the CUDA engine.

    See Also
    --------
    attention : the output these weights produce.

    Notes
    -----
    One tiled pass over the keys keeps, per query, the online-softmax state of
    :func:`attention`, :math:`m` and :math:`l = \sum_j e^{s_j - m}`, and beside it
    :math:`u = \sum_j e^{s_j - m} (s_j - m)`, rescaled with :math:`l` when :math:`m` grows
    (:math:`u' = \alpha (u + (m - m') l)`, :math:`\alpha = e^{m - m'}`), the first key of the
    largest score, and the ``top_k`` best (score, key) pairs. Then

    .. math::

        \mathrm{lse} = m + \log l, \quad H = \log l - u / l, \quad
        \max_j p_j = 1 / l.

    ``received`` is a second, key-owned pass: each block of keys adds
    :math:`w^\top P` of the query blocks in a fixed order, with :math:`P` recomputed from
    ``lse`` (deterministic for any `workers`); `rows` recompute their rows of :math:`P`
    from ``lse``. Memory is a few tiles per thread plus the results. The CUDA engine runs
    the same passes as three kernels (docs/kernels.md, "The statistics kernels"); its top-k
    is a sorted list of at most 32 entries held one per lane of a warp.

    Examples
    --------
    >>> import numpy as np, cuonline
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 300, 16)), rng.standard_normal((2, 400, 16))
    >>> st = cuonline.attention_stats(q, k, causal=True, received=True, top_k=3, rows=[0, 5])
    >>> st.lse.shape, st.received.shape, st.top_indices.shape, st.weights.shape
    ((2, 300), (2, 400), (2, 300, 3), (2, 2, 400))

    Each statistic is one of the dense ``P``:

    >>> s = q @ k.transpose(0, 2, 1) / 4.0
    >>> s[:, np.arange(400)[None, :] > np.arange(300)[:, None] + 100] = -np.inf
    >>> P = np.exp(s - st.lse[..., None])
    >>> bool(np.allclose(P.sum(axis=1), st.received))
    True
    >>> bool(np.array_equal(P.argmax(axis=-1), st.argmax))
    True
    >>> bool(np.allclose(P[:, [0, 5]], st.weights))
    True
    """
    if _dask.is_dask_call(locals()):   # Dask arrays: a lazy graph of calls on the chunks
        return _dask.attention_stats(AttentionStats, **locals())
    options = _options.from_call({**locals(), "precision": "highest"})
    sp = _validate.validate_attention_stats(q, k, options, entropy=entropy, received=received,
                                            query_weights=query_weights, top_k=top_k,
                                            rows=rows)
    if sp.scores.cu_seqlens_q is not None:
        name = _VARLEN_ENGINE               # packed batches (validation keeps them off CUDA)
    elif sp.scores.backend in _CUDA_BACKENDS:
        name = "cuda_stats"
    else:
        name = "numpy_stats"
    engine = importlib.import_module("cuonline.engines." + name)
    return AttentionStats(**engine.attention_stats(sp))


def merge(*states: tuple[Array, Array]) -> tuple[Array, Array]:
    r"""Combine attention results computed on disjoint sets of keys.

    Parameters
    ----------
    *states : (out, lse) pairs
        Each ``out`` of shape (..., Lq, Dv) and ``lse`` of shape (..., Lq), as returned by
        ``attention(..., return_lse=True)`` for the same queries over a part of the keys. All
        pairs share one shape and array library; every ``out`` has one real floating dtype
        and every ``lse`` one real floating dtype (attention's: float64 for float64 ``out``,
        float32 otherwise).

    Returns
    -------
    out, lse : arrays
        The result of attention over the union of the keys, ``out`` in the dtype of the
        states' ``out`` and ``lse`` in that of their ``lse``. Computed in float64 if either
        dtype is float64, else in float32.

    Raises
    ------
    TypeError
        A state that is not a pair, a non-floating ``out`` or ``lse`` (integer, boolean,
        complex), dtypes that differ between states, arrays from different libraries or a
        ``numpy.ma`` masked array.
    ValueError
        No state, or shapes that do not agree.

    Notes
    -----
    With :math:`M = \max_i L_i` and :math:`w_i = e^{L_i - M}`:
    :math:`L = M + \log \sum_i w_i` and :math:`o = \sum_i w_i o_i / \sum_i w_i`.
    A state with :math:`L = -\infty` (no visible key) has weight 0 whatever its ``out``; if
    no state sees a key, ``out`` is 0 and ``lse`` is ``-inf``. A state with
    :math:`L = +\infty` (infinite mass, the mark of an overflow upstream) makes its rows
    ``lse = +inf`` and ``out`` NaN, as ``logsumexp`` would; a NaN ``lse`` makes both NaN. The
    merge is associative and independent of order, so keys may be split across chunks, devices
    or Dask tasks.

    Examples
    --------
    >>> import numpy as np, cuonline
    >>> rng = np.random.default_rng(1)
    >>> q, k, v = (rng.standard_normal((3, 50, 8)) for _ in range(3))
    >>> a = cuonline.attention(q, k[:, :20], v[:, :20], return_lse=True)
    >>> b = cuonline.attention(q, k[:, 20:], v[:, 20:], return_lse=True)
    >>> out, lse = cuonline.merge(a, b)
    >>> bool(np.allclose(out, cuonline.attention(q, k, v)))
    True
    """
    if _dask.is_dask_merge(states):    # Dask arrays: a lazy blockwise merge
        return _dask.merge(*states)
    named = {f"states[{n}][{i}]": x for n, state in enumerate(states)
             if isinstance(state, (tuple, list)) for i, x in enumerate(state)}
    arrays, origin = _arrays.adapt(named)
    if origin is not None:           # torch, JAX, ...: merge their NumPy/CuPy views
        with origin.running():
            return origin.back(merge(*(
                tuple(arrays[f"states[{n}][{i}]"] for i in range(len(state)))
                if isinstance(state, (tuple, list)) else state
                for n, state in enumerate(states))))
    xp, outs, lses = _validate.validate_merge(states)
    return _merge.merge_states(xp, outs, lses)


@_adapts("x", "mask")
def softmax(x: Array, axis: int = -1, *, mask: Array | None = None,
            backend: str = "auto") -> Array:
    r"""Softmax along `axis`, stable for any finite magnitude.

    Parameters
    ----------
    x : array
        Real floating NumPy or CuPy array (or any DLPack array, as in :func:`attention`).
    axis : int, optional
        The axis to normalise over. Default: the last.
    mask : bool array, optional
        Broadcastable to ``x.shape``; ``False`` entries are left out (weight 0). Read through
        its broadcast strides, never expanded.
    backend : {"auto", "numpy", "cupy", "emulate"}, optional
        As in :func:`attention`: CuPy arrays run on cuonline's CUDA kernel, NumPy arrays on
        NumPy; ``"emulate"`` runs the CUDA kernel on the CPU with NumPy arrays (testing).

    Returns
    -------
    array
        Same shape, dtype and library as `x`. A slice with no visible entry (all masked or all
        ``-inf``) gives zeros, without a warning. A slice holding NaN or ``+inf`` gives NaN.

    Notes
    -----
    :math:`\mathrm{softmax}(x)_j = e^{x_j - m} / \sum_{j'} e^{x_{j'} - m}` with
    :math:`m = \max_j x_j`, computed in float32 for 16-bit inputs. The CUDA kernel finds
    :math:`m` and :math:`l = \sum_j e^{x_j - m}` in one pass over the slice with the online
    normalizer [1]_ (on a larger maximum :math:`m'`, :math:`l` is rescaled by
    :math:`e^{m - m'}`; exponentials in base 2 with :math:`\log_2 e` folded in), merges the
    partial states of its threads, then writes :math:`e^{x_j - m} / l` in a second pass.

    References
    ----------
    .. [1] M. Milakov and N. Gimelshein, "Online normalizer calculation for softmax",
       arXiv:1805.02867, 2018.

    Examples
    --------
    >>> import numpy as np, cuonline
    >>> cuonline.softmax(np.array([1000.0, 1000.0, -np.inf]))
    array([0.5, 0.5, 0. ])
    """
    if _dask.is_dask_softmax(x, mask):   # Dask arrays: a lazy graph over the blocks
        return _dask.softmax(softmax, x, axis, mask=mask, mode="softmax", backend=backend)
    p = _validate.validate_axis_input(x, axis, mask, backend, mode="softmax")
    if p.backend in _CUDA_BACKENDS:
        return _cuda_softmax().run(p)
    return _softmax.softmax(p.xp, p.x, p.axis, p.mask)


@_adapts("x", "mask")
def log_softmax(x: Array, axis: int = -1, *, mask: Array | None = None,
                backend: str = "auto") -> Array:
    r"""Logarithm of :func:`softmax` along `axis`, computed without forming the softmax.

    Parameters and return value as :func:`softmax`; a slice with no visible entry gives
    ``-inf`` everywhere.

    Examples
    --------
    >>> import numpy as np, cuonline
    >>> cuonline.log_softmax(np.array([0.0, 0.0]))
    array([-0.69314718, -0.69314718])
    """
    if _dask.is_dask_softmax(x, mask):   # Dask arrays: a lazy graph over the blocks
        return _dask.softmax(log_softmax, x, axis, mask=mask, mode="log_softmax", backend=backend)
    p = _validate.validate_axis_input(x, axis, mask, backend, mode="log_softmax")
    if p.backend in _CUDA_BACKENDS:
        return _cuda_softmax().run(p)
    return _softmax.log_softmax(p.xp, p.x, p.axis, p.mask)


@_adapts("x", "mask")
def logsumexp(x: Array, axis: int = -1, *, mask: Array | None = None, keepdims: bool = False,
              backend: str = "auto") -> Array:
    r"""``log(sum(exp(x)))`` along `axis`, stable for any finite magnitude.

    Parameters
    ----------
    x, axis, mask, backend
        As in :func:`softmax`.
    keepdims : bool, optional
        Keep the reduced axis with length 1.

    Returns
    -------
    array
        The dtype of `x`; ``-inf`` for a slice with no visible entry, without a warning.

    Examples
    --------
    >>> import numpy as np, cuonline
    >>> float(cuonline.logsumexp(np.array([2.0, 4.0, 1.0, 3.0])))  # doctest: +ELLIPSIS
    4.44018...
    """
    if _dask.is_dask_softmax(x, mask):   # Dask arrays: a lazy graph over the blocks
        return _dask.softmax(logsumexp, x, axis, mask=mask, mode="logsumexp", keepdims=keepdims, backend=backend)
    p = _validate.validate_axis_input(x, axis, mask, backend, mode="logsumexp",
                                      keepdims=keepdims)
    if p.backend in _CUDA_BACKENDS:
        return _cuda_softmax().run(p)
    return _softmax.logsumexp(p.xp, p.x, p.axis, p.mask, p.keepdims)


def _cuda_softmax():
    # imported on first use: the CUDA engine's modules are needed only for cupy/emulate
    return importlib.import_module("cuonline.engines.cuda_softmax")
