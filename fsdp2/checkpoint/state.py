"""Model / optimizer / extra state <-> flat {key: tensor} plus JSON.

Tensor keys are namespaced: ``model/<fqn>``, ``optim/state/<param fqn>/<name>``,
``optim/param_groups/<i>/<name>``, ``extra/<path>`` and ``rank_extra/<rank>/<path>``.
Optimizer state is keyed by parameter FQN (not the optimizer's integer ids) so that it
survives resharding and any reordering of ``named_parameters``.

Values of ``extra`` are JSON, tuples, tensors and numpy scalars and arrays; numpy arrays are
stored as tensors and come back as arrays of the same dtype, numpy scalars as JSON numbers
that come back as scalars of the same dtype. Nothing is pickled.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2 import compat

from .errors import CheckpointError
from .format import MAX_OBJECT_DEPTH

_TENSOR_TAG = "__tensor__"
_TUPLE_TAG = "__tuple__"
_ITEMS_TAG = "__dict_items__"  # dicts with non-string keys
_NUMPY_TAG = "__numpy__"  # {"dtype": name, "value": number} or {"tensor": key}
_TAGS = {_TENSOR_TAG, _TUPLE_TAG, _ITEMS_TAG, _NUMPY_TAG}
# numpy dtypes stored exactly: as JSON numbers (scalars) and as safetensors tensors (arrays).
_NUMPY_DTYPES = {
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
}
# Deepest ``extra`` accepted, leaving room below the manifest's limit for the levels around it.
MAX_EXTRA_DEPTH = MAX_OBJECT_DEPTH - 8


@dataclass
class FlatState:
    """What gets saved: tensors by key (DTensor or plain) and JSON-able objects.

    ``rank_tensors`` and ``rank_object`` are this rank's own ``rank_extra``: written by this
    rank (not by rank 0 like other plain tensors) and collected by rank 0 from every rank.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    rank_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    rank_object: Any = None


# ---------------------------------------------------------------- JSON codec


class JsonCodec:
    """Encode nested Python values as JSON, pulling tensors out under path keys.

    Supports None/bool/int/float/str, lists, tuples, dicts, tensors and numpy scalars and
    arrays of the dtypes in ``_NUMPY_DTYPES``. Anything else is refused (we never fall back
    to pickle).
    """

    def __init__(self, allow_dtensor: bool):
        self.tensors: dict[str, torch.Tensor] = {}
        self._allow_dtensor = allow_dtensor

    def encode(self, value: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_EXTRA_DEPTH:
            raise CheckpointError(f"{path}: nested deeper than {MAX_EXTRA_DEPTH} levels; flatten it")
        np = sys.modules.get("numpy")  # a value can only be a numpy one if numpy is imported
        if np is not None and isinstance(value, (np.ndarray, np.generic)) and not isinstance(value, np.str_):
            return self._encode_numpy(np, value, path)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            if isinstance(value, DTensor) and not self._allow_dtensor:
                raise CheckpointError(f"{path}: DTensors are only supported in model and optimizer state")
            return self._add_tensor(value, path)
        if isinstance(value, tuple):
            return {_TUPLE_TAG: [self.encode(v, f"{path}/{i}", depth + 1) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{path}/{i}", depth + 1) for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value):
                if _TAGS & value.keys():
                    raise CheckpointError(f"{path}: dict keys {sorted(_TAGS & value.keys())} are reserved")
                return {k: self.encode(v, f"{path}/{k}", depth + 1) for k, v in value.items()}
            items = []
            for k, v in value.items():
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise CheckpointError(f"{path}: dict key {k!r} is not a JSON scalar")
                items.append([k, self.encode(v, f"{path}/{k}", depth + 1)])
            return {_ITEMS_TAG: items}
        raise CheckpointError(
            f"{path}: cannot store a {type(value).__name__} (only JSON values, tuples, tensors and "
            "numpy numbers and arrays are supported; convert it, e.g. to a dict or a tensor)"
        )

    def _add_tensor(self, value: torch.Tensor, path: str) -> dict:
        if path in self.tensors:
            raise CheckpointError(f"two tensors map to the same checkpoint key {path!r}; rename one")
        self.tensors[path] = value
        return {_TENSOR_TAG: path}

    def _encode_numpy(self, np, value, path: str) -> dict:
        dtype = value.dtype
        if dtype.name not in _NUMPY_DTYPES:
            raise CheckpointError(
                f"{path}: cannot store a numpy {'array' if isinstance(value, np.ndarray) else 'scalar'} of "
                f"dtype {dtype} without pickle (supported: {', '.join(sorted(_NUMPY_DTYPES))}); convert it, "
                "e.g. with .astype() or .tolist()"
            )
        if isinstance(value, np.generic):
            return {_NUMPY_TAG: {"dtype": dtype.name, "value": value.item()}}
        # Native byte order and contiguous, as safetensors stores it; same dtype name back.
        array = np.asarray(value, dtype=dtype.newbyteorder("="), order="C")  # keeps 0-d arrays 0-d
        if not array.flags.writeable:
            array = array.copy()  # torch.from_numpy warns about read-only arrays
        return {_NUMPY_TAG: {"tensor": self._add_tensor(torch.from_numpy(array), path)[_TENSOR_TAG]}}


def decode(value: Any, get_tensor: Callable[[str], Any], where: str = "checkpoint object") -> Any:
    """Inverse of ``JsonCodec.encode``; ``get_tensor(key)`` supplies tensor values.

    A malformed encoding (as in a crafted manifest) raises ``CheckpointError``.
    """
    if isinstance(value, list):
        return [decode(v, get_tensor, where) for v in value]
    if not isinstance(value, dict):
        return value
    tag = next((t for t in _TAGS if t in value), None)
    if tag is None:
        return {k: decode(v, get_tensor, where) for k, v in value.items()}
    payload = value[tag]
    if len(value) != 1:
        raise CheckpointError(f"{where}: malformed {tag} entry (extra keys {sorted(value)})")
    if tag == _TENSOR_TAG:
        if not isinstance(payload, str):
            raise CheckpointError(f"{where}: malformed tensor reference {payload!r}")
        return get_tensor(payload)
    if tag == _TUPLE_TAG:
        if not isinstance(payload, list):
            raise CheckpointError(f"{where}: malformed tuple {payload!r}")
        return tuple(decode(v, get_tensor, where) for v in payload)
    if tag == _ITEMS_TAG:
        if not isinstance(payload, list) or not all(
            isinstance(kv, list) and len(kv) == 2 and not isinstance(kv[0], (list, dict)) for kv in payload
        ):
            raise CheckpointError(f"{where}: malformed dict items {str(payload)[:100]}")
        return {k: decode(v, get_tensor, where) for k, v in payload}
    return _decode_numpy(payload, get_tensor, where)


def _decode_numpy(payload: Any, get_tensor: Callable[[str], Any], where: str) -> Any:
    if isinstance(payload, dict) and set(payload) == {"tensor"} and isinstance(payload["tensor"], str):
        tensor = get_tensor(payload["tensor"])
        if not isinstance(tensor, torch.Tensor):
            return tensor  # collecting references (tensor_refs)
        if str(tensor.dtype).removeprefix("torch.") not in _NUMPY_DTYPES:
            raise CheckpointError(f"{where}: tensor {payload['tensor']!r} ({tensor.dtype}) is not a numpy array")
        return tensor.numpy()
    if (
        isinstance(payload, dict)
        and set(payload) == {"dtype", "value"}
        and payload["dtype"] in _NUMPY_DTYPES
        and isinstance(payload["value"], (bool, int, float))
    ):
        import numpy as np

        try:
            return np.dtype(payload["dtype"]).type(payload["value"])
        except (OverflowError, ValueError, TypeError) as e:
            raise CheckpointError(f"{where}: malformed numpy scalar {payload!r} ({e})") from None
    raise CheckpointError(f"{where}: malformed numpy value {str(payload)[:100]}")


def tensor_refs(value: Any, where: str = "checkpoint object") -> list[str]:
    """All tensor keys referenced by an encoded JSON value (checking its structure)."""
    out: list[str] = []
    decode(value, out.append, where)
    return out


# ---------------------------------------------------------------- model / optimizer


def model_key(fqn: str) -> str:
    return f"model/{fqn}"


def rank_extra_prefix(rank: int) -> str:
    return f"rank_extra/{rank:05d}"


def reshard_model(model: nn.Module) -> None:
    """Drop every gathered parameter, so the model holds its shards (values do not change).

    A forward without backward (a skipped NaN loss) or an exception inside a child's forward
    leaves groups unsharded: their modules then hold gathered copies, and ``state_dict()`` and
    ``named_parameters()`` show those instead of the shards the optimizer updates. Like
    ``load_state_dict`` in PyTorch, save and load reshard first.
    """
    from fsdp2.runtime.fsdp_module import FSDPModule

    kinds: tuple[type, ...] = (FSDPModule,)
    try:  # models sharded with PyTorch's own fully_shard
        from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

        kinds += (TorchFSDPModule,)
    except ImportError:
        pass
    for module in model.modules():
        if isinstance(module, kinds):
            module.reshard()


def first_meta_tensor(model: nn.Module) -> str | None:
    """Name of the first parameter or buffer (or DTensor shard) on the meta device, if any."""
    for name, value in [*model.named_parameters(), *model.named_buffers()]:
        local = compat.local_tensor(value) if isinstance(value, DTensor) else value
        if local.is_meta:
            return name
    return None


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under ``model/`` keys (values are DTensors or tensors)."""
    out = {}
    for fqn, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"state_dict entry {fqn!r} is a {type(value).__name__}, not a tensor")
        out[model_key(fqn)] = value
    return out


def tied_weights(model: nn.Module, fqns: list[str]) -> list[list[str]]:
    """Groups of state-dict names that are one tensor (e.g. tied embedding and output head).

    Each group is in state-dict order, so the first name is the one Hugging Face keeps
    (the input embedding comes before the head).
    """
    order = {fqn: i for i, fqn in enumerate(fqns)}
    by_tensor: dict[int, list[str]] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for fqn, value in named:
        if fqn in order:
            by_tensor.setdefault(id(value), []).append(fqn)
    return [sorted(names, key=order.__getitem__) for names in by_tensor.values() if len(names) > 1]


def optimizer_param_fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """For each param group, the FQNs of its parameters (in the group's order)."""
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        fqns = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"optimizer param group {gi} holds a parameter that is not in the model; "
                    "create the optimizer from this model's parameters"
                )
            fqns.append(names[id(p)])
        groups.append(fqns)
    return groups


def optimizer_type(optimizer: torch.optim.Optimizer) -> str:
    return type(optimizer).__name__


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
    return codec.tensors, {"type": optimizer_type(optimizer), "state": state, "param_groups": groups}


def flatten(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict | None, rank_extra: Any = None, rank: int = 0
) -> FlatState:
    flat = FlatState(tensors=model_tensors(model))
    ties = tied_weights(model, [k.removeprefix("model/") for k in flat.tensors])
    if ties:
        flat.objects["tied_weights"] = ties
    if optimizer is not None:
        tensors, obj = flatten_optimizer(model, optimizer)
        flat.tensors.update(tensors)
        flat.objects["optimizer"] = obj
    if extra is not None:
        codec = JsonCodec(allow_dtensor=False)
        flat.objects["extra"] = codec.encode(extra, "extra")
        flat.tensors.update(codec.tensors)
    if rank_extra is not None:
        codec = JsonCodec(allow_dtensor=False)
        flat.rank_object = codec.encode(rank_extra, rank_extra_prefix(rank))
        flat.rank_tensors = codec.tensors
    return flat
