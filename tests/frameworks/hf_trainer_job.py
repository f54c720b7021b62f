"""One rank of a Hugging Face fine-tuning job on CPU gloo, sharded by PyTorch's FSDP2 or by fsdp2.

Run under ``torchrun --nproc-per-node 2`` (tests/frameworks/test_hf_trainers.py does)::

    python -m torch.distributed.run --nproc-per-node 2 tests/frameworks/hf_trainer_job.py \\
        --impl torch|fsdp2 --jobs trainer,trainer_sharded,sft,sft_lora,dpo --out DIR

``--impl fsdp2`` calls ``fsdp2.install_as_torch_fsdp()`` before anything else runs: accelerate's
``fsdp2_prepare_model`` and TRL's ``prepare_fsdp`` (the reference model) then shard with fsdp2's
``fully_shard``; ``--impl torch`` never imports fsdp2. Each job writes ``DIR/<job>.pt`` on rank 0:
the logged losses and grad norms (``trainer.state.log_history``), each rank's exact per-step
losses and its collective counts in forward+backward, the full final parameters, the file
``save_model`` wrote, and how the model was sharded (so a silent fallback to DDP cannot pass). A
job that raises writes ``DIR/<job>.rank<r>.error`` (the traceback), the next job still runs, and
the rank exits with status 1 at the end.

On CPU accelerate keeps ``distributed_type == MULTI_CPU`` and drops the FSDP plugin without a
word (it turns FSDP on only for GPU-type multi-process runs), so the Trainer would train with
DDP. ``_shard_on_cpu`` sets, right after ``Accelerator.__init__``, what accelerate sets on a GPU:
``distributed_type = FSDP`` and ``state.fsdp_plugin``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from pathlib import Path

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_DISABLED": "true",
    "WANDB_MODE": "disabled",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "OMP_NUM_THREADS": "1",
}.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

JOBS = ("trainer", "trainer_sharded", "sft", "sft_lora", "dpo")
VOCAB = 97
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
STEPS = 3  # the TRL jobs; the Trainer job runs 4 (a checkpoint at 2, resumed to 4)


def _shard_on_cpu() -> None:
    """After ``Accelerator.__init__``: what accelerate does on a GPU when given an FSDP plugin."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    init = Accelerator.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.state.distributed_type == DistributedType.MULTI_CPU:
            self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    Accelerator.__init__ = __init__


# -- model, tokenizer, data -------------------------------------------------------------------------


def _model(seed: int = 0, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _tokenizer():
    """A word-level tokenizer over ``<pad> <unk> <s> </s> t4 .. t96`` (made here: nothing from the hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + [f"t{i}" for i in range(len(SPECIALS), VOCAB)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _words(g: torch.Generator, lo: int, hi: int) -> str:
    n = int(torch.randint(lo, hi + 1, (1,), generator=g))
    return " ".join(f"t{int(i)}" for i in torch.randint(len(SPECIALS), VOCAB, (n,), generator=g))


def _lm_rows(n: int = 32, length: int = 16):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(len(SPECIALS), VOCAB, (n, length), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * length] * n})


def _text_rows(n: int = 32):
    from datasets import Dataset

    g = torch.Generator().manual_seed(2)
    return Dataset.from_dict({"text": [_words(g, 6, 20) for _ in range(n)]})


def _preference_rows(n: int = 32):
    from datasets import Dataset

    g = torch.Generator().manual_seed(3)
    # Completions start with a space: the prompt then tokenizes as a prefix of prompt + completion.
    rows = [(_words(g, 3, 8), " " + _words(g, 2, 6), " " + _words(g, 2, 6)) for _ in range(n)]
    return Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})


# -- what a run leaves ------------------------------------------------------------------------------


def _recording(trainer_cls):
    """``trainer_cls`` whose ``training_step`` (forward + backward) keeps this rank's exact loss and
    counts the c10d collectives issued in it (a dispatch mode: it sees both implementations)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class Counter(TorchDispatchMode):
        def __init__(self, counts):
            super().__init__()
            self.counts = counts

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                name = str(func.overloadpacket)
                self.counts[name] = self.counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    class Recording(trainer_cls):
        def training_step(self, model, *args, **kwargs):
            counts: dict[str, int] = {}
            layer_calls = [0]
            # Decoder-layer forwards in this forward + backward: activation checkpointing runs each
            # layer's forward again in backward, however accelerate applied it.
            hooks = [
                m.register_forward_pre_hook(lambda *_: layer_calls.__setitem__(0, layer_calls[0] + 1))
                for m in model.modules()
                if isinstance(m, LlamaDecoderLayer)
            ]
            try:
                with Counter(counts):
                    loss = super().training_step(model, *args, **kwargs)
            finally:
                for hook in hooks:
                    hook.remove()
            self.__dict__.setdefault("step_losses", []).append(loss.detach().clone())
            self.__dict__.setdefault("step_comms", []).append(counts)
            self.__dict__.setdefault("step_layer_calls", []).append(layer_calls[0])
            return loss

    Recording.__name__ = Recording.__qualname__ = f"Recording{trainer_cls.__name__}"
    return Recording


def _sharding(trainer) -> dict:
    """How the prepared model was sharded: evidence read off the objects, compared by the test."""
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule as TorchFSDPModule
    from torch.distributed.tensor import DTensor
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = trainer.model_wrapped if trainer.model_wrapped is not None else trainer.model
    params = dict(model.named_parameters())
    fsdp_modules = [name for name, m in model.named_modules() if isinstance(m, TorchFSDPModule)]
    # The FSDP unit whose parameters each decoder layer's are: the layer itself, or (accelerate
    # 1.16 and later, under activation checkpointing) the checkpoint wrapper around it.
    layer_units = {}
    for name, m in model.named_modules():
        if isinstance(m, LlamaDecoderLayer):
            enclosing = [u for u in fsdp_modules if u == "" or name == u or name.startswith(u + ".")]
            layer_units[name] = max(enclosing, key=len)  # the innermost: the one whose hooks gather it
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "is_fsdp_enabled": bool(trainer.is_fsdp_enabled),
        "accelerator_is_fsdp2": bool(trainer.accelerator.is_fsdp2),
        "really_fsdp": trainer.accelerator.distributed_type == DistributedType.FSDP,
        "root_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(model).__mro__],
        "fsdp_modules": fsdp_modules,
        "layer_units": layer_units,
        "params": len(params),
        "dtensor_params": sum(isinstance(p, DTensor) for p in params.values()),
        "mesh_sizes": sorted({p.device_mesh.size() for p in params.values() if isinstance(p, DTensor)}),
        "fsdp2_imported": "fsdp2" in sys.modules,
    }


def _full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _record(trainer) -> dict:
    logged = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    losses = torch.stack(trainer.step_losses)
    every_rank = [torch.empty_like(losses) for _ in range(dist.get_world_size())]
    dist.all_gather(every_rank, losses)
    return {
        "steps": [e["step"] for e in logged],
        "losses": [e["loss"] for e in logged],
        "grad_norms": [e.get("grad_norm") for e in logged],
        "log": logged,  # every logged value of every step (TRL adds entropy, token accuracy, DPO rewards...)
        "rank_losses": torch.stack(every_rank),
        "comm": trainer.step_comms,
        "layer_calls": trainer.step_layer_calls,
        "global_step": trainer.state.global_step,
    }


def _args(config_cls, out: Path, **kwargs):
    common = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=1e-2,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        fsdp=True,
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "reshard_after_forward": True,
            "state_dict_type": "FULL_STATE_DICT",
        },
    )
    common.update(kwargs)
    return config_cls(**common)


# -- the jobs ----------------------------------------------------------------------------------------


def _trainer(out: Path, state_dict_type: str, save_model: bool, activation_checkpointing: bool = False) -> dict:
    """transformers.Trainer, 4 steps with a checkpoint at step 2 (``state_dict_type`` picks its
    format), then a model with other weights resumed from that checkpoint to step 4."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    cls = _recording(Trainer)
    run_dir = out / "run"
    fsdp_config = {
        "version": 2,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "reshard_after_forward": True,
        "state_dict_type": state_dict_type,
        "activation_checkpointing": activation_checkpointing,
    }
    args = _args(
        TrainingArguments, run_dir, max_steps=4, save_strategy="steps", save_steps=2, fsdp_config=dict(fsdp_config)
    )
    trainer = cls(model=_model(), args=args, train_dataset=_lm_rows(), data_collator=default_data_collator)
    trainer.train()
    result = _record(trainer)
    result["sharding"] = _sharding(trainer)
    result["params"] = _full_params(trainer.model)
    if save_model:
        from safetensors.torch import load_file

        trainer.save_model(str(out / "saved"))
        dist.barrier()
        result["saved"] = load_file(str(out / "saved" / "model.safetensors"))
    result["checkpoint_files"] = sorted(
        str(p.relative_to(run_dir / "checkpoint-2")) for p in (run_dir / "checkpoint-2").rglob("*") if p.is_file()
    )

    resumed = cls(
        model=_model(seed=1),  # other weights: the checkpoint must replace them all
        args=_args(TrainingArguments, out / "resumed", max_steps=4, fsdp_config=dict(fsdp_config)),
        train_dataset=_lm_rows(),
        data_collator=default_data_collator,
    )
    resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-2"))
    result["resumed"] = _record(resumed)
    result["resumed"]["sharding"] = _sharding(resumed)
    result["resumed"]["params"] = _full_params(resumed.model)
    return result


def job_trainer(out: Path) -> dict:
    """Full state dicts (the default): checkpoints hold pytorch_model_fsdp.bin and optimizer.bin
    gathered to rank 0, and ``save_model`` writes model.safetensors."""
    return _trainer(out, "FULL_STATE_DICT", save_model=True)


def job_trainer_sharded(out: Path) -> dict:
    """Sharded state dicts: checkpoints through torch.distributed.checkpoint (each rank its shards);
    and FSDP's activation checkpointing (accelerate wraps each decoder layer in PyTorch's
    checkpoint_wrapper before sharding it)."""
    return _trainer(out, "SHARDED_STATE_DICT", save_model=False, activation_checkpointing=True)


def _sft(out: Path, lora: bool) -> dict:
    from trl import SFTConfig, SFTTrainer

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        )
    name = "sft_lora" if lora else "sft"
    args = _args(SFTConfig, out / name, max_steps=STEPS, max_length=32, dataset_num_proc=None)
    # Plain SFT ties the input and output embeddings (accelerate shards them as one unit with the
    # final norm), the LoRA run keeps them apart.
    trainer = _recording(SFTTrainer)(
        model=_model(tied=not lora),
        args=args,
        train_dataset=_text_rows(),
        processing_class=_tokenizer(),
        peft_config=peft_config,
    )
    trainer.train()
    result = _record(trainer)
    result["sharding"] = _sharding(trainer)
    result["params"] = _full_params(trainer.model)
    result["trainable"] = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    if lora:  # the frozen base weights (PEFT's names: base_model.model.X, q_proj.base_layer) kept their values
        initial = dict(_model(tied=False).named_parameters())
        base = {
            n.replace("base_model.model.", "").replace(".base_layer", ""): p
            for n, p in result["params"].items()
            if "lora_" not in n
        }
        result["frozen_unchanged"] = base.keys() == initial.keys() and all(
            torch.equal(p, initial[n]) for n, p in base.items()
        )
    # save_model under FSDP: accelerate gathers the full state dict; PEFT keeps the adapter's.
    trainer.save_model(str(out / name / "saved"))
    dist.barrier()
    from safetensors.torch import load_file

    saved = "adapter_model.safetensors" if lora else "model.safetensors"
    result["saved"] = load_file(str(out / name / "saved" / saved))
    result["activation_checkpointing"] = bool(args.activation_checkpointing)  # TRL's default: on
    return result


def job_sft(out: Path) -> dict:
    return _sft(out, lora=False)


def job_sft_lora(out: Path) -> dict:
    return _sft(out, lora=True)


def job_dpo(out: Path) -> dict:
    """DPOTrainer with an explicit reference model (TRL shards it with its own ``prepare_fsdp``)."""
    from trl import DPOConfig, DPOTrainer

    args = _args(DPOConfig, out / "dpo", max_steps=STEPS, max_length=32, beta=0.1, dataset_num_proc=None)
    trainer = _recording(DPOTrainer)(
        model=_model(), ref_model=_model(), args=args, train_dataset=_preference_rows(), processing_class=_tokenizer()
    )
    trainer.train()
    result = _record(trainer)
    result["sharding"] = _sharding(trainer)
    ref = trainer.ref_model
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule as TorchFSDPModule
    from torch.distributed.tensor import DTensor

    result["ref_sharding"] = {
        "root_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(ref).__mro__],
        "is_fsdp": isinstance(ref, TorchFSDPModule),
        "dtensor_params": sum(isinstance(p, DTensor) for p in ref.parameters()),
        "params": sum(1 for _ in ref.parameters()),
    }
    result["params"] = _full_params(trainer.model)
    result["ref_params"] = _full_params(ref)
    initial = dict(_model().named_parameters())
    result["ref_unchanged"] = all(torch.equal(p, initial[n]) for n, p in result["ref_params"].items())
    result["activation_checkpointing"] = bool(args.activation_checkpointing)
    return result


# -- main ---------------------------------------------------------------------------------------------


def _reset_accelerate() -> None:
    """Each Trainer builds its own Accelerator; accelerate's state is a per-process singleton."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=("torch", "fsdp2"), required=True)
    parser.add_argument("--jobs", default=",".join(JOBS))
    parser.add_argument("--out", type=Path, required=True)
    opts = parser.parse_args()
    jobs = [j for j in opts.jobs.split(",") if j]
    unknown = set(jobs) - set(JOBS)
    if unknown:
        parser.error(f"unknown jobs {sorted(unknown)}; known: {', '.join(JOBS)}")

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    if opts.impl == "fsdp2":
        import fsdp2

        fsdp2.install_as_torch_fsdp()
    _shard_on_cpu()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    opts.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for job in jobs:
        try:
            _reset_accelerate()
            result = globals()[f"job_{job}"](opts.out / f"{job}_dirs")
            result["impl"] = opts.impl
            if rank == 0:
                torch.save(result, opts.out / f"{job}.pt")
        except Exception:
            failed.append(job)
            (opts.out / f"{job}.rank{rank}.error").write_text(traceback.format_exc())
            traceback.print_exc()
        # Both ranks finished this job (or raised): the next starts together, or we stop here.
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `import fsdp2` from a checkout
    main()
