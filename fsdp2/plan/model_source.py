"""What the planner plans for: a model it can build on meta, its blocks, its batch, its TP plan.

A :class:`ModelSource` comes from (see :func:`model_source`):

- fsdp2's own configs, :class:`~fsdp2.models.GPTConfig` and :class:`~fsdp2.models.LlamaConfig`;
- a preset name (``gpt-1b``, ``llama3-8b``, ``llama3-70b``, ...: :data:`PRESETS`);
- a Hugging Face ``config.json`` of a Llama/Mistral (built as fsdp2's Llama) or GPT-2/GPT-NeoX
  (built as fsdp2's GPT) decoder, read as plain JSON: ``transformers`` is not needed;
- ``"package.module:factory"``: a callable returning an ``nn.Module`` that takes token ids
  ``(batch, seq)``; it is called under ``torch.device("meta")``. Its blocks are the entries of
  its largest ``nn.ModuleList`` unless ``block=`` names their class; the loss is
  ``model.loss(tokens, targets)`` if the model has one, else the sum of its output.

Tensor parallelism is planned for models with a TP plan (fsdp2's Llama: Megatron-style column
then row splits of attention and MLP; or ``tp_plan=`` for a factory). Inside the planner a TP
degree ``t`` is a *TP-local twin*: the same model with every planned Linear cut to one rank's
share (:func:`tensor_parallel_local`), so the estimator and the dry run see exactly the
parameters, activations and FLOPs of one TP rank (the residual stream stays whole, as without
sequence parallelism).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp2.models import GPT, GPTConfig, Llama, LlamaConfig, tensor_parallel_plan
from fsdp2.models import gpt as gpt_module
from fsdp2.models import llama as llama_module


class PlanInputError(ValueError):
    """Bad input to the planner: names what was wrong and how to fix it."""


# Model presets: fsdp2's 1B GPT (benchmarks/bench_fsdp.py) and the Llama 3 shapes.
PRESETS: dict[str, GPTConfig | LlamaConfig] = {
    "gpt-small": GPTConfig(vocab_size=2048, seq_len=128, dim=256, n_layers=4, n_heads=4),
    "gpt-1b": GPTConfig(vocab_size=32000, seq_len=2048, dim=2048, n_layers=18, n_heads=16),
    "llama3-8b": LlamaConfig(
        vocab_size=128256, seq_len=8192, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336
    ),
    "llama3-70b": LlamaConfig(
        vocab_size=128256, seq_len=8192, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28672
    ),
    "llama3-405b": LlamaConfig(
        vocab_size=128256, seq_len=8192, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, hidden_dim=53248
    ),
}


@dataclass
class ModelSource:
    """A model the planner can build on meta at any sequence length, with its blocks and loss."""

    name: str
    build: Callable[[int], nn.Module]  # seq_len -> model (called under the meta device)
    is_block: Callable[[nn.Module], bool]  # the modules given to fully_shard (besides the root)
    vocab_size: int
    tp_plan: Callable[[], dict] | None = None  # per block: {submodule name: ColwiseParallel()/RowwiseParallel()}
    notes: list[str] = field(default_factory=list)  # approximations, printed with the plan
    with_layers: Callable[[int], "ModelSource"] | None = None  # same model, fewer blocks (calibration)
    language_model: bool = False  # the output is logits: the loss is their cross-entropy

    def loss(self, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss, through ``model``'s forward (so wrappers such as DDP see the call)."""
        if self.language_model:
            return F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        if hasattr(model, "loss"):
            return model.loss(tokens, targets)
        out = model(tokens)
        return out if out.numel() == 1 else out.float().sum()

    def inputs(
        self, batch: int, seq_len: int, device: torch.device | str = "meta"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, self.vocab_size, (batch, seq_len + 1), device=device)
        return tokens[:, :-1], tokens[:, 1:]

    def meta_model(self, seq_len: int) -> nn.Module:
        with torch.device("meta"):
            return self.build(seq_len)

    def tp_problem(self, tp: int, model: nn.Module) -> str | None:
        """Why TP degree ``tp`` cannot be planned for ``model`` (None: it can)."""
        if self.tp_plan is None:
            return f"{self.name} has no tensor-parallel plan"
        for block in (m for m in model.modules() if self.is_block(m)):
            for name, style in self.tp_plan().items():
                linear = block.get_submodule(name)
                dim = _split_dim(style)
                size = linear.out_features if dim == 0 else linear.in_features
                if size % tp:
                    return f"{name} has {size} {'outputs' if dim == 0 else 'inputs'}, not divisible by TP {tp}"
            for attn in (m for m in block.modules() if isinstance(m, llama_module.Attention)):
                heads = attn.wk.out_features // attn.head_dim
                if heads % tp:
                    return f"{heads} key/value heads do not split over TP {tp}"
            break  # blocks are alike
        return None


def _split_dim(style: Any) -> int:
    """0 for a column split (output features), 1 for a row split (input features)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, ColwiseParallel):
        return 0
    if isinstance(style, RowwiseParallel):
        return 1
    raise PlanInputError(
        f"tp_plan: only ColwiseParallel and RowwiseParallel on nn.Linear are planned, got {type(style).__name__}"
    )


def tensor_parallel_local(model: nn.Module, is_block: Callable[[nn.Module], bool], plan: dict, tp: int) -> nn.Module:
    """A meta copy of ``model`` in which every planned Linear of every block holds one TP rank's share.

    ColwiseParallel splits a Linear's outputs (weight rows, bias); RowwiseParallel its inputs
    (weight columns; the bias stays whole). Other parameters are untouched (replicated over TP).
    """
    twin = copy.deepcopy(model)
    if tp == 1:
        return twin
    for block in (m for m in twin.modules() if is_block(m)):
        for name, style in plan.items():
            linear = block.get_submodule(name)
            if not isinstance(linear, nn.Linear):
                raise PlanInputError(f"tp_plan: {name} is a {type(linear).__name__}; the planner splits nn.Linear only")
            dim = _split_dim(style)
            out_f, in_f = linear.weight.shape
            shape = (out_f // tp, in_f) if dim == 0 else (out_f, in_f // tp)
            linear.weight = nn.Parameter(torch.empty(shape, device="meta", dtype=linear.weight.dtype))
            if linear.bias is not None and dim == 0:
                linear.bias = nn.Parameter(torch.empty(shape[0], device="meta", dtype=linear.bias.dtype))
            linear.out_features, linear.in_features = shape
    return twin


@dataclass(frozen=True)
class TensorParallelTraffic:
    """What DTensor all-reduces over the TP group in one forward + backward, summed over blocks."""

    forward_elements: int = 0  # per token
    backward_elements: int = 0
    forward_calls: int = 0
    backward_calls: int = 0


def tensor_parallel_traffic(
    model: nn.Module, is_block: Callable[[nn.Module], bool], plan: dict
) -> TensorParallelTraffic:
    """DTensor's Megatron layout: a RowwiseParallel output is a partial sum, all-reduced in forward;
    a ColwiseParallel input is replicated, so its gradient is all-reduced in backward, once per
    column-split Linear (q, k and v each reduce their own)."""
    forward = backward = forward_calls = backward_calls = 0
    for block in (m for m in model.modules() if is_block(m)):
        for name, style in plan.items():
            linear = block.get_submodule(name)
            if _split_dim(style) == 1:
                forward, forward_calls = forward + linear.out_features, forward_calls + 1
            else:
                backward, backward_calls = backward + linear.in_features, backward_calls + 1
    return TensorParallelTraffic(forward, backward, forward_calls, backward_calls)


# -- sources ------------------------------------------------------------------------------------


def from_config(cfg: GPTConfig | LlamaConfig, name: str | None = None, notes: list[str] | None = None) -> ModelSource:
    if isinstance(cfg, LlamaConfig):
        model, block, tp_plan = Llama, llama_module.Block, tensor_parallel_plan
        note = (
            "TP splits the blocks (fsdp2.models.tensor_parallel_plan, no sequence parallelism): the embedding, "
            "output projection and residual stream are whole on every TP rank"
        )
    elif isinstance(cfg, GPTConfig):
        model, block, tp_plan = GPT, gpt_module.Block, None
        note = "fsdp2's GPT fuses q/k/v with a fixed head count: no tensor-parallel plan"
    else:
        raise PlanInputError(f"model config must be a GPTConfig or LlamaConfig, got {type(cfg).__name__}")
    label = name or model.__name__
    return ModelSource(
        name=label,
        build=lambda seq_len: model(dataclasses.replace(cfg, seq_len=seq_len)),
        is_block=lambda m: isinstance(m, block),
        vocab_size=cfg.vocab_size,
        tp_plan=tp_plan,
        notes=list(notes or []) + [note],
        language_model=True,
        with_layers=lambda n: from_config(dataclasses.replace(cfg, n_layers=n), f"{label} ({n} layers)"),
    )


_LLAMA_TYPES = ("llama", "mistral")
_GPT_TYPES = ("gpt2", "gpt_neox")
# Far beyond any published model (widths ~16k-50k, vocabularies ~250k, ~130 layers), and small enough
# that every weight's element and byte counts stay exact in int64 on the meta device.
_MAX_SIZE = 1 << 24
_MAX_LAYERS = 1 << 12  # the planner builds every block on meta: 4096 take about 20 s


def _read_json(path: str) -> Any:
    """The JSON of ``path``, which must be a regular file: a FIFO or device would block or never end."""
    from fsdp2.checkpoint.errors import CheckpointError
    from fsdp2.checkpoint.paths import open_regular, read_text

    fix = "pass the model's config.json (or its folder)"
    try:
        fd, _ = open_regular(path, fix)
        try:
            text = read_text(fd, path, fix)
        finally:
            os.close(fd)
        return json.loads(text)
    except CheckpointError as e:
        raise PlanInputError(str(e)) from None
    except (OSError, ValueError) as e:  # ValueError: not JSON, or a number of more than 4300 digits
        raise PlanInputError(f"cannot read Hugging Face config {path}: {e}") from None
    except RecursionError:
        raise PlanInputError(
            f"cannot read Hugging Face config {path}: nested too deeply to be a model config"
        ) from None


def _size(hf: dict, key: str, path: str, default: Any = None, limit: int = _MAX_SIZE) -> int:
    """``hf[key]`` (or ``default`` if absent) as a size: a whole number from 1 to ``limit``."""
    if key not in hf and default is None:
        raise KeyError(key)
    value = hf.get(key, default)
    if value is None and default is not None:
        value = default  # "n_inner": null means the default, as in transformers
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanInputError(f"{path}: {key} must be a whole number, got {json.dumps(value)}")
    if not 1 <= value <= limit:
        raise PlanInputError(f"{path}: {key}={value} is out of range: it must be from 1 to {limit}")
    return value


def _divides(part: int, part_key: str, whole: int, whole_key: str, path: str) -> None:
    if whole % part:
        raise PlanInputError(f"{path}: {part_key}={part} does not divide {whole_key}={whole}; fix the config")


def from_hf_config(path: str) -> ModelSource:
    """A Hugging Face ``config.json`` of a decoder, as the fsdp2 model with the same shapes.

    Every size is checked (a whole number in range, heads dividing the width) before anything is built.
    """
    hf = _read_json(path)
    if not isinstance(hf, dict):
        raise PlanInputError(f"{path} holds a JSON {type(hf).__name__}, not an object: not a model config")
    kind = hf.get("model_type")
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or str(kind)
    try:
        if kind in _LLAMA_TYPES:
            heads = _size(hf, "num_attention_heads", path)
            dim = _size(hf, "hidden_size", path)
            _divides(heads, "num_attention_heads", dim, "hidden_size", path)
            kv_heads = _size(hf, "num_key_value_heads", path, default=heads)
            _divides(kv_heads, "num_key_value_heads", heads, "num_attention_heads", path)
            if hf.get("head_dim") not in (None, dim // heads):
                raise PlanInputError(
                    f"{path}: head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads; not supported"
                )
            cfg = LlamaConfig(
                vocab_size=_size(hf, "vocab_size", path),
                seq_len=_size(hf, "max_position_embeddings", path, 2048, 1 << 31),
                dim=dim,
                n_layers=_size(hf, "num_hidden_layers", path, limit=_MAX_LAYERS),
                n_heads=heads,
                n_kv_heads=kv_heads,
                hidden_dim=_size(hf, "intermediate_size", path),
                tie_weights=bool(hf.get("tie_word_embeddings", False)),
            )
            return from_config(
                cfg, name, [f"{path}: model_type {kind!r} built as fsdp2's Llama (RMSNorm, rotary, SwiGLU, GQA)"]
            )
        if kind in _GPT_TYPES:
            if kind == "gpt2":
                dim, heads = _size(hf, "n_embd", path), _size(hf, "n_head", path)
                _divides(heads, "n_head", dim, "n_embd", path)
                layers = _size(hf, "n_layer", path, limit=_MAX_LAYERS)
                inner = _size(hf, "n_inner", path, default=4 * dim)
                tie = bool(hf.get("tie_word_embeddings", True))
                positions = _size(hf, "n_positions", path, 1024, 1 << 31)
            else:
                dim, heads = _size(hf, "hidden_size", path), _size(hf, "num_attention_heads", path)
                _divides(heads, "num_attention_heads", dim, "hidden_size", path)
                layers = _size(hf, "num_hidden_layers", path, limit=_MAX_LAYERS)
                inner = _size(hf, "intermediate_size", path)
                tie = bool(hf.get("tie_word_embeddings", False))
                positions = _size(hf, "max_position_embeddings", path, 2048, 1 << 31)
            if inner % dim:
                raise PlanInputError(
                    f"{path}: MLP width {inner} is not a multiple of the model width {dim}; not supported"
                )
            cfg = GPTConfig(
                vocab_size=_size(hf, "vocab_size", path),
                seq_len=positions,
                dim=dim,
                n_layers=layers,
                n_heads=heads,
                mlp_ratio=inner // dim,
                tie_weights=tie,
            )
            return from_config(
                cfg,
                name,
                [
                    f"{path}: model_type {kind!r} built as fsdp2's GPT (learned positions, LayerNorm, GELU MLP; "
                    "q/k/v biases and rotary embeddings not modelled: < 0.1% of the parameters)"
                ],
            )
    except KeyError as e:
        raise PlanInputError(f"{path}: missing field {e.args[0]!r} for model_type {kind!r}") from e
    raise PlanInputError(
        f"{path}: model_type {kind!r} is not supported; "
        f"the planner reads {', '.join(_LLAMA_TYPES + _GPT_TYPES)} configs. "
        "For another architecture pass an importable factory, e.g. --model mypkg.models:build"
    )


def from_factory(spec: str, *, block: str | None = None, tp_plan: Callable[[], dict] | None = None) -> ModelSource:
    """``"package.module:callable"``: the callable builds the model (under the meta device)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise PlanInputError(f"model factory must look like 'package.module:callable', got {spec!r}")
    try:
        factory = functools.reduce(getattr, attr.split("."), importlib.import_module(module_name))
    except (ImportError, AttributeError) as e:
        raise PlanInputError(f"cannot import model factory {spec!r}: {e}") from e
    if not callable(factory):
        raise PlanInputError(f"model factory {spec!r} is not callable")
    with torch.device("meta"):
        probe = factory()
    if not isinstance(probe, nn.Module):
        raise PlanInputError(f"model factory {spec!r} returned {type(probe).__name__}, not an nn.Module")
    return from_module_factory(lambda seq_len: factory(), probe, spec, block=block, tp_plan=tp_plan)


def from_module_factory(
    build: Callable[[int], nn.Module],
    probe: nn.Module,
    name: str,
    *,
    block: str | None = None,
    tp_plan: Callable[[], dict] | None = None,
) -> ModelSource:
    is_block = _block_predicate(probe, block, name)
    embeddings = [m for m in probe.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise PlanInputError(
            f"{name}: no nn.Embedding found; the planner feeds token ids and needs the vocabulary size"
        )
    return ModelSource(
        name=name,
        build=build,
        is_block=is_block,
        vocab_size=embeddings[0].num_embeddings,
        tp_plan=tp_plan,
        notes=[
            f"{name}: blocks = {block or 'modules of the classes in its largest nn.ModuleList'}; "
            "sequence length fixed by the factory's model"
        ],
    )


def _block_predicate(model: nn.Module, block: str | None, name: str) -> Callable[[nn.Module], bool]:
    if block is not None:
        if not any(type(m).__name__ == block for m in model.modules()):
            raise PlanInputError(f"{name}: no module of class {block!r}")
        return lambda m: type(m).__name__ == block
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise PlanInputError(f"{name}: no nn.ModuleList of blocks found; name the block class (block=... / --block)")
    # By class, not identity: the predicate must recognize the blocks of every model the factory builds.
    classes = {type(m) for m in max(lists, key=len)}
    return lambda m: type(m) in classes


def model_source(model: Any, *, block: str | None = None, tp_plan: Callable[[], dict] | None = None) -> ModelSource:
    """Whatever the user named as the model, as a ModelSource (see the module docstring)."""
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, (GPTConfig, LlamaConfig)):
        return from_config(model)
    if isinstance(model, nn.Module):
        if any(not p.is_meta for p in model.parameters()):
            raise PlanInputError("plan(model=nn.Module): build it on the meta device (with torch.device('meta'))")
        return from_module_factory(
            lambda seq_len: copy.deepcopy(model), model, type(model).__name__, block=block, tp_plan=tp_plan
        )
    if isinstance(model, str):
        if model in PRESETS:
            return from_config(PRESETS[model], model)
        if model.endswith(".json") or os.path.isdir(model):
            path = os.path.join(model, "config.json") if os.path.isdir(model) else model
            return from_hf_config(path)
        if ":" in model:
            return from_factory(model, block=block, tp_plan=tp_plan)
        raise PlanInputError(
            f"unknown model {model!r}: give a preset ({', '.join(PRESETS)}), a Hugging Face config.json, "
            "or a factory 'package.module:callable'"
        )
    raise PlanInputError(
        "model must be a preset name, config.json path, factory, GPTConfig/LlamaConfig or meta nn.Module; "
        f"got {type(model).__name__}"
    )


# -- activation checkpointing ---------------------------------------------------------------------


def checkpoint_blocks(model: nn.Module, is_block: Callable[[nn.Module], bool]) -> nn.Module:
    """Recompute each block's forward in backward (``torch.utils.checkpoint``, non-reentrant).

    The checkpoint wraps the block's ``forward`` itself, so fully_shard's hooks stay outside it
    (the block is gathered once for backward, before its recompute). Returns ``model``.
    """
    from torch.utils.checkpoint import checkpoint

    for block in (m for m in model.modules() if is_block(m)):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
