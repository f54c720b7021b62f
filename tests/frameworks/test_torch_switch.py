"""``install_as_torch_fsdp`` with-blocks nest; one model is sharded by one implementation.

fsdp2 and PyTorch's FSDP2 each refuse, naming both modules, a model that mixes them (in either
order, or both on one module); fsdp2's ``register_fsdp_forward_method`` / ``share_comm_ctx``
hand modules PyTorch sharded to PyTorch's own. In this process: a fake world (collectives do
nothing) for the refusals, a one-rank gloo world where numbers are compared.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2 import FSDPUsageError
from fsdp2.runtime.fsdp_module import managed_by_pytorch

PYTORCH_FULLY_SHARD = torch_fsdp.fully_shard


@pytest.fixture
def switch_off_after():
    """Whatever a test does, the switch is off when it ends."""
    yield
    fsdp2.uninstall_as_torch_fsdp()
    assert torch_fsdp.fully_shard is PYTORCH_FULLY_SHARD


# -- nesting ----------------------------------------------------------------------------------------


def test_an_inner_with_block_leaves_the_outer_switch_on(switch_off_after):
    with fsdp2.install_as_torch_fsdp() as switch:
        with fsdp2.install_as_torch_fsdp():
            assert torch_fsdp.fully_shard is fsdp2.fully_shard
        assert switch.installed and torch_fsdp.fully_shard is fsdp2.fully_shard  # still the outer block's
        with fsdp2.install_as_torch_fsdp():
            with fsdp2.install_as_torch_fsdp():
                pass
            assert torch_fsdp.fully_shard is fsdp2.fully_shard
        assert torch_fsdp.register_fsdp_forward_method is fsdp2.register_fsdp_forward_method
    assert not switch.installed and torch_fsdp.fully_shard is PYTORCH_FULLY_SHARD


def test_a_with_block_inside_a_plain_install_leaves_it_on(switch_off_after):
    installed = fsdp2.install_as_torch_fsdp()
    assert installed.installed
    with fsdp2.install_as_torch_fsdp():
        pass
    assert installed.installed and torch_fsdp.fully_shard is fsdp2.fully_shard  # the plain call's, until uninstall
    fsdp2.uninstall_as_torch_fsdp()
    assert not installed.installed and torch_fsdp.fully_shard is PYTORCH_FULLY_SHARD


def test_the_switch_object_as_a_with_block_nests_too(switch_off_after):
    from fsdp2.torch_switch import _SWITCH as switch

    with switch:
        with switch:
            assert torch_fsdp.fully_shard is fsdp2.fully_shard
        assert switch.installed
    assert not switch.installed and torch_fsdp.fully_shard is PYTORCH_FULLY_SHARD


# -- one model, one implementation ------------------------------------------------------------------


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))


def _shard_blocks(model, shard):
    for layer in (model[0], model[2]):
        shard(layer, mesh=_mesh())


def test_fsdp2_blocks_under_a_pytorch_root_are_refused_naming_both(fake_world):
    fake_world(2)
    model = _mlp()
    _shard_blocks(model, fsdp2.fully_shard)
    with pytest.raises(
        FSDPUsageError,
        match=r"PyTorch's torch.distributed.fsdp.fully_shard\(Sequential\): its submodule "
        r"'0' \(FSDPLinear\) is sharded by fsdp2's fully_shard; one model",
    ):
        PYTORCH_FULLY_SHARD(model, mesh=_mesh())


def test_pytorch_blocks_under_an_fsdp2_root_are_refused_naming_both(fake_world):
    fake_world(2)
    model = _mlp()
    _shard_blocks(model, PYTORCH_FULLY_SHARD)
    params = list(model.parameters())
    with pytest.raises(
        FSDPUsageError,
        match=r"fully_shard\(Sequential\): its submodule '0' \(FSDPLinear\) was sharded "
        r"by PyTorch's torch.distributed.fsdp.fully_shard, and this call on "
        r"Sequential is fsdp2's; one model",
    ) as error:
        fsdp2.fully_shard(model, mesh=_mesh())
    assert "tensor" not in str(error.value)  # not taken for tensor parallelism
    assert type(model) is nn.Sequential and list(model.parameters()) == params  # nothing changed


def test_pytorch_blocks_under_a_root_sharded_after_the_switch_are_refused(fake_world, switch_off_after):
    """A model PyTorch sharded before the switch, finished by framework code after it."""
    fake_world(2)
    model = _mlp()
    _shard_blocks(model, PYTORCH_FULLY_SHARD)
    with fsdp2.install_as_torch_fsdp():
        with pytest.raises(FSDPUsageError, match=r"submodule '0' \(FSDPLinear\) was sharded by PyTorch's"):
            torch_fsdp.fully_shard(model, mesh=_mesh())


def test_both_implementations_on_one_module_are_refused(fake_world):
    fake_world(2)
    theirs_first = PYTORCH_FULLY_SHARD(_mlp(), mesh=_mesh())
    with pytest.raises(
        AssertionError,
        match=r"this FSDPSequential was already sharded by PyTorch's "
        r"torch.distributed.fsdp.fully_shard, and this call is fsdp2's",
    ) as error:
        fsdp2.fully_shard(theirs_first, mesh=_mesh())
    assert isinstance(error.value, FSDPUsageError)
    # The other order: PyTorch's own "applied once" check (fsdp2 lists fully_shard in its registry).
    ours_first = fsdp2.fully_shard(_mlp(), mesh=_mesh())
    with pytest.raises(AssertionError, match="fully_shard has already been applied"):
        PYTORCH_FULLY_SHARD(ours_first, mesh=_mesh())


def test_pytorch_on_a_block_of_an_fsdp2_root_is_refused(fake_world):
    fake_world(2)
    model = fsdp2.fully_shard(_mlp(), mesh=_mesh())
    with pytest.raises(
        FSDPUsageError,
        match=r"fully_shard\(Linear\): its parameters are already sharded by fsdp2's "
        r"fully_shard\(Sequential\)",
    ):
        PYTORCH_FULLY_SHARD(model[0], mesh=_mesh())


def test_pytorch_fully_shard_is_unchanged_for_pytorch_models(fake_world):
    fake_world(2)
    fsdp2.fully_shard(_mlp(), mesh=_mesh())  # fsdp2 modules exist in the process
    model = _mlp()
    _shard_blocks(model, PYTORCH_FULLY_SHARD)
    PYTORCH_FULLY_SHARD(model, mesh=_mesh())
    assert managed_by_pytorch(model)


# -- a model PyTorch sharded, used after the switch ----------------------------------------------------


@pytest.fixture
def one_rank():
    assert not dist.is_initialized(), "a process group leaked into this test process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))

    def score(self, x):
        return self.forward(x).sigmoid()


def _pytorch_sharded_scorer():
    torch.manual_seed(0)
    model = _Scorer()
    PYTORCH_FULLY_SHARD(model.body, mesh=_mesh())
    return PYTORCH_FULLY_SHARD(model, mesh=_mesh())


def test_register_fsdp_forward_method_after_the_switch_on_a_model_pytorch_sharded(one_rank, switch_off_after):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    reference = _pytorch_sharded_scorer()
    torch_fsdp.register_fsdp_forward_method(reference, "score")  # PyTorch's, no switch
    expected = (reference.score(x).detach(), reference(x).detach())

    model = _pytorch_sharded_scorer()
    with fsdp2.install_as_torch_fsdp():
        assert torch_fsdp.register_fsdp_forward_method is fsdp2.register_fsdp_forward_method
        torch_fsdp.register_fsdp_forward_method(model, "score")
        assert torch.equal(model.score(x).detach(), expected[0])
        out = model(x)  # the forward after score() runs as the root's forward
        assert torch.equal(out.detach(), expected[1])
        out.sum().backward()
        assert all(p.grad is not None for p in model.parameters())


def test_share_comm_ctx_after_the_switch_on_models_pytorch_sharded(one_rank, switch_off_after):
    chunks = [_pytorch_sharded_scorer(), _pytorch_sharded_scorer()]
    with fsdp2.install_as_torch_fsdp():
        torch_fsdp.share_comm_ctx(chunks)  # PyTorch's: one comm context for both
    assert chunks[0]._get_fsdp_state()._comm_ctx is chunks[1]._get_fsdp_state()._comm_ctx
    ours = fsdp2.fully_shard(_Scorer(), mesh=_mesh())
    with pytest.raises(FSDPUsageError, match="FSDP_Scorer was sharded by PyTorch's fully_shard, the others by fsdp2's"):
        fsdp2.share_comm_ctx([chunks[0], ours])
