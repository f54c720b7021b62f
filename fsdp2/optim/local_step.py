"""Step a torch.optim optimizer on the local shards of DTensor parameters, as plain tensors.

An optimizer over DTensor parameters (every fsdp2 / FSDP2 parameter is one) runs each of its
element-wise ops through DTensor's dispatch, which costs tens of microseconds per op and per
parameter: 10-20 ms of a training step that needs none of it, since an element-wise update of a
shard reads only that shard. ``step_on_local_shards(optimizer)`` makes ``optimizer.step()`` hand
the optimizer, for the duration of the step, plain tensors sharing storage with each parameter's
local shard, with ``.grad`` the local shard of the gradient and the state entries the local
shards of the DTensor state. Everything else stays as it was: the optimizer is still a normal
``torch.optim.Optimizer`` over the DTensor parameters, its state entries are DTensors
(``state_dict()``, ``load_state_dict()``, ``fsdp2.checkpoint`` and ``torch.distributed.checkpoint``
see the same names, types and placements), and lr schedulers, ``add_param_group`` and ``zero_grad``
work as before. The result is bitwise that of the plain step on DTensors.

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    fsdp2.optim.step_on_local_shards(optimizer)     # from now on optimizer.step() skips DTensor dispatch

Only for optimizers whose update of an element reads that element's own parameter, gradient and
state (SGD, Adam, AdamW and the other element-wise ``torch.optim`` classes): one that reduces over
a tensor (LBFGS, Adafactor, Muon, ...) would compute something else on a shard, so it is refused.
A step falls back to the DTensor path when it cannot be exact on local shards: a ``closure``
(it recomputes gradients mid-step), a gradient whose placements differ from its parameter's, or a
0-dim DTensor parameter whose state does not exist yet.

By default (no call needed) it is installed on every optimizer that is exactly one of those
classes and holds parameters of ``fsdp2.fully_shard``: at its first ``step()`` (which itself
still runs on DTensors), through torch.optim's public global step pre-hook, registered once by
the first ``fully_shard`` call. No torch.optim class or function is patched; other optimizers
only pay one attribute lookup per step. ``step_on_dtensors(optimizer)`` opts one out. A step
during which other code would see the parameters (step hooks on the optimizer, or global ones
other than the default's) runs on DTensors, as on PyTorch's FSDP2: the default changes nothing
that anyone can observe, only the time.
"""

from __future__ import annotations

import types
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp2 import compat
from fsdp2.runtime.sharded_param import managed_by

# Every one updates each element from that element's parameter, gradient and state alone.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adadelta,
    torch.optim.Adagrad, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
    torch.optim.Rprop,
)

_HANDLE_ATTR = "_fsdp2_local_shard_step"
_DECIDED_ATTR = "_fsdp2_default_step_decided"  # the default looked at this optimizer already


def step_on_local_shards(optimizer: torch.optim.Optimizer, *, elementwise: bool = False) -> "LocalShardStep":
    """Make ``optimizer.step()`` run on the local shards of its DTensor parameters as plain tensors.

    ``elementwise=True`` vouches for an optimizer class not in ``ELEMENTWISE_OPTIMIZERS`` whose
    update is element-wise too. Returns the installed :class:`LocalShardStep`; its ``remove()``
    restores the plain DTensor step.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"step_on_local_shards: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not elementwise and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        known = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(
            f"step_on_local_shards: {type(optimizer).__name__} is not known to update each element from that "
            f"element alone (known: {known}); on a shard an optimizer that reduces over a tensor computes "
            "something else. If its update is element-wise, pass elementwise=True."
        )
    existing = getattr(optimizer, _HANDLE_ATTR, None)
    if existing is not None and existing.active:
        if existing.by_default:
            return existing  # the default installed it already: the same step
        raise ValueError("step_on_local_shards: this optimizer already steps on local shards (remove() the first one)")
    return LocalShardStep(optimizer)


def step_on_dtensors(optimizer: torch.optim.Optimizer) -> None:
    """Opt ``optimizer`` out of the default: its ``step()`` runs on the DTensor parameters
    (removes a local-shard step installed on it, by default or by ``step_on_local_shards``)."""
    setattr(optimizer, _DECIDED_ATTR, True)
    existing = getattr(optimizer, _HANDLE_ATTR, None)
    if existing is not None:
        existing.remove()


# -- the default ------------------------------------------------------------------------------

_default_hook = None  # the global step pre-hook's handle, once registered


def step_on_local_shards_by_default() -> None:
    """Register (once per process) the step pre-hook that installs the local-shard step on
    optimizers for which it is known to give the same result (called by ``fully_shard``)."""
    global _default_hook
    if _default_hook is None:
        _default_hook = register_optimizer_step_pre_hook(_install_where_identical)


def _install_where_identical(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer.__dict__.get(_DECIDED_ATTR):
        return
    setattr(optimizer, _DECIDED_ATTR, True)  # looked at once, whatever the answer
    if _HANDLE_ATTR in optimizer.__dict__:
        return  # the user chose already
    # Exact classes only: a subclass may override step() with an update that is not element-wise.
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS and any(
        managed_by(p) is not None for group in optimizer.param_groups for p in group["params"]
    ):
        LocalShardStep(optimizer, by_default=True)  # from the next step on: this one is under way


def _user_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether code other than the optimizer's own runs inside its ``step()``: step hooks on it, or
    global ones besides the default's."""
    return bool(compat.optimizer_step_hooks(optimizer)) or any(
        hook is not _install_where_identical for hook in compat.global_optimizer_step_hooks()
    )


class LocalShardStep:
    """Installed on one optimizer: its ``step()`` presents local shards, then folds new state back.

    Lifecycle: active from construction until ``remove()``; a removed one passes ``step()``
    straight through (an lr scheduler may have wrapped it since, so it stays in the chain).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, by_default: bool = False):
        self.optimizer = optimizer
        self.active = True
        self.by_default = by_default  # installed by the default, not by step_on_local_shards
        self._inner_step = optimizer.step  # bound method, or an lr scheduler's wrapper of it
        self._aliases: dict[DTensor, tuple[torch.Tensor, torch.Tensor]] = {}  # param -> (its local tensor, our alias)
        self.local_steps = 0  # steps taken on local shards (the rest fell back to DTensors)
        setattr(optimizer, _HANDLE_ATTR, self)
        # A method bound to the optimizer, as lr schedulers expect (they rebind step.__func__ to it).
        optimizer.step = types.MethodType(_step, optimizer)  # type: ignore[method-assign]

    def remove(self) -> None:
        self.active = False
        self._aliases.clear()

    # -- one step -------------------------------------------------------------------------------

    def step(self, *args, **kwargs):
        closure = kwargs.get("closure", args[0] if args else None)
        if not self.active or closure is not None:
            return self._inner_step(*args, **kwargs)
        if self.by_default and _user_step_hooks(self.optimizer):
            # Hooks see the parameters during step(): on PyTorch's FSDP2 they are DTensors, so the
            # default, which must change nothing anyone can observe, steps on DTensors here.
            return self._inner_step(*args, **kwargs)
        aliases = self._present()
        if aliases is None:
            return self._inner_step(*args, **kwargs)
        opt = self.optimizer
        held_params = [group["params"] for group in opt.param_groups]
        held_state = opt.state
        local_state = defaultdict(dict)
        # The state's DTensor entries as their local tensors, fetched in one batch.
        dtensor_entries = []  # (alias, key, DTensor)
        for param, alias in aliases.items():
            entries = held_state.get(param)
            if entries:
                translated = local_state[alias]
                for key, value in entries.items():
                    translated[key] = value  # a DTensor is replaced below, keeping the entries' order
                    if isinstance(value, DTensor):
                        dtensor_entries.append((alias, key, value))
        for (alias, key, _), local in zip(dtensor_entries, compat.local_tensors([v for *_, v in dtensor_entries])):
            local_state[alias][key] = local
        for group in opt.param_groups:
            group["params"] = [aliases[p] for p in group["params"]]
        opt.state = local_state
        try:
            result = self._inner_step(*args, **kwargs)
            self.local_steps += 1
            return result
        finally:
            for group, params in zip(opt.param_groups, held_params):
                group["params"] = params
            opt.state = held_state
            self._fold_back(aliases, local_state)
            for param, alias in aliases.items():
                if alias is not param:
                    alias.grad = None  # the gradient's storage belongs to the DTensor grad, which zero_grad frees

    def _present(self) -> dict | None:
        """Parameter -> what the optimizer sees in its place this step; None: this step must use DTensors."""
        opt = self.optimizer
        params = [param for group in opt.param_groups for param in group["params"]]
        dtensors = [param for param in params if isinstance(param, DTensor)]
        for param in dtensors:
            grad = param.grad
            if grad is not None and (
                not isinstance(grad, DTensor)
                or grad.placements != param.placements
                or (grad.device_mesh is not param.device_mesh and grad.device_mesh != param.device_mesh)
            ):
                return None
            if param.dim() == 0 and grad is not None and not opt.state.get(param):
                return None  # its new state entries cannot be told apart from the scalar 'step'
        # Only now that the whole step is known to go local: the aliases, made once per local tensor.
        previous, aliases = self._aliases, {param: param for param in params}
        locals_ = compat.local_tensors(dtensors)
        for param, local in zip(dtensors, locals_):
            cached = previous.get(param)
            aliases[param] = cached[1] if cached is not None and cached[0] is local else local.detach().requires_grad_(param.requires_grad)
        with_grads = [param for param in dtensors if param.grad is not None]
        for param in dtensors:
            aliases[param].grad = None
        for param, grad in zip(with_grads, compat.local_tensors([param.grad for param in with_grads])):
            aliases[param].grad = grad
        self._aliases = {param: (local, aliases[param]) for param, local in zip(dtensors, locals_)}
        return aliases

    def _fold_back(self, aliases: dict, local_state: dict) -> None:
        """Write the state the optimizer left on the aliases back onto the DTensor parameters."""
        state = self.optimizer.state
        held_dtensors = []  # (held entries, key, the DTensor held before, the value after)
        for param, alias in aliases.items():
            entries = local_state.get(alias)
            if entries is None:
                continue
            if alias is param:  # a plain parameter: its entries were never translated
                state[param] = entries
                continue
            held = state[param]
            for key, value in entries.items():
                before = held.get(key)
                if isinstance(before, DTensor):
                    held_dtensors.append((held, key, before, value))
                elif before is None and _is_shard_shaped(value, alias):
                    held[key] = _like(value, param)  # new per-element state: a DTensor, as on the DTensor path
                else:
                    held[key] = value
        befores = compat.local_tensors([before for _, _, before, _ in held_dtensors])
        for (held, key, before, value), local_before in zip(held_dtensors, befores):
            if value is not local_before:  # replaced, not updated in place
                held[key] = _like(value, before)


def _step(optimizer: torch.optim.Optimizer, *args, **kwargs):
    return getattr(optimizer, _HANDLE_ATTR).step(*args, **kwargs)


def _is_shard_shaped(value, alias: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == alias.shape and value.device == alias.device


def _like(local: torch.Tensor, template: DTensor) -> DTensor:
    # Not DTensor.from_local: it would move CPU-offloaded state to the mesh's device.
    return compat.dtensor_like(template, local)
