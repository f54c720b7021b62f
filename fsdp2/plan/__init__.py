"""Pick the simplest sharding that fits: memory and step time of every strategy, before launch.

    from fsdp2.plan import plan, Cluster
    p = plan("llama3-8b", seq_len=8192, global_batch=256, cluster=Cluster(gpus=64))
    print(p)                      # table + verdict;  p.to_json(), fsdp2.plan.report.save_plot(p, "plan.png")

    python -m fsdp2.plan --model llama3-8b --gpus 64 --seq-len 8192 --global-batch 256

Strategies (fsdp2/plan/strategies.py): DDP (torch DDP, modelled), ZeRO-2
(``reshard_after_forward=False``), FSDP, HSDP for every replica count that divides the cluster,
FSDP + TP and HSDP + TP with TP inside a node.

**Memory per GPU** comes from :func:`fsdp2.tools.estimate.estimate_memory` and its meta dry run
of one micro-step (fsdp2/tools/meta_step.py), recorded once per TP degree and replayed for each
sharding: parameters, gradients and optimizer state (exact), gathered parameters, fsdp2's
buffers and activations at the moment of the peak. TP: the model with each planned Linear cut
to one rank's share (fsdp2/plan/model_source.py). DDP: every parameter kept gathered (no
sharding) plus its gradient buckets. A strategy fits if its peak is at most
``usable_fraction`` (90%) of GPU memory.

**Communication per step** (per GPU): fsdp2's collectives exactly as ``count_comm`` counts them
(all-gather outputs, reduce-scatter inputs, HSDP's all-reduce), times the micro-batches per step;
modelled separately: DDP's gradient all-reduce, TP's activation all-reduces (DTensor: each
row-split Linear's output in forward, each column-split Linear's input gradient in backward),
Muon's all-to-all. Bytes through a GPU's link use ring factors: ``(g-1)/g`` of the buffer for
all-gather and reduce-scatter over ``g`` ranks, ``2(g-1)/g`` for all-reduce; a group inside one
node uses NVLink, one spanning nodes the network.

**Step time**::

    step      = A * micro + optimizer                 A = global_batch / (data-parallel ranks * micro_batch)
                (fsdp2 gathers and reduces in every micro-batch; DDP only in the last, under no_sync())
    micro     = replay of fsdp2's schedule over the recorded micro-step (fsdp2/plan/timeline.py):
                compute spans between fsdp2's hooks take FLOPs / rate, TP all-reduces run inline,
                each collective takes latency + ring_factor * bytes / link bandwidth on its stream;
                compute waits only where fsdp2 waits (a group's all-gather before its forward or
                backward, the oldest reduction beyond 2 in flight, all reductions at the end)
    FLOPs     = counted on the meta dry run (torch.utils.flop_counter formulas: matmuls and
                attention, causal attention as half; activation checkpointing adds the recompute)
    rate      = Cluster.tflops (achievable; --calibrate measures it from one real step)
    optimizer = bytes the update touches / HBM bandwidth (+ Muon's Newton-Schulz FLOPs and all-to-all)

Verdict: among strategies that fit, the simplest (DDP < ZeRO-2 < FSDP < HSDP < FSDP+TP <
HSDP+TP) whose step time is within ``tolerance`` (5%) of the fastest, with one line of why.
"""

from fsdp2.plan.cluster import Cluster
from fsdp2.plan.model_source import PRESETS, ModelSource, PlanInputError, model_source
from fsdp2.plan.planner import plan
from fsdp2.plan.results import Plan, Precision, StrategyResult, Workload
from fsdp2.plan.strategies import Kind, Strategy

__all__ = [
    "Cluster",
    "Kind",
    "ModelSource",
    "PRESETS",
    "Plan",
    "PlanInputError",
    "Precision",
    "Strategy",
    "StrategyResult",
    "Workload",
    "model_source",
    "plan",
]
