"""Building a program's model, meshes and wrapping, for fsdp2 or PyTorch's FSDP2.

The meshes (``MESHES``) are made on process groups of their own, so that a collective one rank
never joins times out in seconds (``short_timeouts``) instead of holding the harness's world;
after such a hang the world is replaced (its groups' collectives no longer pair up).
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.fuzz.program import MIXED_PRECISION, Block, Model, Wrap

# name -> what it is; the world sizes it takes.
MESHES = {
    "flat": ("1-D over the world", (2, 4)),
    "hsdp": ("(replicate, shard) named mesh, replicate = world / 2", (2, 4)),
    "hsdp-unflattened": ("(replicate, shard) unflattened from a flat world mesh", (2, 4)),
    "dp-slice": ('init_device_mesh((2, world / 2), ("dp_shard", "tp"))["dp_shard"], no TP', (2, 4)),
    "dp-slice-whole": ('init_device_mesh((world, 1), ("dp_shard", "tp"))["dp_shard"], no TP', (2, 4)),
    "unflattened-slice": (
        'torchtitan\'s: (dp_shard = world, tp = 1) unflattened from a flat world mesh, ["dp_shard"]',
        (2, 4),
    ),
    "tp": ('(dp, tp) named mesh: TP on mesh["tp"] first, fully_shard on mesh["dp"]', (4,)),
    "tp-unflattened": ("torchtitan's: dp and tp slices of two meshes unflattened from one world mesh", (4,)),
    "ep": ("dense blocks on a flat mesh, experts on (efsdp, ep) unflattened from the same world mesh", (4,)),
}


@dataclass
class Meshes:
    dp: object  # the mesh fully_shard gets
    tp: object = None
    efsdp: object = None
    ep: object = None
    data_rank: int = 0  # which batch this rank reads: TP peers read the same

    @property
    def shard_size(self) -> int:
        return self.dp.size(-1)


@contextlib.contextmanager
def short_timeouts(seconds: float):
    """Inside, the collectives of every process group but the harness's world time out after
    ``seconds`` (``set_timeout`` changes it), also those of groups created inside (by this code,
    PyTorch or fsdp2); on exit they get the default timeout back."""
    from torch.distributed import distributed_c10d as c10d

    original = c10d._get_default_timeout
    c10d._get_default_timeout = lambda backend: datetime.timedelta(seconds=seconds)
    try:
        set_timeout(seconds)
        yield
    finally:
        c10d._get_default_timeout = original
        set_timeout(c10d.default_pg_timeout.total_seconds())


def set_timeout(seconds: float) -> None:
    from torch.distributed import distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):
        if pg is not c10d.GroupMember.WORLD and pg is not _CONTROL.get("group"):
            c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), pg)


_CONTROL: dict = {}
CONTROL_TIMEOUT_S = 600


def control_group():
    """The group the ranks exchange their reports over: all ranks, a timeout longer than any hang
    timeout (a rank that finished a call waits there while another sits out a hang)."""
    if "group" not in _CONTROL:
        _CONTROL["group"] = dist.new_group(
            list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S)
        )
    return _CONTROL["group"]


# The meshes of each kind, made once per rank process: fsdp2 and PyTorch keep process groups they
# derive from a mesh (subgroups by ranks), which must outlive one program.
_MESHES: dict[str, Meshes] = {}


def meshes(kind: str, ws: int) -> Meshes:
    if kind not in _MESHES:
        _MESHES[kind] = build_meshes(kind, ws)
    return _MESHES[kind]


def build_meshes(kind: str, ws: int) -> Meshes:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    rank = dist.get_rank()

    def world(name="world"):
        return DeviceMesh.from_group(dist.new_group(list(range(ws))), "cpu", mesh_dim_names=(name,))

    if kind == "flat":
        return Meshes(world("dp"), data_rank=rank)
    if kind == "hsdp":
        return Meshes(init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("replicate", "shard")), data_rank=rank)
    if kind == "hsdp-unflattened":
        return Meshes(world()._unflatten(0, (ws // 2, 2), ("replicate", "shard")), data_rank=rank)
    if kind == "dp-slice":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp_shard", "tp"))
        return Meshes(mesh["dp_shard"], data_rank=rank)
    if kind == "dp-slice-whole":
        mesh = init_device_mesh("cpu", (ws, 1), mesh_dim_names=("dp_shard", "tp"))
        return Meshes(mesh["dp_shard"], data_rank=rank)
    if kind == "unflattened-slice":
        return Meshes(world()._unflatten(0, (ws, 1), ("dp_shard", "tp"))["dp_shard"], data_rank=rank)
    if kind == "tp":
        mesh = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
        return Meshes(mesh["dp"], tp=mesh["tp"], data_rank=mesh["dp"].get_local_rank())
    if kind == "tp-unflattened":
        flat = world()
        dense = flat._unflatten(0, (ws // 2, 2), ("dp", "tp"))
        loading = flat._unflatten(0, (ws // 2, 2), ("batch", "tp"))
        return Meshes(dense["dp"], tp=loading["tp"], data_rank=dense["dp"].get_local_rank())
    if kind == "ep":
        flat = world()
        dense = flat._unflatten(0, (ws,), ("fsdp",))
        sparse = flat._unflatten(0, (ws // 2, 2), ("efsdp", "ep"))
        return Meshes(dense["fsdp"], efsdp=sparse["efsdp"], ep=sparse["ep"], data_rank=rank)
    raise ValueError(f"unknown mesh {kind!r}")


# -- the model -----------------------------------------------------------------------------------------------


def _run(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``layer`` in its weight's dtype, the result back in ``h``'s (blocks of two dtypes)."""
    return layer(h.to(layer.weight.dtype)).to(h.dtype)


def _norm(kind: str, dim: int) -> nn.Module:
    return nn.LayerNorm(dim) if kind == "layer" else nn.RMSNorm(dim)


class LinearBlock(nn.Module):
    def __init__(self, spec: Block, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=spec.bias)

    def forward(self, h):
        return h + torch.tanh(_run(self.lin, h))


class MLPBlock(nn.Module):
    def __init__(self, spec: Block, dim: int):
        super().__init__()
        self.norm = _norm(spec.norm, dim) if spec.norm else None
        self.up = nn.Linear(dim, 2 * dim, bias=spec.bias)
        self.down = nn.Linear(2 * dim, dim, bias=spec.bias)

    def forward(self, h):
        x = _run(self.norm, h) if self.norm is not None else h
        return h + _run(self.down, torch.relu(_run(self.up, x)))


class GatedBlock(nn.Module):
    """Always called; its branch (all its parameters) only while ``gate_open``."""

    def __init__(self, spec: Block, dim: int):
        super().__init__()
        self.branch = nn.Linear(dim, dim, bias=spec.bias)
        self.gate_open = True

    def forward(self, h):
        if self.gate_open:
            return h + torch.tanh(_run(self.branch, h))
        return h * 1.0  # a new tensor: the module's output still reaches backward


class NestedBlock(nn.Module):
    def __init__(self, spec: Block, dim: int):
        super().__init__()
        self.inner = nn.ModuleList(make_block(child, dim) for child in spec.children)

    def forward(self, h):
        return run_blocks(self.inner, h)


class Experts(nn.Module):
    """Expert weights split over the expert-parallel mesh (``Shard(0)``): each rank computes with its
    own experts, weighted by their router gates (no token dispatch)."""

    def __init__(self, dim: int, n: int = 4, hidden: int = 6):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, dim, hidden) * 0.3)
        self.w2 = nn.Parameter(torch.randn(n, hidden, dim) * 0.3)

    def forward(self, h, gate):
        w1, w2 = self.w1, self.w2
        if hasattr(w1, "to_local"):
            w1, w2 = w1.to_local(), w2.to_local()
            first = self.w1.device_mesh.get_local_rank() * w1.shape[0]
            gate = gate[..., first : first + w1.shape[0]]
        out = torch.einsum("bsd,edf->bsef", h, w1.to(h.dtype)).relu()
        return (torch.einsum("bsef,efd->bsed", out, w2.to(h.dtype)) * gate.unsqueeze(-1)).sum(-2)


class ExpertsBlock(nn.Module):
    """A dense layer, a router and experts; while ``gate_open`` is False the experts and router go
    unused (a step without experts)."""

    def __init__(self, spec: Block, dim: int):
        super().__init__()
        self.dense = nn.Linear(dim, dim, bias=spec.bias)
        self.router = nn.Linear(dim, 4, bias=False)
        self.experts = Experts(dim)
        self.gate_open = True

    def forward(self, h):
        x = torch.tanh(_run(self.dense, h))
        if not self.gate_open:
            return h + x
        return h + self.experts(x, _run(self.router, x).softmax(-1))


BLOCKS = {"linear": LinearBlock, "mlp": MLPBlock, "gated": GatedBlock, "nested": NestedBlock, "experts": ExpertsBlock}


def make_block(spec: Block, dim: int) -> nn.Module:
    block = BLOCKS[spec.kind](spec, dim)
    block.bypassed = False
    block.twice = spec.twice
    return block


def _set_param(p: nn.Parameter, spec: Block) -> None:
    if spec.dtype != "float32":
        p.data = p.data.to(getattr(torch, spec.dtype))
    if spec.frozen:
        p.requires_grad_(False)


def _apply_spec(block: nn.Module, spec: Block) -> None:
    """dtype and frozen on the parameters the block itself holds (not a nested child block's)."""
    for module in _own_modules(block):
        for p in module.parameters(recurse=False):
            _set_param(p, spec)


def _own_modules(block: nn.Module):
    yield block
    for child in block.children():
        if isinstance(child, nn.ModuleList):
            continue
        yield from _own_modules(child)


def run_blocks(blocks, h):
    for block in blocks:
        if block.bypassed:
            continue
        h = block(h)
        if block.twice:
            h = block(h)
    return h


class FuzzModel(nn.Module):
    def __init__(self, spec: Model):
        super().__init__()
        if spec.input == "embedding":
            self.emb = nn.Embedding(spec.vocab, spec.dim)
        else:
            self.inp = nn.Linear(spec.vocab, spec.dim)
        self.blocks = nn.ModuleList(make_block(b, spec.dim) for b in spec.blocks)
        self.norm = _norm(spec.final_norm, spec.dim) if spec.final_norm else None
        self.head = nn.Linear(spec.dim, spec.vocab, bias=spec.head_bias)
        if spec.tied:
            self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x) if hasattr(self, "emb") else _run(self.inp, x)
        h = run_blocks(self.blocks, h)
        if self.norm is not None:
            h = _run(self.norm, h)
        return _run(self.head, h)


def block_specs(spec: Model) -> dict[str, Block]:
    """Each block's path in the model -> its spec (nested ones included)."""
    found = {}

    def walk(prefix, blocks):
        for i, b in enumerate(blocks):
            path = f"{prefix}{i}"
            found[path] = b
            walk(f"{path}.inner.", b.children)

    walk("blocks.", spec.blocks)
    return found


def build_model(spec: Model, seed: int) -> FuzzModel:
    torch.manual_seed(seed)
    model = FuzzModel(spec)
    for path, b in block_specs(spec).items():
        _apply_spec(model.get_submodule(path), b)
    return model


def batch(spec: Model, index: int, data_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * index + data_rank)
    if spec.input == "embedding":
        return torch.randint(0, spec.vocab, (2, 3), generator=g)
    return torch.randn(2, 3, spec.vocab, generator=g)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


# -- wrapping ------------------------------------------------------------------------------------------------


def _policies(wrap: Wrap) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    param, reduce, output = (None if d is None else getattr(torch, d) for d in MIXED_PRECISION[wrap.mp])
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output)}
    if wrap.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if wrap.reshard is not None:
        kwargs["reshard_after_forward"] = wrap.reshard
    return kwargs


def parallelize(model: FuzzModel, spec: Model, meshes: Meshes) -> None:
    """TP first (as torchtitan): MLP blocks column-wise then row-wise on the TP mesh; experts split
    over the expert-parallel mesh."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for path, b in block_specs(spec).items():
        block = model.get_submodule(path)
        if b.kind == "mlp" and meshes.tp is not None:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(block, meshes.tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if b.kind == "experts" and meshes.ep is not None:
            for name in ("w1", "w2"):
                weight = getattr(block.experts, name)
                sharded = nn.Parameter(
                    distribute_tensor(weight.detach(), meshes.ep, [Shard(0)]), requires_grad=weight.requires_grad
                )
                setattr(block.experts, name, sharded)


def wrap_model(model: FuzzModel, spec: Model, meshes: Meshes, fully_shard) -> None:
    """``fully_shard`` (PyTorch's or fsdp2's) on every block that has a ``wrap``, innermost first,
    then the root."""
    blocks = block_specs(spec)
    for path in sorted(blocks, key=lambda p: -p.count(".")):
        b = blocks[path]
        if b.wrap is None:
            continue
        block = model.get_submodule(path)
        kwargs = _policies(b.wrap)
        if b.kind == "experts" and meshes.efsdp is not None:
            kwargs["shard_placement_fn"] = _expert_placement(block, meshes)
        fully_shard(block, mesh=meshes.dp, **kwargs)
    fully_shard(model, mesh=meshes.dp, **_policies(spec.root))


def _expert_placement(block: ExpertsBlock, meshes: Meshes):
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

    efsdp = FSDPMeshInfo(meshes.efsdp, shard_mesh_dim=0)
    experts = set(block.experts.parameters())
    return lambda p: ShardPlacementResult(None, efsdp) if p in experts else None
