"""Evaluate every strategy for one model, workload and cluster: memory, bytes, step time, verdict.

See fsdp2/plan/__init__.py for the model behind the numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from fsdp2.policies import MixedPrecisionPolicy
from fsdp2.plan.cluster import Cluster
from fsdp2.plan.model_source import (
    ModelSource,
    PlanInputError,
    checkpoint_blocks,
    count_params,
    model_source,
    TensorParallelTraffic,
    tensor_parallel_local,
    tensor_parallel_traffic,
)
from fsdp2.plan.results import CommPerStep, MemoryPerRank, Plan, Precision, StepTime, StrategyResult, Workload
from fsdp2.plan.strategies import Kind, Strategy, enumerate_strategies, tp_candidates
from fsdp2.plan.timeline import Collective, GroupComm, MicroStep, ring_seconds, simulate
from fsdp2.runtime import schedule
from fsdp2.tools.estimate import MemoryEstimate, add_step_profile, estimate_memory, group_bytes, trace_step
from fsdp2.tools.kernel_scratch import KernelScratch
from fsdp2.tools.meta_step import StepTrace, repeat_blocks, replay_step

OPTIMIZERS = ("adamw", "sgd", "sgd_momentum", "muon")

# Muon (modelled, not run in the dry run): Newton-Schulz iterations per update of a matrix.
MUON_NS_STEPS = 5


# -- per-TP-degree model: one recording each -----------------------------------------------------


@dataclass
class _Variant:
    """The model as one TP rank sees it, and its recorded micro-step."""

    model: nn.Module
    trace: StepTrace
    tensor_parallel: TensorParallelTraffic


# Blocks recorded when a model has more: the dry run of 4 blocks, repeated, is the dry run of all
# of them (fsdp2.tools.meta_step.repeat_blocks; exact, and checked on every use).
RECORDED_BLOCKS = 4


def _record(
    source: ModelSource, model: nn.Module, tp: int, workload: Workload, kernel_scratch: str | torch.device | None
) -> StepTrace:
    plan = source.tp_plan() if tp > 1 else {}
    local = tensor_parallel_local(model, source.is_block, plan, tp)
    if workload.activation_checkpointing:
        checkpoint_blocks(local, source.is_block)
    return trace_step(
        local,
        groups=source.is_block,
        mp_policy=workload.precision.policy(),
        sample_input=source.inputs(workload.micro_batch, workload.seq_len),
        loss_fn=source.loss,
        kernel_scratch=kernel_scratch,
    )


def _variant(
    source: ModelSource, base: nn.Module, tp: int, workload: Workload, kernel_scratch: str | torch.device | None
) -> _Variant:
    plan = source.tp_plan() if tp > 1 else {}
    local = tensor_parallel_local(base, source.is_block, plan, tp)
    blocks = sum(1 for m in local.modules() if source.is_block(m))
    trace = None
    if source.with_layers is not None and blocks > RECORDED_BLOCKS + 2:
        short = source.with_layers(RECORDED_BLOCKS)
        trace = repeat_blocks(_record(short, short.meta_model(workload.seq_len), tp, workload, kernel_scratch), blocks)
    if trace is None:
        trace = _record(source, base, tp, workload, kernel_scratch)
    return _Variant(local, trace, tensor_parallel_traffic(local, source.is_block, plan))


# -- one strategy ---------------------------------------------------------------------------------


def _estimate(strategy: Strategy, variant: _Variant, source: ModelSource, workload: Workload) -> MemoryEstimate:
    optimizer = workload.optimizer
    policy = workload.precision.policy()
    if strategy.kind is Kind.DDP:
        return _ddp_estimate(variant, source, policy, optimizer)
    mesh: Any = (strategy.replicate, strategy.shard) if strategy.replicate > 1 else strategy.shard
    return estimate_memory(
        variant.model,
        mesh,
        groups=source.is_block,
        mp_policy=policy,
        reshard_after_forward=strategy.reshard_after_forward,
        optimizer=optimizer,
        step_trace=variant.trace,
        all_gather_policy=workload.precision.all_gather_policy(),
    )


def _ddp_estimate(
    variant: _Variant, source: ModelSource, policy: MixedPrecisionPolicy, optimizer: str
) -> MemoryEstimate:
    """torch DDP as fsdp2 at one rank would hold it, except that nothing is gathered: parameters
    are used in place, and only a compute dtype other than theirs makes a copy of each (what
    autocast caches), alive from its forward until backward ends. DDP's gradient buckets are
    added by the caller."""
    est = estimate_memory(variant.model, 1, groups=source.is_block, mp_policy=policy, optimizer=optimizer)
    casts = policy.param_dtype is not None and policy.param_dtype != torch.float32
    sizes = [dataclasses.replace(g, gathered=g.gathered if casts else 0, gather_buffer=0) for g in group_bytes(est)]
    add_step_profile(est, replay_step(variant.trace, sizes, frees_after_forward=[False] * len(sizes)))
    return est


def _matrix_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """2-D parameters other than embeddings (Muon orthogonalizes these; AdamW takes the rest)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [
        tuple(p.shape)
        for p in {id(p): p for p in model.parameters()}.values()
        if p.dim() == 2 and id(p) not in embeddings
    ]


class _Links:
    """Collectives of one strategy on the cluster's links: their durations and the bytes each
    link carries for this rank (ring factors)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.wire: dict[str, float] = {}

    def collective(
        self, link: str, nbytes: float, size: int, *, all_reduce: bool = False, times: int = 1
    ) -> Collective | None:
        """One collective of an ``nbytes`` buffer over ``size`` ranks, issued ``times`` per micro-step."""
        if size <= 1 or not nbytes:
            return None
        factor = (2 if all_reduce else 1) * (size - 1) / size
        self.wire[link] = self.wire.get(link, 0.0) + times * factor * nbytes
        bandwidth, latency = self.cluster.bandwidth(link), self.cluster.latency(link)
        return Collective(ring_seconds(nbytes, size, bandwidth, latency, all_reduce=all_reduce), link)


def _group_collectives(est: MemoryEstimate, strategy: Strategy, links: _Links) -> list[GroupComm]:
    """Each group's collectives in one micro-step (DDP: its gradient all-reduce)."""
    cluster = links.cluster
    if strategy.kind is Kind.DDP:
        ddp_link = cluster.link(1, cluster.gpus)
        # at shard size 1 a group's reduce output is its whole gradient in the reduce dtype
        return [
            GroupComm(all_reduce=links.collective(ddp_link, g.reduce_output_bytes, cluster.gpus, all_reduce=True))
            for g in est.groups
        ]
    s, r = strategy.shard, strategy.replicate
    shard_link, replicate_link = strategy.shard_link(cluster), strategy.replicate_link(cluster)
    groups = []
    for g in est.groups:
        free = g.frees_after_forward
        groups.append(
            GroupComm(
                gather=links.collective(shard_link, g.all_gather_bytes, s, times=2 if free else 1),
                reduce=links.collective(shard_link, g.reduce_scatter_input_bytes, s),
                all_reduce=links.collective(replicate_link, g.reduce_output_bytes if r > 1 else 0, r, all_reduce=True),
                frees_after_forward=free,
            )
        )
    return groups


def _fsdp_bytes(est: MemoryEstimate, strategy: Strategy) -> dict[str, int]:
    """fsdp2's own collectives per micro-step as count_comm counts them (the estimator's count,
    low-precision all-gathers included); DDP runs none of them."""
    if strategy.kind is Kind.DDP:
        return dict.fromkeys(est.comm_bytes_per_step, 0)  # the keys count_comm reports
    return dict(est.comm_bytes_per_step)


def _evaluate(
    strategy: Strategy, variant: _Variant, source: ModelSource, workload: Workload, cluster: Cluster
) -> StrategyResult:
    result = StrategyResult(strategy)
    accumulation = workload.accumulation(strategy)
    est = _estimate(strategy, variant, source, workload)
    precision = workload.precision
    ddp = strategy.kind is Kind.DDP

    buckets = est.sharded_grads if ddp else 0  # DDP's flat gradient buckets, a second copy of the grads
    result.memory = MemoryPerRank(
        params=est.sharded_params,
        grads=est.sharded_grads,
        optimizer=est.optimizer_state,
        gathered_peak=0 if ddp else est.peak_gathered_params,
        activations=est.activations or 0,
        peak=est.peak + buckets,
        peak_phase=est.peak_phase or "",
        extra=buckets,
    )
    result.fits = result.memory.peak <= cluster.usable_bytes

    links = _Links(cluster)
    groups = _group_collectives(est, strategy, links)

    # Tensor parallel (modelled): all-reduces of activations, inline on the compute stream.
    t, tp_link = strategy.tp, strategy.tp_link(cluster)
    tokens = workload.micro_batch * workload.seq_len
    recomputes = 2 if workload.activation_checkpointing else 1
    traffic = variant.tensor_parallel
    tp_bytes = (
        traffic.forward_elements * recomputes * tokens * precision.compute_bytes,
        traffic.backward_elements * tokens * precision.compute_bytes,
    )
    tp_calls = (traffic.forward_calls * recomputes, traffic.backward_calls)
    tp_seconds = [0.0, 0.0]
    for phase in (0, 1):
        op = links.collective(tp_link, tp_bytes[phase], t, all_reduce=True)
        if op is not None:  # one latency per call, the bytes as if in one call
            tp_seconds[phase] = op.seconds + (tp_calls[phase] - 1) * cluster.latency(tp_link)

    micro: MicroStep = simulate(
        variant.trace,
        groups,
        flops_per_second=cluster.tflops * 1e12,
        tp_forward_seconds=tp_seconds[0],
        tp_backward_seconds=tp_seconds[1],
        reduce_window=None if ddp else schedule.DEFAULT_MAX_REDUCES_IN_FLIGHT,
    )
    micro_wire, links.wire = links.wire, {}
    # Micro-steps that communicate: fsdp2 gathers and reduces in every one; DDP accumulates the
    # others under no_sync() (its gradients are full-size anyway) and all-reduces in the last.
    syncs = 1 if ddp else accumulation
    quiet = (
        simulate(variant.trace, [GroupComm() for _ in groups], flops_per_second=cluster.tflops * 1e12) if ddp else micro
    )

    optimizer_seconds, muon_bytes = _optimizer_seconds(est, strategy, variant, workload, cluster, links)
    step = syncs * micro.total + (accumulation - syncs) * quiet.total + optimizer_seconds
    result.time = StepTime(
        seconds=step,
        compute=accumulation * micro.compute,
        tensor_parallel=accumulation * micro.tensor_parallel,
        exposed_comm=syncs * micro.exposed_comm + (accumulation - syncs) * quiet.exposed_comm,
        optimizer=optimizer_seconds,
        accumulation=accumulation,
        flops_per_gpu=accumulation * variant.trace.flops,
    )
    wire = {link: syncs * nbytes for link, nbytes in micro_wire.items()}
    for link, nbytes in links.wire.items():  # once per step: the optimizer's
        wire[link] = wire.get(link, 0.0) + nbytes
    result.comm = CommPerStep(
        fsdp={k: accumulation * v for k, v in _fsdp_bytes(est, strategy).items()},
        ddp_all_reduce=sum(g.reduce_output_bytes for g in est.groups) if ddp else 0,
        tensor_parallel=accumulation * sum(tp_bytes) if t > 1 else 0,
        muon_all_to_all=muon_bytes,
        wire={link: int(nbytes) for link, nbytes in wire.items()},
        micro_batches=accumulation,
    )
    result.tokens_per_second = workload.tokens / step
    return result


def _optimizer_seconds(
    est: MemoryEstimate, strategy: Strategy, variant: _Variant, workload: Workload, cluster: Cluster, links: _Links
) -> tuple[float, int]:
    """HBM time of the update (read params, grads, state; write params, state) plus Muon's work."""
    touched = 2 * est.sharded_params + est.sharded_grads + 2 * est.optimizer_state
    seconds = touched / (cluster.hbm_gbps * 1e9)
    if workload.optimizer != "muon":
        return seconds, 0
    # Muon (modelled): each rank orthogonalizes 1/shard of the matrices after an all-to-all that
    # brings it whole matrices, and one that sends the updates back: 2x the matrix shards' bytes.
    shapes = _matrix_shapes(variant.model)
    ns_flops = sum(MUON_NS_STEPS * (4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3) for a, b in shapes)
    share = strategy.shard if strategy.shards_params else 1
    seconds += ns_flops / share / (cluster.tflops * 1e12)
    if share == 1:
        return seconds, 0
    matrix_bytes = sum(a * b for a, b in shapes) * 4 // share  # fp32 momentum/updates, this rank's shards
    nbytes = 2 * matrix_bytes
    seconds += links.collective(strategy.shard_link(cluster), nbytes, share).seconds
    return seconds, nbytes


# -- verdict --------------------------------------------------------------------------------------


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _verdict(results: list[StrategyResult], tolerance: float, cluster: Cluster) -> tuple[StrategyResult | None, str]:
    evaluated = [r for r in results if r.skipped is None]
    fitting = [r for r in evaluated if r.fits]
    if not fitting:
        if not evaluated:
            return None, "no strategy could be evaluated (see the skipped reasons)"
        least = min(evaluated, key=lambda r: r.memory.peak)
        return None, (
            f"nothing fits: the smallest peak is {least.name} at {_size(least.memory.peak)} "
            f"> {_size(cluster.usable_bytes)} usable; use activation checkpointing, a smaller "
            "micro-batch, more GPUs or a larger TP degree"
        )
    best = min(fitting, key=lambda r: r.time.seconds)
    close = [r for r in fitting if r.time.seconds <= best.time.seconds * (1 + tolerance)]
    chosen = min(close, key=lambda r: (r.strategy.kind.simplicity, r.time.seconds))
    usable = f"{_size(cluster.usable_bytes)} usable"
    simpler = [r for r in evaluated if r.strategy.kind.simplicity < chosen.strategy.kind.simplicity]
    simpler_fits = [r for r in simpler if r.fits]
    why = f"{chosen.name} fits ({_size(chosen.memory.peak)} of {usable})"
    if len(simpler) > 1 and not simpler_fits:
        smallest = min(simpler, key=lambda r: r.memory.peak)
        why = (
            f"nothing simpler fits (the smallest, {smallest.name}, needs {_size(smallest.memory.peak)} > {usable}); "
            + why
        )
    elif simpler:
        first = min(simpler, key=lambda r: r.strategy.kind.simplicity)
        if not first.fits:
            why = f"{first.name} needs {_size(first.memory.peak)} > {usable}; " + why
    if chosen is best:
        why += " and is the fastest"
    else:
        why += f", within {chosen.time.seconds / best.time.seconds - 1:.1%} of the fastest ({best.name})"
    if simpler_fits:
        simplest = min(simpler_fits, key=lambda r: r.strategy.kind.simplicity)
        why += f"; simpler {simplest.name} fits too but is {simplest.time.seconds / best.time.seconds - 1:.0%} slower"
    return chosen, why


# -- entry point ----------------------------------------------------------------------------------


def plan(
    model: Any,
    *,
    seq_len: int,
    global_batch: int | None = None,
    micro_batch: int = 1,
    optimizer: str = "adamw",
    precision: Precision = Precision(),
    activation_checkpointing: bool = False,
    cluster: Cluster = Cluster(),
    strategies: list[str] | None = None,
    tolerance: float = 0.05,
    block: str | None = None,
    tp_plan: Callable[[], dict] | None = None,
    kernel_scratch: str | torch.device | None = None,
) -> Plan:
    """Predict memory, communication and step time of every strategy; pick the simplest that fits.

    ``model``: a preset name, a Hugging Face ``config.json``, ``"package.module:factory"``, a
    GPTConfig/LlamaConfig or a meta ``nn.Module`` (see fsdp2.plan.model_source). ``global_batch``
    (sequences per step; default ``micro_batch x gpus``) is split into micro-batches of
    ``micro_batch`` sequences per data-parallel rank, with gradient accumulation where a strategy
    has fewer data-parallel ranks. ``strategies``: names or kinds to keep (e.g. ``["FSDP", "HSDP"]``).
    The verdict is the simplest fitting strategy within ``tolerance`` of the fastest fitting one.
    ``kernel_scratch``: a device of this machine on which to measure the workspace each op's
    kernel takes (fsdp2.tools.estimate.trace_step); for a peak that must match this machine's.
    """
    if optimizer not in OPTIMIZERS:
        raise PlanInputError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if seq_len < 1 or micro_batch < 1:
        raise PlanInputError(f"seq_len and micro_batch must be >= 1, got {seq_len} and {micro_batch}")
    if not tolerance >= 0:  # also nan; inf is fine: the simplest fitting strategy, however slow
        raise PlanInputError(f"tolerance must be a share >= 0 (0.05: within 5% of the fastest), got {tolerance}")
    global_batch = micro_batch * cluster.gpus if global_batch is None else global_batch
    if global_batch < 1:
        raise PlanInputError(f"global_batch must be >= 1, got {global_batch}")
    if kernel_scratch is not None:
        KernelScratch(kernel_scratch)  # a device this machine has, checked before any dry run
    source = model_source(model, block=block, tp_plan=tp_plan)
    workload = Workload(seq_len, global_batch, micro_batch, optimizer, precision, activation_checkpointing)
    base = source.meta_model(seq_len)
    notes = list(source.notes)

    tp_ok = []
    for t in tp_candidates(cluster):
        problem = source.tp_problem(t, base)
        if problem is None:
            tp_ok.append(t)
        elif source.tp_plan is not None:
            notes.append(f"TP {t} not planned: {problem}")
    if source.tp_plan is None:
        notes.append(f"no TP strategies: {source.name} has no tensor-parallel plan")
    candidates = enumerate_strategies(cluster, tp_ok)
    if strategies is not None:
        wanted = set(strategies)
        available = [c.name for c in candidates]
        candidates = [c for c in candidates if c.name in wanted or c.kind.value in wanted]
        if not candidates:
            raise PlanInputError(
                f"strategies={strategies}: none of these names or kinds ({', '.join(k.value for k in Kind)}) apply "
                f"to {cluster.gpus} GPUs; available: {', '.join(available)}"
                + "".join(f"; {n}" for n in notes if n.startswith("TP "))
            )

    variants: dict[int, _Variant] = {}
    results = []
    for strategy in candidates:
        if workload.accumulation(strategy) is None:
            results.append(
                StrategyResult(
                    strategy,
                    skipped=(
                        f"global batch {global_batch} does not split into {strategy.data_parallel} ranks "
                        f"x micro-batch {micro_batch}"
                    ),
                )
            )
            continue
        if strategy.tp not in variants:
            variants[strategy.tp] = _variant(source, base, strategy.tp, workload, kernel_scratch)
        results.append(_evaluate(strategy, variants[strategy.tp], source, workload, cluster))
    recommended, reason = _verdict(results, tolerance, cluster)
    if optimizer == "muon":
        notes.append(
            "Muon is modelled, not replayed: one momentum buffer; all-to-all of 2x the matrix shards; "
            f"{MUON_NS_STEPS} Newton-Schulz steps per matrix, split over the shard group"
        )
    return Plan(source.name, count_params(base), workload, cluster, results, recommended, reason, tolerance, notes)
