"""Operators: Prefect tasks that say what the runner needs to know to cut volumes for them.

An *operator* is a Prefect task whose function takes one numpy block
``(iline, xline, twt)`` and returns a block of the same shape. The
:func:`operator` decorator makes such a task and attaches an
:class:`OperatorSpec` to its function:

- ``halo(params) -> (hi, hx, ht)``: how many extra samples per axis the
  operator reads around each output element (so chunked results are exact);
- ``memory_params``: the parameters that change its memory per element (they
  go into the model key; others, such as a threshold, do not split the key);
- ``whole_traces``: True when the operator must see whole traces (anything
  global along time, such as an FFT-based Hilbert transform), so the planner
  never cuts the ``twt`` axis for it.

The spec lives on the function (``fn.__memchunk_operator__``), so it survives
``task.with_options(...)`` and pickling. A plain ``@task`` works too: it gets
:data:`DEFAULT_SPEC` (no halo unless ``chunked(..., halo=...)`` gives one, key
from the task name only, whole traces).

>>> from memchunk_prefect.operators import operator, spec_of, operator_key
>>> @operator(halo=lambda p: (p["r"], p["r"], p["r"]), memory_params=("r",))
... def box(block, r=1, scale=1.0):
...     return block * scale
>>> spec_of(box).halo_for({"r": 2})
(2, 2, 2)
>>> operator_key(box, {"r": 2, "scale": 3.0}, dtype="float32")
'box[r=2]|float32|cpu'
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from memchunk_prefect.core.chunks import Shape, normalize_halo

SPEC_ATTRIBUTE = "__memchunk_operator__"


@dataclass(frozen=True)
class OperatorSpec:
    """What the runner needs to know about an operator to cut volumes for it."""

    halo: Callable[[Mapping[str, Any]], Any] | None = None
    memory_params: tuple[str, ...] = ()
    whole_traces: bool = True
    device: str = "cpu"
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def params_with_defaults(self, params: Mapping[str, Any]) -> dict[str, Any]:
        merged = dict(self.defaults)
        merged.update(params)
        return merged

    def halo_for(self, params: Mapping[str, Any]) -> Shape:
        """The halo (iline, xline, twt) in samples for these parameters."""
        if self.halo is None:
            return (0, 0, 0)
        return normalize_halo(self.halo(self.params_with_defaults(params)))


DEFAULT_SPEC = OperatorSpec()


def _function_of(task_or_fn: Any) -> Callable[..., Any]:
    return getattr(task_or_fn, "fn", task_or_fn)


def spec_of(task_or_fn: Any) -> OperatorSpec:
    """The operator spec of a task (or its function); :data:`DEFAULT_SPEC` for plain tasks."""
    return getattr(_function_of(task_or_fn), SPEC_ATTRIBUTE, DEFAULT_SPEC)


def operator_name(task_or_fn: Any) -> str:
    """The operator's name: the Prefect task name, or the function's name."""
    name = getattr(task_or_fn, "name", None)
    return str(name) if name else _function_of(task_or_fn).__name__


def _format_param(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_format_param(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def operator_key(task_or_fn: Any, params: Mapping[str, Any] | None = None, *, dtype: str = "float32",
                 device: str | None = None) -> str:
    """The model key: name, memory-relevant parameters, dtype and device.

    Parameters that do not change memory are left out, so e.g. a threshold
    never splits what the model learns. Defaults are filled in, so calling
    with and without a default-valued parameter gives the same key.
    """
    spec = spec_of(task_or_fn)
    merged = spec.params_with_defaults(params or {})
    parts = [f"{name}={_format_param(merged[name])}" for name in spec.memory_params if name in merged]
    inner = f"[{';'.join(parts)}]" if parts else ""
    return f"{operator_name(task_or_fn)}{inner}|{dtype}|{device or spec.device}"


def operator(
    fn: Callable[..., Any] | None = None,
    *,
    halo: Callable[[Mapping[str, Any]], Any] | int | Sequence[int] | None = None,
    memory_params: Sequence[str] = (),
    whole_traces: bool = True,
    device: str = "cpu",
    **task_options: Any,
):
    """Decorate a block function as a Prefect task that the runner knows how to chunk.

    ``halo`` is a function of the call's parameters (defaults filled in), or a
    constant int / 3 ints. ``task_options`` go to ``prefect.task``.
    """

    def decorate(f: Callable[..., Any]):
        from prefect import task

        halo_fn = halo if callable(halo) or halo is None else (lambda _p, _h=normalize_halo(halo): _h)
        sig = inspect.signature(f)
        defaults = {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
        spec = OperatorSpec(halo=halo_fn, memory_params=tuple(memory_params), whole_traces=whole_traces,
                            device=device, defaults=defaults)
        setattr(f, SPEC_ATTRIBUTE, spec)
        return task(f, **task_options)

    return decorate(fn) if fn is not None else decorate
