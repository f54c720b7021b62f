"""fsdp2's usage errors are instances of the exception type PyTorch's FSDP2 raises for the same misuse.

Code written against PyTorch catches ``AssertionError``, ``NotImplementedError``,
``RuntimeError`` or ``TypeError`` where PyTorch raises those; fsdp2 raises an ``FSDPUsageError``
(a ValueError, with its own message) that is also that type. Each case runs the same misuse on
PyTorch's ``fully_shard`` and on fsdp2's, in this process on a fake process group (collectives do
nothing). Also here: the gradient reduction at world size 1 divides by nothing, as PyTorch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp2 import FSDPUsageError

WORLD = 4


@pytest.fixture
def fake_rank():
    """``fake_rank(rank)``: this process becomes ``rank`` of a fake world of WORLD ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group leaked into this test process"

    def init(rank: int = 0) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _mesh():
    return init_device_mesh("cpu", (WORLD,))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))


def _with_hooked_weight(cls, model=None):
    model = model if model is not None else _mlp()
    model[-1].weight = nn.Parameter(cls(model[-1].weight.detach().clone()))
    return model


def _applied_twice(fully_shard):
    model = fully_shard(_mlp(), mesh=_mesh())
    fully_shard(model, mesh=_mesh())


def _pre_hook_only(fully_shard):
    from tests.runtime.gather_subclasses import PreOnly

    fully_shard(_with_hooked_weight(PreOnly), mesh=_mesh())


def _pre_hook_of_wrong_arity(fully_shard):
    from tests.runtime.gather_subclasses import WrongArity

    model = fully_shard(_with_hooked_weight(WrongArity), mesh=_mesh())
    model(torch.randn(2, 4))  # PyTorch checks the arity at the first all-gather


def _hooks_on_an_uneven_dim_1_shard(fully_shard):
    from tests.runtime.gather_subclasses import Bf16Gathered

    model = _with_hooked_weight(Bf16Gathered)  # weight (4, 6): 6 columns do not split over 4 ranks
    fully_shard(model, mesh=_mesh(), shard_placement_fn=lambda p: Shard(1) if isinstance(p, Bf16Gathered) else None)
    model(torch.randn(2, 4))


def _hooks_on_a_2d_mesh_without_names(fully_shard):
    from tests.runtime.gather_subclasses import Bf16Gathered

    fully_shard(_with_hooked_weight(Bf16Gathered), mesh=init_device_mesh("cpu", (2, WORLD // 2)))


def _hook_inputs_not_padded(fully_shard):
    from tests.runtime.gather_subclasses import Bf16Gathered

    class Unpadded(Bf16Gathered):
        def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
            return (self._data.to(torch.bfloat16),), None  # this rank's rows only, no padding

    model = fully_shard(_with_hooked_weight(Unpadded, nn.Sequential(nn.Linear(4, 6))), mesh=_mesh())
    model(torch.randn(2, 4))


def _int_reshard_with_several_shard_dims(fully_shard):
    from torch.distributed.fsdp import DataParallelMeshDims

    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("a", "b"))
    fully_shard(_mlp(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("a", "b")), reshard_after_forward=2)


def _shard_dim_out_of_range(fully_shard):
    fully_shard(_mlp(), mesh=_mesh(), shard_placement_fn=lambda p: Shard(5))


def _tensor_parallel_on_the_data_parallel_dim(fully_shard):
    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    model = _mlp()
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh["dp"], [Shard(0)]))
    fully_shard(model, mesh=mesh["dp"])


def _tensor_parallel_on_an_unrelated_mesh(fully_shard):
    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("other",))
    model = _mlp()
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), other, [Shard(0)]))
    fully_shard(model, mesh=mesh["dp"])


def _spmd_shard_dims_not_adjacent(fully_shard):
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Replicate

    mesh = init_device_mesh("cpu", (2, 1, WORLD // 2), mesh_dim_names=("a", "tp", "b"))
    linear = nn.Linear(4, 6)
    for name in ("weight", "bias"):
        setattr(linear, name, nn.Parameter(distribute_tensor(getattr(linear, name).detach(), mesh, [Replicate()] * 3)))
    fully_shard(linear, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("a", "b")))


def _reset_iter_state_off_the_root(fully_shard):
    model = _mlp()
    fully_shard(model[0], mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    model(torch.randn(2, 4))
    model[0].reset_iter_state()


def _forward_on_meta_parameters(fully_shard):
    with torch.device("meta"):
        model = _mlp()
    fully_shard(model, mesh=_mesh())
    model(torch.randn(2, 4))


def _load_state_dict_of_other_shapes(fully_shard):
    model = fully_shard(_mlp(), mesh=_mesh())
    model.load_state_dict({k: torch.zeros(3) for k in model.state_dict()})


def _load_state_dict_missing_a_key(fully_shard):
    model = fully_shard(_mlp(), mesh=_mesh())
    state = model.state_dict()
    del state["0.bias"]
    model.load_state_dict(state)


def _max_input_buffers_not_an_int(fully_shard):
    fully_shard(_mlp(), mesh=_mesh()).set_reduce_scatter_max_input_buffers(1.5)


# name: (the type PyTorch's FSDP2 raises, the misuse, the fake rank to run it on)
CASES = {
    "applied_twice": (AssertionError, _applied_twice, 0),
    "pre_hook_only": (AssertionError, _pre_hook_only, 0),
    "pre_hook_of_wrong_arity": (AssertionError, _pre_hook_of_wrong_arity, 0),
    "hooks_on_an_uneven_dim_1_shard": (NotImplementedError, _hooks_on_an_uneven_dim_1_shard, 0),
    "hooks_on_a_2d_mesh_without_names": (AssertionError, _hooks_on_a_2d_mesh_without_names, 0),
    "hook_inputs_not_padded": (AssertionError, _hook_inputs_not_padded, WORLD - 1),  # the rank holding padding
    "int_reshard_with_several_shard_dims": (NotImplementedError, _int_reshard_with_several_shard_dims, 0),
    "shard_dim_out_of_range": (AssertionError, _shard_dim_out_of_range, 0),
    "tensor_parallel_on_the_data_parallel_dim": (RuntimeError, _tensor_parallel_on_the_data_parallel_dim, 0),
    "tensor_parallel_on_an_unrelated_mesh": (RuntimeError, _tensor_parallel_on_an_unrelated_mesh, 0),
    "spmd_shard_dims_not_adjacent": (RuntimeError, _spmd_shard_dims_not_adjacent, 0),
    "reset_iter_state_off_the_root": (RuntimeError, _reset_iter_state_off_the_root, 0),
    "forward_on_meta_parameters": (RuntimeError, _forward_on_meta_parameters, 0),
    "load_state_dict_of_other_shapes": (RuntimeError, _load_state_dict_of_other_shapes, 0),
    "load_state_dict_missing_a_key": (RuntimeError, _load_state_dict_missing_a_key, 0),
    "max_input_buffers_not_an_int": (TypeError, _max_input_buffers_not_an_int, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_usage_error_is_also_the_type_pytorch_raises(fake_rank, case, capsys):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp2 import fully_shard

    torch_type, misuse, rank = CASES[case]
    fake_rank(rank)
    with pytest.raises(torch_type) as theirs:
        misuse(torch_fully_shard)
    assert not isinstance(theirs.value, FSDPUsageError)
    with pytest.raises(FSDPUsageError) as ours:
        misuse(fully_shard)
    assert isinstance(ours.value, torch_type), f"fsdp2 raised {type(ours.value).__mro__}; PyTorch raises {torch_type}"
    capsys.readouterr()  # PyTorch prints a stack trace with some of its assertions


def test_the_wrong_type_and_a_bad_value_of_max_input_buffers_raise_like_pytorch(fake_rank):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp2 import fully_shard

    fake_rank()
    for shard in (torch_fully_shard, fully_shard):
        model = shard(_mlp(), mesh=_mesh())
        with pytest.raises(TypeError, match="max_input_buffers"):
            model.set_reduce_scatter_max_input_buffers(True)
        with pytest.raises(ValueError, match="max_input_buffers") as error:
            model.set_reduce_scatter_max_input_buffers(0)
        assert not isinstance(error.value, TypeError)


# -- the gradient reduction at world size 1 -------------------------------------------------------


def _divisions_in_backward(fully_shard, mp_policy, force_sum: bool, hsdp: bool) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    divisions: list[str] = []

    class Divisions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "div" in func.overloadpacket.__name__:
                divisions.append(str(func))
            return func(*args, **(kwargs or {}))

    mesh = (
        init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else init_device_mesh("cpu", (1,))
    )
    model = _mlp()
    fully_shard(model[0], mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if force_sum:
        model.set_force_sum_reduction_for_comms(True)
    x = torch.randn(2, 4)
    model(x).sum().backward()  # lazy init
    loss = model(x).sum()
    with Divisions():
        loss.backward()
    assert all(isinstance(p, DTensor) and p.grad is not None for p in model.parameters())
    return divisions


@pytest.mark.parametrize(
    "reduce_dtype, force_sum, hsdp",
    [(None, False, False), (torch.float16, False, False), (None, True, False), (torch.float16, False, True)],
)
def test_no_division_of_gradients_at_world_size_1(reduce_dtype, force_sum, hsdp):
    """Averaging over one rank divides by 1: PyTorch's FSDP2 skips that division, and so does fsdp2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp2 import fully_shard
    from fsdp2.tools.noop_pg import init_noop_process_group

    mp = MixedPrecisionPolicy(param_dtype=reduce_dtype, reduce_dtype=reduce_dtype)
    for shard in (torch_fully_shard, fully_shard):
        init_noop_process_group(1)
        try:
            assert _divisions_in_backward(shard, mp, force_sum, hsdp) == [], shard.__module__
        finally:
            dist.destroy_process_group()
