"""One parameter managed by fully_shard: its DTensor shard and its gathered (unsharded) form."""

from __future__ import annotations

import functools
import weakref
from enum import Enum, auto
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from fsdp2 import compat
from fsdp2.errors import FSDPUsageError
from fsdp2.layout.shard_layout import ShardLayout
from fsdp2.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, param_dtype_of, reduce_dtype_of
from fsdp2.runtime.codecs import GatherCodec, PlainCodec
from fsdp2.runtime.dp_mesh import DataParallelMesh
from fsdp2.runtime.dtensor_spec import ShardedSpec
from fsdp2.runtime.param_slots import ParamSlot


class ParamState(Enum):
    SHARDED = auto()  # modules see the DTensor shard; no gathered memory is held
    UNSHARDED = auto()  # modules see the full tensor in param_dtype


class GradDtype(Enum):
    """In which dtype autograd accumulates the unsharded parameter's gradient: where the installed
    PyTorch's FSDP2 has it do so in the reduce dtype (compat.UNSHARDED_GRAD_IN_REDUCE_DTYPE,
    torch >= 2.15), fsdp2 follows its rule exactly, since it decides where the uses of a
    parameter are summed."""

    COMPUTE = auto()  # as autograd computes it (the reduce dtype is the compute dtype, or torch < 2.15)
    # Always the reduce dtype, each use's gradient cast before it is added: a reduce dtype no wider
    # than the compute dtype, or a wider one replicated under TP (its pending sum is reduced over TP in it).
    REDUCE = auto()
    PER_BACKWARD = auto()  # the reduce dtype only in a backward without sync that starts a sum (choose_grad_dtype)


# Attribute naming the module whose fully_shard call manages a parameter; catches a parameter
# claimed twice. An attribute, not a weak dict: nn.Module._apply (``to_empty`` after meta init)
# swaps DTensor parameters in place with torch.utils.swap_tensors, which refuses tensors that
# have weakrefs, and which swaps ``__dict__`` too, so the owner re-marks after every _apply.
_OWNER_ATTR = "_fsdp2_managed_by"


def mark_managed(param: nn.Parameter, owner: str) -> None:
    setattr(param, _OWNER_ATTR, owner)


def managed_by(param: nn.Parameter) -> str | None:
    return getattr(param, _OWNER_ATTR, None)


class ShardedParam:
    """A parameter sharded along ``shard_dim`` over the mesh's shard dim.

    The sharded form is an ``nn.Parameter`` wrapping a DTensor; it is what the optimizer sees
    and what ``state_dict()`` returns. Its local tensor lives on the mesh device, or on the CPU
    under ``CPUOffloadPolicy``. The unsharded form is one persistent ``nn.Parameter`` whose
    storage is allocated on unshard and freed (resized to 0) on reshard: keeping the same tensor
    object lets autograd's saved references stay valid across reshard/unshard cycles.

    ``codec`` (fsdp2.runtime.codecs, set by the group) says how it travels through the all-gather.
    """

    def __init__(
        self,
        fqn: str,
        param: nn.Parameter,
        slots: list[ParamSlot],
        dp: DataParallelMesh,
        shard_dim: int,
        spec: ShardedSpec,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        owner: str = "",
    ):
        self.fqn = fqn
        self.owner = owner
        self.slots = slots
        self.mp_policy = mp_policy
        self.device = dp.device  # where it is gathered and computed on
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self._pin = self.offload and offload_policy.pin_memory and torch.cuda.is_available()
        self.storage_device = torch.device("cpu") if self.offload else self.device
        self.tensor_parallel = spec.tensor_parallel  # None unless composed with TP
        self.layout = ShardLayout(spec.fsdp_input.shape, shard_dim, dp.shard_size, dp.shard_rank)
        self._on_grad_ready: Callable[["ShardedParam", torch.Tensor], None] | None = None
        self.state = ParamState.SHARDED

        # clone(): the shard must own its memory so the full tensor can be freed.
        local = self._to_storage(self.layout.local_slice(spec.fsdp_input).clone())
        dtensor = compat.make_dtensor(local, spec.mesh, spec.placements, param.shape, param.stride())
        self.sharded_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        # requires_grad as fsdp2 last read it (here and at refresh): what a compiled step computes
        # gradients for (eager reads the live flag at every forward).
        self.trainable = param.requires_grad
        mark_managed(param, owner)
        mark_managed(self.sharded_param, owner)
        self.unsharded_param: nn.Parameter | None = None
        self._padded_full: torch.Tensor | None = None  # storage owner of unsharded_param
        # Gradient summed over microbatches without sync, kept in reduce_dtype for precision.
        self.unsynced_sum: torch.Tensor | None = None
        self._flat_shard_of: torch.Tensor | None = None  # the local shard _flat_shard views
        self._flat_shard: torch.Tensor | None = None
        self._flat_numel = 0
        self._slot_numel = self.layout.padded_shard_numel  # its plain codec's all-gather slot
        self._read_dtypes()
        self.codec: GatherCodec = PlainCodec(self)
        self.hold_sharded()
        self._make_traced_leaf()

    def bind_grad_ready(self, on_grad_ready: Callable[["ShardedParam", torch.Tensor], None]) -> None:
        """``on_grad_ready(self, unsharded_param)`` runs when autograd has accumulated this
        parameter's gradient. Bound before the first unshard (it is registered then)."""
        self._on_grad_ready = on_grad_ready

    @property
    def requires_grad(self) -> bool:
        # Read live: users freeze or unfreeze the (sharded) parameter after fully_shard.
        return self.sharded_param.requires_grad

    def _read_dtypes(self) -> None:
        """Dtypes follow the shard: ``module.to(dtype)`` after fully_shard changes them."""
        shard = self.local_shard
        self.orig_dtype = shard.dtype
        self.param_dtype = param_dtype_of(shard, self.mp_policy)
        self.reduce_dtype = reduce_dtype_of(shard, self.mp_policy)
        self.grad_dtype_rule = self._grad_dtype_rule()

    def _grad_dtype_rule(self) -> GradDtype:
        compute, reduce = self.param_dtype, self.reduce_dtype
        if not (compat.UNSHARDED_GRAD_IN_REDUCE_DTYPE and compute.is_floating_point and reduce.is_floating_point):
            return GradDtype.COMPUTE
        if reduce == compute:
            return GradDtype.COMPUTE
        if reduce.itemsize <= compute.itemsize:
            return GradDtype.REDUCE  # PyTorch defers only the upcast to a wider dtype
        tp = self.tensor_parallel
        if tp is not None and any(isinstance(placement, Replicate) for placement in tp.placements):
            return GradDtype.REDUCE
        return GradDtype.PER_BACKWARD

    def on_compute_device(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` where the parameter is gathered and computed on: under CPU offload the shard
        lives on the host, and every codec, eager or compiled, encodes it on the device (as
        PyTorch's FSDP2 hands it to a tensor subclass's hooks); a pinned one copies asynchronously."""
        if shard.device == self.device:
            return shard
        return shard.to(self.device, non_blocking=self._pin)

    def _to_storage(self, local: torch.Tensor) -> torch.Tensor:
        if local.device.type == "meta":
            return local
        local = local.to(self.storage_device)
        return local.pin_memory() if self._pin and not local.is_pinned() else local

    # -- views the modules see ----------------------------------------------------------------

    @property
    def local_shard(self) -> torch.Tensor:
        # Read through the DTensor every time: to_empty()/_apply swap its contents in place.
        return compat.local_tensor(self.sharded_param)

    def hold_sharded(self) -> None:
        hold_all_sharded((self,))

    def hold_unsharded(self) -> None:
        hold_all_unsharded((self,))

    def refresh(self) -> None:
        """Re-read the parameter after something outside fsdp2 replaced or converted it.

        ``load_state_dict(assign=True)`` or ``module.weight = nn.Parameter(...)`` register a new
        parameter; ``module.to(dtype)``/``to_empty`` swap a new tensor into ours. Take the
        registered one over (a DTensor sharded like ours, or the full tensor, which we shard),
        put it in every place the parameter is tied to, and follow its dtype.
        """
        self._flat_shard_of = self._flat_shard = None
        current = self.registered_replacement()
        if current is not None:
            self.sharded_param = self._adopt(current)
            for slot in self.slots:
                slot.hold(self.sharded_param)
        mark_managed(self.sharded_param, self.owner)  # a tensor swap replaced its __dict__
        self.trainable = self.sharded_param.requires_grad
        self._make_traced_leaf()
        param_dtype = self.param_dtype
        self._read_dtypes()
        if self.param_dtype != param_dtype:
            self.forget_unsharded()  # the gathered storage has the old dtype

    def registered_replacement(self) -> torch.Tensor | None:
        """What is registered in the parameter's place if it is neither of ours (assigned, or
        loaded with ``assign=True``): eager takes it over at ``refresh``, a compiled step refuses
        it (fsdp2.runtime.traced.check_traceable)."""
        current = self.slots[0].current()
        if current is self.sharded_param or current is self.unsharded_param:
            return None
        return current

    def forget_unsharded(self) -> None:
        """Drop the unsharded parameter: the next unshard builds it anew."""
        if self.unsharded_param is not None:
            self.free_unsharded()
            self.unsharded_param = self._padded_full = None

    def _adopt(self, new: torch.Tensor) -> nn.Parameter:
        ours = self.sharded_param
        if isinstance(new, DTensor):
            if (
                new.device_mesh != ours.device_mesh
                or tuple(new.placements) != tuple(ours.placements)
                or new.shape != ours.shape
            ):
                raise FSDPUsageError(
                    f"parameter {self.fqn} was replaced by a DTensor with mesh {new.device_mesh}, placements "
                    f"{tuple(new.placements)} and shape {tuple(new.shape)}; fully_shard({self.owner}) shards it as "
                    f"{tuple(ours.placements)} on {ours.device_mesh} with shape {tuple(ours.shape)}. Assign a "
                    "DTensor laid out like model.state_dict() gives, or a full tensor."
                )
            local = compat.local_tensor(new)
        elif isinstance(new, torch.Tensor) and new.shape == ours.shape and self.tensor_parallel is None:
            local = self.layout.local_slice(new.detach())
        else:
            raise FSDPUsageError(
                f"parameter {self.fqn} was replaced by a {type(new).__name__} of shape {tuple(new.shape)}; fully_shard"
                f"({self.owner}) expects a DTensor like model.state_dict() gives or a full tensor of shape "
                f"{tuple(ours.shape)}."
            )
        # Own the memory: a view (a box of a full tensor) would keep the whole tensor alive.
        if compat.view_base(local) is not None or not local.is_contiguous():
            local = local.clone(memory_format=torch.contiguous_format)
        local = self._to_storage(local.detach())
        dtensor = compat.dtensor_like(ours, local)
        return nn.Parameter(dtensor, requires_grad=new.requires_grad)

    # -- the traced path's input ------------------------------------------------------------------

    def _make_traced_leaf(self) -> None:
        """``traced_leaf``: the local shard as a plain tensor sharing its storage (and version
        counter), which a compiled graph (fsdp2.runtime.traced) gathers from. A plain tensor, not
        the DTensor: AOTAutograd would wrap and unwrap every DTensor input and gradient in Python
        on every step. It takes no gradient: the group's reduced gradient goes to one leaf per
        bucket (fsdp2.runtime.grad_sinks), which hands it to every DTensor ``.grad`` at once."""
        shard = self.local_shard
        # The tensor object it was made from: one swapped into the DTensor from outside fsdp2 (a
        # submodule's _apply) is not seen by a compiled step, which refuses it (grad_sinks.BucketSinks).
        self.traced_source = shard
        leaf = getattr(self, "traced_leaf", None)
        if leaf is not None and (leaf.device, leaf.dtype, leaf.shape) == (shard.device, shard.dtype, shard.shape):
            real = shard.device.type != "meta" and not isinstance(shard, compat.FakeTensor)  # fakes have no data_ptr
            if real and leaf.data_ptr() == shard.data_ptr():
                return  # still the shard's memory (and no new tensor inside a functorch transform)
        self.traced_leaf = shard.detach()

    # -- all-gather -----------------------------------------------------------------------------

    def copy_in_pair(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(where in its all-gather ``slot`` this rank's shard goes, the shard); None if it has no
        rows (see :func:`copy_in_pairs`)."""
        return copy_in_pairs((self,), (slot,))[0]

    def copy_gathered_out(self, gathered: torch.Tensor) -> None:
        """Fill the unsharded parameter from its ``world x padded_shard_numel`` gathered block."""
        self._allocate_unsharded()
        with torch.no_grad():
            self.layout.copy_full_out(gathered, self._gather_target)

    def unsharded_storage(self) -> torch.Tensor:
        """The unsharded parameter's padded 1-D storage, allocated (autograd does not see writes)."""
        self._allocate_unsharded()
        return self._gather_target

    def gather_target(self) -> torch.Tensor | None:
        """For dim-0 shards, the ``world x padded_shard_numel`` view the gathered block is copied
        into directly (one fused copy for the whole group); None for other shard dims."""
        if self.layout.dim != 0:
            return None
        self._allocate_unsharded()
        return self._gather_rows

    def _allocate_unsharded(self) -> None:
        numel = self.layout.world * self.layout.padded_shard_numel
        if self.unsharded_param is None:
            self._padded_full = torch.empty(numel, dtype=self.param_dtype, device=self.device)
            self._padded_nbytes = numel * self._padded_full.element_size()
            self._padded_storage = self._padded_full.untyped_storage()  # the same object across resizes
            # Same storage, separate version counter: refilling it must not look like an in-place
            # change to autograd, which saved the unsharded parameter in forward for backward.
            self._gather_target = self._padded_full.data
            # Views survive the storage being freed and regrown, so build them once.
            self._gather_rows = self._gather_target.view(self.layout.world, self.layout.padded_shard_numel)
            self._gather_real_rows = self._gather_rows[: self.layout.ranks_with_rows]
            full = self._padded_full[: self.layout.full_numel].view(self.layout.full_shape)
            if self.tensor_parallel is not None:
                full = self.tensor_parallel.wrap(full)  # TP modules compute on DTensors
            # Created with its final requires_grad: setting it later is an in-place change that
            # functorch transforms (torch.func.jvp) refuse on a tensor from outside the transform.
            self.unsharded_param = nn.Parameter(full, requires_grad=self.requires_grad)
            self._set_unsharded_grad_dtype()
            self._grad_hook_registered = False
        elif self._padded_storage.nbytes() == 0:
            self._padded_storage.resize_(self._padded_nbytes)

    def _sync_requires_grad(self) -> None:
        """Give the unsharded parameter the shard's current requires_grad (and our grad hook)."""
        wanted = self.requires_grad
        if self.unsharded_param.requires_grad != wanted:
            self.unsharded_param.requires_grad_(wanted)
        if wanted and not self._grad_hook_registered and self._on_grad_ready is not None:
            # The callback itself with this parameter bound: no frame of ours in between, per
            # parameter and step.
            self.unsharded_param.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready, self))
            self._grad_hook_registered = True

    def gathered_rank_rows(self) -> torch.Tensor:
        """The unsharded parameter as ``world x padded_shard_numel`` rank slots (as all-gathered)."""
        world, n = self.layout.world, self.layout.padded_shard_numel
        if self.layout.dim == 0:
            return self._gather_rows  # already laid out by rank
        slots = torch.empty(world, n, dtype=self.param_dtype, device=self.device)
        self.layout.copy_full_in(self._padded_full[: self.layout.full_numel].view(self.layout.full_shape), slots)
        return slots

    def adopt_unsharded(self, tensor: torch.Tensor) -> None:
        """Make ``tensor``, built by the codec (a tensor subclass's post-all-gather hook), the
        unsharded parameter, viewed with the parameter's shape and contiguous strides."""
        full = torch.as_strided(tensor, self.layout.full_shape, self.layout.full_strides, 0)
        if self.tensor_parallel is not None:
            full = self.tensor_parallel.wrap(full)
        self.unsharded_param = nn.Parameter(full, requires_grad=self.requires_grad)
        self._set_unsharded_grad_dtype()
        self._grad_hook_registered = False

    def _set_unsharded_grad_dtype(self) -> None:
        if self.grad_dtype_rule is not GradDtype.COMPUTE:  # see GradDtype
            self.unsharded_param.grad_dtype = self.reduce_dtype

    def choose_grad_dtype(self, synced: bool) -> None:
        """At a backward's start (GradDtype.PER_BACKWARD): the unsharded parameter's ``grad_dtype``
        for this backward (:meth:`summed_in`)."""
        unsharded = self.unsharded_param
        starts = unsharded.grad is None and self.unsynced_sum is None
        unsharded.grad_dtype = self.summed_in(synced, starts)

    def summed_in(self, synced: bool, starts_sum: bool) -> torch.dtype | None:
        """The dtype a backward adds the gradients of this parameter's uses in, as PyTorch's FSDP2
        (GradDtype): ``reduce_dtype``, each use's gradient cast before it is added, or None for
        the compute dtype. A backward without sync that starts a sum (``starts_sum``) casts under
        GradDtype.PER_BACKWARD; any other adds the uses in the compute dtype (into a sum already
        kept in ``reduce_dtype``, in place). The compiled step's gradient port follows it too."""
        rule = self.grad_dtype_rule
        if rule is GradDtype.REDUCE or (rule is GradDtype.PER_BACKWARD and starts_sum and not synced):
            return self.reduce_dtype
        return None

    def free_unsharded(self) -> None:
        free_all_unsharded((self,))

    # -- gradients ------------------------------------------------------------------------------

    @property
    def has_unreduced_grad(self) -> bool:
        grad = self.unsharded_param.grad if self.unsharded_param is not None else None
        return grad is not None or self.unsynced_sum is not None

    def add_to_unsynced_sum(self) -> None:
        """Keep this backward's gradient locally (no communication) for a later synced backward.

        Kept as autograd made it, only cast to ``reduce_dtype``: a tensor-parallel gradient stays a
        DTensor, so pending (Partial) sums over microbatches add up at full precision and are
        redistributed once, when the synced backward reduces them (as PyTorch's FSDP2 does)."""
        grad = self.unsharded_param.grad
        if grad is None or grad.dtype == self.reduce_dtype:
            return  # autograd accumulates in place into .grad at full precision already
        self.unsharded_param.grad = None
        if self.unsynced_sum is None:
            self.unsynced_sum = grad.to(self.reduce_dtype)
        else:
            self.unsynced_sum, grad = _alike(self.unsynced_sum, grad, self.tensor_parallel)
            self.unsynced_sum.add_(grad)

    def add_compiled_unsynced(self, full: torch.Tensor) -> None:
        """Add a compiled backward's gradient without sync (``full``: this parameter's full, TP-local
        gradient in ``reduce_dtype``, owned) to its unsynced sum: the one store both executors'
        microbatches keep their sums in."""
        if self.unsynced_sum is None:
            self.unsynced_sum = full
        else:
            self.unsynced_sum, full = _alike(self.unsynced_sum, full, self.tensor_parallel)
            self.unsynced_sum.add_(full)


def _alike(summed: torch.Tensor, new: torch.Tensor, tensor_parallel) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed`` and ``new`` as tensors of one kind: under tensor parallelism an eager microbatch's
    gradient is a DTensor (a pending sum, redistributed once at the synced backward) and a compiled
    one's TP-local; where both meet, the DTensor is made TP-local first."""
    if tensor_parallel is None or isinstance(summed, DTensor) == isinstance(new, DTensor):
        return summed, new
    return tensor_parallel.local_grad(summed), tensor_parallel.local_grad(new)


def weak_hook(method: Callable, *args) -> Callable:
    """``method`` (bound) with ``args`` bound after its object, as a tensor hook that refers to them
    weakly: autograd keeps a leaf's hooks where the garbage collector cannot see them, so a hook
    that referred to its owner strongly would keep the owner, its module and the leaf alive
    forever. A C-level partial of proxies: no Python call more per call than the method itself."""
    return functools.partial(method.__func__, weakref.proxy(method.__self__), *map(weakref.proxy, args))


# -- a group's parameters in one pass ------------------------------------------------------------
#
# The verbs a group applies to all its parameters on every unshard, reshard and reduction: the one
# implementation of each, a loop with no Python call per parameter in the common case, so that host
# work per step grows with the number of groups rather than of parameters. The per-parameter
# methods above (hold_sharded, hold_unsharded, copy_in_pair) call these with one parameter.


def hold_all_sharded(params: Sequence[ShardedParam]) -> None:
    """Put every parameter's sharded form in all the places it is registered."""
    parameters_of = compat.parameter_registry  # a C accessor: no Python call per parameter
    for p in params:
        tensor = p.sharded_param
        for slot in p.slots:
            parameters_of(slot.module)[slot.name] = tensor  # as ParamSlot.hold, inlined
        p.state = ParamState.SHARDED


def hold_all_unsharded(params: Sequence[ShardedParam]) -> None:
    """Put every parameter's unsharded form in all its places, with the shard's requires_grad."""
    parameters_of = compat.parameter_registry
    for p in params:
        tensor = p.unsharded_param
        wanted = p.sharded_param.requires_grad
        if tensor.requires_grad != wanted or (wanted and not p._grad_hook_registered):
            p._sync_requires_grad()
        for slot in p.slots:
            parameters_of(slot.module)[slot.name] = tensor
        p.state = ParamState.UNSHARDED


def free_all_unsharded(params: Sequence[ShardedParam]) -> None:
    """Free every parameter's unsharded storage (the tensor objects stay for autograd)."""
    for p in params:
        if p._padded_full is not None:
            p._padded_storage.resize_(0)
        if p.codec.holds_memory:
            p.codec.release()


def allocate_all_unsharded(params: Sequence[ShardedParam]) -> None:
    """Give every parameter's unsharded storage its memory (building it the first time)."""
    for p in params:
        if p.unsharded_param is None:
            p._allocate_unsharded()
        else:
            storage = p._padded_storage
            if storage.nbytes() == 0:  # nbytes(): size() is a Python call
                storage.resize_(p._padded_nbytes)


def unsharded_storages(params: Sequence[ShardedParam]) -> list[torch.Tensor]:
    """Every parameter's :meth:`ShardedParam.unsharded_storage`."""
    allocate_all_unsharded(params)
    return [p._gather_target for p in params]


def gather_targets(params: Sequence[ShardedParam]) -> list[torch.Tensor] | None:
    """Every parameter's :meth:`ShardedParam.gather_target`, its storage allocated; None unless
    all are dim-0 shards."""
    if any([p.layout.dim != 0 for p in params]):
        return None
    allocate_all_unsharded(params)
    return [p._gather_rows for p in params]


def gather_real_row_targets(params: Sequence[ShardedParam]) -> list[torch.Tensor]:
    """Every dim-0 parameter's rank slots that hold real rows (``ranks_with_rows x
    padded_shard_numel`` of its :meth:`ShardedParam.gather_target`), its storage allocated."""
    allocate_all_unsharded(params)
    return [p._gather_real_rows for p in params]


def copy_in_pairs(params: Sequence[ShardedParam], slots: Sequence[torch.Tensor]) -> list:
    """Per parameter, (where in its all-gather ``slot`` this rank's shard goes, the shard), or None
    if it has no rows here. ``slot`` is its plain codec's all-gather slot (``padded_shard_numel``
    elements; on one rank, its unsharded storage). Paired so a group copies all its shards in with
    one fused (casting) copy; padding rows are left as they are (they only land in padding)."""
    pairs = []
    for p, slot, shard in zip(params, slots, compat.local_tensors([p.sharded_param for p in params])):
        if p._flat_shard_of is not shard:  # not the cached contiguous shard: first use, or refreshed
            layout = p.layout
            if not layout.local_rows:
                pairs.append(None)
                continue
            padded_inside = layout.dim != 0 and layout.local_rows < layout.chunk
            if padded_inside or not shard.is_contiguous():
                pairs.append((layout.shard_rows(slot), shard))  # not a flat prefix of the slot
                continue
            # Cached: the shard tensor changes only in refresh() (after _apply or a load), which
            # drops the cache; swap_tensors keeps the object but swaps its storage under it.
            p._flat_shard_of, p._flat_shard = shard, shard.reshape(-1)
            p._flat_numel = p._flat_shard.numel()
        pairs.append((slot if p._flat_numel == p._slot_numel else slot[: p._flat_numel], p._flat_shard))
    return pairs


def take_unreduced_grads(params: Sequence[ShardedParam]) -> dict[int, torch.Tensor | None]:
    """``id(p) ->`` the full local gradient to reduce (this backward's, plus what backwards without
    sync kept) for every parameter that requires a gradient, releasing our references to it."""
    grads = {}
    for p in params:
        if not p.sharded_param.requires_grad:
            continue
        unsharded = p.unsharded_param
        grad = None
        if unsharded is not None:
            grad, unsharded.grad = unsharded.grad, None
        summed = p.unsynced_sum
        if summed is not None:
            p.unsynced_sum = None
            if grad is not None:
                summed, grad = _alike(summed, grad, p.tensor_parallel)
                grad = summed.add_(grad)  # the kept sum first
            else:
                grad = summed
        if p.tensor_parallel is not None and grad is not None:
            grad = p.tensor_parallel.local_grad(grad)  # once, on the sum over microbatches
        grads[id(p)] = grad
    return grads


def accumulate_sharded_grads(
    params: Sequence[ShardedParam], reduced_slots: Sequence[torch.Tensor], host_syncs_later: bool = True
) -> None:
    """Add each parameter's rows of its reduced padded slot to its sharded ``.grad`` (a DTensor),
    which lives where the shard lives: on the CPU under offload, whatever the mesh's device, so the
    optimizer steps there. First gradients are assigned in one call for the group.
    ``host_syncs_later``: the eager root waits for the device once at the end of backward, so a
    first offloaded gradient may copy asynchronously; else (the compiled step) every copy waits."""
    fresh_params, fresh_grads = [], []
    for p, slot in zip(params, reduced_slots):
        layout = p.layout
        existing = p.sharded_param.grad
        if not p.offload and existing is None and layout.local_rows == layout.chunk:
            # A first gradient, no padding on this rank, on the shard's device: a view of the slot.
            local = slot.view(layout.local_shape)
            fresh_params.append(p.sharded_param)
            fresh_grads.append(local if local.dtype == p.orig_dtype else local.to(p.orig_dtype))
            continue
        local = layout.shard_rows(slot)
        if local.dtype != p.orig_dtype:
            local = local.to(p.orig_dtype)
        if p.offload:
            # A fresh gradient may arrive asynchronously (the root syncs the host once at the
            # end of backward); one the host adds to right away must be there now.
            local = local.to(p.storage_device, non_blocking=host_syncs_later and existing is None and p._pin)
        if existing is None:
            p.sharded_param.grad = compat.dtensor_like(p.sharded_param, local.contiguous())
        else:
            compat.local_tensor(existing).add_(local)
    compat.assign_dtensor_grads(fresh_params, fresh_grads)
