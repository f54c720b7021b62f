"""Tensor subclasses with FSDP all-gather hooks, for the drop-in tests (tests/runtime/test_dropin.py).

Each wraps an fp32 tensor (``_data``) and unwraps itself in ``__torch_dispatch__``: compute ops
return plain tensors, structural ops (views, copies, new tensors) keep the wrapper, in-place ops
write the wrapped data. The hooks decide what travels in the all-gather:

- :class:`Bf16Gathered`: the data cast to bf16 (the 5-argument pre hook; pads an uneven shard
  itself from ``outer_size`` and the mesh size); the post hook upcasts into a new tensor that
  fsdp frees on reshard and refills through ``out=``.
- :class:`Int8Gathered`: int8 codes + one fp32 scale per row (the older 1-argument pre hook,
  so even shards only); dequantized by the post hook.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

aten = torch.ops.aten
_STRUCTURAL = {
    aten.detach.default,
    aten.clone.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.t.default,
    aten.select.int,
    aten.unbind.int,
}


class _Wrapper(torch.Tensor):
    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device, requires_grad=False
        )

    def __init__(self, data: torch.Tensor):
        self._data = data

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, size, stride):
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t._data if isinstance(t, _Wrapper) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable:
            return args[0] if isinstance(out, torch.Tensor) else out  # in-place: the wrapper itself
        if func in _STRUCTURAL:
            return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)
        return out


def unwrap(t: torch.Tensor) -> torch.Tensor:
    return t._data if isinstance(t, _Wrapper) else t


class Bf16Gathered(_Wrapper):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = -(-outer_size[0] // mesh.size())
        data = self._data
        if data.shape[0] < rows:
            data = F.pad(data, (0, 0) * (data.dim() - 1) + (0, rows - data.shape[0]))
        return (data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        if out is not None:
            out._data.copy_(gathered[: out.shape[0]])
            return None
        data = gathered.to(param_dtype)
        return Bf16Gathered(data), (data,)


class Int8Gathered(_Wrapper):
    def fsdp_pre_all_gather(self, mesh):
        data = self._data
        scale = data.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
        return (torch.round(data / scale).to(torch.int8), scale), "rows"

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        assert metadata == "rows"
        codes, scale = outputs
        if out is not None:
            torch.mul(codes, scale, out=out._data)
            return None
        data = (codes * scale).to(param_dtype)
        return Int8Gathered(data), (data,)


class PreOnly(_Wrapper):
    def fsdp_pre_all_gather(self, mesh):
        return (self._data,), None


class WrongArity(Bf16Gathered):
    def fsdp_pre_all_gather(self, mesh, outer_size):
        return (self._data,), None
