"""fsdp2 inside code written for PyTorch's FSDP2: frameworks and PyTorch's own FSDP readers.

fsdp2 modules pass ``isinstance(m, torch.distributed.fsdp.FSDPModule)``, so every branch a
framework or PyTorch takes on that check is driven here through the framework's own code (or,
for torchtitan, whose import needs triton, its exact functions reproduced with the source
cited), side by side with PyTorch's FSDP2 on the same gloo world: bitwise-equal losses,
parameters and gradients, equal collective counts. ``fsdp2.install_as_torch_fsdp()`` is checked
on module-level names bound before and after it.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn as nn

from fsdp2.models import GPT
from tests.support.models import CFG, float8_mlp
from tests.support.parity import (
    assert_same_params,
    shard_blocks_then_root,
    step_batch,
    train_side_by_side,
    twins,
    world_mesh,
)


class _CollectiveCounter:
    """Counts the c10d collectives issued inside it (a dispatch mode: it sees PyTorch's FSDP2 and
    fsdp2 alike). Not DTensor's CommDebugMode: its module tracker breaks under pipelining's
    ``autograd.grad`` and across several forwards."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, int] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional"):
                    name = str(func.overloadpacket)
                    counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.counts = counts
        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _comm_counts(fn, into: dict | None = None):
    """``(fn(), {collective: count})``, the counts added to ``into`` if given."""
    with _CollectiveCounter() as counter:
        result = fn()
    counts = into if into is not None else {}
    for op, n in counter.counts.items():
        counts[op] = counts.get(op, 0) + n
    return result, counts


def _assert_same_grads(theirs, ours):
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), f"gradient of {name} differs"


# -- identity -------------------------------------------------------------------------------------


def _identity(rank, ws):
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp._fully_shard._fully_shard as torch_impl

    import fsdp2

    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    for cls in (torch_fsdp.FSDPModule, torch_impl.FSDPModule):
        assert isinstance(ours, cls) and isinstance(ours.blocks[0], cls)
        assert not isinstance(ours.tok_emb, cls)  # not fully_shard'ed itself
    assert isinstance(ours, fsdp2.FSDPModule) and not isinstance(theirs, fsdp2.FSDPModule)
    # Either fully_shard's state() answers the same for an fsdp2 module (frameworks may hold either).
    ours.loss(*step_batch(0, rank, ws)).backward()  # lazy init: the root knows its states
    for state_of in (torch_fsdp.fully_shard.state, fsdp2.fully_shard.state):
        assert [len(s._fsdp_param_groups) for s in state_of(ours)._state_ctx.all_states] == [1, 1, 1]
        assert state_of(ours.tok_emb) is None
        assert state_of(ours) is torch_fsdp.fully_shard.state(ours) is ours._get_fsdp_state()  # one object
    handle = ours.blocks[0].unshard(async_op=True)
    assert isinstance(handle, torch_fsdp.UnshardHandle)
    handle.wait()
    ours.blocks[0].reshard()
    # Slicing a fully_shard'ed container builds the original class (past both FSDPModule classes).
    sequential = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fsdp2.fully_shard(sequential, mesh=world_mesh())
    assert type(sequential[0:1]) is nn.Sequential


def test_fsdp2_modules_are_pytorch_fsdp_modules(worlds):
    worlds.run(2, _identity)


# -- torchtitan ------------------------------------------------------------------------------------
# Reproduced from pytorch/torchtitan, torchtitan/distributed/fsdp.py (functions
# disable_fsdp_gradient_division and set_fsdp_gradient_sync); torchtitan 0.3.0's variant also
# forces SUM reductions. Importing torchtitan needs triton, so the functions are copied in
# behaviour, not imported.


def _torchtitan_disable_fsdp_gradient_division(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


def _torchtitan_set_fsdp_gradient_sync(model_parts, is_last_microbatch: bool) -> None:
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        if not isinstance(part, FSDPModule):
            raise TypeError(f"gradient accumulation needs an FSDPModule, got {type(part).__name__}")
        part.set_is_last_backward(is_last_microbatch)
        part.set_requires_gradient_sync(is_last_microbatch)


def _torchtitan_training(rank, ws):
    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    for model in (theirs, ours):
        _torchtitan_disable_fsdp_gradient_division(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    for step in range(2):
        results = []
        for model in (theirs, ours):
            losses, comm = [], {}
            for micro in range(2):  # torchtitan's gradient accumulation over 2 microbatches
                _torchtitan_set_fsdp_gradient_sync([model], is_last_microbatch=micro == 1)
                x, y = step_batch(10 * step + micro, rank, ws)

                def micro_step(model=model, x=x, y=y):
                    loss = model.loss(x, y)
                    loss.backward()
                    return loss.detach()

                losses.append(_comm_counts(micro_step, comm)[0])
            results.append((losses, comm))
        (their_losses, their_comm), (our_losses, our_comm) = results
        assert all(torch.equal(a, b) for a, b in zip(their_losses, our_losses)), step
        assert their_comm == our_comm, (their_comm, our_comm)
        _assert_same_grads(theirs, ours)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_same_params(theirs, ours)


def test_torchtitan_gradient_division_and_accumulation_like_pytorch(worlds):
    """torchtitan skips modules failing isinstance(m, FSDPModule): before fsdp2 modules passed it,
    fsdp2 kept dividing by the world size (grad_norm halved) and synced every microbatch."""
    worlds.run(2, _torchtitan_training)


# -- Lightning -------------------------------------------------------------------------------------


def _lightning_no_backward_sync(rank, ws):
    from lightning.fabric.strategies.model_parallel import _ParallelBackwardSyncControl

    control = _ParallelBackwardSyncControl()
    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-1) for m in (theirs, ours)]
    for step in range(2):
        counts = []
        for model in (theirs, ours):
            comm = {}
            for micro in range(3):
                x, y = step_batch(10 * step + micro, rank, ws)
                with control.no_backward_sync(model, enabled=micro < 2):  # Fabric's own context
                    _comm_counts(lambda model=model, x=x, y=y: model.loss(x, y).backward(), comm)
            counts.append(comm)
        assert counts[0] == counts[1], counts
        _assert_same_grads(theirs, ours)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_same_params(theirs, ours)


def test_lightning_fabric_no_backward_sync_skips_the_sync_like_pytorch(worlds):
    pytest.importorskip("lightning")
    worlds.run(2, _lightning_no_backward_sync)


# -- accelerate (through the switch) -----------------------------------------------------------------


def _accelerate_prepare(rank, ws):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    import fsdp2

    class _Accelerator:  # the attributes fsdp2_prepare_model reads from accelerate.Accelerator
        def __init__(self):
            self.state = types.SimpleNamespace(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
            self.is_main_process = rank == 0
            self.device = torch.device("cpu")
            self.mixed_precision = "no"
            self.torch_device_mesh = None

    torch.manual_seed(0)
    theirs = GPT(CFG)
    torch.manual_seed(0)
    ours = GPT(CFG)
    fsdp2_prepare_model(_Accelerator(), theirs)
    with fsdp2.install_as_torch_fsdp():
        fsdp2_prepare_model(_Accelerator(), ours)
    assert isinstance(ours, fsdp2.FSDPModule) and not isinstance(theirs, fsdp2.FSDPModule)
    train_side_by_side(theirs, ours, rank, ws, steps=2)


def test_accelerate_fsdp2_prepare_model_uses_fsdp2_under_the_switch(worlds):
    pytest.importorskip("accelerate")
    worlds.run(2, _accelerate_prepare)


# -- PyTorch's own readers of FSDP modules -----------------------------------------------------------


# Each schedule drives 4 stages over 2 pipeline ranks (one Linear each; one stage of two per rank for
# the single-stage schedules), placed as the schedule expects: interleaved (stage i on rank i % 2)
# or in a V (rank 0 holds the first and the last stage).
PIPELINE_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "single", {}),
    "1f1b": ("Schedule1F1B", "single", {}),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "interleaved", {}),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "interleaved", {}),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", "v", {}),
    # torch >= 2.15: a stage's gradient reductions are waited on later in the schedule (pipelining
    # then tells stages' communication contexts apart through the private state).
    "interleaved_1f1b_deferred_wait": ("ScheduleInterleaved1F1B", "interleaved", {"defer_reduce_grad_wait": True}),
}


def _pipeline_stage_layers(placement: str, pp: int) -> dict[int, list[int]]:
    """{stage index: the indices of its layers} on pipeline rank ``pp``."""
    if placement == "single":
        return {pp: [2 * pp, 2 * pp + 1]}
    stages = [pp, pp + 2] if placement == "interleaved" else [pp, 3 - pp]
    return {stage: [stage] for stage in stages}


def _pipeline_side_by_side(rank, ws, schedule_name):
    """2 pipeline ranks x 2 data-parallel ranks: PyTorch's pipeline schedules drive fsdp2's stages
    through their FSDP branch (backwards without sync, one reduction per group at the end) like
    PyTorch's FSDP2 stages: bitwise gradients, the same collectives."""
    import copy

    import torch.distributed.pipelining as pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp2 import fully_shard

    class_name, placement, options = PIPELINE_SCHEDULES[schedule_name]
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    widths = [8, 16, 16, 16, 4]
    layers = [nn.Sequential(nn.Linear(widths[i], widths[i + 1]), nn.Tanh()) for i in range(4)]
    mine = _pipeline_stage_layers(placement, pp)
    n_stages = 4 if placement != "single" else 2
    loss_fn = lambda out, y: (out - y).square().mean()  # noqa: E731
    g = torch.Generator().manual_seed(dp)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(2)]
    parts, counts = [], []
    for shard in (torch_fully_shard, fully_shard):
        stages, modules = [], []
        for index, layer_ids in mine.items():
            part = nn.Sequential(*copy.deepcopy([layers[i] for i in layer_ids]))
            for module in [m for m in part.modules() if isinstance(m, nn.Linear)] + [part]:
                shard(module, mesh=mesh["dp"])
            stages.append(
                pipelining.PipelineStage(part, index, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
            )
            modules.append(part)
        schedule_class = getattr(pipelining, class_name)
        schedule = schedule_class(
            stages if placement != "single" else stages[0], n_microbatches=4, loss_fn=loss_fn, **options
        )
        step_counts: dict = {}
        for x, y in batches:
            inputs = (x,) if 0 in mine else ()
            kwargs = {"target": y} if n_stages - 1 in mine else {}
            _comm_counts(lambda: schedule.step(*inputs, **kwargs), into=step_counts)
        parts.append(modules)
        counts.append(step_counts)
    assert counts[0] == counts[1], counts  # one reduce-scatter per group and step, not one per microbatch
    for theirs, ours in zip(*parts):
        _assert_same_grads(theirs, ours)
        assert_same_params(theirs, ours)
    return parts[1]  # fsdp2's stage modules on this rank


def _pipelining(rank, ws, schedule_name):
    _pipeline_side_by_side(rank, ws, schedule_name)


def _pipelining_and_gathering_ahead(rank, ws):
    """GPipe, then gathering a stage ahead of its forward, as pipelining variants do through the
    private state."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor

    (ours,) = _pipeline_side_by_side(rank, ws, "gpipe")
    for state in torch_fully_shard.state(ours)._state_ctx.all_states:
        if group := state._fsdp_param_group:  # None for the parameterless root, as in PyTorch
            group.unshard(async_op=True)
            group.wait_for_unshard()
    assert not any(isinstance(p, DTensor) for p in ours.parameters())
    ours.reshard()
    for module in ours.modules():
        if isinstance(module, nn.Linear):
            module.reshard()
    assert all(isinstance(p, DTensor) for p in ours.parameters())


def test_pipelining_drives_fsdp2_stages_like_pytorch(worlds):
    worlds.run(4, _pipelining_and_gathering_ahead)


@pytest.mark.parametrize("schedule_name", [name for name in PIPELINE_SCHEDULES if name != "gpipe"])
def test_pipeline_schedules_drive_fsdp2_stages_like_pytorch(worlds, schedule_name):
    import inspect

    import torch.distributed.pipelining as pipelining

    class_name, _, options = PIPELINE_SCHEDULES[schedule_name]
    accepted = inspect.signature(getattr(pipelining, class_name)).parameters
    if any(option not in accepted for option in options):
        pytest.skip(f"this torch's {class_name} has no {sorted(options)}")
    worlds.run(4, _pipelining, schedule_name)


class _Scorer(nn.Module):
    """A model used through a method other than forward (``score``, like ``generate``)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.proj(x))

    def score(self, x):
        return self.out(torch.tanh(self.proj(x))).sum()


def _register_forward_method(rank, ws):
    from torch.distributed.fsdp import register_fsdp_forward_method

    def shard(model, fully_shard):
        mesh = world_mesh()
        fully_shard(model.proj, mesh=mesh)
        fully_shard(model, mesh=mesh)

    theirs, ours = twins(_Scorer, shard)
    for model in (theirs, ours):
        register_fsdp_forward_method(model, "score")  # PyTorch's function, on both
    opts = [torch.optim.SGD(m.parameters(), lr=1e-1) for m in (theirs, ours)]
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        results = [_comm_counts(lambda m=m: _score_step(m, x)) for m in (theirs, ours)]
        assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1], results
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_same_params(theirs, ours)


def _score_step(model, x):
    loss = model.score(x)
    loss.backward()
    return loss.detach()


def test_pytorch_register_fsdp_forward_method_works_on_fsdp2_modules(worlds):
    worlds.run(2, _register_forward_method)


def _memory_tracker(rank, ws):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from fsdp2 import FSDPUsageError

    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    tracker = FSDPMemTracker(ours)
    with pytest.raises(FSDPUsageError, match=r"fsdp2_mem_tracker\..*reads FSDPState\._pre_forward_hook_handle"):
        with tracker:
            pass
    train_side_by_side(theirs, ours, rank, ws, steps=1)  # the model still trains, untouched


def test_pytorch_memory_tracker_refuses_fsdp2_modules_naming_the_call(worlds):
    worlds.run(2, _memory_tracker)


def _dcp_state_dict(rank, ws):
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    train_side_by_side(theirs, ours, rank, ws, steps=1)
    their_sd, our_sd = get_model_state_dict(theirs), get_model_state_dict(ours)
    assert list(their_sd) == list(our_sd)
    for key in their_sd:
        assert torch.equal(their_sd[key].full_tensor(), our_sd[key].full_tensor()), key
    full = get_model_state_dict(
        theirs, options=torch.distributed.checkpoint.state_dict.StateDictOptions(full_state_dict=True)
    )
    set_model_state_dict(
        ours, full, options=torch.distributed.checkpoint.state_dict.StateDictOptions(full_state_dict=True)
    )
    assert_same_params(theirs, ours)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ours.loss(*step_batch(0, rank, ws)).backward()
    opt.step()
    assert get_optimizer_state_dict(ours, opt)["state"]


def test_dcp_state_dict_helpers_on_fsdp2_modules(worlds):
    worlds.run(2, _dcp_state_dict)


def test_pytorch_private_state_members_fsdp2_lacks_raise_naming_the_caller():
    from fsdp2.runtime.torch_view import TorchStateView, UnsupportedTorchInternal

    view = TorchStateView(state=None)
    with pytest.raises(UnsupportedTorchInternal, match=r"test_frameworks\..* reads FSDPState\._training_state"):
        view._training_state
    with pytest.raises(UnsupportedTorchInternal, match=r"sets FSDPState\._pre_forward_hook_handle"):
        view._pre_forward_hook_handle = None
    assert not hasattr(view, "_anything")  # hasattr probes still answer


# -- the switch ------------------------------------------------------------------------------------


def test_switch_rebinds_names_bound_before_and_after_and_undoes():
    import torch.distributed._composable.fsdp as composable
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp._fully_shard as torch_private

    import fsdp2

    theirs = torch_fsdp.fully_shard
    framework = types.ModuleType("fake_framework")  # a framework that imported fully_shard at import time
    exec(
        "from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method\n"
        "from torch.distributed._composable.fsdp import fully_shard as shard_it\n"
        "table = {'fully_shard': fully_shard}\n",
        framework.__dict__,
    )
    sys.modules["fake_framework"] = framework
    # A PyTorch module outside FSDP2's import paths that binds fully_shard (pipelining's stage did
    # up to torch 2.14): a stand-in, so the rule is checked on every release.
    torch_reader = types.ModuleType("torch.distributed._fsdp2_switch_test_reader")
    torch_reader.fully_shard = theirs
    sys.modules[torch_reader.__name__] = torch_reader
    try:
        with fsdp2.install_as_torch_fsdp() as switch:
            assert switch.installed
            assert framework.fully_shard is fsdp2.fully_shard and framework.shard_it is fsdp2.fully_shard
            assert framework.register_fsdp_forward_method is fsdp2.register_fsdp_forward_method
            for module in (torch_fsdp, torch_private, composable):
                assert module.fully_shard is fsdp2.fully_shard, module.__name__
            assert torch_fsdp.share_comm_ctx is fsdp2.share_comm_ctx
            from torch.distributed.fsdp import fully_shard as imported_after

            assert imported_after is fsdp2.fully_shard
            # Documented limits: a dict entry is not a module-level name; PyTorch's own modules
            # outside its import paths keep PyTorch's function (they only read fully_shard.state).
            assert framework.table["fully_shard"] is theirs
            assert torch_reader.fully_shard is theirs
            fsdp2.install_as_torch_fsdp()  # again: no harm
            assert torch_fsdp.fully_shard is fsdp2.fully_shard
        assert not switch.installed
        for module in (torch_fsdp, torch_private, composable, framework):
            assert module.fully_shard is theirs, module.__name__
        assert framework.shard_it is theirs and torch_fsdp.share_comm_ctx is not fsdp2.share_comm_ctx
        assert torch_fsdp.MixedPrecisionPolicy is fsdp2.MixedPrecisionPolicy  # never needed switching
    finally:
        fsdp2.uninstall_as_torch_fsdp()
        del sys.modules[torch_reader.__name__]
        del sys.modules["fake_framework"]


def test_uninstall_leaves_a_name_rebound_since_alone():
    import torch.distributed.fsdp as torch_fsdp

    import fsdp2

    theirs = torch_fsdp.fully_shard
    framework = types.ModuleType("fake_framework_2")
    framework.fully_shard = theirs
    sys.modules["fake_framework_2"] = framework
    try:
        fsdp2.install_as_torch_fsdp()
        sentinel = object()
        framework.fully_shard = sentinel  # the framework rebinds it itself meanwhile
        fsdp2.uninstall_as_torch_fsdp()
        assert framework.fully_shard is sentinel and torch_fsdp.fully_shard is theirs
    finally:
        fsdp2.uninstall_as_torch_fsdp()
        del sys.modules["fake_framework_2"]


# -- PEFT adapters on a frozen Hugging Face model ------------------------------------------------------
# A frozen base weight is read by backward for its input's gradient after every trainable
# parameter of its block has its gradient (LoRA's q_proj: lora_A, lora_B, then the base layer);
# a group that ended its backward on its parameters' gradients alone freed that weight first.

_PEFT_ADAPTERS = ("lora", "dora", "ia3")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def _peft_model(adapter: str):
    from peft import IA3Config, LoraConfig, get_peft_model

    config = {
        "lora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
        "dora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True),
        "ia3": lambda: IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    }[adapter]()
    model = get_peft_model(_tiny_llama(), config)
    for name, p in model.named_parameters():  # LoRA's B starts at zero: give every adapter weight a value
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def _shard_peft(model, fully_shard, **kwargs):
    mesh = world_mesh()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _token_batch(step, rank, ws):
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, 97, (2 * ws, 16), generator=g)
    return ids[2 * rank : 2 * rank + 2]


def _peft_steps(model, opt, steps, rank, ws, micro=2, first_step=0):
    """``steps`` optimizer steps of ``micro`` microbatches (the gradient synced on the last only)
    and clipping; per step: (losses, grad norm, {collective: count})."""
    trace = []
    for step in range(first_step, first_step + steps):
        losses, comm = [], {}
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            ids = _token_batch(10 * step + m, rank, ws)

            def micro_step(ids=ids):
                loss = model(input_ids=ids, labels=ids).loss / micro
                loss.backward()
                return loss.detach()

            losses.append(_comm_counts(micro_step, comm)[0])
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.5)
        opt.step()
        opt.zero_grad()
        trace.append((losses, norm.full_tensor() if hasattr(norm, "full_tensor") else norm, comm))
    return trace


def _trainable_adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _peft_side_by_side(rank, ws, adapter, mixed_precision):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kwargs = (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if mixed_precision
        else {}
    )
    theirs, ours = twins(lambda: _peft_model(adapter), lambda m, fs: _shard_peft(m, fs, **kwargs))
    their_trace = _peft_steps(theirs, _trainable_adamw(theirs), 3, rank, ws)
    our_opt = _trainable_adamw(ours)
    our_trace = _peft_steps(ours, our_opt, 3, rank, ws)
    for step, ((their_losses, their_norm, their_comm), (our_losses, our_norm, our_comm)) in enumerate(
        zip(their_trace, our_trace)
    ):
        assert all(torch.equal(a, b) for a, b in zip(their_losses, our_losses)), (step, their_losses, our_losses)
        assert torch.equal(their_norm, our_norm), (step, their_norm, our_norm)
        assert their_comm == our_comm, (step, their_comm, our_comm)
    assert_same_params(theirs, ours)
    # Frozen parameters carry no gradient and no optimizer state.
    frozen = [p for p in ours.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
    assert len(our_opt.state) == sum(p.requires_grad for p in ours.parameters())


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("adapter", _PEFT_ADAPTERS)
def test_peft_adapters_train_like_pytorch(worlds, adapter, mixed_precision):
    """2-microbatch accumulation without sync on the first, clipping, AdamW on the adapters:
    bitwise losses, grad norms, collective counts and parameters against PyTorch's FSDP2."""
    pytest.importorskip("peft")
    worlds.run(2, _peft_side_by_side, adapter, mixed_precision)


def _peft_resume(rank, ws, path):
    from fsdp2 import fully_shard
    from fsdp2.checkpoint import load, save

    def build():
        torch.manual_seed(0)
        model = _shard_peft(_peft_model("lora"), fully_shard)
        return model, _trainable_adamw(model)

    straight, straight_opt = build()
    _peft_steps(straight, straight_opt, 3, rank, ws)
    first, first_opt = build()
    _peft_steps(first, first_opt, 2, rank, ws)
    save(path, first, first_opt, extra={"step": 2})
    resumed, resumed_opt = build()
    assert load(path, resumed, resumed_opt) == {"step": 2}
    _peft_steps(resumed, resumed_opt, 1, rank, ws, first_step=2)
    assert_same_params(straight, resumed)


def test_peft_lora_checkpoint_resume_is_bitwise(worlds, tmp_path):
    pytest.importorskip("peft")
    worlds.run(2, _peft_resume, str(tmp_path / "ckpt"))


# -- torchao float8 training ----------------------------------------------------------------------------


def _gathered_bytes(fn):
    """``(fn(), bytes all-gathered into this rank)`` over the c10d all-gathers ``fn`` issues."""
    from torch.utils._python_dispatch import TorchDispatchMode

    total = [0]

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional") and "gather" in str(func.overloadpacket):
                outputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                for out in outputs:
                    for t in out if isinstance(out, (list, tuple)) else [out]:
                        total[0] += t.numel() * t.element_size()
            return func(*args, **(kwargs or {}))

    with Mode():
        result = fn()
    return result, total[0]


def _float8_side_by_side(rank, ws):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    def shard(model, fully_shard, float8_all_gather):
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather))
        for index in (0, 2):
            fully_shard(model[index], mesh=world_mesh())
        fully_shard(model, mesh=world_mesh())
        return model

    # PyTorch's FSDP2 cannot all-gather float8 over gloo ("Invalid scalar type"): it runs without.
    theirs, ours = twins(float8_mlp, lambda m, fs: shard(m, fs, fs.__module__.startswith("fsdp2")))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        results = []
        for model, opt in zip((theirs, ours), opts):

            def train_step(model=model, opt=opt):
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss.detach()

            results.append(_gathered_bytes(train_step))
        precompute_float8_dynamic_scale_for_fsdp(ours)
        (their_loss, their_bytes), (our_loss, our_bytes) = results
        assert torch.equal(their_loss, our_loss), (step, their_loss, our_loss)
        assert our_bytes < their_bytes, (our_bytes, their_bytes)  # the float8 weights travel as bytes
    assert_same_params(theirs, ours)


def test_torchao_float8_all_gather_equals_pytorch_without_it(worlds):
    """Float8 training with ``enable_fsdp_float8_all_gather=True`` runs on gloo (fsdp2 gathers the
    float8 payload as bytes) and equals PyTorch's FSDP2 with the bf16/fp32 all-gather bitwise:
    torchao casts the same values to float8 before or after the all-gather."""
    pytest.importorskip("torchao")
    worlds.run(2, _float8_side_by_side)
