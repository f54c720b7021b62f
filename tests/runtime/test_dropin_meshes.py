"""Drop-in on the meshes large runs train on, side by side with PyTorch's FSDP2 (tests/runtime/side_by_side.py).

torchtitan builds every mesh by unflattening one flat world mesh, composes FSDP with tensor and
sequence parallelism, and accumulates gradients over pipeline microbatches without sync. Losses,
parameters and collective counts must be bitwise PyTorch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp

from fsdp2.models import Llama, LlamaConfig
from tests.runtime.side_by_side import (
    CollectiveCounter,
    assert_same_layout,
    assert_same_params,
    llama_sequence_parallel,
    twins,
)

CFG = LlamaConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4, hidden_dim=48)

_PYTORCH_2_13 = hasattr(torch_fsdp, "DataParallelMeshDims")  # its FSDP2's newest public name


def _tp_meshes(kind: str):
    """(data-parallel mesh, TP mesh) of 4 ranks as 2 x 2: slices of one named mesh, or (torchtitan's
    way) of two meshes unflattened from a flat world mesh, whose root names neither dim."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind in ("named", "tp-first"):
        names = ("fsdp", "tp") if kind == "named" else ("tp", "fsdp")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        return mesh["fsdp"], mesh["tp"]
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (2, 2), ("fsdp", "tp"))
    loading = world._unflatten(0, (2, 2), ("batch", "tp"))
    return dense["fsdp"], loading["tp"]


def _tensor_parallel_side_by_side(rank, ws, kind, mixed_precision, microbatches, steps=2):
    """Llama with TP + sequence parallel on the TP mesh, fully_shard on the data-parallel mesh; each
    step accumulates ``microbatches`` backwards, gradient sync off for all but the last."""
    dp_mesh, tp_mesh = _tp_meshes(kind)
    mp = (
        torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else torch_fsdp.MixedPrecisionPolicy()
    )

    def shard(model, fully_shard):
        llama_sequence_parallel(model, tp_mesh)
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)

    theirs, ours = twins(lambda: Llama(CFG), shard)
    assert_same_layout(theirs, ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, CFG.vocab_size, (dp_size * microbatches, CFG.seq_len + 1), generator=g)
        mine = tokens[dp_rank * microbatches : (dp_rank + 1) * microbatches]  # TP peers share their batch
        results = []
        for model, opt in zip((theirs, ours), opts):
            losses = []
            with CollectiveCounter() as comm:
                for micro in range(microbatches):
                    model.set_requires_gradient_sync(micro == microbatches - 1)
                    loss = model.loss(mine[micro : micro + 1, :-1], mine[micro : micro + 1, 1:])
                    loss.backward()
                    losses.append(loss.detach())
            grads = [p.grad.full_tensor() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            results.append((torch.stack(losses), comm.counts, grads))
        (their_losses, their_comm, their_grads), (our_losses, our_comm, our_grads) = results
        assert torch.equal(their_losses, our_losses), (step, their_losses, our_losses)
        assert their_comm == our_comm, (step, their_comm, our_comm)
        for (name, _), a, b in zip(theirs.named_parameters(), their_grads, our_grads):
            assert torch.equal(a, b), f"step {step}: gradient of {name} differs from PyTorch FSDP2"
        assert_same_params(theirs, ours)


@pytest.mark.skipif(not _PYTORCH_2_13, reason="PyTorch < 2.13 cannot join meshes made by unflattening")
@pytest.mark.parametrize("kind", ["unflattened", "named", "tp-first"])
def test_tensor_parallel_on_meshes_made_by_unflattening_like_pytorch(worlds, kind):
    """torchtitan unflattens one world mesh into the FSDP mesh and (separately) the TP mesh; a named
    mesh may also list the TP dim first."""
    worlds.run(4, _tensor_parallel_side_by_side, kind, False, 1)


@pytest.mark.skipif(not _PYTORCH_2_13, reason="PyTorch < 2.13 cannot join meshes made by unflattening")
def test_partial_gradients_summed_over_microbatches_like_pytorch(worlds):
    """Norm weights replicated under sequence parallelism get pending-sum (Partial) gradients in
    bf16; across backwards without sync they add up in the reduce dtype and are reduced once."""
    worlds.run(4, _tensor_parallel_side_by_side, "unflattened", True, 3)


def _tp_mesh_of_another_root(rank, ws):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor

    from fsdp2 import FSDPUsageError, fully_shard

    dp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))["fsdp"]
    # A root listing the ranks in another order: its dims index other devices than dp_mesh's root's.
    tp_mesh = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("batch", "tp"))["tp"]
    model = Llama(CFG)
    llama_sequence_parallel(model, tp_mesh)
    block = model.blocks[0]
    before = dict(block.named_parameters())
    with pytest.raises(FSDPUsageError) as caught:
        fully_shard(block, mesh=dp_mesh)
    unchanged = all(p is before[n] and isinstance(p, DTensor) for n, p in block.named_parameters())
    return str(caught.value), unchanged


def test_tensor_parallel_mesh_of_another_root_is_explained(worlds):
    message, unchanged = worlds.run(4, _tp_mesh_of_another_root)[0]
    assert "attn_norm.weight" in message and "DeviceMesh((tp=2)" in message, message
    assert "shares no root mesh" in message and "Slice the data-parallel and tensor-parallel meshes" in message
    assert unchanged
