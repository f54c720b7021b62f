"""Where every tensor lives when the mesh's device is not the offload device, checked without a GPU.

CI has no accelerator, and on a CPU mesh the compute device and the offload device are the same,
so a tensor put on the wrong one goes unnoticed (CPU offload once crashed on the first GPU run:
"attempting to assign a gradient with device type 'cpu' to a tensor with device type 'cuda'").
Here the mesh's device is ``meta``, standing in for the accelerator, and every tensor is a
FakeTensor (PyTorch's tensors with metadata and no data, which run every op's device checks and
copy between devices). (A fake ``cuda`` device would be closer, but a CPU-only build refuses
indexing on it.) A fake process group stands in for NCCL. A full training step runs with CPU
offload, and the test asserts the device of every sharded parameter, gathered parameter,
and gradient against the policy.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdp2.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=67, seq_len=16, dim=36, n_layers=2, n_heads=3)
ACCELERATOR = torch.device("meta")


@pytest.fixture
def accelerator_mesh(fake_world, monkeypatch):
    """A fake 2-rank world whose mesh is on the stand-in accelerator; yields the mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    # The stand-in's device module, as ``torch.cuda`` is an accelerator's: DTensor's sharding
    # propagation asks it how many devices a host has (torch >= 2.15), nothing else.
    assert getattr(torch, ACCELERATOR.type, None) is None
    monkeypatch.setattr(torch, ACCELERATOR.type, types.SimpleNamespace(device_count=lambda: 2), raising=False)
    fake_world(2)
    return DeviceMesh.from_group(dist.group.WORLD, ACCELERATOR.type)


def _train_one_step(mesh, mp: bool):
    from torch.distributed.tensor import DTensor

    from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True))
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    storage = torch.device("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = GPT(CFG)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        shards = {name: p for name, p in model.named_parameters()}
        for name, p in shards.items():
            assert isinstance(p, DTensor) and p.device == storage and p.to_local().device == storage, (name, p.device)
        tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), device=ACCELERATOR)
        gathered = {}
        # Runs after fsdp2's own pre-forward hook (which is prepended): the gathered parameters.
        model.blocks[0].register_forward_pre_hook(
            lambda m, a: gathered.update({n: p.device for n, p in m.named_parameters()})
        )
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        assert gathered and all(d == ACCELERATOR for d in gathered.values()), gathered
        # The optimizer's state is made like its parameter (zeros_like), so a CPU parameter with a
        # CPU gradient is a CPU optimizer step. (DTensor cannot run the step itself on a meta mesh.)
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.device == storage and p.grad.to_local().device == storage, name


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
def test_cpu_offload_keeps_shards_and_grads_on_cpu_with_an_accelerator_mesh(accelerator_mesh, mp):
    _train_one_step(accelerator_mesh, mp=mp)


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
def test_the_compiled_steps_path_keeps_offloaded_shards_and_grads_on_cpu(accelerator_mesh, mp, monkeypatch):
    """The same step through the path a compiled whole step traces (fsdp2.runtime.traced), run
    eagerly: the shards are moved to the device before the gather and the reduced gradients back
    to the host, where the optimizer steps."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _train_one_step(accelerator_mesh, mp=mp)
