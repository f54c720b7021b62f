"""2-D and 3-D meshes: FSDP + tensor parallel, HSDP, and HSDP + TP, against an unsharded reference.

Tolerance: fp32 with AdamW(lr=1e-2) and gradient clipping; TP changes the summation order of
matmuls as well as of the gradient reduction, so parameters get ``atol=5e-5`` (losses and
gradient norms ``rtol=1e-5``).
"""

import copy

import pytest
import torch

from fsdp2.models import Llama, LlamaConfig, tensor_parallel_plan

CFG = LlamaConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4, hidden_dim=48)
STEPS = 3
PARAM_ATOL = 5e-5


def train_2d(rank: int, world_size: int, mesh_shape: tuple, names: tuple, use_tp: bool) -> dict:
    """Train a Llama with TP on the 'tp' dim (if any) and fully_shard on the data-parallel dims."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fsdp2 import clip_grad_norm_, fully_shard

    torch.manual_seed(0)
    reference = Llama(CFG)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    dp_names = tuple(n for n in names if n != "tp")
    dp_mesh = mesh[dp_names] if len(dp_names) > 1 else mesh[dp_names[0]]
    for block in model.blocks:
        if use_tp:
            parallelize_module(block, mesh["tp"], tensor_parallel_plan())
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)

    # Each data-parallel coordinate takes its slice of the global batch; TP peers share it.
    dp_rank = 0
    for name in dp_names:
        dp_rank = dp_rank * mesh[name].size() + mesh[name].get_local_rank()
    dp_size = dp_mesh.size()
    per_rank = 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    records = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, CFG.vocab_size, (per_rank * dp_size, CFG.seq_len + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        loss = model.loss(x[rows], y[rows])
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        opt.zero_grad()
        ref_loss = reference.loss(x, y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        records.append(
            {
                "loss": global_loss.item() / world_size,
                "ref_loss": ref_loss.item(),
                "norm": norm.item(),
                "ref_norm": ref_norm.item(),
            }
        )
    worst = max(
        ((p.full_tensor() - r).abs().max().item(), name)
        for (name, p), r in zip(model.named_parameters(), reference.parameters())
    )
    meshes = sorted({tuple(p.device_mesh.mesh_dim_names) for p in model.parameters()})
    return {"records": records, "worst": worst, "meshes": meshes}


def _assert_matches(result: dict) -> None:
    for step, r in enumerate(result["records"]):
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), f"loss at step {step}"
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), f"grad norm at step {step}"
    diff, name = result["worst"]
    assert diff <= PARAM_ATOL, f"{name} differs by {diff:.3g}"


def test_fsdp_with_tensor_parallel_2x2(worlds):
    result = worlds.run(4, train_2d, (2, 2), ("dp", "tp"), True)[0]
    _assert_matches(result)
    # TP weights live on the combined mesh; norms and embeddings on the data-parallel mesh.
    assert result["meshes"] == [("dp",), ("dp", "tp")]


def test_hsdp_2x2(worlds):
    result = worlds.run(4, train_2d, (2, 2), ("replicate", "shard"), False)[0]
    _assert_matches(result)
    assert result["meshes"] == [("replicate", "shard")]


@pytest.mark.slow  # the only 8-rank world: its start and teardown dominate
def test_hsdp_with_tensor_parallel_2x2x2(worlds):
    """3-D: replicate x shard x tp on 8 real ranks (tiny model; ~10 s on 2 cores)."""
    result = worlds.run(8, train_2d, (2, 2, 2), ("replicate", "shard", "tp"), True)[0]
    _assert_matches(result)
    assert result["meshes"] == [("replicate", "shard"), ("replicate", "shard", "tp")]


def _whole_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fsdp2 import FSDPUsageError, fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    block = Llama(CFG).blocks[0]
    parallelize_module(block, mesh["tp"], tensor_parallel_plan())
    before = {n: p for n, p in block.named_parameters()}
    try:
        fully_shard(block, mesh=mesh)  # the TP dim again: meant mesh["dp"]
    except FSDPUsageError as e:
        unchanged = all(p is before[n] for n, p in block.named_parameters())
        return str(e), unchanged, type(block).__name__
    return None


def test_mesh_misuse_is_explained_and_changes_nothing(worlds):
    import re

    result = worlds.run(4, _whole_mesh)[0]
    assert result is not None, "expected FSDPUsageError"
    text, unchanged, class_name = result
    assert re.search("already a DTensor on mesh dims .*tp.*fully_shard composes with tensor parallelism", text), text
    assert unchanged and class_name == "Block"


def _checkpoint_across_meshes(rank, world_size, path):
    """Save from TP+FSDP on (dp=2, tp=2), load into FSDP on 4 ranks, save again, load back into 2-D."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fsdp2 import checkpoint, fully_shard

    def build_2d(seed):
        torch.manual_seed(seed)
        model = Llama(CFG)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], tensor_parallel_plan())
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"])

    def build_1d(seed):
        torch.manual_seed(seed)
        model = Llama(CFG)
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def full(model):
        return {k: v.full_tensor() for k, v in model.state_dict().items()}

    source = build_2d(seed=1)
    expected = full(source)
    checkpoint.save(f"{path}/from-2d", source, extra={"step": 3})
    flat = build_1d(seed=2)
    extra = checkpoint.load(f"{path}/from-2d", flat)
    after_1d = full(flat)
    checkpoint.save(f"{path}/from-1d", flat)
    back = build_2d(seed=3)
    checkpoint.load(f"{path}/from-1d", back)
    after_2d = full(back)
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in expected)  # noqa: E731
    return extra["step"], same(after_1d, expected), same(after_2d, expected)


def test_checkpoint_2d_to_1d_and_back(worlds, tmp_path):
    step, to_1d, back_to_2d = worlds.run(4, _checkpoint_across_meshes, str(tmp_path))[0]
    assert step == 3
    assert to_1d, "TP+FSDP checkpoint loaded into a 1-D FSDP model differs"
    assert back_to_2d, "1-D checkpoint loaded back into TP+FSDP differs"


def _load_full_state_into_2d(rank, world_size):
    """load_state_dict with full tensors into TP+FSDP: each rank keeps exactly its own box."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fsdp2 import fully_shard

    torch.manual_seed(1)
    source = Llama(CFG)
    torch.manual_seed(2)
    model = Llama(CFG)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], tensor_parallel_plan())
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.load_state_dict(source.state_dict())
    return [k for k, v in model.state_dict().items() if not torch.equal(v.full_tensor(), source.state_dict()[k])]


def test_load_full_state_dict_into_tp_fsdp(worlds):
    assert worlds.run(4, _load_full_state_into_2d)[0] == []
