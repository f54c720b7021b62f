"""Tensors inside the nested values modules take and return (forward inputs, activations).

``torch.utils._pytree`` sees lists, tuples, named tuples and dicts but not dataclasses, which
models use for outputs (Hugging Face's ``ModelOutput``, user records passed between blocks). A
tensor we do not see gets no pre-backward hook, and backward then reads freed parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``: through sequences, mappings and dataclass fields, at any depth."""
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t) or t, value)
    return found


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any, rebuild: bool = False) -> Any:
    """``value`` with every tensor ``t`` replaced by ``fn(t)``; containers rebuilt only if changed
    (always with ``rebuild``)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for field in dataclasses.fields(value):
            if not field.init:
                continue
            old = getattr(value, field.name)
            new = map_tensors(fn, old, rebuild)
            if rebuild or new is not old:
                changes[field.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, dict):
        items = {k: map_tensors(fn, v, rebuild) for k, v in value.items()}
        if not rebuild and all(items[k] is value[k] for k in value):
            return value
        rebuilt = value.copy()  # keeps the mapping's own type (OrderedDict, ModelOutput, ...)
        rebuilt.update(items)
        return rebuilt
    if isinstance(value, (list, tuple)):
        items = [map_tensors(fn, v, rebuild) for v in value]
        if not rebuild and all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*items)  # named tuple
        return type(value)(items)
    return value


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor cast to ``dtype``."""
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    # In a trace, containers are always rebuilt: dynamo cannot compare a traced tensor with the
    # original by identity (map_tensors' "unchanged" check).
    return map_tensors(cast, value, rebuild=torch.compiler.is_compiling())
