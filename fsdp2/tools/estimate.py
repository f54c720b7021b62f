"""Per-rank memory of a model under fully_shard, computed from shapes alone (works on meta).

    with torch.device("meta"):
        model = GPT(cfg)
    est = estimate_memory(model, 8, groups=lambda m: isinstance(m, Block),
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    print(est)

``mesh_or_world_size``: a DeviceMesh (1-D: FSDP; 2-D: HSDP, replicate x shard), a world size
(FSDP), or a ``(replicate, shard)`` pair (HSDP without a process group).

``groups`` says which submodules the user passes to ``fully_shard`` (a predicate on modules or a
list of module names from ``named_modules()``); the root is a group too (``fully_shard(model)``)
unless ``root=False``. As with fully_shard applied bottom-up, a parameter belongs to its innermost
group. Without ``sample_input`` no tensor is created: only shapes, dtypes and ``requires_grad``
are read.

Exact (checked against real runs in tests/plan/test_estimate.py):
    sharded parameters, sharded gradients, optimizer state, communication bytes per step.
    Frozen parameters (``requires_grad=False``: a PEFT model's base) have no gradient and no
    optimizer state; the optimizer is taken to hold the trainable parameters.
Modelled from fsdp2's schedule (upper bounds of each term on its own):
    peak gathered parameters, peak unsharded gradients, reduce-scatter buffers.
``total`` sums those fields: an upper bound of the parameter-related memory (not all peaks
coincide in time), activations not included.

With ``sample_input`` (one rank's batch) the estimate also runs the step dry on meta
(fsdp2/tools/meta_step.py; or pass ``step_trace=`` from :func:`trace_step` to reuse one
recording for several shardings of the same model and batch) and fills:
    ``activations``: bytes of the distinct storages autograd saves for backward (not params);
    ``peak``: the predicted per-rank allocator peak of a training step (forward, backward,
    optimizer step), everything that is alive at that moment: sharded state, activations,
    gathered params, unsharded grads, fsdp2's buffers. Checked against the CPU allocator peak
    measured by fsdp2.tools.memory_meter in a fake process group (tests/plan/test_estimate.py).
Never included: allocator caching/fragmentation, communication-library workspaces, kernel
scratch memory outside PyTorch's allocator. Kernel scratch through PyTorch's allocator is
machine-dependent and counted only when measured (``kernel_scratch=`` a device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn as nn

from fsdp2.policies import AllGatherPolicy, MixedPrecisionPolicy, param_dtype_of, reduce_dtype_of
from fsdp2.runtime import schedule
from fsdp2.runtime.buckets import gather_row_bytes
from fsdp2.runtime.codecs import plain_column, quantized_column
from fsdp2.layout.shard_layout import ShardLayout
from fsdp2.tools.kernel_scratch import KernelScratch
from fsdp2.tools.meta_step import GroupBytes, StepProfile, StepTrace, meta_copy, record_step, replay_step

# Optimizer state tensors per parameter shaped like the parameter, and whether a scalar ``step``
# tensor is kept per parameter (torch.optim's Adam/AdamW keep a float32 0-dim tensor).
_OPTIMIZERS = {
    "adamw": (2, True),
    "adam": (2, True),
    "sgd": (0, False),
    "sgd_momentum": (1, False),
    # Muon keeps one momentum buffer per parameter (modelled here: its whole-matrix exchange is not in the dry run).
    "muon": (1, False),
    "none": (0, False),
}
_STEP_BYTES = 4


@dataclass
class GroupEstimate:
    """One fully_shard group: its parameters and the per-rank sizes fsdp2 derives from them."""

    name: str
    num_params: int  # elements of the full (unsharded) parameters
    sharded_bytes: int  # this rank's shards, in the parameters' own dtypes
    gathered_bytes: int  # unsharded parameters in param_dtype, padded as fsdp2 stores them
    all_gather_bytes: int  # all-gather output buffers (== gathered_bytes unless quantized; 0 at world 1)
    unsharded_grad_bytes: int  # full gradients in param_dtype, before reduction
    reduce_scatter_bytes: int  # reduce-scatter input (world x numel_per_rank) + output, reduce_dtype
    reduce_scatter_input_bytes: int
    sharded_grad_bytes: int = 0  # this rank's gradient shards, in the parameters' own dtypes
    reduce_output_bytes: int = 0  # reduce-scatter output (numel_per_rank, reduce_dtype): HSDP all-reduces it
    frees_after_forward: bool = False  # reshard_after_forward frees it: backward gathers it again


@dataclass
class MemoryEstimate:
    """Per-rank bytes. ``__str__`` renders a table."""

    world_size: int  # ranks a parameter is sharded over (the shard dim)
    rank: int
    num_params: int
    groups: list[GroupEstimate]
    sharded_params: int
    sharded_grads: int
    optimizer_state: int
    peak_gathered_params: int
    peak_unsharded_grads: int
    reduce_scatter_buffers: int
    comm_bytes_per_step: dict[str, int] = field(default_factory=dict)
    # With a sample input only (None otherwise): see estimate_memory.
    largest_param_shard: int = 0  # bytes of the largest local shard of one parameter
    activations: int | None = None
    peak: int | None = None
    peak_phase: str | None = None
    replicate_size: int = 1  # HSDP: replicas the reduced gradient shards are all-reduced over

    @property
    def sharded_state(self) -> int:
        """Params + grads + optimizer state: what stays allocated between steps."""
        return self.sharded_params + self.sharded_grads + self.optimizer_state

    @property
    def total(self) -> int:
        """Sum of the parameter-related terms (each at its own peak); no activations. See ``peak``."""
        return self.sharded_state + self.peak_gathered_params + self.peak_unsharded_grads + self.reduce_scatter_buffers

    def __str__(self) -> str:
        rows = [
            ("sharded params", self.sharded_params),
            ("sharded grads", self.sharded_grads),
            ("optimizer state", self.optimizer_state),
            ("peak gathered params", self.peak_gathered_params),
            ("peak unsharded grads", self.peak_unsharded_grads),
            ("reduce-scatter buffers", self.reduce_scatter_buffers),
            ("total (excl. activations)", self.total),
        ]
        if self.peak is not None:
            rows += [
                ("activations (saved for backward)", self.activations),
                (f"predicted step peak ({self.peak_phase})", self.peak),
            ]
        width = max(len(r[0]) for r in rows)
        lines = [
            f"fsdp2 memory estimate: {self.num_params / 1e6:.2f}M params, {len(self.groups)} groups, "
            f"rank {self.rank} of {self.world_size}",
            f"{'':{width}}  {'MiB':>10}",
        ]
        lines += [f"{name:{width}}  {nbytes / 2**20:10.2f}" for name, nbytes in rows]
        comm = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in self.comm_bytes_per_step.items())
        lines.append(f"comm per step (buffer bytes): {comm}")
        return "\n".join(lines)


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank actually holds for ``tensors`` (a DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds for ``optimizer``'s state tensors (what ``optimizer_state`` predicts)."""
    return local_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def _mesh_sizes(mesh_or_world_size) -> tuple[int, int, int]:
    """(shard size, this rank's shard rank, replicate size)."""
    if isinstance(mesh_or_world_size, int):
        return mesh_or_world_size, 0, 1
    if isinstance(mesh_or_world_size, tuple):
        if len(mesh_or_world_size) != 2 or not all(isinstance(n, int) and n >= 1 for n in mesh_or_world_size):
            raise ValueError(f"estimate_memory: a mesh shape must be (replicate, shard), got {mesh_or_world_size}")
        replicate, shard = mesh_or_world_size
        return shard, 0, replicate
    mesh = mesh_or_world_size  # a DeviceMesh: 1-D (FSDP) or 2-D (replicate, shard)
    if mesh.ndim == 1:
        return mesh.size(0), mesh.get_local_rank(0), 1
    return mesh.size(1), mesh.get_local_rank(1), mesh.size(0)


def _group_members(model: nn.Module, groups, root: bool) -> list[tuple[str, nn.Module]]:
    if groups is None:
        chosen: list[tuple[str, nn.Module]] = []
    elif callable(groups):
        chosen = [(n, m) for n, m in model.named_modules() if n and groups(m)]
    else:
        wanted = list(groups)
        named = dict(model.named_modules())
        missing = [n for n in wanted if n not in named]
        if missing:
            raise ValueError(f"estimate_memory: no such modules: {missing}")
        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        chosen = sorted(((n, named[n]) for n in wanted if n), key=lambda nm: order[nm[0]])
    if root:
        chosen = [("<root>", model)] + chosen
    return chosen


def _assign_params(model: nn.Module, members: list[tuple[str, nn.Module]]) -> list[list[schedule.ManagedParam]]:
    """Each parameter goes to its innermost group, as fully_shard applied bottom-up assigns it."""
    group_modules = {id(m) for _, m in members}
    claimed: set[int] = set()
    params: list[list[schedule.ManagedParam]] = [[] for _ in members]
    for index in reversed(range(len(members))):  # innermost (latest in pre-order) first
        module = members[index][1]
        for managed in schedule.managed_params((module,), lambda m: id(m) in group_modules):
            if id(managed.param) not in claimed:
                claimed.add(id(managed.param))
                params[index].append(managed)
    return params


def _frees_after_forward(members: list, root: bool, setting, world: int) -> list[bool]:
    if isinstance(setting, int) and not isinstance(setting, bool) and setting not in (1, world):
        raise ValueError(
            f"estimate_memory: reshard_after_forward={setting} (a subgroup) is not modelled; use None, True or False"
        )
    return [
        schedule.after_forward(setting, is_root=root and i == 0, shard_size=world) is schedule.AfterForward.FREE
        for i in range(len(members))
    ]


def estimate_memory(
    model: nn.Module,
    mesh_or_world_size,
    *,
    groups: Callable[[nn.Module], bool] | Iterable[str] | None = None,
    root: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    optimizer: str = "adamw",
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    rank: int | None = None,
    sample_input: tuple | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    all_gather_policy: AllGatherPolicy | Callable[[str], AllGatherPolicy | None] | None = None,
    step_trace: StepTrace | None = None,
    kernel_scratch: str | torch.device | None = None,
) -> MemoryEstimate:
    """Estimate rank ``rank``'s memory (default: rank 0, or this rank of a given mesh).

    ``all_gather_policy``: the ``set_all_gather_policy`` of every group, or a function of the
    group's name (``"<root>"`` or its module name) giving each group's (None: not quantized).

    ``sample_input``: one rank's batch (a tuple of model arguments, meta tensors or not) for a
    dry run of forward + backward on meta, which fills ``activations`` and ``peak`` (see
    fsdp2.tools.meta_step). ``loss_fn(model, *sample_input)`` returns the loss; default
    ``model(*sample_input)``, summed if not a scalar. ``step_trace``: instead of
    ``sample_input``, a recording of the same model's step from :func:`trace_step`.
    ``kernel_scratch``: a device (``"cpu"``, ``"cuda"``) on which to measure the scratch every op's
    real kernel allocates while it runs, and count it in ``peak`` (see :func:`trace_step`).

    The step modelled is the eager one. A step compiled whole (``torch.compile(model,
    fullgraph=True)``, fsdp2's traced path) is not modelled: the compiler reuses buffers, fuses
    kernels and re-gathers in backward. On the benchmark GPT the compiled peak measured 2.8% below
    this prediction (benchmarks/RESULTS.md, "The whole step compiled"); other models are not measured.
    """
    if sample_input is not None and step_trace is not None:
        raise ValueError("estimate_memory: pass sample_input or step_trace, not both")
    if sample_input is not None and not isinstance(sample_input, tuple):
        raise TypeError(
            f"estimate_memory: sample_input must be a tuple of model arguments, got {type(sample_input).__name__}"
        )
    if loss_fn is not None and sample_input is None:
        raise ValueError("estimate_memory: loss_fn needs sample_input")
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"estimate_memory: optimizer must be one of {sorted(_OPTIMIZERS)}, got {optimizer!r}")
    world, mesh_rank, replicate = _mesh_sizes(mesh_or_world_size)
    rank = mesh_rank if rank is None else rank
    mp_policy = mp_policy or MixedPrecisionPolicy()
    n_states, has_step = _OPTIMIZERS[optimizer]

    members = _group_members(model, groups, root)
    group_params = _assign_params(model, members)
    frees = _frees_after_forward(members, root, reshard_after_forward, world)
    estimates: list[GroupEstimate] = []
    sharded_params = sharded_grads = optimizer_state = largest_param_shard = 0
    for (name, _), managed, free in zip(members, group_params, frees):
        g = GroupEstimate(name, 0, 0, 0, 0, 0, 0, 0, frees_after_forward=free)
        per_rank_reduce = 0  # numel_per_rank * elem of the reduce buffers, summed over dtypes
        policy = all_gather_policy(name) if callable(all_gather_policy) else all_gather_policy
        columns = []  # of the group's all-gather, as its parameters' codecs lay them out
        for fqn, p in ((m.fqn, m.param) for m in managed):
            dim = 0
            if shard_placement_fn is not None:
                placement = shard_placement_fn(p)
                dim = placement.dim % p.dim() if placement is not None else 0
            layout = ShardLayout(p.shape, dim, world, rank)
            elem = p.dtype.itemsize
            param_dtype = param_dtype_of(p, mp_policy)
            param_elem = param_dtype.itemsize
            reduce_elem = reduce_dtype_of(p, mp_policy).itemsize
            local = math.prod(layout.local_shape) * elem
            padded_full = world * layout.padded_shard_numel
            quantized = policy is not None and world > 1 and policy.quantizes(fqn, p, param_dtype)
            columns.append(quantized_column(layout, policy) if quantized else plain_column(layout, param_dtype))
            g.num_params += p.numel()
            g.sharded_bytes += local
            g.gathered_bytes += padded_full * param_elem
            if p.requires_grad:
                g.unsharded_grad_bytes += p.numel() * param_elem
                per_rank_reduce += layout.padded_shard_numel * reduce_elem
                sharded_grads += local
                g.sharded_grad_bytes += local
                largest_param_shard = max(largest_param_shard, local)
                optimizer_state += n_states * local + (_STEP_BYTES if has_step else 0)
        g.reduce_output_bytes = per_rank_reduce
        if world == 1:
            # A one-rank shard group communicates nothing: no all-gather buffer, and the
            # reduce-scatter input is its own output.
            g.all_gather_bytes = 0
            g.reduce_scatter_input_bytes = 0
            g.reduce_scatter_bytes = per_rank_reduce
        else:
            g.all_gather_bytes = world * gather_row_bytes(columns) if columns else 0
            g.reduce_scatter_input_bytes = world * per_rank_reduce
            g.reduce_scatter_bytes = (world + 1) * per_rank_reduce
        sharded_params += g.sharded_bytes
        estimates.append(g)

    root_group = estimates[0] if root else None
    others = estimates[1:] if root else estimates
    est = MemoryEstimate(
        world_size=world,
        rank=rank,
        num_params=sum(g.num_params for g in estimates),
        groups=estimates,
        sharded_params=sharded_params,
        sharded_grads=sharded_grads,
        optimizer_state=optimizer_state,
        largest_param_shard=largest_param_shard,
        peak_gathered_params=_peak_gathered(root_group, others, frees[-1] if others else False),
        peak_unsharded_grads=_peak_unsharded_grads(root_group, others),
        reduce_scatter_buffers=_peak_reduce_scatter(estimates),
        comm_bytes_per_step=_comm_per_step(estimates, frees, replicate),
        replicate_size=replicate,
    )
    if sample_input is not None:
        step_trace = trace_step(
            model,
            groups=groups,
            root=root,
            mp_policy=mp_policy,
            sample_input=sample_input,
            loss_fn=loss_fn,
            kernel_scratch=kernel_scratch,
        )
    if step_trace is not None:
        _add_step_peak(est, step_trace, frees)
    return est


# Extra bytes torch.optim.AdamW's per-parameter (non-foreach: the CPU default) step allocates
# at once, in units of the largest local parameter shard: exp_avg_sq.sqrt() and its division.
# A rough bound, not validated: the optimizer step was never the peak in our measurements.
_OPTIMIZER_STEP_TEMPS = 2


def trace_step(
    model: nn.Module,
    *,
    groups: Callable[[nn.Module], bool] | Iterable[str] | None = None,
    root: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    sample_input: tuple,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    kernel_scratch: str | torch.device | None = None,
) -> StepTrace:
    """Record one step of ``model`` (on meta, left untouched) for ``estimate_memory(step_trace=...)``.

    The recording depends on the model, its groups, the compute dtype and the batch, not on
    the sharding: estimate every mesh and ``reshard_after_forward`` setting from one recording.

    ``kernel_scratch``: a real device. Each distinct op of the dry run then also runs once there
    on zero-filled inputs, and the workspace its kernel allocates while running is recorded
    (fsdp2/tools/kernel_scratch.py). Which kernels run depends on the machine (oneDNN takes
    bfloat16 matmuls only on CPUs with AVX-512 BF16 or AMX, attention buffers grow with the
    thread count): a peak meant to match a measured one on this machine needs it. Without it
    (the default: planning for another machine, or a model too large to run an op of here)
    kernel scratch is not counted.
    """
    if not isinstance(sample_input, tuple):
        raise TypeError(
            f"estimate_memory: sample_input must be a tuple of model arguments, got {type(sample_input).__name__}"
        )
    mp_policy = mp_policy or MixedPrecisionPolicy()
    twin = meta_copy(model, mp_policy.param_dtype)
    members = _group_members(twin, groups, root)
    params = [[m.param for m in group] for group in _assign_params(twin, members)]
    return record_step(
        twin,
        [m for _, m in members],
        params,
        sample_input,
        loss_fn=loss_fn,
        cast_inputs_to=mp_policy.param_dtype if mp_policy.cast_forward_inputs else None,
        kernel_scratch=KernelScratch(kernel_scratch) if kernel_scratch is not None else None,
    )


def _add_step_peak(est: MemoryEstimate, trace: StepTrace, frees: list[bool]) -> None:
    """Fill ``activations``/``peak`` from a recorded meta step (fsdp2.tools.meta_step)."""
    if trace.n_groups != len(est.groups):
        raise ValueError(
            f"estimate_memory: step_trace was recorded with {trace.n_groups} groups, this estimate has "
            f"{len(est.groups)}; record it with the same model, groups and root"
        )
    add_step_profile(est, replay_step(trace, group_bytes(est), frees_after_forward=frees))


def group_bytes(est: MemoryEstimate) -> list[GroupBytes]:
    """What fsdp2 allocates per group, as the dry run's replay takes it."""
    return [
        GroupBytes(
            gathered=g.gathered_bytes,
            gather_buffer=g.all_gather_bytes,
            reduce_scatter=g.reduce_scatter_bytes,
            sharded_grads=g.sharded_grad_bytes,
        )
        for g in est.groups
    ]


def add_step_profile(est: MemoryEstimate, profile: StepProfile) -> None:
    """Fill ``activations``/``peak`` of ``est`` from a replayed step.

    The peak of a step = what is held between steps (sharded params + optimizer state) plus the
    higher of: the replayed step's peak (activations, autograd's gradients, gathered params and
    fsdp2's buffers, all at the moment they coincide, usually early in backward), and the
    optimizer step (sharded grads + its temporaries).
    """
    optimizer_step = est.sharded_grads + _OPTIMIZER_STEP_TEMPS * est.largest_param_shard
    est.activations = profile.saved_activations
    est.peak = est.sharded_params + est.optimizer_state + max(profile.peak, optimizer_step)
    est.peak_phase = profile.peak_phase if profile.peak >= optimizer_step else "optimizer step"


def _peak_gathered(root: GroupEstimate | None, blocks: list[GroupEstimate], blocks_free: bool) -> int:
    """Largest sum of live gathered parameters + all-gather output buffers over fsdp2's schedule.

    The root group unshards first and is gathered through backward (re-gathered first thing if
    it freed after forward). Forward gathers one group at a time; during copy-out a group's
    all-gather output and its unsharded parameters coexist (2x). Backward unshards group i and
    prefetches group i-1 (forward order); group i may still be gathered while i-1 copies out of
    its buffer. Blocks that keep their parameters after forward stay gathered until backward.
    """
    base = root.gathered_bytes if root else 0
    peaks = [2 * base]
    if blocks_free:
        for i, g in enumerate(blocks):
            peaks.append(base + 2 * g.gathered_bytes)
            if i > 0:
                peaks.append(base + g.gathered_bytes + 2 * blocks[i - 1].gathered_bytes)
    else:
        held = base
        for g in blocks:
            peaks.append(held + 2 * g.gathered_bytes)
            held += g.gathered_bytes
    return max(peaks)


def _peak_unsharded_grads(root: GroupEstimate | None, blocks: list[GroupEstimate]) -> int:
    """The root's full grads live through all of backward (its first params, e.g. the embedding,
    get their grads last); on top of them at most one other group's grads before its reduction."""
    base = root.unsharded_grad_bytes if root else 0
    return base + max((g.unsharded_grad_bytes for g in blocks), default=0)


def _peak_reduce_scatter(groups: list[GroupEstimate]) -> int:
    """fsdp2 keeps up to DEFAULT_MAX_REDUCES_IN_FLIGHT groups' reductions in flight and issues the
    next before waiting on the oldest: the largest run of that many + 1 consecutive groups'
    buffers (backward order)."""
    window = schedule.DEFAULT_MAX_REDUCES_IN_FLIGHT + 1
    sizes = [g.reduce_scatter_bytes for g in reversed(groups)]
    if len(sizes) <= window:
        return sum(sizes)
    return max(sum(sizes[i : i + window]) for i in range(len(sizes) - window + 1))


def _comm_per_step(groups: list[GroupEstimate], frees: list[bool], replicate: int) -> dict[str, int]:
    """Buffer bytes of one forward+backward, counted as fsdp2.tools.comm_stats counts them: a
    group that frees after forward is gathered again in backward; with replicas (HSDP) each
    group's reduced shard is all-reduced across them."""
    return {
        "all_gather": sum((2 if free else 1) * g.all_gather_bytes for g, free in zip(groups, frees)),
        "reduce_scatter": sum(g.reduce_scatter_input_bytes for g in groups if g.reduce_scatter_input_bytes),
        "all_reduce": sum(g.reduce_output_bytes for g in groups) if replicate > 1 else 0,
        "all_to_all": 0,  # fsdp2.optim's optimizer step, not forward+backward
    }
