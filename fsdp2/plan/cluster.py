"""The machines a plan is for: GPUs, memory, compute rate and the two links between GPUs.

Defaults describe H100 SXM nodes (8 GPUs, NVLink 4) with one 400 Gb/s InfiniBand NIC per GPU.
Bandwidths are *bus bandwidths* in the NCCL sense, per GPU and per direction: the rate at
which a ring collective moves each rank's share; a ring all-gather or reduce-scatter over
``g`` ranks of a buffer of ``B`` bytes takes ``(g - 1) / g * B / bandwidth``, an all-reduce
twice that. A group whose ranks all sit in one node uses NVLink; a group that spans nodes is
bound by the NICs (each GPU drives its own: rings of different groups do not share one).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

GiB = 2**30


@dataclass(frozen=True)
class Cluster:
    gpus: int = 8
    gpus_per_node: int = 8
    gpu_memory_gib: float = 79.6  # H100 SXM 80GB as the driver reports it (81559 MiB)
    # Usable share of GPU memory for what the estimator predicts: the rest covers the CUDA
    # context, NCCL's buffers and the caching allocator's fragmentation, which it does not.
    usable_fraction: float = 0.9
    tflops: float = 400.0  # achievable bf16 dense TFLOP/s per GPU: 40% of H100 SXM's 989 peak (--calibrate measures it)
    intra_node_gbps: float = 360.0  # GB/s per GPU, NVLink 4 (450 GB/s per direction, ~80% reached by NCCL)
    inter_node_gbps: float = 45.0  # GB/s per GPU, 400 Gb/s InfiniBand (50 GB/s, ~90% reached by NCCL)
    hbm_gbps: float = 2700.0  # GB/s, H100 HBM3 (3.35 TB/s, ~80% reached by the optimizer's elementwise kernels)
    intra_latency_us: float = 10.0  # per collective call
    inter_latency_us: float = 25.0
    name: str = "H100 SXM 80GB, NVLink 4 (360 GB/s per GPU), 400 Gb/s InfiniBand per GPU (45 GB/s)"
    calibrated: str | None = None  # how tflops/hbm_gbps were measured, if they were

    def __post_init__(self) -> None:
        for field_name in ("gpus", "gpus_per_node"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"Cluster: {field_name} must be >= 1, got {getattr(self, field_name)}")
        # nan and inf pass a plain "> 0" and turn every prediction into nonsense (nan compares false).
        for field_name in ("gpu_memory_gib", "tflops", "intra_node_gbps", "inter_node_gbps", "hbm_gbps"):
            if not (math.isfinite(getattr(self, field_name)) and getattr(self, field_name) > 0):
                raise ValueError(f"Cluster: {field_name} must be a finite number > 0, got {getattr(self, field_name)}")
        for field_name in ("intra_latency_us", "inter_latency_us"):
            if not (math.isfinite(getattr(self, field_name)) and getattr(self, field_name) >= 0):
                raise ValueError(f"Cluster: {field_name} must be a finite number >= 0, got {getattr(self, field_name)}")
        if not 0 < self.usable_fraction <= 1:
            raise ValueError(f"Cluster: usable_fraction must be in (0, 1], got {self.usable_fraction}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"Cluster: {self.gpus} GPUs do not fill nodes of {self.gpus_per_node}")

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gib * GiB * self.usable_fraction

    @property
    def node_size(self) -> int:
        """GPUs that share NVLink (all of them on one partly used node)."""
        return min(self.gpus, self.gpus_per_node)

    def link(self, stride: int, size: int) -> str:
        """``"intra"`` or ``"inter"``: the link of groups of ``size`` ranks ``stride`` apart.

        Groups tile the ranks; they all stay inside nodes iff one group's span divides the node.
        """
        if size == 1:
            return "none"
        span = stride * size
        return "intra" if span <= self.node_size and self.node_size % span == 0 else "inter"

    def bandwidth(self, link: str) -> float:
        """Bytes per second of a link."""
        return (self.intra_node_gbps if link == "intra" else self.inter_node_gbps) * 1e9

    def latency(self, link: str) -> float:
        return (self.intra_latency_us if link == "intra" else self.inter_latency_us) * 1e-6

    def describe(self) -> str:
        num = lambda x: f"{x:.0f}" if x >= 100 else f"{x:.3g}"  # noqa: E731
        nodes = max(1, self.gpus // self.gpus_per_node)
        rate = f"{num(self.tflops)} TFLOP/s achievable per GPU" + (
            f" ({self.calibrated})" if self.calibrated else " (assumed: 40% of peak)"
        )
        return (
            f"{self.gpus} GPUs = {nodes} node(s) x {self.node_size}; {self.gpu_memory_gib:.1f} GiB each, "
            f"{self.usable_fraction:.0%} usable; {rate}; NVLink {self.intra_node_gbps:.0f} GB/s, "
            f"network {self.inter_node_gbps:.0f} GB/s per GPU; HBM {num(self.hbm_gbps)} GB/s"
        )

    def to_dict(self) -> dict:
        return asdict(self)
