"""The rules of a training step: which group owns a parameter, what a group keeps after forward,
what backward prefetches, how many reductions may be in flight.

The runtime (``param_group``, ``hooks``) applies these rules and the memory estimator's dry run
(``fsdp2.tools.meta_step``) replays them, so both read them from here and cannot drift apart.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, TypeVar

import torch.nn as nn

# Reduce-scatters of this many groups may still be running when the next group issues its
# own; then the oldest is waited on. Bounds reduce-scatter buffer memory at MAX + 1 groups.
# ``FSDPModule.set_reduce_scatter_max_input_buffers`` overrides it per root.
DEFAULT_MAX_REDUCES_IN_FLIGHT = 2


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
            for name, param in module._parameters.items():
                if param is None or param in ignored:
                    continue
                entry = found.get(id(param))
                if entry is None:
                    found[id(param)] = ManagedParam(f"{path}{name}", param, [(module, name)])
                else:
                    entry.places.append((module, name))
            for child_name, child in reversed(list(module._modules.items())):
                if child is not None and not is_other_group(child):
                    stack.append((f"{path}{child_name}.", child))
    return sorted(found.values(), key=lambda m: order.get(id(m.param), len(order)))


# -- what a group keeps between its forward and its backward ---------------------------------------


def reshard_after_forward_ranks(setting: bool | int | None, *, is_root: bool, shard_size: int) -> int:
    """How many ranks a group stays sharded over after forward: 1 keeps it gathered, the shard
    size frees everything but the shard, ``k`` in between keeps 1/k (re-gathered over k ranks).

    ``None`` (PyTorch 2.13's default) frees every group except the root, whose backward starts
    right after forward and would only gather it again.
    """
    if setting is None:
        return 1 if is_root else shard_size
    if setting is True:
        return shard_size
    if setting is False:
        return 1
    return int(setting)


def ranks_after_forward(setting_ranks: int, shard_size: int, *, grad_enabled: bool) -> int:
    """The reshard to apply at the end of one forward (see ``reshard_after_forward_ranks``).

    Not applied to an activation-checkpoint recompute inside backward: backward needs the
    parameters right then, and releases them itself after the group's gradients."""
    if not grad_enabled:
        return shard_size  # no backward follows: keep nothing gathered
    return setting_ranks


# -- what backward prefetches --------------------------------------------------------------------

T = TypeVar("T")


def implicit_backward_prefetch(post_forward_order: Sequence[T], current: T) -> list[T]:
    """Backward runs groups in the reverse of the order they finished forward: prefetch the one
    that finished just before ``current`` (the root, finishing last, prefetches the last block).
    A group that ran forward several times is placed by its first finish."""
    for index, item in enumerate(post_forward_order):
        if item is current:
            return [post_forward_order[index - 1]] if index > 0 else []
    return []


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

