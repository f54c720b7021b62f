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
still runs on DTensors). What that takes, and all it takes: one global step pre-hook, registered
through torch.optim's public ``register_optimizer_step_pre_hook`` by the first ``fully_shard``
call, removed when the last fully_shard'ed module is freed (a process hook:
fsdp2.runtime.process_hooks) or by ``set_local_shard_steps(False)``. No torch.optim class, method or function is
patched, and nothing is written on an optimizer the default leaves alone (it is remembered by a
weak reference): such an optimizer, over plain tensors or PyTorch FSDP2's DTensors, steps exactly
as without fsdp2, at the cost of the hook's one Python call per step. ``step_on_dtensors(optimizer)``
opts one out; ``set_local_shard_steps(False)`` turns the default off for the whole process. A
step during which other code would see the parameters (step hooks on the optimizer, or global
ones other than the default's) runs on DTensors, as on PyTorch's FSDP2: the default changes
nothing that anyone can observe, only the time.
"""

from __future__ import annotations

import types
import weakref
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp2 import compat
from fsdp2.runtime.process_hooks import PROCESS_HOOKS
from fsdp2.runtime.sharded_param import managed_by

# Every one updates each element from that element's parameter, gradient and state alone.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.Adagrad,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)

_HANDLE_ATTR = "_fsdp2_local_shard_step"


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
            existing.requested = True  # asked for now: it stays when the default is switched off
            return existing  # the default installed it already: the same step
        raise ValueError("step_on_local_shards: this optimizer already steps on local shards (remove() the first one)")
    return LocalShardStep(optimizer)


def step_on_dtensors(optimizer: torch.optim.Optimizer) -> None:
    """Opt ``optimizer`` out of the default: its ``step()`` runs on the DTensor parameters
    (removes a local-shard step installed on it, by default or by ``step_on_local_shards``)."""
    _remember_looked_at(optimizer)
    existing = getattr(optimizer, _HANDLE_ATTR, None)
    if existing is not None:
        existing.remove()


# -- the default ------------------------------------------------------------------------------

_default_hook = None  # the global step pre-hook's handle, while registered
_default_on = True  # set_local_shard_steps
_default_wanted = False  # fsdp2 modules exist (the process hook is installed)
# Optimizers the default has decided on, by weak reference: an optimizer it leaves alone carries
# nothing of fsdp2's, and a dead one leaves the set.
_looked_at: set[weakref.ref] = set()


def _wanted(wanted: bool) -> None:
    """The process hook's install / remove (fsdp2.runtime.process_hooks): fsdp2 modules exist."""
    global _default_wanted
    _default_wanted = wanted
    _sync_default_hook()


PROCESS_HOOKS.register("optimizer local-shard step", lambda: _wanted(True), lambda: _wanted(False))


def set_local_shard_steps(enabled: bool) -> None:
    """Turn the default local-shard step on or off for the whole process (it is on).

    Off: no optimizer gets the local-shard step by default any more (the global step pre-hook
    is removed), and the ones the default already gave it step on DTensors again, as on
    PyTorch's FSDP2; ``step_on_local_shards(optimizer)`` still installs it on one optimizer.
    On again: the default resumes, for those optimizers too. Call it on every rank.
    """
    global _default_on
    if not isinstance(enabled, bool):
        raise TypeError(f"set_local_shard_steps: expected True or False, got {enabled!r}")
    _default_on = enabled
    _sync_default_hook()


def _sync_default_hook() -> None:
    global _default_hook
    if _default_on and _default_wanted and _default_hook is None:
        _default_hook = register_optimizer_step_pre_hook(_install_where_identical)
    elif not (_default_on and _default_wanted) and _default_hook is not None:
        _default_hook.remove()
        _default_hook = None


def _remember_looked_at(optimizer: torch.optim.Optimizer) -> None:
    _looked_at.add(weakref.ref(optimizer, _looked_at.discard))


def _install_where_identical(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    # Runs before every step of every optimizer in the process: no Python call on the way out
    # (a weak reference compares and hashes as its optimizer, in C).
    if _HANDLE_ATTR in optimizer.__dict__ or weakref.ref(optimizer) in _looked_at:
        return  # installed (by the default or the user), opted out, or looked at once already
    _remember_looked_at(optimizer)
    # Exact classes only: a subclass may override step() with an update that is not element-wise.
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS and any(
        managed_by(p) is not None for group in optimizer.param_groups for p in group["params"]
    ):
        LocalShardStep(optimizer, by_default=True)  # from the next step on: this one is under way


class LocalShardStep:
    """Installed on one optimizer: its ``step()`` presents local shards, then folds new state back.

    Lifecycle: active from construction until ``remove()``; a removed one passes ``step()``
    straight through (an lr scheduler may have wrapped it since, so it stays in the chain).

    What a step presents (the aliases, the translated state) is a :class:`_Presentation`, kept
    from step to step while the parameters, their local shards and the optimizer's state entries
    are the objects it was built from: a step then re-checks them by identity and hands over the
    new gradients, with no dict keyed by a tensor (each such lookup is a Python ``__hash__`` call)
    and no Python call per parameter. Anything else (new state, a replaced entry, a new param
    group, ``load_state_dict``) builds it again, as every step did before.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, by_default: bool = False):
        self.optimizer = optimizer
        self.active = True
        self.by_default = by_default  # installed by the default, not by step_on_local_shards
        self.requested = not by_default  # step_on_local_shards asked for it (set_local_shard_steps leaves it on)
        self._inner_step = optimizer.step  # bound method, or an lr scheduler's wrapper of it
        self._presentation: _Presentation | None = None
        self.local_steps = 0  # steps taken on local shards (the rest fell back to DTensors)
        setattr(optimizer, _HANDLE_ATTR, self)
        # A method bound to the optimizer, as lr schedulers expect (they rebind step.__func__ to it).
        optimizer.step = types.MethodType(_step, optimizer)  # type: ignore[method-assign]

    def remove(self) -> None:
        self.active = False
        self._presentation = None

    @property
    def aliases(self) -> list[tuple[DTensor, torch.Tensor]]:
        """(DTensor parameter, the plain tensor presented in its place) of the last local step."""
        return [] if self._presentation is None else [(p, alias) for p, _, alias, _ in self._presentation.dtensors]

    # -- one step -------------------------------------------------------------------------------

    def step(self, *args, **kwargs):
        closure = kwargs.get("closure", args[0] if args else None)
        if not self.active or closure is not None:
            return self._inner_step(*args, **kwargs)
        if self.by_default and (
            (not _default_on and not self.requested)
            or compat.has_step_hooks_besides(self.optimizer, _install_where_identical)
        ):
            # Switched off; or hooks see the parameters during step(): on PyTorch's FSDP2 they are
            # DTensors, so the default, which must change nothing anyone can observe, steps on DTensors.
            return self._inner_step(*args, **kwargs)
        opt = self.optimizer
        presentation = self._presentation
        if presentation is None or not presentation.still_fits(opt):
            presentation = self._presentation = _Presentation.build(opt, self._presentation)
        if not presentation.hand_over_grads(opt):
            return self._inner_step(*args, **kwargs)
        held_params = [group["params"] for group in opt.param_groups]
        held_state = opt.state
        for group, aliases in zip(opt.param_groups, presentation.group_aliases):
            group["params"] = aliases
        opt.state = presentation.local_state
        try:
            result = self._inner_step(*args, **kwargs)
            self.local_steps += 1
            return result
        finally:
            for group, params in zip(opt.param_groups, held_params):
                group["params"] = params
            opt.state = held_state
            if not presentation.fold_back_unchanged():
                _fold_back(held_state, presentation)
                presentation.retire()  # the state changed shape: the next step builds anew
            presentation.drop_grads()  # their storage belongs to the DTensor grads, which zero_grad frees


class _Presentation:
    """What the optimizer sees during a local step, and the objects it was made from.

    ``dtensors``: per DTensor parameter (param, its local shard, the alias presented, whether it
    is 0-dim); ``group_aliases``: each param group's list as presented; ``local_state``: the
    optimizer state keyed by what is presented, a DTensor entry replaced by its local tensor;
    ``entries``: per state entry (the held entries dict, the presented one, key, the held value,
    the presented value), what :meth:`still_fits` and :meth:`fold_back_unchanged` compare by identity.
    """

    __slots__ = (
        "params",
        "dtensors",
        "group_aliases",
        "held_state",
        "state_items",
        "entry_dicts",
        "entry_lens",
        "local_state",
        "local_dicts",
        "local_lens",
        "entries",
        "grad_specs",
    )

    @classmethod
    def build(cls, opt: torch.optim.Optimizer, previous: "_Presentation | None") -> "_Presentation":
        """A presentation of ``opt``'s current parameters and state (whether this step's gradients
        allow a local step is :meth:`hand_over_grads`'s question). Aliases of ``previous`` whose
        local shard is unchanged are kept (the optimizer's own caches may refer to them)."""
        self = cls()
        params = [param for group in opt.param_groups for param in group["params"]]
        held_state = opt.state
        known = {} if previous is None else {id(p): (p, local, alias) for p, local, alias, _ in previous.dtensors}
        aliases: dict[int, torch.Tensor] = {}  # by id(param): no Python __hash__ call per lookup
        self.dtensors = []
        local_of = compat.local_tensor_of
        for param in params:
            if not isinstance(param, DTensor) or id(param) in aliases:
                continue
            local = local_of(param)
            p, cached_local, alias = known.get(id(param), (None, None, None))
            if p is not param or cached_local is not local or alias.requires_grad != param.requires_grad:
                alias = local.detach().requires_grad_(param.requires_grad)
            aliases[id(param)] = alias
            self.dtensors.append((param, local, alias, param.dim() == 0))
        self.grad_specs = [None] * len(self.dtensors)  # per DTensor parameter: a gradient spec found to match
        self.params = params
        self.group_aliases = [[aliases.get(id(p), p) for p in group["params"]] for group in opt.param_groups]
        # The state, translated: a plain parameter shares its entries dict; a DTensor parameter's
        # gets a dict of its own whose DTensor values are their local tensors.
        self.held_state = held_state
        self.state_items = list(held_state.items())
        self.entry_dicts = [entries for _, entries in self.state_items]
        self.entry_lens = [len(entries) for entries in self.entry_dicts]
        self.local_state = defaultdict(dict)
        self.entries = []
        for param, entries in self.state_items:
            alias = aliases.get(id(param))
            if alias is None:
                self.local_state[param] = entries
                continue
            translated = self.local_state[alias]
            for key, value in entries.items():
                shown = local_of(value) if isinstance(value, DTensor) else value
                translated[key] = shown
                self.entries.append((entries, translated, key, value, shown))
        self.local_dicts = list(self.local_state.values())
        self.local_lens = [len(entries) for entries in self.local_dicts]
        return self

    def still_fits(self, opt: torch.optim.Optimizer) -> bool:
        """Whether the parameters, their local shards, requires_grad and every state entry are the
        objects this was built from (compared by identity: a few Python calls, none per parameter)."""
        groups, aliases = opt.param_groups, self.group_aliases
        if opt.state is not self.held_state or len(opt.state) != len(self.state_items) or len(groups) != len(aliases):
            return False
        i, params = 0, self.params  # every group's parameters, one after the other
        for group, group_aliases in zip(groups, aliases):
            group_params = group["params"]
            if len(group_params) != len(group_aliases):
                return False
            for param in group_params:
                if param is not params[i]:
                    return False
                i += 1
        local_of = compat.local_tensor_of  # a C accessor: no Python call per parameter
        for param, local, alias, _ in self.dtensors:
            if local_of(param) is not local or alias.requires_grad != param.requires_grad:
                return False
        for (param, entries), (held_param, held_entries) in zip(opt.state.items(), self.state_items):
            if param is not held_param or entries is not held_entries:
                return False
        if list(map(len, self.entry_dicts)) != self.entry_lens or list(map(len, self.local_dicts)) != self.local_lens:
            return False
        try:
            for entries, translated, key, value, shown in self.entries:
                if (
                    entries[key] is not value
                    or translated[key] is not shown
                    or (shown is not value and local_of(value) is not shown)
                ):
                    return False
        except KeyError:
            return False
        return True

    def hand_over_grads(self, opt: torch.optim.Optimizer) -> bool:
        """Each alias's ``.grad``: its parameter's local gradient. False (nothing handed over): a
        gradient this step cannot take on local shards."""
        matched = self.grad_specs
        local_of, spec_of = compat.local_tensor_of, compat.spec_of  # C accessors: no Python call per parameter
        for i, (param, _, alias, scalar) in enumerate(self.dtensors):
            grad = param.grad
            if grad is None:
                alias.grad = None
                continue
            spec = spec_of(grad) if type(grad) is DTensor else None
            if spec is not spec_of(param) and spec is not matched[i]:
                if not _grad_matches(param, grad):
                    self.drop_grads()
                    return False
                matched[i] = spec  # a gradient op's output spec is usually the same object every step
            if scalar and not opt.state.get(param):  # its new state could not be told apart from 'step'
                self.drop_grads()
                return False
            alias.grad = local_of(grad)
        return True

    def fold_back_unchanged(self) -> bool:
        """Whether the step left the presented state as it was presented (updated in place): then
        the DTensor state already holds it. False: :func:`_fold_back` writes it back."""
        if len(self.local_state) != len(self.local_dicts) or list(map(len, self.local_dicts)) != self.local_lens:
            return False
        for _, translated, key, _, shown in self.entries:
            if translated[key] is not shown:
                return False
        return True

    def retire(self) -> None:
        """Never fit again (the state it was made from has changed); its aliases stay reusable."""
        self.held_state = None

    def drop_grads(self) -> None:
        for _, _, alias, _ in self.dtensors:
            alias.grad = None


def _grad_matches(param: DTensor, grad) -> bool:
    return (
        isinstance(grad, DTensor)
        and grad.placements == param.placements
        and (grad.device_mesh is param.device_mesh or grad.device_mesh == param.device_mesh)
    )


def _fold_back(state, presentation: _Presentation) -> None:
    """Write the state the optimizer left on the aliases back onto the DTensor parameters."""
    by_alias = {id(alias): param for param, _, alias, _ in presentation.dtensors}
    held_dtensors = []  # (held entries, key, the DTensor held before, the value after)
    for alias, entries in presentation.local_state.items():
        param = by_alias.get(id(alias))
        if param is None:  # a plain parameter: its entries were never translated
            state[alias] = entries
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
    return (
        isinstance(value, torch.Tensor)
        and value.dim() > 0
        and value.shape == alias.shape
        and value.device == alias.device
    )


def _like(local: torch.Tensor, template: DTensor) -> DTensor:
    # Not DTensor.from_local: it would move CPU-offloaded state to the mesh's device.
    return compat.dtensor_like(template, local)
