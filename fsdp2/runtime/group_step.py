"""What a group's backward does with its gradients, decided once and run by both executors.

A group's reduction is described here, per reduce bucket, as a frozen :class:`BucketStep`: the
bucket (its parameters and padded layout, fsdp2.runtime.buckets), the reduce ops and divisions
(fsdp2.runtime.reduce_plan), the process groups, and the user's settings it was decided under
(:class:`ReduceSettings`). ``GroupReduce`` (fsdp2.runtime.reduce) makes the steps, once per set of
reduced parameters and settings, and runs them eagerly with c10d calls and persistent buffers;
the compiled step (fsdp2.runtime.traced) emits the very same steps as graph ops. Neither decides
anything the other could decide differently: a setting reaches both through a new step.

:func:`backward_mode` says what a backward does with the reduced gradient (reduce it into
``.grad``, or keep a sum for a later backward).

A group's whole step is one :class:`GroupStep`: its :class:`GatherStep`, its reduce steps, its
backward mode and what it keeps after forward, made anew by ``ParamGroup.configure`` whenever a
setting or the parameters change. Both executors read the group's current one; setters change
settings only.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from fsdp2.runtime import collectives
from fsdp2.runtime.buckets import FlatBucket
from fsdp2.runtime.reduce_plan import ReducePlan
from fsdp2.runtime.schedule import AfterForward


class Mode(enum.IntEnum):
    """What one backward does with a bucket's gradient."""

    SYNCED = 0  # reduce-scatter (HSDP: and all-reduce) and divide: to the parameters' .grad
    PARTIAL = 1  # HSDP with set_requires_all_reduce(False): reduce-scatter, kept for the next all-reduce
    UNSYNCED = 2  # set_requires_gradient_sync(False): kept unreduced for the next synced backward


@dataclass(frozen=True)
class ReduceSettings:
    """The user's settings a group's reduce steps are decided from (``GroupReduce.configure``)."""

    divide_factor: float | None = None  # set_gradient_divide_factor; None: average over data-parallel ranks
    force_sum: bool = False  # set_force_sum_reduction_for_comms: SUM collectives, separate divisions
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    custom_reduce_scatter: Any = None
    reduce_scatter_group: dist.ProcessGroup | None = None  # set_separate_reduce_scatter_group; None: the shard group


def backward_mode(requires_gradient_sync: bool, hybrid: bool, requires_all_reduce: bool) -> Mode:
    """``set_requires_gradient_sync`` / ``set_requires_all_reduce`` (HSDP) as a backward's mode."""
    if not requires_gradient_sync:
        return Mode.UNSYNCED
    if hybrid and not requires_all_reduce:
        return Mode.PARTIAL
    return Mode.SYNCED


@dataclass(frozen=True)
class ReduceSpec:
    """What a compiled graph needs to know of a :class:`BucketStep` to reduce its bucket: plain
    values (process groups by name, the user's collective by its key), so the registry of specs
    (:func:`spec_named`) holds nothing alive. ``key`` is a digest of all of it: two graphs whose
    texts are equal reduce alike, in this process or another."""

    reduce_dtype: torch.dtype
    grad_dtype: torch.dtype
    plan: ReducePlan
    world: int
    shard_group: str
    replicate_group: str | None
    hooked: bool
    custom_reduce_scatter: str | None
    out_collectives: bool
    key: str = field(init=False, repr=False, compare=False)  # made eagerly: a trace only reads it

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", "step-" + hashlib.sha256(repr(self).encode()).hexdigest()[:24])

    def after_reduce_scatter(self, reduced: torch.Tensor, mode: Mode, run: "ReduceRunner", at: Any = None):
        """A bucket's reduce-scattered shard on to what ``mode`` keeps, in PyTorch FSDP2's order,
        for both executors: under HSDP the partial sums kept for it join the all-reduce across
        replicas (PARTIAL keeps the sum for that instead), then the user's all-reduce hook and the
        division after the sum. ``run`` does each piece where its executor does (eager's
        ``GroupReduce`` in place on its buffers, a compiled graph as ops), ``at`` is its context."""
        if self.replicate_group is not None:
            if mode is Mode.PARTIAL:
                return run.keep_partial(at, reduced)
            reduced = run.all_reduce(at, run.add_partial(at, reduced))
        if self.hooked or self.plan.divide_after != 1:
            reduced = run.hook_and_divide(at, reduced)
        return reduced

    def handed_over_dtype(self, mode: Mode) -> torch.dtype:
        """The dtype a reduced flat shard leaves a compiled graph in: the shards' dtype where the
        graph finishes a synced reduction, else the reduce dtype (a user's all-reduce hook and the
        division after it run outside the graph; kept sums stay in the reduce dtype)."""
        if mode is Mode.SYNCED and not self.hooked:
            return self.grad_dtype
        return self.reduce_dtype


class ReduceRunner(Protocol):
    """How an executor runs the pieces of ``ReduceSpec.after_reduce_scatter`` (``at``: its context)."""

    def keep_partial(self, at: Any, reduced: torch.Tensor) -> torch.Tensor: ...

    def add_partial(self, at: Any, reduced: torch.Tensor) -> torch.Tensor: ...

    def all_reduce(self, at: Any, reduced: torch.Tensor) -> torch.Tensor: ...

    def hook_and_divide(self, at: Any, reduced: torch.Tensor) -> torch.Tensor: ...


# Every spec a graph may name, by its key (small plain records, never dropped).
_SPECS: dict[str, ReduceSpec] = {}


def spec_named(key: str) -> ReduceSpec:
    return _SPECS[key]


@dataclass(frozen=True)
class BucketStep:
    """One reduce bucket's reduction: what to reduce, with which ops and divisions, over which
    ranks. ``world``: the shard group's size (the reduce-scatter input is ``world`` rows);
    ``grad_dtype``: the dtype of the bucket's shards, or its reduce dtype where they have several
    (each is cast as it is written); ``hooked``: a user's all-reduce hook sees the reduced bucket
    before the division that follows the sum; ``custom_reduce_scatter``: the user's collective's
    key (``collectives.register_user_comm``); ``out_collectives``: a compiled graph may use the
    ``*_out`` collectives on ``shard_group`` (``collectives.out_variants_usable``).

    ``spec`` is what a compiled graph emits of it (registered as the step is made, eagerly: a
    trace names it by ``spec.key``)."""

    bucket: FlatBucket
    plan: ReducePlan
    world: int
    shard_group: dist.ProcessGroup  # where the reduce-scatter runs
    replicate_group: dist.ProcessGroup | None  # HSDP: the all-reduce across replicas
    grad_dtype: torch.dtype
    hooked: bool
    custom_reduce_scatter: str | None = None
    out_collectives: bool = False
    spec: ReduceSpec = field(init=False, compare=False)

    def __post_init__(self) -> None:
        spec = ReduceSpec(
            self.bucket.dtype,
            self.grad_dtype,
            self.plan,
            self.world,
            self.shard_group.group_name,
            None if self.replicate_group is None else self.replicate_group.group_name,
            self.hooked,
            self.custom_reduce_scatter,
            self.out_collectives,
        )
        object.__setattr__(self, "spec", _SPECS.setdefault(spec.key, spec))

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.bucket.dtype

    def summed_dtype(self, synced: bool, starts_sum: bool) -> torch.dtype:
        """The dtype a compiled backward sums the uses' gradients in before reducing: the one eager
        sums them in, in each unsharded parameter (``ShardedParam.summed_in``), where the bucket's
        parameters agree, else the reduce dtype."""
        dtypes = {p.summed_in(synced, starts_sum) or p.param_dtype for p in self.bucket.params}
        return dtypes.pop() if len(dtypes) == 1 else self.reduce_dtype


@dataclass(frozen=True)
class GatherStep:
    """A group's all-gather: over ``world`` ranks of ``shard_group``, with c10d's collective or the
    user's (``custom``, set_custom_all_gather; a graph calls it by ``custom_key``,
    ``collectives.register_user_comm``). ``out_collectives``: a compiled graph may use the
    ``*_out`` all-gather on ``shard_group`` (``collectives.out_variants_usable``)."""

    world: int
    shard_group: dist.ProcessGroup
    custom: Any = None
    out_collectives: bool = False
    custom_key: str | None = field(init=False, compare=False)

    def __post_init__(self) -> None:
        key = None if self.custom is None else collectives.register_user_comm(self.custom)
        object.__setattr__(self, "custom_key", key)


@dataclass(frozen=True)
class GroupStep:
    """One group's step as its configuration decides it: ``gather``; ``reduce_steps``, per reduce
    dtype the :class:`BucketStep` of its trainable parameters (a compiled backward reduces them,
    eager picks the steps of the parameters a backward reached, ``GroupReduce.issue``); ``mode``;
    ``include_unused`` (set_reduce_scatter_unused_params); and what the group keeps after forward
    (``schedule.after_forward``): ``after_forward`` where lazy init placed it (the root's group, or
    one below it: eager's), :meth:`after_forward_for` as the root of a forward or below it (a
    compiled step's root is the first call its trace gathers)."""

    gather: GatherStep
    reduce_steps: tuple[BucketStep, ...]
    mode: Mode
    include_unused: bool
    after_forward: AfterForward
    after_forward_as_root: AfterForward
    after_forward_below_root: AfterForward

    def after_forward_for(self, is_root: bool) -> AfterForward:
        return self.after_forward_as_root if is_root else self.after_forward_below_root
