"""What a plan holds: every strategy's memory, bytes and step time, the verdict; and its text forms.

``print(plan)`` is the table :func:`render_table` writes, ``plan.to_json()`` :func:`to_json`'s
dict. The planner (fsdp2/plan/planner.py) fills these in; fsdp2/plan/report.py plots them.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import torch

from fsdp2.plan.cluster import Cluster
from fsdp2.plan.strategies import Strategy
from fsdp2.policies import AllGatherPolicy, MixedPrecisionPolicy, reduce_dtype_of


@dataclass(frozen=True)
class Precision:
    """Mixed precision as fully_shard's MixedPrecisionPolicy (master weights stay fp32)."""

    param_dtype: torch.dtype | None = torch.bfloat16  # compute and all-gather dtype (None: fp32)
    reduce_dtype: torch.dtype | None = torch.float32  # gradient reduction dtype (None: MixedPrecisionPolicy's default)
    low_precision_all_gather: bool = False  # AllGatherPolicy(torch.int8) on every group (float8: same bytes)

    def policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def all_gather_policy(self) -> AllGatherPolicy | None:
        return AllGatherPolicy(torch.int8) if self.low_precision_all_gather else None

    @property
    def compute_bytes(self) -> int:
        return (self.param_dtype or torch.float32).itemsize

    def describe(self) -> str:
        name = lambda d: str(d or torch.float32).replace("torch.", "")  # noqa: E731
        reduce = reduce_dtype_of(torch.empty(0), self.policy())  # the fp32 master weights' gradients
        text = f"params {name(self.param_dtype)}, reduce {name(reduce)}"
        return text + (", int8 all-gather (AllGatherPolicy)" if self.low_precision_all_gather else "")


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int  # sequences per optimizer step, over the whole cluster
    micro_batch: int = 1  # sequences per data-parallel rank per forward/backward
    optimizer: str = "adamw"
    precision: Precision = Precision()
    activation_checkpointing: bool = False

    def accumulation(self, strategy: Strategy) -> int | None:
        """Micro-batches per step for ``strategy`` (None: the global batch does not split evenly)."""
        per_step = strategy.data_parallel * self.micro_batch
        return self.global_batch // per_step if self.global_batch % per_step == 0 else None

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


@dataclass
class MemoryPerRank:
    """Bytes on one GPU. ``peak`` is the predicted allocator peak of a step (everything at once)."""

    params: int
    grads: int
    optimizer: int
    gathered_peak: int  # fsdp2's gathered parameters + all-gather buffers at their own peak
    activations: int  # saved for backward (one micro-batch)
    peak: int
    peak_phase: str
    extra: int = 0  # DDP: its gradient buckets


@dataclass
class CommPerStep:
    """Bytes per optimizer step on one rank."""

    fsdp: dict[str, int]  # buffer bytes as fsdp2.tools.comm_stats counts them (all_gather/reduce_scatter/all_reduce)
    ddp_all_reduce: int = 0  # modelled: torch DDP's bucket all-reduces
    tensor_parallel: int = 0  # modelled: DTensor's all-reduces of activations (not counted by count_comm)
    muon_all_to_all: int = 0  # modelled: Muon's all-to-all of the matrix shards
    wire: dict[str, int] = field(default_factory=dict)  # bytes through this rank's link, per link ("intra"/"inter")
    micro_batches: int = 1  # per step: fsdp2 and TP communicate in each, DDP in the last only

    def per_micro_step(self) -> dict[str, int]:
        """Bytes of one forward + backward, keyed as fsdp2.plan.apply.count_bytes counts them."""
        a = self.micro_batches
        return {
            **{k: v // a for k, v in self.fsdp.items()},
            "tensor_parallel": self.tensor_parallel // a,
            "ddp_all_reduce": self.ddp_all_reduce,
        }


@dataclass
class StepTime:
    seconds: float  # one optimizer step
    compute: float  # FLOPs / rate, all micro-batches
    tensor_parallel: float
    exposed_comm: float  # collectives compute had to wait for
    optimizer: float  # optimizer step (HBM-bound; Muon adds its Newton-Schulz FLOPs and all-to-all)
    accumulation: int  # micro-batches per step
    flops_per_gpu: int  # per step


@dataclass
class StrategyResult:
    strategy: Strategy
    skipped: str | None = None  # why it was not evaluated
    fits: bool = False
    memory: MemoryPerRank | None = None
    comm: CommPerStep | None = None
    time: StepTime | None = None
    tokens_per_second: float = 0.0

    @property
    def name(self) -> str:
        return self.strategy.name


@dataclass
class Plan:
    model: str
    num_params: int
    workload: Workload
    cluster: Cluster
    results: list[StrategyResult]
    recommended: StrategyResult | None
    reason: str
    tolerance: float
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return render_table(self)

    def to_json(self) -> dict:
        return to_json(self)

    def result(self, name: str) -> StrategyResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no strategy named {name!r}; have {[r.name for r in self.results]}")


# -- the text forms -----------------------------------------------------------------------------

GiB = 2**30


def _memory_unit(plan: "Plan") -> tuple[str, float]:
    """GiB, or MiB for models whose peaks are all below 1 GiB."""
    peaks = [r.memory.peak for r in plan.results if r.memory is not None]
    return ("GiB", GiB) if not peaks or max(peaks) >= GiB else ("MiB", 2**20)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def _tokens(rate: float) -> str:
    return f"{rate / 1e3:.1f}k" if rate < 1e6 else f"{rate / 1e6:.2f}M"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _header(plan: "Plan") -> list[str]:
    w = plan.workload
    ac = ", activation checkpointing" if w.activation_checkpointing else ""
    return [
        f"fsdp2 plan: {plan.model}, {_params(plan.num_params)} params",
        f"workload: global batch {w.global_batch} x {w.seq_len} tokens, "
        f"micro-batch {w.micro_batch} per data-parallel rank, "
        f"{w.optimizer}, {w.precision.describe()}{ac}",
        f"cluster: {plan.cluster.describe()}",
    ]


def _columns(unit: str) -> tuple[str, ...]:
    return (
        "strategy",
        "fits",
        f"peak {unit}",
        "params",
        "grads",
        "optim",
        "gathered",
        "activ.",
        "NVLink GB",
        "network GB",
        "compute+TP ms",
        "exposed comm ms",
        "step ms",
        "tokens/s",
    )


def _row(r: "StrategyResult", scale: float, width: int) -> tuple[str, ...]:
    if r.skipped is not None:
        return (r.name, "-", "skipped: " + r.skipped) + ("",) * (width - 3)
    m, c, t = r.memory, r.comm, r.time
    mem = lambda nbytes: f"{nbytes / scale:.1f}"  # noqa: E731
    return (
        r.name,
        "yes" if r.fits else "NO",
        mem(m.peak),
        mem(m.params),
        mem(m.grads + m.extra),
        mem(m.optimizer),
        mem(m.gathered_peak),
        mem(m.activations),
        _gb(c.wire.get("intra", 0)),
        _gb(c.wire.get("inter", 0)),
        _ms(t.compute + t.tensor_parallel),
        _ms(t.exposed_comm),
        _ms(t.seconds),
        _tokens(r.tokens_per_second),
    )


def render_table(plan: "Plan") -> str:
    unit, scale = _memory_unit(plan)
    columns = _columns(unit)
    rows = [columns] + [_row(r, scale, len(columns)) for r in plan.results]
    skipped = [r for r in rows[1:] if r[2].startswith("skipped")]
    shown = [rows[0]] + [r for r in rows[1:] if r not in skipped]
    widths = [max(len(r[i]) for r in shown) for i in range(len(columns))]
    lines = _header(plan) + [""]
    for index, row in enumerate(shown):
        cells = [cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [f"{r[0]}: {r[2]}" for r in skipped]
    lines.append("")
    if plan.recommended is not None:
        lines.append(f"verdict: {plan.recommended.name}. {plan.reason}.")
    else:
        lines.append(f"verdict: {plan.reason}.")
    lines += [
        "",
        "peak = predicted allocator peak per GPU (fsdp2.tools.estimate's meta dry run: params, grads, optimizer state, "
        "gathered params, activations, buffers); grads include DDP's buckets; NVLink/network GB = bytes through one "
        "GPU's link per step (ring collectives); exposed comm = time compute waits for collectives under fsdp2's "
        "schedule; step = micro-batches x (compute + TP all-reduces + exposed comm) + optimizer step.",
        "DDP is torch DDP (modelled); TP all-reduce bytes are modelled (count_comm counts fsdp2's collectives only).",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if hasattr(value, "name") and "name" not in out:
            out["name"] = value.name
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)  # dtypes


def to_json(plan: "Plan") -> dict:
    out = _plain(plan)
    out["recommended"] = plan.recommended.name if plan.recommended is not None else None
    out["units"] = {
        "memory": "bytes per GPU",
        "comm": "bytes per step per GPU",
        "time": "seconds per step",
        "tokens_per_second": "whole cluster",
    }
    return out
