"""Tensor-subclass all-gather hooks (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), as
PyTorch's FSDP2 calls them.

A parameter whose local tensor is a tensor subclass defining both hooks chooses what is
all-gathered and how the gathered tensors become its unsharded form; torchao's float8 training
all-gathers float8 weights this way. fsdp2 calls them at the same points as PyTorch:

- ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)``, or the older
  ``fsdp_pre_all_gather(mesh)``, on every gather from the shards, returns
  ``(inputs, metadata)``. ``mesh`` is the 1-D shard mesh, ``outer_size``/``outer_stride`` the
  unsharded parameter's shape and contiguous strides, ``module`` the module holding it. Each
  input is all-gathered as its own column of the group's one all-gather; with uneven sharding
  every input must have the padded shard's number of rows along dim 0.
- ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`` gets each input
  gathered, viewed as ``(world * rows, *input.shape[1:])``. The first time it returns
  ``(tensor, inner_tensors)``: ``tensor`` (viewed as the parameter's shape) becomes the
  unsharded parameter and ``inner_tensors`` are freed on every reshard. Later gathers allocate
  those inner tensors again and call it with ``out=`` the unsharded parameter to refill in place.

The outputs are tensors of the parameter's own (a post hook may keep them as its data), freed
on reshard and allocated again before the next copy-out. With ``reshard_after_forward=k`` the
gathered inputs are what is held (PyTorch refuses that combination): backward re-gathers them
over k ranks and calls only the post hook.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from fsdp2.errors import FSDPUsageAssertionError, FSDPUsageError, FSDPUsageNotImplementedError
from fsdp2.runtime.codecs import Column, GatherCodec, Pairs

if TYPE_CHECKING:
    from fsdp2.runtime.dp_mesh import DataParallelMesh
    from fsdp2.runtime.sharded_param import ShardedParam

PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"
_ARITIES = (1, 5)  # fsdp_pre_all_gather(mesh) and (mesh, outer_size, outer_stride, module, mp_policy)


def has_hooks(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, PRE)


def check_hooks(fqn: str, tensor: torch.Tensor, shard_dim: int, dp: DataParallelMesh, owner: str) -> None:
    """Before fully_shard changes anything: the hooks ``tensor`` (a parameter's local tensor)
    defines are usable. Raises FSDPUsageError naming the parameter and the fix."""
    has_pre, has_post = hasattr(tensor, PRE), hasattr(tensor, POST)
    where = f"fully_shard({owner}): parameter {fqn} ({type(tensor).__name__})"
    if has_pre != has_post:
        present, missing = (PRE, POST) if has_pre else (POST, PRE)
        raise FSDPUsageAssertionError(
            f"{where} defines {present} but not {missing}. A tensor subclass that customizes the "
            f"all-gather must define both {PRE} and {POST}; define {missing}, or remove {present}."
        )
    if not has_pre:
        return
    arity = _pre_arity(tensor)
    if arity not in _ARITIES:
        raise FSDPUsageAssertionError(
            f"{where}: {PRE} takes {arity} arguments; expected {PRE}(self, mesh, outer_size, outer_stride, "
            f"module, mp_policy) or the older {PRE}(self, mesh)."
        )
    if shard_dim != 0:
        raise FSDPUsageNotImplementedError(
            f"{where} all-gathers through {PRE}/{POST}, which fsdp2 (like PyTorch) calls for "
            f"dim-0 shards only; shard_placement_fn returned Shard({shard_dim}). Return Shard(0) or None for it."
        )
    if dp.shard_mesh is None:
        raise FSDPUsageAssertionError(
            f"{where} all-gathers through {PRE}, which receives the shard dim's mesh; give the 2-D HSDP "
            "mesh mesh_dim_names (init_device_mesh(..., mesh_dim_names=('replicate', 'shard')))."
        )


def _pre_arity(tensor: torch.Tensor) -> int:
    return len(inspect.signature(getattr(tensor, PRE)).parameters)  # bound method: without self


class SubclassCodec(GatherCodec):
    """The parameter's own pre/post all-gather hooks (module docstring)."""

    builds_unsharded = True
    prepares = True
    holds_memory = True  # the hooks' all-gather outputs and inner tensors

    def __init__(self, param: ShardedParam, shard_mesh: DeviceMesh):
        super().__init__(param)
        self.shard_mesh = shard_mesh
        self._mesh_only = _pre_arity(param.local_shard) == 1
        self._inputs: tuple[torch.Tensor, ...] = ()
        self._shapes: list[torch.Size] = []
        self._columns: tuple[Column, ...] | None = None
        self._metadata: Any = None
        self._outputs: list[torch.Tensor] = []  # per input: world * numel, ours, freed on reshard
        self._inner: tuple[torch.Tensor, ...] = ()  # the post hook's inner tensors, freed on reshard

    def prepare(self) -> None:
        inputs, self._metadata = self.pre_all_gather(self.param.on_compute_device(self.param.local_shard))
        self._inputs = inputs
        self._shapes = [t.shape for t in inputs]
        self._columns = tuple(Column(t.dtype, t.numel()) for t in inputs)

    def pre_all_gather(self, shard: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any]:
        """``(inputs, metadata)`` of the subclass's pre-all-gather hook on ``shard``, checked. The
        eager gather (``prepare``) and the compiled step (``encode``) both call it."""
        p, layout = self.param, self.param.layout
        if self._mesh_only:
            result = getattr(shard, PRE)(self.shard_mesh)
        else:
            module = p.slots[0].module
            result = getattr(shard, PRE)(self.shard_mesh, layout.full_shape, layout.full_strides, module, p.mp_policy)
        inputs, metadata = self._pair(result, PRE, "(all_gather_inputs, metadata)")
        inputs = tuple(inputs)
        if not all(isinstance(t, torch.Tensor) for t in inputs):
            raise FSDPUsageError(f"{self._where(PRE)} returned all-gather inputs that are not all tensors: {inputs!r}")
        if not layout.is_even and any(t.dim() == 0 or t.shape[0] != layout.chunk for t in inputs):
            raise FSDPUsageAssertionError(
                f"{self._where(PRE)} returned inputs of shapes {[tuple(t.shape) for t in inputs]}; the parameter "
                f"(shape {tuple(layout.full_shape)}) is sharded unevenly over {layout.world} ranks, so every input "
                f"must have the padded shard's {layout.chunk} rows along dim 0 (pad this rank's "
                f"{layout.local_rows} rows, e.g. from outer_size and the mesh size)."
            )
        return inputs, metadata

    def encode(self, shard: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The pre-all-gather hook's ``(inputs, metadata)`` on ``shard`` (the compiled step's form)."""
        return self.pre_all_gather(self.param.on_compute_device(shard))

    def decode(self, shard: torch.Tensor, wire: tuple[torch.Tensor, ...], metadata: Any, blocks) -> torch.Tensor:
        """The unsharded tensor ``shard``'s post-all-gather hook builds from the gathered ``blocks``
        (each input's, ``world x bytes``), without ``out=``: the compiled step's form."""
        outputs = tuple(block.contiguous().view(t.dtype).view(-1, *t.shape[1:]) for block, t in zip(blocks, wire))
        post = getattr(shard, POST)
        tensor, _ = self._pair(
            post(outputs, metadata, self.param.param_dtype), POST, "(unsharded_tensor, inner_tensors)"
        )
        return tensor

    def columns(self) -> tuple[Column, ...]:
        if self._columns is None:
            raise RuntimeError(f"parameter {self.param.fqn}: {PRE} has not run yet")  # a gather bug, not a user error
        return self._columns

    def pack(self, slots: list[torch.Tensor]) -> Pairs:
        pairs = [(slot, t.reshape(-1)) for slot, t in zip(slots, self._inputs)]
        self._inputs = ()
        return pairs

    def unpack(self, blocks: list[torch.Tensor]) -> Pairs:
        world = self.param.layout.world
        return [(self._output(i, world).view(world, -1), block) for i, block in enumerate(blocks)]

    def unshard_locally(self) -> Pairs:
        self.prepare()
        pairs = [(self._output(i, 1), t.reshape(-1)) for i, t in enumerate(self._inputs)]
        self._inputs = ()
        return pairs

    def _output(self, index: int, world: int) -> torch.Tensor:
        """This input's gathered output, allocated (again) for the copy-out."""
        column = self._columns[index]
        numel = world * column.numel
        if index < len(self._outputs):
            out = self._outputs[index]
            if out.dtype == column.dtype and out.numel() == numel:
                _allocate(out)
                return out
        out = torch.empty(numel, dtype=column.dtype, device=self.param.device)
        self._outputs[index : index + 1] = [out]
        return out

    def finish(self) -> None:
        p = self.param
        outputs = tuple(out.view(-1, *shape[1:]) for out, shape in zip(self._outputs, self._shapes))
        post = getattr(p.local_shard, POST)
        if p.unsharded_param is None:
            tensor, inner = self._pair(
                post(outputs, self._metadata, p.param_dtype), POST, "(unsharded_tensor, inner_tensors)"
            )
            self._inner = tuple(inner)
            p.adopt_unsharded(tensor)
        else:
            for t in self._inner:
                _allocate(t)
            # The metadata of the latest pre hook: a re-gather from subgroup rows has no pre hook of its own.
            post(outputs, self._metadata, p.param_dtype, out=p.unsharded_param)

    def release(self) -> None:
        for t in (*self._outputs, *self._inner):
            t.untyped_storage().resize_(0)

    def _pair(self, result: Any, hook: str, expected: str) -> tuple[Any, Any]:
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise FSDPUsageError(f"{self._where(hook)} returned {type(result).__name__}; expected a pair {expected}")
        return result[0], result[1]

    def _where(self, hook: str) -> str:
        return (
            f"parameter {self.param.fqn} of fully_shard({self.param.owner}): "
            f"{type(self.param.local_shard).__name__}.{hook}"
        )


def _allocate(tensor: torch.Tensor) -> None:
    """Give a tensor whose storage was freed (resized to 0) its memory back."""
    storage = tensor.untyped_storage()
    nbytes = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if storage.size() < nbytes:
        storage.resize_(nbytes)
