"""Fine-tuning through the Hugging Face stack, sharded by PyTorch's FSDP2 and by fsdp2, bitwise.

The ``transformers`` Trainer (``fsdp_config={"version": 2}``: accelerate's FSDP2 plugin) with
full and sharded (torch.distributed.checkpoint) checkpoints, ``save_model`` and a resume; TRL's
``SFTTrainer`` (plain, and with a PEFT LoRA config) and ``DPOTrainer`` with its reference model.
tests/frameworks/hf_trainer_job.py runs every configuration under ``torchrun --nproc-per-node 2`` on CPU gloo
ranks, once with PyTorch's ``fully_shard`` and once under ``fsdp2.install_as_torch_fsdp()``; the
frameworks' own code calls ``fully_shard`` either way. Compared bitwise: every logged value of
every step (loss, grad norm, learning rate, TRL's metrics), each rank's loss, the collectives in
each forward+backward, the full final parameters, what ``save_model`` and the checkpoints wrote,
and the resumed run against the uninterrupted one.

On CPU accelerate drops the FSDP plugin silently and trains with DDP; the job turns FSDP on as
accelerate does on a GPU, and each test first checks that the model really was sharded, by the
implementation it names (DTensor parameters, the FSDP class of the model).
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # two torchrun launches of the Trainer and TRL

for _module in ("transformers", "accelerate", "datasets", "safetensors"):
    pytest.importorskip(_module)

JOB = Path(__file__).resolve().with_name("hf_trainer_job.py")
ROOT = JOB.parents[2]
IMPLS = ("torch", "fsdp2")
NEEDS = {
    "trainer": (),
    "trainer_sharded": (),
    "sft": ("trl", "tokenizers"),
    "sft_lora": ("trl", "tokenizers", "peft"),
    "dpo": ("trl", "tokenizers"),
}
# How each run says what sharded it (the rest of a result must match bitwise).
NOT_COMPARED = {"impl", "root_mro", "fsdp2_imported"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One torchrun launch per implementation, running every configuration whose packages are
    installed: ``{impl: its output folder}`` (a launch that fails leaves its log for the tests)."""
    jobs = [job for job, needs in NEEDS.items() if all(importlib.util.find_spec(m) for m in needs)]
    base = tmp_path_factory.mktemp("hf_trainers")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_DISABLED="true",
        WANDB_MODE="disabled",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    outs = {}
    for impl in IMPLS:
        out = base / impl
        out.mkdir()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(JOB),
            "--impl",
            impl,
            "--jobs",
            ",".join(jobs),
            "--out",
            str(out),
        ]
        with open(out / "log.txt", "w") as log:
            # Its own session: on a timeout the ranks go with torchrun, not left behind in a collective.
            launch = subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                launch.wait(timeout=600)
            except subprocess.TimeoutExpired:
                os.killpg(launch.pid, signal.SIGKILL)
                launch.wait()
                log.write("\n[test_hf_trainers] killed after 600 s\n")
        outs[impl] = out
    return outs


def _result(runs: dict[str, Path], impl: str, job: str) -> dict:
    out = runs[impl]
    errors = sorted(out.glob(f"{job}.rank*.error"))
    if errors:
        pytest.fail(f"{job} under {impl} raised:\n" + "\n".join(e.read_text() for e in errors))
    path = out / f"{job}.pt"
    if not path.exists():
        pytest.fail(f"{job} under {impl} wrote no result; its log ends:\n" + (out / "log.txt").read_text()[-4000:])
    result = torch.load(path, weights_only=False)
    assert result["impl"] == impl
    return result


def _results(runs, job: str) -> tuple[dict, dict]:
    for module in NEEDS[job]:
        pytest.importorskip(module)
    return _result(runs, "torch", job), _result(runs, "fsdp2", job)


def _assert_sharded(sharding: dict, impl: str) -> None:
    """The model trained sharded, by ``impl``: not DDP after a silent fallback, nor the other one."""
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule as TorchFSDPModule

    import fsdp2

    name = lambda cls: f"{cls.__module__}.{cls.__qualname__}"  # noqa: E731
    assert sharding["really_fsdp"] and sharding["distributed_type"] == "DistributedType.FSDP", sharding
    assert sharding["is_fsdp_enabled"] and sharding["accelerator_is_fsdp2"], sharding
    assert sharding["params"] > 0 and sharding["dtensor_params"] == sharding["params"], sharding
    assert sharding["mesh_sizes"] == [2], sharding
    # accelerate's units: the root, the embeddings, each decoder layer, the tail.
    assert sharding["fsdp_modules"][0] == "" and len(sharding["fsdp_modules"]) >= 4, sharding
    mro = sharding["root_mro"]
    assert name(TorchFSDPModule) in mro, mro  # either way a PyTorch FSDPModule (what frameworks test)
    if impl == "fsdp2":
        assert name(fsdp2.FSDPModule) in mro and mro[0].startswith("fsdp2."), mro
    else:
        assert not any(c.startswith("fsdp2.") for c in mro) and not sharding["fsdp2_imported"], mro


def _assert_same(theirs, ours, path: str = "") -> None:
    """Bitwise: tensors by dtype, shape and every bit; floats exactly; everything else by ==."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and theirs.dtype == ours.dtype and theirs.shape == ours.shape, path
        bits = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)  # noqa: E731
        assert torch.equal(bits(theirs), bits(ours)), f"{path} differs"
    elif isinstance(theirs, dict):
        assert sorted(theirs) == sorted(ours), (path, sorted(theirs), sorted(ours))  # json sorts keys
        for key in theirs:
            if key not in NOT_COMPARED:
                _assert_same(theirs[key], ours[key], f"{path}/{key}")
    elif isinstance(theirs, (list, tuple)):
        assert type(theirs) is type(ours) and len(theirs) == len(ours), (path, theirs, ours)
        for i, (a, b) in enumerate(zip(theirs, ours)):
            _assert_same(a, b, f"{path}[{i}]")
    elif isinstance(theirs, float):
        assert isinstance(ours, float) and (theirs == ours or math.isnan(theirs) and math.isnan(ours)), (
            path,
            theirs,
            ours,
        )
    else:
        assert theirs == ours, (path, theirs, ours)


def _assert_trained(result: dict, steps: int) -> None:
    assert result["global_step"] == steps and result["steps"] == list(range(1, steps + 1)), result["steps"]
    assert all(math.isfinite(x) for x in result["losses"] + result["grad_norms"]), result["log"]
    assert result["rank_losses"].shape == (2, len(result["comm"]))
    assert all(c.get("c10d._reduce_scatter_base_", 0) > 0 for c in result["comm"]), result["comm"]  # FSDP's


LAYERS = 2  # hf_trainer_job's Llama


def _assert_activation_checkpointing(result: dict, applied: bool) -> None:
    """Each decoder layer is an FSDP unit of its own (the layer, or the checkpoint wrapper around
    it: accelerate 1.15 shards the wrapped layer, 1.16 the wrapper), and activation checkpointing
    really ran, or really did not: checkpointed layers run their forward again in backward."""
    units = result["sharding"]["layer_units"]
    assert len(units) == LAYERS, units
    for layer, unit in units.items():
        assert unit in (layer, layer.removesuffix("._checkpoint_wrapped_module")) and unit, units
        assert layer.endswith("._checkpoint_wrapped_module") == applied, units
    forwards_per_step = LAYERS * (2 if applied else 1)
    assert result["layer_calls"] == [forwards_per_step] * len(result["comm"]), result["layer_calls"]


def _flat(tree, path: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{path}/{key}").items()}
    return {path: tree}


# -- the Trainer ---------------------------------------------------------------------------------------


def _assert_resumed_like_uninterrupted(result: dict) -> None:
    """Resumed at step 2 from a model with other weights: steps 3 and 4 as in the run that never stopped."""
    resumed = result["resumed"]
    _assert_trained(resumed, 4)
    assert resumed["rank_losses"].shape == (2, 2)  # two steps trained after the resume
    _assert_same(result["log"], resumed["log"], "log")  # steps 1-2 from trainer_state.json, 3-4 trained
    _assert_same(result["rank_losses"][:, 2:], resumed["rank_losses"], "rank_losses")
    _assert_same(result["comm"][2:], resumed["comm"], "comm")
    _assert_same(result["params"], resumed["params"], "params")


def test_trainer_full_state_dict_save_model_and_resume_bitwise_like_pytorch(runs):
    """Trainer, 4 steps, checkpoint at step 2 (pytorch_model_fsdp.bin and optimizer.bin gathered
    to rank 0), save_model's model.safetensors, and a resume from the checkpoint."""
    theirs, ours = _results(runs, "trainer")
    for result, impl in ((theirs, "torch"), (ours, "fsdp2")):
        _assert_sharded(result["sharding"], impl)
        _assert_sharded(result["resumed"]["sharding"], impl)
        _assert_trained(result, 4)
        _assert_resumed_like_uninterrupted(result)
        _assert_activation_checkpointing(result, applied=False)
        _assert_same(result["params"], {k: result["saved"][k] for k in result["params"]}, "saved")
        assert sorted(result["saved"]) == sorted(result["params"])
        assert {"pytorch_model_fsdp.bin", "optimizer.bin", "model.safetensors"} <= set(result["checkpoint_files"])
    _assert_same(theirs, ours)
    checkpoint = Path("trainer_dirs", "run", "checkpoint-2")
    for name in ("pytorch_model_fsdp.bin", "optimizer.bin"):
        files = [torch.load(runs[impl] / checkpoint / name, weights_only=True) for impl in IMPLS]
        _assert_same(*files, name)


def test_trainer_sharded_state_dict_checkpoint_and_resume_bitwise_like_pytorch(runs):
    """As above with SHARDED_STATE_DICT (the checkpoint goes through torch.distributed.checkpoint,
    each rank writing its shards; read back whole, both implementations wrote the same values) and
    FSDP's activation checkpointing (PyTorch's checkpoint_wrapper around each decoder layer)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    theirs, ours = _results(runs, "trainer_sharded")
    for result, impl in ((theirs, "torch"), (ours, "fsdp2")):
        _assert_sharded(result["sharding"], impl)
        _assert_sharded(result["resumed"]["sharding"], impl)
        _assert_trained(result, 4)
        _assert_resumed_like_uninterrupted(result)
        assert {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"} <= set(result["checkpoint_files"])
        _assert_activation_checkpointing(result, applied=True)
        _assert_activation_checkpointing(result["resumed"], applied=True)
    _assert_same(theirs, ours)
    checkpoint = Path("trainer_sharded_dirs", "run", "checkpoint-2")
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        whole = []
        for impl in IMPLS:
            dcp_to_torch_save(runs[impl] / checkpoint / part, runs[impl] / f"{part}.pt")
            whole.append(_flat(torch.load(runs[impl] / f"{part}.pt", weights_only=True)))
        assert len(whole[0]) > 0
        _assert_same(*whole, part)


# -- TRL ---------------------------------------------------------------------------------------------


def test_trl_sft_trainer_bitwise_like_pytorch(runs):
    """SFTTrainer on text through a tokenizer built here, tied embeddings, TRL's default
    activation checkpointing (its recomputation gathers again in backward), save_model."""
    theirs, ours = _results(runs, "sft")
    for result, impl in ((theirs, "torch"), (ours, "fsdp2")):
        _assert_sharded(result["sharding"], impl)
        _assert_trained(result, 3)
        assert result["activation_checkpointing"]
        assert len(result["trainable"]) == len(result["params"])  # full fine-tuning
        assert "lm_head.weight" not in result["params"]  # tied: one parameter
        _assert_same(result["params"], {k: result["saved"][k] for k in result["params"]}, "saved")
        assert "entropy" in result["log"][0] and "mean_token_accuracy" in result["log"][0]
    _assert_same(theirs, ours)


def test_trl_sft_trainer_with_peft_lora_bitwise_like_pytorch(runs):
    """SFTTrainer with a LoRA config (r=4 on q_proj and v_proj): frozen base weights sharded
    beside trainable adapters; only the adapters change; save_model writes the adapter."""
    theirs, ours = _results(runs, "sft_lora")
    for result, impl in ((theirs, "torch"), (ours, "fsdp2")):
        _assert_sharded(result["sharding"], impl)
        _assert_trained(result, 3)
        trainable = result["trainable"]
        assert len(trainable) == 8 and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
        assert result["frozen_unchanged"]
        saved = result["saved"]  # PEFT's names: no adapter name, no base weights
        assert len(saved) == len(trainable)
        _assert_same(
            {n: result["params"][n] for n in trainable},
            {n: saved[n.replace(".default", "")] for n in trainable},
            "saved adapter",
        )
    _assert_same(theirs, ours)


def test_trl_dpo_trainer_with_reference_model_bitwise_like_pytorch(runs):
    """DPOTrainer with an explicit reference model, which TRL shards with its own prepare_fsdp
    (one fully_shard on the root): rewards, log-probs and logits logged each step, bitwise."""
    theirs, ours = _results(runs, "dpo")
    for result, impl in ((theirs, "torch"), (ours, "fsdp2")):
        _assert_sharded(result["sharding"], impl)
        _assert_trained(result, 3)
        ref = result["ref_sharding"]
        assert ref["is_fsdp"] and ref["dtensor_params"] == ref["params"] > 0, ref
        assert any(c.startswith("fsdp2.") for c in ref["root_mro"]) == (impl == "fsdp2"), ref["root_mro"]
        assert result["ref_unchanged"]
        assert {"rewards/chosen", "rewards/margins", "logps/chosen", "logits/rejected"} <= set(result["log"][0])
        assert result["log"][-1]["rewards/margins"] != 0.0  # the policy moved away from the reference
    _assert_same(theirs, ours)
