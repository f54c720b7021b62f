"""The rules of a training step: which group owns a parameter, what a group keeps after forward,
what backward prefetches, how many reductions may be in flight.

The runtime (``param_group``, ``hooks``) applies these rules and the memory estimator's dry run
(``fsdp2.tools.meta_step``) replays them, so both read them from here and cannot drift apart.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum, auto
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import torch.nn as nn

from fsdp2 import compat

# Reduce-scatters of this many groups may still be running when the next group issues its
# own; then the oldest is waited on. Bounds reduce-scatter buffer memory at MAX + 1 groups.
# ``FSDPModule.set_reduce_scatter_max_input_buffers`` overrides it per root.
DEFAULT_MAX_REDUCES_IN_FLIGHT = 2

# The all-gather stream runs at most this many groups ahead of the compute stream's copy-outs:
# before allocating the next all-gather output it waits for the newest copy-out
# (``streams.GatherBuffers``), so block i+1 gathers while block i computes, and at most this
# + 1 groups' all-gather outputs are alive at once (tests/runtime/test_streams.py checks it).
GATHERS_AHEAD_OF_COMPUTE = 1


# -- which group owns a parameter -----------------------------------------------------------------


@dataclass
class ManagedParam:
    """A parameter one fully_shard call takes over, and every ``module.<name>`` that holds it."""

    fqn: str
    param: nn.Parameter
    places: list[tuple[nn.Module, str]]


def managed_params(
    roots: Sequence[nn.Module], is_other_group: Callable[[nn.Module], bool], ignored: set = frozenset()
) -> list[ManagedParam]:
    """The parameters a group of ``roots`` owns: those under them and not under another group.

    fully_shard is applied bottom-up, so a parameter belongs to its innermost group. A
    parameter registered in several places (tied) is one ManagedParam with several places.
    Ordered as ``parameters()`` orders them, so buffers are laid out as the model declares.
    """
    found: dict[int, ManagedParam] = {}
    order: dict[int, int] = {}
    for root in roots:
        for p in root.parameters():
            order.setdefault(id(p), len(order))
    for prefix_index, root in enumerate(roots):
        prefix = f"{prefix_index}." if len(roots) > 1 else ""
        stack: list[tuple[str, nn.Module]] = [(prefix, root)]
        while stack:
            path, module = stack.pop()
            for name, param in compat.module_parameters(module).items():
                if param is None or param in ignored:
                    continue
                entry = found.get(id(param))
                if entry is None:
                    found[id(param)] = ManagedParam(f"{path}{name}", param, [(module, name)])
                else:
                    entry.places.append((module, name))
            for child_name, child in reversed(list(compat.module_children(module).items())):
                if child is not None and not is_other_group(child):
                    stack.append((f"{path}{child_name}.", child))
    return sorted(found.values(), key=lambda m: order.get(id(m.param), len(order)))


# -- what a group keeps between its forward and its backward ---------------------------------------


class AfterForward(Enum):
    """What a group does with its gathered parameters when its forward ends."""

    KEEP = auto()  # stay gathered until backward
    FREE = auto()  # keep only the shard; backward gathers again
    KEEP_SUBGROUP_SHARD = auto()  # reshard_after_forward=k: keep 1/k, backward gathers over k ranks


def after_forward(setting: bool | int | None, *, is_root: bool, shard_size: int) -> AfterForward:
    """The user's ``reshard_after_forward`` as an action. ``None`` (PyTorch 2.13's default) frees
    every group except the root, whose backward starts right after forward and would only gather
    it again; an int ``k`` keeps 1/k (1: everything, the shard size: only the shard)."""
    if setting is None:
        return AfterForward.KEEP if is_root else AfterForward.FREE
    if isinstance(setting, bool):
        return AfterForward.FREE if setting else AfterForward.KEEP
    if setting == 1:
        return AfterForward.KEEP
    if setting == shard_size:
        return AfterForward.FREE
    return AfterForward.KEEP_SUBGROUP_SHARD


def after_this_forward(action: AfterForward, *, grad_enabled: bool) -> AfterForward:
    """The action at the end of one forward. Not applied to an activation-checkpoint recompute
    inside backward: backward needs the parameters then, and frees them after the gradients."""
    return action if grad_enabled else AfterForward.FREE  # no backward follows: keep nothing gathered


# -- what backward prefetches --------------------------------------------------------------------

T = TypeVar("T")


def implicit_backward_prefetch(post_forward_order: Sequence[T], current: T) -> list[T]:
    """Backward runs groups in the reverse of the order they finished forward: prefetch the one
    that finished just before ``current`` (the root, finishing last, prefetches the last block).
    A group that ran forward several times is placed by its first finish."""
    for index, item in enumerate(post_forward_order):
        if item == current:
            return [post_forward_order[index - 1]] if index > 0 else []
    return []


# -- when a group's backward ends ------------------------------------------------------------------


def backward_ends_at_inputs(
    requires_grad: Iterable[bool], reduces_unused: bool = False, manual_finalization: bool = False
) -> bool:
    """Whether a group whose parameters have these ``requires_grad`` flags ends its backward
    (reduces its gradients, frees what it gathered) once autograd has the gradients of its
    forward inputs (at the end of backward if none needs one), PyTorch's FSDP2's timing, not
    once every parameter has its gradient (the same point when neither is special, and the
    earlier signal). It does when:

    - it holds a frozen parameter, whose last read in backward (a frozen weight's use for the
      inputs' gradient: a LoRA base layer) has no gradient to signal it;
    - it reduces unused parameters (``set_reduce_scatter_unused_params(True)``), so a rank whose
      backward reaches none of them reduces at the same point of backward as a rank whose does;
    - the backward is finalized by hand (``set_manual_backward_finalization(True)``): a group
      whose inputs need no gradient then waits, unreduced, for ``finalize_backward()``, as in
      PyTorch (its unsharded gradients stay where ``module.zero_grad()`` reaches them).

    (``param_group.BackwardEnd.INPUT_GRADS``.)"""
    return reduces_unused or manual_finalization or not all(requires_grad)


# -- one-rank shard groups -----------------------------------------------------------------------

_one_rank_groups_communicate = False


def one_rank_skips_collectives(shard_size: int) -> bool:
    """A shard group of one rank (world size 1, HSDP with shard size 1) needs no all-gather and no
    reduce-scatter: its shard is the whole parameter. Decided when a group is built."""
    return shard_size == 1 and not _one_rank_groups_communicate


@contextlib.contextmanager
def always_communicate() -> Iterator[None]:
    """Groups built inside run every collective even with one rank, so tests and
    ``benchmarks/gpu_check.py`` exercise the full collective and stream path at world size 1."""
    global _one_rank_groups_communicate
    previous, _one_rank_groups_communicate = _one_rank_groups_communicate, True
    try:
        yield
    finally:
        _one_rank_groups_communicate = previous
