"""The options of an attention call, defined once.

:class:`Options` is the one table of the keywords that :func:`cuonline.attention`,
:func:`cuonline.attention_backward` and :func:`cuonline.attention_vjp` take besides their
arrays: each field is an option with its default, and its metadata says what kind of value it
is. Validation (``_validate.validate_attention``), the backward, ``attention_vjp`` and the Dask
engine read the options from here; the public functions keep explicit keyword signatures for
their users (``tests/test_options.py`` checks that they match this table, name for name and
default for default) and hand the options on in one step with :func:`from_call`.

Adding an option is: its row here, its rule in ``_validate``, its engine code, its docs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["Options", "array_layout", "array_options", "differentiable_options", "from_call",
           "names", "option_kind"]

# The kinds of option (field metadata "kind"):
#   "array"    - an array (or None) read per score, broadcast against the batch shape
#   "position" - where queries and keys sit (causal, window, offsets): Dask rewrites these
#                per chunk task
#   "value"    - a scalar rule (scale, softcap, ...), passed to every engine and task as is
#   "engine"   - how to compute, not what (precision, backend, workers)


def _array(layout: tuple[str, ...], *, grad: str | None = None) -> Any:
    """An array option: ``layout`` names its trailing axes after the batch axes, as the Dask
    engine chunks them ("q"/"k": the query/key axis, "qb"/"kb": a block bias's coarse axes,
    "whole": one chunk); ``grad`` is its field of :class:`cuonline.Gradients` (None: a
    constant that receives no gradient)."""
    return field(default=None, metadata={"kind": "array", "layout": layout, "grad": grad})


def _option(kind: str, default: Any = None) -> Any:
    return field(default=default, metadata={"kind": kind})


@dataclass(frozen=True)
class Options:
    """The keywords of an attention call besides its arrays, as the user passed them.

    Values are not checked here: ``_validate.validate_attention`` checks them and turns them
    into a :class:`cuonline._validate.Problem`. See :func:`cuonline.attention` for the
    meaning of each.
    """

    scale: Any = _option("value")
    causal: Any = _option("position", False)
    window: Any = _option("position")
    bias: Any = _array(("q", "k"), grad="dbias")
    mask: Any = _array(("q", "k"))
    kv_lengths: Any = _array(())
    alibi_slopes: Any = _array(())
    softcap: Any = _option("value")
    softcap_bias: Any = _option("value", False)
    q_offset: Any = _option("position")
    k_offset: Any = _option("position", 0)
    bias_block: Any = _option("value")
    rel_bias: Any = _array(("whole",), grad="drel_bias")
    rel_q: Any = _array(("q", "whole"), grad="drel_q")
    rel_k: Any = _array(("whole", "whole"), grad="drel_k")
    # packed variable-length batches (FlashAttention's cu_seqlens): 1-D sequence boundaries,
    # read on the host (the Dask engine plans its graph from their values)
    cu_seqlens_q: Any = _array(("whole",))
    cu_seqlens_k: Any = _array(("whole",))
    precision: Any = _option("engine", "highest")
    backend: Any = _option("engine", "auto")
    workers: Any = _option("engine")

    def asdict(self) -> dict[str, Any]:
        """The options as keywords (a shallow copy: arrays are not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` applied (names checked: an unknown one is a TypeError)."""
        return dataclasses.replace(self, **changes)

    def arrays(self) -> dict[str, Any]:
        """The array options that were given (not None), by name, in table order."""
        return {n: getattr(self, n) for n in array_options() if getattr(self, n) is not None}


_FIELDS = {f.name: f for f in dataclasses.fields(Options)}


def names() -> tuple[str, ...]:
    """Every option's name, in table order (the order of the public signatures)."""
    return tuple(_FIELDS)


def option_kind(name: str) -> str:
    """"array", "position", "value" or "engine"."""
    return _FIELDS[name].metadata["kind"]


def array_options() -> tuple[str, ...]:
    """The options that are arrays, in table order."""
    return _ARRAY_OPTIONS


# read on every call, by validation and by the engines' plans: made once from the table
_ARRAY_OPTIONS = tuple(n for n, f in _FIELDS.items() if f.metadata["kind"] == "array")


def array_layout(name: str) -> tuple[str, ...]:
    """The logical trailing axes of array option ``name`` (see :func:`_array`)."""
    return _FIELDS[name].metadata["layout"]


def differentiable_options() -> dict[str, str]:
    """Array options that receive a gradient -> their field of :class:`cuonline.Gradients`."""
    return {n: f.metadata["grad"] for n, f in _FIELDS.items() if f.metadata.get("grad")}


def from_call(arguments: Mapping[str, Any]) -> Options:
    """The :class:`Options` among a public function's bound arguments (``locals()`` at its
    top). An option the function does not take (a framework binding that does not offer it
    yet) keeps its default; ``tests/test_options.py`` holds cuonline's own public functions
    to the whole table."""
    return Options(**{n: arguments[n] for n in _FIELDS if n in arguments})
