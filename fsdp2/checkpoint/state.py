"""Model / optimizer / extra state <-> flat {key: tensor} plus JSON.

Tensor keys are namespaced: ``model/<fqn>``, ``optim/state/<param fqn>/<name>``,
``optim/param_groups/<i>/<name>`` and ``extra/<path>``. Optimizer state is keyed by
parameter FQN (not the optimizer's integer ids) so that it survives resharding and
any reordering of ``named_parameters``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .errors import CheckpointError

_TENSOR_TAG = "__tensor__"
_TUPLE_TAG = "__tuple__"
_ITEMS_TAG = "__dict_items__"  # dicts with non-string keys
_TAGS = {_TENSOR_TAG, _TUPLE_TAG, _ITEMS_TAG}


@dataclass
class FlatState:
    """What gets saved: tensors by key (DTensor or plain) and JSON-able objects."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- JSON codec


class JsonCodec:
    """Encode nested Python values as JSON, pulling tensors out under path keys.

    Supports None/bool/int/float/str, lists, tuples, dicts and tensors. Anything else
    is refused (we never fall back to pickle).
    """

    def __init__(self, allow_dtensor: bool):
        self.tensors: dict[str, torch.Tensor] = {}
        self._allow_dtensor = allow_dtensor

    def encode(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            if isinstance(value, DTensor) and not self._allow_dtensor:
                raise CheckpointError(f"{path}: DTensors are only supported in model and optimizer state")
            if path in self.tensors:
                raise CheckpointError(f"two tensors map to the same checkpoint key {path!r}; rename one")
            self.tensors[path] = value
            return {_TENSOR_TAG: path}
        if isinstance(value, tuple):
            return {_TUPLE_TAG: [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value):
                if _TAGS & value.keys():
                    raise CheckpointError(f"{path}: dict keys {sorted(_TAGS & value.keys())} are reserved")
                return {k: self.encode(v, f"{path}/{k}") for k, v in value.items()}
            items = []
            for k, v in value.items():
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise CheckpointError(f"{path}: dict key {k!r} is not a JSON scalar")
                items.append([k, self.encode(v, f"{path}/{k}")])
            return {_ITEMS_TAG: items}
        raise CheckpointError(
            f"{path}: cannot store a {type(value).__name__} (only JSON values, tuples and "
            "tensors are supported; convert it, e.g. to a dict or a tensor)")


def decode(value: Any, get_tensor) -> Any:
    """Inverse of ``JsonCodec.encode``; ``get_tensor(key)`` supplies tensor values."""
    if isinstance(value, list):
        return [decode(v, get_tensor) for v in value]
    if isinstance(value, dict):
        if _TENSOR_TAG in value:
            return get_tensor(value[_TENSOR_TAG])
        if _TUPLE_TAG in value:
            return tuple(decode(v, get_tensor) for v in value[_TUPLE_TAG])
        if _ITEMS_TAG in value:
            return {k: decode(v, get_tensor) for k, v in value[_ITEMS_TAG]}
        return {k: decode(v, get_tensor) for k, v in value.items()}
    return value


def tensor_refs(value: Any) -> list[str]:
    """All tensor keys referenced by an encoded JSON value."""
    out: list[str] = []
    decode(value, lambda key: out.append(key))
    return out


# ---------------------------------------------------------------- model / optimizer


def model_key(fqn: str) -> str:
    return f"model/{fqn}"


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under ``model/`` keys (values are DTensors or tensors)."""
    out = {}
    for fqn, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"state_dict entry {fqn!r} is a {type(value).__name__}, not a tensor")
        out[model_key(fqn)] = value
    return out


def optimizer_param_fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """For each param group, the FQNs of its parameters (in the group's order)."""
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        fqns = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(f"optimizer param group {gi} holds a parameter that is not in the model")
            fqns.append(names[id(p)])
        groups.append(fqns)
    return groups


def flatten_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(tensors, json) for an optimizer; state keyed by parameter FQN."""
    sd = optimizer.state_dict()
    fqn_groups = optimizer_param_fqns(model, optimizer)
    id_to_fqn = {}
    for saved, fqns in zip(sd["param_groups"], fqn_groups):
        id_to_fqn.update(zip(saved["params"], fqns))
    codec = JsonCodec(allow_dtensor=True)
    state = {id_to_fqn[pid]: codec.encode(s, f"optim/state/{id_to_fqn[pid]}") for pid, s in sd["state"].items()}
    groups = []
    for gi, (saved, fqns) in enumerate(zip(sd["param_groups"], fqn_groups)):
        hyper = {k: v for k, v in saved.items() if k != "params"}
        groups.append({"params": fqns, **codec.encode(hyper, f"optim/param_groups/{gi}")})
    return codec.tensors, {"state": state, "param_groups": groups}


def flatten(model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict | None) -> FlatState:
    flat = FlatState(tensors=model_tensors(model))
    if optimizer is not None:
        tensors, obj = flatten_optimizer(model, optimizer)
        flat.tensors.update(tensors)
        flat.objects["optimizer"] = obj
    if extra is not None:
        codec = JsonCodec(allow_dtensor=False)
        flat.objects["extra"] = codec.encode(extra, "extra")
        flat.tensors.update(codec.tensors)
    return flat
