"""A dry run of one fully_shard training step on the meta device: the bytes alive over time.

Used by :func:`fsdp2.tools.estimate.estimate_memory` when given a sample input, and by the
planner (fsdp2.plan), which replays one recording under many sharding strategies. Two parts:

**Record** (:func:`record_step`, slow: the model runs). The model (a meta copy, parameters
cast to the mixed-precision ``param_dtype``) runs forward and backward on meta tensors. We
write down, in order, every *real* meta storage the model's ops create and free (activations,
autograd's gradients, the unsharded parameter gradients: a TorchDispatchMode sees every op's
outputs, and a ``weakref.finalize`` on each output's storage tells when autograd lets go of it;
PyTorch keeps a storage's Python object alive exactly as long as the storage) and every hook
of fsdp2's schedule (a group's forward begins/ends, its backward begins, its gradients are
handed to the reduction), together with the FLOPs the ops did since the previous hook.
Nothing here depends on how the parameters are sharded.

**Replay** (:func:`replay_step`, fast: no ops). Walks the recording and adds the *virtual*
bytes fsdp2 allocates around the ops, which a meta run cannot show: all-gather buffers,
gathered (unsharded) parameters, reduce-scatter buffers, sharded grads, sized for one sharding
(see fsdp2/runtime/schedule.py, hooks.py and param_group.py): gather before a group's forward,
reshard after it (not the root), re-gather in backward when the gradient reaches the group's
output, prefetch the previous group, reduce-scatter and reshard once all of a group's gradients
have accumulated (a group holding a frozen parameter: once its forward inputs have their
gradients, or at the end of backward), at most two groups' reductions in flight.

The peak of real + virtual bytes over the run is what the step adds on top of the sharded
parameters and optimizer state held between steps. Parameters' own storages are not counted
(they stand for the gathered parameters, which the virtual bytes count with fsdp2's padding).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import flop_registry

from fsdp2 import compat
from fsdp2.compat import TorchDispatchMode, tree_flatten, tree_map
from fsdp2.runtime import schedule
from fsdp2.runtime.activations import cast_floating, map_tensors, tensors_in
from fsdp2.tools.kernel_scratch import KernelScratch


@dataclass
class GroupBytes:
    """What fsdp2 allocates for one fully_shard group, per rank (from fsdp2.tools.estimate)."""

    gathered: int  # unsharded params, padded as fsdp2 stores them
    gather_buffer: int  # all-gather output (== gathered unless quantized; 0 for a one-rank shard group)
    reduce_scatter: int  # reduce-scatter input + output buffers
    sharded_grads: int  # this rank's gradient shards, once reduced


@dataclass
class StepProfile:
    """Result of a replay: peaks in bytes, on top of the sharded state held between steps."""

    peak: int  # highest real + virtual bytes over forward + backward
    saved_activations: int  # distinct storages saved for backward (not parameters), end of forward
    peak_phase: str  # "forward" or "backward": when the peak happened
    sharded_grads: int  # sharded grads alive after the step (the optimizer step's extra input)


class Event(IntEnum):
    """What a recorded step is made of, in the order it happened."""

    ALLOC = 0  # a real storage of ``value`` bytes was created
    FREE = 1  # a real storage of ``value`` bytes died
    PRE_FORWARD = 2  # group ``value``'s forward begins
    POST_FORWARD = 3  # group ``value``'s forward ends
    BACKWARD = 4  # backward begins (``loss.backward()``)
    PRE_BACKWARD = 5  # the gradient reached group ``value``'s outputs
    REDUCE = 6  # group ``value``'s full gradients go into its reduce-scatter buffers ...
    REDUCE_ISSUED = 7  # ... and have been dropped: the group reshards, the reduction is in flight
    RESHARD = 8  # end of backward: group ``value`` frees what it gathered
    FINISH = 9  # end of backward: every reduction completes
    SCRATCH = 10  # the op that just ran held ``value`` more bytes while it ran (kernel scratch)


# Events that carry bytes, not a group number.
MEMORY_EVENTS = (Event.ALLOC, Event.FREE, Event.SCRATCH)


@dataclass
class StepTrace:
    """One recorded forward + backward: ``events`` as (Event, value, FLOPs since the previous hook).

    FLOPs are counted by torch.utils.flop_counter's formulas (matmuls and attention; causal
    attention counted as half of the full product, as fused kernels skip masked blocks); a hook
    event carries the FLOPs of the ops between it and the hook event before it.
    """

    n_groups: int
    events: list[tuple[Event, int, int]] = field(default_factory=list)
    saved_activations: int = 0
    tail_flops: int = 0  # after the last hook event (end of backward)
    saved_before_forward: dict[int, int] = field(
        default_factory=dict
    )  # group -> bytes saved for backward when its forward began

    @property
    def flops(self) -> int:
        return sum(f for _, _, f in self.events) + self.tail_flops

    def hook_events(self) -> list[tuple[Event, int, int]]:
        return [e for e in self.events if e[0] not in MEMORY_EVENTS]


# -- FLOPs --------------------------------------------------------------------------------------


def _causal_share(is_causal: bool) -> float:
    return 0.5 if is_causal else 1.0


def _cpu_flash_forward_flops(query, key, value, dropout_p=0.0, is_causal=False, *args, out_val=None, **kwargs) -> int:
    full = flop_registry[compat.aten_flash_attention](query, key, value, out_val=out_val)
    return int(full * _causal_share(is_causal))


def _cpu_flash_backward_flops(
    grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *args, out_val=None, **kwargs
) -> int:
    full = flop_registry[compat.aten_flash_attention_backward](grad_out, query, key, value, out_val=out_val)
    return int(full * _causal_share(is_causal))


# The fused CPU kernel the dry run uses for attention (see _FusedAttention) has no formula in
# torch.utils.flop_counter; it computes what the CUDA flash kernel does.
_FLOP_FORMULAS = {
    **flop_registry,
    compat.aten_cpu_flash_attention: _cpu_flash_forward_flops,
    compat.aten_cpu_flash_attention_backward: _cpu_flash_backward_flops,
}


# -- record -------------------------------------------------------------------------------------


class _Recorder:
    """Appends events to a StepTrace; counts FLOPs between hook events and bytes saved for backward."""

    def __init__(self, trace: StepTrace):
        self.trace = trace
        self.flops = 0
        self.saved = 0
        self.in_backward = False

    def memory(self, kind: Event, nbytes: int) -> None:
        self.trace.events.append((kind, nbytes, 0))

    def hook(self, kind: Event, group: int) -> None:
        self.trace.events.append((kind, group, self.flops))
        self.flops = 0


class _ObserveOps(TorchDispatchMode):
    """Every op's new storages (until they die), its FLOPs and, given a KernelScratch, the
    scratch its real kernel takes, into the recorder."""

    def __init__(self, recorder: _Recorder, untracked: Sequence[torch.Tensor], scratch: KernelScratch | None = None):
        super().__init__()
        self.recorder = recorder
        self.scratch = scratch
        self.live: dict[int, int] = {}  # id(storage object) -> nbytes; ids only of live objects
        # Parameters: views of them (``weight.t()``) must not count as new memory. Holding the
        # storage objects keeps their ids from being reused.
        self._untracked = [t.untyped_storage() for t in untracked]
        self._untracked_ids = {id(s) for s in self._untracked}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FLOP_FORMULAS.get(func.overloadpacket)
        if formula is not None:
            self.recorder.flops += int(formula(*args, **kwargs, out_val=out))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        if self.scratch is not None:
            scratch = self.scratch.bytes_of(func, args, kwargs)
            if scratch:
                self.recorder.memory(Event.SCRATCH, scratch)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.live or key in self._untracked_ids or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.recorder.memory(Event.ALLOC, storage.nbytes())
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.recorder.memory(Event.FREE, self.live.pop(key))


class _ScheduleHooks:
    """Module and gradient hooks that record fsdp2's schedule events for each group."""

    def __init__(self, recorder: _Recorder, modules: list[nn.Module], params: list[list[nn.Parameter]]):
        self.recorder = recorder
        self.params = params
        self.in_pre_backward: set[int] = set()
        self.reduced: set[int] = set()
        self.pending = [sum(p.requires_grad for p in ps) for ps in params]
        # A group holding a frozen parameter ends its backward at its inputs' gradients, not at
        # its parameters' (schedule.backward_ends_at_inputs; hooks._EndBackwardAtInputs).
        self.ends_at_inputs = [schedule.backward_ends_at_inputs(p.requires_grad for p in ps) for ps in params]
        for index, (module, ps) in enumerate(zip(modules, params)):
            module.register_forward_pre_hook(
                lambda m, args, kwargs, i=index: self._pre_forward(i, args, kwargs), prepend=True, with_kwargs=True
            )
            module.register_forward_hook(lambda m, a, out, i=index: self._post_forward(i, out))
            for p in ps:
                if p.requires_grad and not self.ends_at_inputs[index]:
                    p.register_post_accumulate_grad_hook(lambda p, i=index: self._grad_ready(i))

    def _pre_forward(self, i: int, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # An activation-checkpoint recompute inside backward is not a forward: fsdp2 only
        # gathers then, which the group's pre-backward already did (hooks.FSDPState).
        if self.recorder.in_backward:
            return None
        self.recorder.trace.saved_before_forward.setdefault(i, self.recorder.saved)
        self.recorder.hook(Event.PRE_FORWARD, i)
        if self.ends_at_inputs[i] and torch.is_grad_enabled():
            return _InputsGradsReady.wrap(lambda: self._inputs_grads_ready(i), args, kwargs)
        return None

    def _inputs_grads_ready(self, i: int) -> None:
        if i in self.in_pre_backward and i not in self.reduced:
            self._post_backward(i)

    def _post_forward(self, i: int, output: Any) -> None:
        if self.recorder.in_backward:
            return
        self.recorder.hook(Event.POST_FORWARD, i)
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, i=i: self._pre_backward(i))

    def _pre_backward(self, i: int) -> None:
        if i in self.in_pre_backward:
            return
        self.in_pre_backward.add(i)
        self.recorder.hook(Event.PRE_BACKWARD, i)

    def _grad_ready(self, i: int) -> None:
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self._post_backward(i)

    def _post_backward(self, i: int) -> None:
        self.reduced.add(i)
        self.recorder.hook(Event.REDUCE, i)
        for p in self.params[i]:
            p.grad = None  # fsdp2 hands the unsharded gradient to the reduce-scatter and drops it
        self.recorder.hook(Event.REDUCE_ISSUED, i)

    def finish_backward(self) -> None:
        for i in reversed(range(len(self.params))):
            if i not in self.reduced and any(p.grad is not None for p in self.params[i]):
                self._post_backward(i)
            self.recorder.hook(Event.RESHARD, i)
        self.recorder.hook(Event.FINISH, -1)


class _InputsGradsReady(torch.autograd.Function):
    """Identity on a group's forward inputs whose backward calls ``ready``: autograd has the
    gradients of all of them (fsdp2's hooks._EndBackwardAtInputs). Inputs that need no gradient
    give no signal: the end of backward ends such a group (finish_backward)."""

    @staticmethod
    def forward(ctx, ready: Callable[[], None], *inputs: torch.Tensor):
        ctx.ready = ready
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.ready()
        return (None, *grads)

    @classmethod
    def wrap(cls, ready: Callable[[], None], args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if not inputs:
            return None
        passed = dict(zip(map(id, inputs), cls.apply(ready, *inputs)))
        return map_tensors(lambda t: passed.get(id(t), t), (args, kwargs))


class _FusedAttention(TorchFunctionMode):
    """Run scaled_dot_product_attention as the fused (flash) kernel, as CPU and CUDA do.

    On meta, SDPA's backend choice falls back to the math path, which materializes the
    ``T x T`` attention weights and saves them for backward; the real run uses a fused kernel
    that saves only the output and a log-sum-exp per row. Its meta kernel has the same outputs.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            fused = self._fused(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)

    @staticmethod
    def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if enable_gqa or query.dim() != 4 or key.shape != query.shape or value.shape != query.shape:
            return None  # shapes the flash kernel does not take: keep the default path
        return compat.aten_cpu_flash_attention(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )[0]


def meta_copy(model: nn.Module, param_dtype: torch.dtype | None) -> nn.Module:
    """A meta-device copy of ``model`` whose floating parameters are in ``param_dtype``."""
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError(
            "estimate_memory(sample_input=...): build the model on the meta device (with torch.device('meta'))"
        )
    twin = copy.deepcopy(model)
    if param_dtype is not None:
        cast: dict[int, nn.Parameter] = {}  # tied parameters stay tied
        for module in twin.modules():
            parameters = compat.module_parameters(module)
            for name, p in list(parameters.items()):
                if p is not None and p.is_floating_point():
                    if id(p) not in cast:
                        cast[id(p)] = nn.Parameter(p.detach().to(param_dtype), requires_grad=p.requires_grad)
                    parameters[name] = cast[id(p)]
    return twin


def _to_meta(tree: Any) -> Any:
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, tree)


def _default_loss(model: nn.Module, *inputs: Any) -> torch.Tensor:
    out = model(*inputs)
    return out if out.numel() == 1 else out.float().sum()


def record_step(
    model: nn.Module,
    modules: list[nn.Module],
    params: list[list[nn.Parameter]],
    sample_input: tuple,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    cast_inputs_to: torch.dtype | None = None,
    kernel_scratch: KernelScratch | None = None,
) -> StepTrace:
    """Forward + backward of ``model`` (a meta copy the caller gives up: hooks stay on it;
    ``modules``/``params`` its groups) on meta inputs, recorded as a StepTrace. With
    ``kernel_scratch``, each op's scratch on that device is recorded too (fsdp2/tools/kernel_scratch.py)."""
    trace = StepTrace(n_groups=len(modules))
    recorder = _Recorder(trace)
    hooks = _ScheduleHooks(recorder, modules, params)
    if cast_inputs_to is not None:  # fsdp2 casts floating inputs of each group to param_dtype
        for module in modules:
            module.register_forward_pre_hook(
                lambda m, args, kwargs: cast_floating((args, kwargs), cast_inputs_to), with_kwargs=True
            )
    inputs = _to_meta(tuple(sample_input))
    saved: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # hold saved tensors so storage ids stay unique while counting
    param_storages = {id(s) for s in (p.untyped_storage() for p in model.parameters())}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if id(s) not in param_storages and id(s) not in saved:
            saved[id(s)] = s.nbytes()
            recorder.saved += s.nbytes()
            keep.append(t)
        return t

    with _FusedAttention(), _ObserveOps(recorder, list(model.parameters()), kernel_scratch):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = (loss_fn or _default_loss)(model, *inputs)
        trace.saved_activations = recorder.saved
        del keep[:]
        recorder.in_backward = True
        recorder.hook(Event.BACKWARD, -1)
        # Straight into the autograd engine: ``loss.backward()`` would pass through
        # _FusedAttention's handler, which runs with the mode off, and activation checkpointing
        # recomputes attention in backward.
        compat.run_backward(loss)
        del loss
        hooks.finish_backward()
    trace.tail_flops = recorder.flops
    return trace


def repeat_blocks(trace: StepTrace, total_blocks: int) -> StepTrace | None:
    """The recording of the same model with ``total_blocks`` identical blocks instead of the
    recorded ones, or None if the recording does not show identical blocks.

    For models whose groups are the root (0) and blocks 1..K run in order: a middle block's
    events (from its forward's start to the next block's, and from its backward's start to the
    previous block's) are the same for every middle block up to their group numbers, so block
    K-1's are repeated. Checked: blocks K-2 and K-1 must match exactly (events relative to the
    block, FLOPs, bytes, bytes saved for backward), else None. Recording K = 4 blocks of an
    80-block model this way gives, event for event, its own recording (tests/plan/test_estimate.py).
    """
    blocks = trace.n_groups - 1
    if blocks < 4 or total_blocks < blocks:
        return None
    m = blocks - 1  # the block to repeat
    extra = total_blocks - blocks
    where = {}
    for index, (kind, group, _) in enumerate(trace.events):
        if kind in (Event.PRE_FORWARD, Event.PRE_BACKWARD):
            where.setdefault((kind, group), index)
    try:
        fwd = [where[(Event.PRE_FORWARD, g)] for g in range(blocks + 1)]
        bwd = {g: where[(Event.PRE_BACKWARD, g)] for g in range(1, blocks + 1)}
    except KeyError:
        return None
    if fwd != sorted(fwd) or [bwd[g] for g in range(blocks, 0, -1)] != sorted(bwd.values()):
        return None  # blocks do not run in order

    def period(start: int, end: int, block: int) -> list:
        return [
            (kind, value - block if kind not in MEMORY_EVENTS else value, flops)
            for kind, value, flops in trace.events[start:end]
        ]

    forward = period(fwd[m], fwd[m + 1], m)
    backward = period(bwd[m], bwd[m - 1], m)
    saved = trace.saved_before_forward
    if (
        forward != period(fwd[m - 1], fwd[m], m - 1)
        or backward != period(bwd[m - 1], bwd[m - 2], m - 1)
        or saved[m + 1] - saved[m] != saved[m] - saved[m - 1]
    ):
        return None

    def placed(events: list, block: int) -> list:
        return [(kind, value + block if kind not in MEMORY_EVENTS else value, flops) for kind, value, flops in events]

    def renumbered(events: list) -> list:
        """Recorded events after the repeated block: later blocks move up by ``extra``; a group-wide
        event naming the repeated block (end-of-backward reshards) repeats for every copy."""
        out = []
        for kind, value, flops in events:
            if kind in MEMORY_EVENTS or value < m:
                out.append((kind, value, flops))
            elif value > m:
                out.append((kind, value + extra, flops))
            else:
                out += [(kind, g, flops if g == m else 0) for g in range(m + extra, m - 1, -1)]
        return out

    events = list(trace.events[: fwd[m]])
    for repeat in range(extra + 1):
        events += placed(forward, m + repeat)
    events += renumbered(trace.events[fwd[m + 1] : bwd[m]])
    for repeat in range(extra, -1, -1):
        events += placed(backward, m + repeat)
    events += renumbered(trace.events[bwd[m - 1] :])
    per_block = saved[m + 1] - saved[m]
    return StepTrace(
        n_groups=trace.n_groups + extra,
        events=events,
        saved_activations=trace.saved_activations + extra * per_block,
        tail_flops=trace.tail_flops,
        saved_before_forward={
            **{g: v for g, v in saved.items() if g <= m},
            **{m + c: saved[m] + c * per_block for c in range(1, extra + 1)},
            **{g + extra: v + extra * per_block for g, v in saved.items() if g > m},
        },
    )


# -- replay -------------------------------------------------------------------------------------


class _Ledger:
    """Running real + virtual bytes and their peak."""

    def __init__(self) -> None:
        self.real = 0
        self.virtual = 0
        self.peak = 0
        self.peak_phase = "forward"
        self.phase = "forward"

    def note(self, transient: int = 0) -> None:
        """Record the current total (plus ``transient`` bytes alive only for a moment) as a peak candidate."""
        total = self.real + self.virtual + transient
        if total > self.peak:
            self.peak, self.peak_phase = total, self.phase

    def add_virtual(self, nbytes: int) -> None:
        self.virtual += nbytes
        self.note()


class _ScheduleReplay:
    """fsdp2's unshard/reshard/reduce-scatter decisions for one sharding, as virtual bytes."""

    def __init__(self, ledger: _Ledger, sizes: list[GroupBytes], frees_after_forward: list[bool]):
        self.ledger = ledger
        self.sizes = sizes
        self.frees_after_forward = frees_after_forward
        self.gathered: set[int] = set()
        self.forward_order: list[int] = []
        self.prefetched: set[int] = set()  # all-gather buffer allocated, not yet copied out
        self.reducing: list[int] = []
        self.sharded_grads = 0

    # -- gathers -----------------------------------------------------------------------------

    def _unshard(self, i: int) -> None:
        """Copy out of the all-gather buffer into per-parameter storage: both alive for a moment."""
        if i in self.gathered:
            return
        g, buffer = self.sizes[i].gathered, self.sizes[i].gather_buffer
        if i in self.prefetched:  # buffer already allocated by the prefetch
            self.prefetched.discard(i)
            self.ledger.add_virtual(g)  # + parameters, buffer still alive
            self.ledger.virtual -= buffer  # buffer freed
        else:
            self.ledger.virtual += g
            self.ledger.note(transient=buffer)
        self.gathered.add(i)

    def _prefetch(self, i: int) -> None:
        if i in self.gathered or i in self.prefetched:
            return
        if not self.sizes[i].gather_buffer:
            self._unshard(i)  # nothing to communicate: a prefetch unshards right away
            return
        self.prefetched.add(i)
        self.ledger.add_virtual(self.sizes[i].gather_buffer)

    def _reshard(self, i: int) -> None:
        if i in self.gathered:
            self.gathered.discard(i)
            self.ledger.virtual -= self.sizes[i].gathered

    # -- events ------------------------------------------------------------------------------

    def pre_forward(self, i: int) -> None:
        self._unshard(i)

    def post_forward(self, i: int) -> None:
        if self.frees_after_forward[i]:
            self._reshard(i)
        self.forward_order.append(i)  # post-forward order: backward prefetches in its reverse

    def pre_backward(self, i: int) -> None:
        self._unshard(i)
        for j in schedule.implicit_backward_prefetch(self.forward_order, i):
            self._prefetch(j)

    def reduce(self, i: int) -> None:
        """Reduce-scatter buffers join the unsharded grads (which the next events free)."""
        self.ledger.add_virtual(self.sizes[i].reduce_scatter)

    def reduce_issued(self, i: int) -> None:
        self._reshard(i)
        self.reducing.append(i)
        while len(self.reducing) > schedule.DEFAULT_MAX_REDUCES_IN_FLIGHT:
            self._finish_reduce(self.reducing.pop(0))

    def _finish_reduce(self, i: int) -> None:
        self.ledger.virtual -= self.sizes[i].reduce_scatter
        self.ledger.add_virtual(self.sizes[i].sharded_grads)
        self.sharded_grads += self.sizes[i].sharded_grads

    def finish(self) -> None:
        for i in self.reducing:
            self._finish_reduce(i)
        self.reducing.clear()


def replay_step(trace: StepTrace, sizes: list[GroupBytes], *, frees_after_forward: list[bool]) -> StepProfile:
    """The peak of ``trace`` with fsdp2's buffers sized by ``sizes`` (one per group)."""
    if len(sizes) != trace.n_groups or len(frees_after_forward) != trace.n_groups:
        raise ValueError(f"replay_step: the trace has {trace.n_groups} groups, got sizes for {len(sizes)}")
    ledger = _Ledger()
    replay = _ScheduleReplay(ledger, sizes, frees_after_forward)
    for kind, value, _ in trace.events:
        if kind is Event.ALLOC:
            ledger.real += value
            ledger.note()
        elif kind is Event.SCRATCH:
            ledger.note(transient=value)
        elif kind is Event.FREE:
            ledger.real -= value
        elif kind is Event.PRE_FORWARD:
            replay.pre_forward(value)
        elif kind is Event.POST_FORWARD:
            replay.post_forward(value)
        elif kind is Event.BACKWARD:
            ledger.phase = "backward"
        elif kind is Event.PRE_BACKWARD:
            replay.pre_backward(value)
        elif kind is Event.REDUCE:
            replay.reduce(value)
        elif kind is Event.REDUCE_ISSUED:
            replay.reduce_issued(value)
        elif kind is Event.RESHARD:
            replay._reshard(value)
        elif kind is Event.FINISH:
            replay.finish()
    return StepProfile(ledger.peak, trace.saved_activations, ledger.peak_phase, replay.sharded_grads)
