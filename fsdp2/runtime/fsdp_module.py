"""``FSDPModule``: the methods a fully_shard'ed module gains (its class is swapped to include them).

The method set and signatures are PyTorch FSDP2's (``torch.distributed.fsdp.FSDPModule``);
tests/runtime/test_dropin.py compares them by introspection against the installed torch. The class
derives from PyTorch's, so ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` holds and
frameworks that branch on it call these methods; PyTorch code that reads private FSDP state
gets :mod:`fsdp2.runtime.torch_view`.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2 import compat
from fsdp2.errors import FSDPDeepcopyError, FSDPUsageError, FSDPUsageRuntimeError, FSDPUsageTypeError
from fsdp2.policies import AllGatherPolicy
from fsdp2.runtime.hooks import BackwardState, Finalization, FSDPState, Root
from fsdp2.runtime.torch_view import TorchStateView


class UnshardHandle(compat.TorchUnshardHandle):
    """Returned by ``unshard(async_op=True)``; ``wait()`` blocks until the parameters are usable."""

    def __init__(self, state: FSDPState):
        self._state = state

    def wait(self) -> None:
        for group in self._state.groups:
            group.wait_for_unshard()


class GradientReductionHandle(compat.TorchGradientReductionHandle):
    """Returned by ``finalize_backward(async_op=True)``; ``wait()`` completes the gradient
    reductions (the gradients are in ``.grad`` when it returns). Wait before the next forward."""

    def __init__(self, root: Root | None):
        self._root = root

    def wait(self) -> None:
        if self._root is not None:
            self._root.complete_reduction(self)
            self._root = None


class FSDPModule(compat.TorchFSDPModule):
    """Mixin placed in front of a module's own class by ``fully_shard``. A subclass of PyTorch's
    ``FSDPModule``, whose methods it all overrides (the MRO is ``FSDP<Cls>, FSDPModule,
    torch's FSDPModule, Cls``)."""

    _fsdp_state: FSDPState
    _orig_cls_mro_index = 3  # PyTorch's convention: where the module's own class sits in the MRO

    def __new__(cls, *args, **kwargs):
        # Constructing a fully_shard'ed class anew (slicing an nn.Sequential or a ModuleList does
        # ``type(self)(...)``) builds the original class: the new module is not sharded.
        original = next(c for c in cls.__mro__ if not issubclass(c, compat.TorchFSDPModule))
        module = original.__new__(original, *args, **kwargs)
        module.__init__(*args, **kwargs)
        return module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A frame of fsdp2's own around nn.Module.__call__: torch.compile(model) traces from here,
        # so the root's FSDP hooks join the model's one graph. Without it dynamo runs a compiled
        # top-level module's hooks as frames of their own (torch.nn's __call__ is not traced),
        # one graph each, with the gathered parameters passed between them.
        return super().__call__(*args, **kwargs)

    def __deepcopy__(self, memo):
        raise FSDPDeepcopyError(
            f"FSDP does not support deepcopy: {type(self).__name__} is fully_shard'ed (its parameters are shards "
            "tied to process groups); deep-copy the model before fully_shard, or copy its state_dict()."
        )

    def _get_fsdp_state(self) -> TorchStateView:
        """What PyTorch's own code reads as this module's FSDP state (also ``fully_shard.state``
        of PyTorch's fully_shard): the members it uses, routed to fsdp2's."""
        return TorchStateView.of(self._fsdp_state)

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state]
        states: list[FSDPState] = []
        for module in self.modules():
            state = module.__dict__.get("_fsdp_state")
            if state is not None and state not in states:
                states.append(state)
        return states

    # -- manual control -------------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (e.g. ahead of its forward)."""
        state = self._fsdp_state
        for group in state.groups:
            group.unshard(async_op=async_op)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's gathered parameters; only the shards remain. Not recursive."""
        for group in self._fsdp_state.groups:
            group.reshard()

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: reshard everything, forget the
        iteration (its gradient reductions are discarded), so the next one starts clean.
        Call it on the root module."""
        state = self._fsdp_state
        if state.root is None:
            return  # no forward ran yet: nothing to reset
        if not state.is_root:
            raise FSDPUsageRuntimeError(
                f"{type(self).__name__}.reset_iter_state: call it on the root fully_shard module"
            )
        state.root.reset()

    # -- gradient reduction -------------------------------------------------------------------------

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps full local gradients and communicates nothing (accumulation).
        Under HSDP it sets the all-reduce across replicas as well (as PyTorch's FSDP2 does)."""
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.set_sync(gradient_sync=requires_gradient_sync, all_reduce=requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but keeps the sums here instead of all-reducing across
        replicas (accumulation); the next all-reduce includes them."""
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.set_sync(all_reduce=requires_all_reduce)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the data-parallel size.
        Not recursive (as in PyTorch): call it on each module whose factor should change."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise FSDPUsageError(f"set_gradient_divide_factor: factor must be a positive number, got {factor!r}")
        for group in self._fsdp_state.groups:
            group.configure_reduce(divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor`."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """``hook(reduce_output)`` runs on each reduced gradient bucket of this module (after the
        HSDP all-reduce, before a division that follows the sum), before it is added to ``.grad``.
        ``stream`` is accepted for compatibility: the hook runs where the reduction runs. A module
        whose parameters are sharded on several meshes (``ShardPlacementResult``) calls it for
        each mesh's buckets (PyTorch's FSDP2 refuses such a module). ``None`` removes the hook,
        as in PyTorch's FSDP2."""
        if hook is not None and not callable(hook):
            raise FSDPUsageError(f"set_all_reduce_hook: hook must be callable, got {type(hook).__name__}")
        for group in self._fsdp_state.groups:
            group.configure_reduce(all_reduce_hook=hook)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: parameters without a gradient this backward are reduced as zeros, so ranks whose
        control flow used different parameters still issue matching reduce-scatters. Default
        False (as PyTorch): such parameters keep ``.grad`` None."""
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.set_reduce_unused(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many groups' reductions may be in flight under this module's root (default 2)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise FSDPUsageTypeError(
                f"set_reduce_scatter_max_input_buffers: expected an int >= 1, got {max_input_buffers!r}"
            )
        if max_input_buffers < 1:
            raise FSDPUsageError(
                f"set_reduce_scatter_max_input_buffers: expected an int >= 1, got {max_input_buffers!r}"
            )
        state = self._fsdp_state
        state.settings.max_reduces_in_flight = max_input_buffers
        if state.root is not None:
            state.root.reduce_window.limit = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run reduce-scatters on a process group of their own (collective: call it on every rank)."""
        groups: dict[tuple[int, ...], Any] = {}
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                if not enable:
                    group.configure_reduce(reduce_scatter_group=None)
                    continue
                ranks = tuple(dist.get_process_group_ranks(group.dp.shard_group))
                if ranks not in groups:
                    groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
                group.configure_reduce(reduce_scatter_group=groups[ranks])

    def set_custom_all_gather(self, comm: Any) -> None:
        """Use ``comm`` (``allocate(size, *, dtype, device)`` and ``comm(output, input, group,
        async_op)``) for this module's all-gathers instead of c10d's. Parameters sharded on
        several meshes: every mesh's all-gather calls it, with that mesh's process group."""
        _check_comm(comm, "set_custom_all_gather")
        for group in self._fsdp_state.groups:
            group.set_custom_all_gather(comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Use ``comm`` (``allocate(...)`` and ``comm(output, input, group, op=..., async_op=...)``,
        reducing with the c10d ``op`` PyTorch's FSDP2 would pass) for this module's reduce-scatters
        instead of c10d's. Parameters sharded on several meshes: every mesh's reduce-scatter calls
        it, with that mesh's process group."""
        _check_comm(comm, "set_custom_reduce_scatter")
        for group in self._fsdp_state.groups:
            group.configure_reduce(custom_reduce_scatter=comm)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: this module's gradient collectives reduce with SUM only, and the division by the
        data-parallel size (or the gradient divide factor) runs as separate ops; False (default):
        AVG/PREMUL_SUM where PyTorch's FSDP2 uses them. Not recursive, as in PyTorch."""
        for group in self._fsdp_state.groups:
            group.configure_reduce(force_sum=bool(enable))

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for compatibility; fsdp2 allocates communication buffers from PyTorch's
        caching allocator (use set_custom_all_gather/set_custom_reduce_scatter to choose)."""

    def set_all_gather_policy(self, policy: AllGatherPolicy | None, *, recurse: bool = True) -> None:
        """All-gather the parameters ``policy`` picks in 1 byte per element with block scales
        (fsdp2's own, not in PyTorch: fully_shard keeps PyTorch's signature, so the policy is set
        here). ``None`` gathers them in ``param_dtype`` again. Call it between steps; with
        ``recurse=False`` only this module's own group changes (e.g. keep the root's embeddings
        and head exact: ``model.set_all_gather_policy(None, recurse=False)`` after setting it on all)."""
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.set_all_gather_policy(policy, type(self).__name__)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise FSDPUsageError(
            f"{type(self).__name__}.set_symm_mem_for_comm: fsdp2 does not allocate all-gather buffers in NCCL "
            "symmetric memory; use set_custom_all_gather with an allocator of your choice instead."
        )

    # -- resharding and backward ----------------------------------------------------------------------

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free (True) or keep (False) parameters after forward from now on; overrides the
        fully_shard argument, also the root's default and an int (no 1/k copy is kept)."""
        if not isinstance(reshard_after_forward, bool):
            raise FSDPUsageError(f"set_reshard_after_forward expects a bool, got {reshard_after_forward!r}")
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.set_reshard_after_forward(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not gather this module's parameters (none is needed to compute
        its gradients, e.g. an embedding); its gradients are still reduced."""
        for group in self._fsdp_state.groups:
            group.unshard_in_backward = unshard_in_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """True: backward iterations end when the caller calls :meth:`finalize_backward` (on this
        root), after one or more backwards, instead of at the end of each backward; gradients not
        reduced during backward (gradient sync off, or not all ready) are reduced then. This
        supersedes :meth:`set_is_last_backward`. Set it before the backward; it cannot change
        during a backward, nor from a backward until its iteration is finalized (or reset)."""
        state = self._fsdp_state
        name = type(self).__name__
        if not isinstance(enabled, bool):
            raise FSDPUsageTypeError(f"{name}.set_manual_backward_finalization expects a bool, got {enabled!r}")
        root = state.root
        if root is not None and not state.is_root:
            raise FSDPUsageRuntimeError(
                f"{name}.set_manual_backward_finalization: call it on the root fully_shard module "
                f"({root.root_state.name}), which finalizes the backward of every module under it"
            )
        wanted = Finalization.MANUAL if enabled else Finalization.AUTOMATIC
        if wanted is state.settings.finalization:
            return
        if compat.autograd_backward_running():
            raise FSDPUsageRuntimeError(
                f"{name}.set_manual_backward_finalization({enabled}): called during backward; change it before "
                "the backward starts"
            )
        if root is not None and root.backward is not BackwardState.IDLE:
            raise FSDPUsageRuntimeError(
                f"{name}.set_manual_backward_finalization({enabled}): a backward iteration started under "
                f"{root.finalization.name.lower()} finalization has not ended; call finalize_backward() (and wait "
                "on its handle) or reset_iter_state() first"
            )
        state.settings.finalization = wanted

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """End the backward iteration under manual finalization (see
        :meth:`set_manual_backward_finalization`), after every backward of it: reduce the gradients
        the backwards left (as :meth:`set_requires_gradient_sync` now says), reshard as
        :meth:`set_reshard_after_backward` now says, and complete the reductions. With ``async_op``
        return a :class:`GradientReductionHandle` instead of waiting: its ``wait()`` completes them
        (call it before using the gradients or the next forward). Call it on the root; before the
        first forward it does nothing."""
        state = self._fsdp_state
        root = state.root
        if root is None and _holds_sums(self):
            # Only compiled steps ran (they make no root): their kept sums need the eager
            # reduction, which the root runs.
            state.lazy_init()
            root = state.root
        if root is None:
            return GradientReductionHandle(None) if async_op else None
        if not state.is_root:
            raise FSDPUsageRuntimeError(
                f"{type(self).__name__}.finalize_backward: call it on the root fully_shard module "
                f"({root.root_state.name}), which finalizes the backward of every module under it"
            )
        handle = GradientReductionHandle(root) if async_op else None
        root.finalize(awaited_by=handle)
        return handle

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """True: resharding keeps the gathered parameters' memory (the next unshard gathers into
        the same memory, so their data pointers stay the same, as CUDA graph capture needs), at
        the cost of holding it between uses. False (default): resharding frees it."""
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.keep_unsharded_storage = bool(keep)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backward is not the last before the optimizer step (microbatching):
        its end skips the host's wait for gradients offloaded to the CPU. Its gradients are in
        ``.grad`` when it returns all the same, as in PyTorch. May be called before the first forward."""
        self._fsdp_state.settings.is_last_backward = is_last_backward

    def set_post_optim_event(self, event: Any) -> None:
        """The root's next forward orders its all-gathers after ``event`` (recorded after the
        optimizer step) instead of everything queued on the compute stream. No effect on CPU."""
        self._fsdp_state.settings.post_optim_event = event

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Issue these modules' all-gathers at the start of this module's forward."""
        self._fsdp_state.forward_prefetch = _states_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Issue these modules' all-gathers at the start of this module's backward."""
        self._fsdp_state.backward_prefetch = _states_of(modules, "set_modules_to_backward_prefetch")

    # -- nn.Module overrides ------------------------------------------------------------------------

    def _apply(self, fn, recurse: bool = True):
        # to()/to_empty()/cuda() replace parameter contents: reshard first so the shards are
        # what is registered, then re-read them (dtypes may have changed).
        groups = [group for state in self._fsdp_states(recurse=True) for group in state.groups]
        for group in groups:
            group.reshard()
        # Past PyTorch's FSDPModule._apply (it reads PyTorch's state) to the module's own class.
        result = compat.apply_past_torch_fsdp_module(self, fn, recurse)
        for group in groups:
            group.refresh_params()
        return result

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Like ``nn.Module.load_state_dict``, but checks everything before changing anything.

        Values may be DTensors sharded like ours (no communication) or full tensors (each rank
        copies its own box, no communication).
        """
        current = self.state_dict()  # reshards every group (as loading does)
        _check_compatible(type(self).__name__, current, state_dict, strict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _check_comm(comm: Any, method: str) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise FSDPUsageError(
            f"{method}: expected an object with allocate(size, *, dtype, device) and __call__, got {comm!r}"
        )


def _states_of(modules: Iterable[Any], method: str) -> list[FSDPState]:
    if isinstance(modules, nn.Module):  # would fail later as "object is not iterable"
        raise FSDPUsageError(
            f"{method} expects a list of modules, got a single {type(modules).__name__}; wrap it in [ ]"
        )
    states = []
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise FSDPUsageError(f"{method}: {type(m).__name__} is not fully_shard'ed; apply fully_shard to it first")
        states.append(m._fsdp_state)
    return states


def _check_compatible(owner: str, current: Mapping[str, Any], incoming: Mapping[str, Any], strict: bool) -> None:
    problems = []
    if strict:
        missing = sorted(set(current) - set(incoming))
        unexpected = sorted(set(incoming) - set(current))
        if missing:
            problems.append(f"missing keys: {missing}")
        if unexpected:
            problems.append(f"unexpected keys: {unexpected}")
    for key, value in incoming.items():
        if key not in current or not isinstance(value, torch.Tensor):
            continue
        have = current[key]
        if tuple(value.shape) != tuple(have.shape):
            problems.append(f"{key}: shape {tuple(value.shape)} in the state dict, {tuple(have.shape)} in the model")
        elif isinstance(value, DTensor) and isinstance(have, DTensor) and value.placements != have.placements:
            problems.append(
                f"{key}: placements {value.placements} in the state dict, {have.placements} in the model; "
                "pass full tensors or DTensors sharded like the model"
            )
    if problems:
        raise FSDPUsageRuntimeError(f"{owner}.load_state_dict: nothing was loaded:\n  " + "\n  ".join(problems))


def managed_by_pytorch(module: Any) -> bool:
    """Sharded by PyTorch's own ``fully_shard`` (before ``install_as_torch_fsdp``, say), not fsdp2's."""
    return isinstance(module, compat.TorchFSDPModule) and not isinstance(module, FSDPModule)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots (pipeline-parallel model chunks) share communication streams. fsdp2
    already uses one set of streams per device for every root, so this only checks its input.
    Modules PyTorch's ``fully_shard`` sharded go to PyTorch's ``share_comm_ctx``."""
    if not isinstance(modules, nn.Module):
        modules = list(modules)
        theirs = [m for m in modules if managed_by_pytorch(m)]
        if theirs and len(theirs) == len(modules):
            return compat.torch_fully_shard_home().share_comm_ctx(modules)
        if theirs:
            raise FSDPUsageError(
                f"share_comm_ctx: {type(theirs[0]).__name__} was sharded by PyTorch's fully_shard, the others by "
                "fsdp2's; modules sharing streams must all be sharded by one implementation"
            )
    _states_of(modules, "share_comm_ctx")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` unshard/reshard like ``forward`` does (e.g. ``generate``).

    A no-op on a module that is not fully_shard'ed, so the same code runs with or without FSDP.
    A module PyTorch's ``fully_shard`` sharded gets PyTorch's ``register_fsdp_forward_method``
    (its hooks are PyTorch's: fsdp2's would skip them and leave its state half-initialized).
    """
    if managed_by_pytorch(module):
        return compat.torch_fully_shard_home().register_fsdp_forward_method(module, method_name)
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise FSDPUsageError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    state = module._fsdp_state

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        args, kwargs = state._pre_forward_hook(module, args, kwargs)
        output = method(*args, **kwargs)
        return state._post_forward_hook(module, args, kwargs, output)

    object.__setattr__(module, method_name, wrapped)


def _holds_sums(module: nn.Module) -> bool:
    """Some fully_shard'ed module under ``module`` keeps sums for the next synced backward."""
    for sub in module.modules():
        state = sub.__dict__.get("_fsdp_state")
        if state is not None:
            for group in state.groups:
                if group.reduce.holds_unsynced_sums or group.reduce.partial_sums:
                    return True
    return False
