"""A generated program: a model, its wrapping, and the calls a training script makes on it.

Everything here is plain data (frozen dataclasses of ints, bools, strings and tuples), so a
program's ``repr`` is Python that rebuilds it, and ``as_pytest`` prints it as a test to paste.
``tests/fuzz/runner.py`` builds the model from it and runs the calls on fsdp2 and on PyTorch's
FSDP2 side by side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# -- the model --------------------------------------------------------------------------------------------

# Mixed precision policies by name: (param_dtype, reduce_dtype, output_dtype).
MIXED_PRECISION = {
    "fp32": (None, None, None),
    "bf16": ("bfloat16", "float32", None),
    "bf16-params": ("bfloat16", None, None),
    "bf16-out-fp32": ("bfloat16", "float32", "float32"),
    "fp16": ("float16", "float16", None),
    "fp32-params-fp16-reduce": (None, "float16", None),
}


@dataclass(frozen=True)
class Wrap:
    """The arguments of one ``fully_shard`` call. ``reshard``: ``reshard_after_forward`` (None: the
    default); ``mp``: a key of ``MIXED_PRECISION``; ``offload``: ``CPUOffloadPolicy(pin_memory=False)``."""

    reshard: bool | int | None = None
    mp: str = "fp32"
    offload: bool = False


@dataclass(frozen=True)
class Block:
    """One block of the residual stream ``h -> h + f(h)``. Kinds:

    - ``linear``: ``f = tanh(lin(h))``;
    - ``mlp``: ``f = down(relu(up(norm(h))))`` (``norm``: ``""``, ``"layer"`` or ``"rms"``);
      tensor-parallel (``up`` column-wise, ``down`` row-wise) on a mesh with a TP dim;
    - ``gated``: ``f = tanh(branch(h))`` when its gate is open, ``f = 0`` (its parameters unused)
      when a forward closes it (``Forward.closed``), on some ranks or all;
    - ``nested``: its ``children`` in turn, each maybe its own ``fully_shard`` call;
    - ``experts``: a dense layer, a router and experts (3-D weights) that a closed gate leaves
      unused; on the ``ep`` mesh the experts are split over the expert-parallel mesh and sharded
      on their own data-parallel mesh, the rest on the model's (one ``fully_shard`` call over two
      meshes).

    ``wrap``: the block's own ``fully_shard`` call, or None (its parameters join the enclosing
    call's group). ``frozen``: its parameters get ``requires_grad=False`` before sharding.
    ``dtype``: its parameters' dtype (``"bfloat16"`` beside fp32 ones: two dtypes in one group).
    ``twice``: called twice per forward.
    """

    kind: str = "linear"
    bias: bool = True
    norm: str = ""
    frozen: bool = False
    dtype: str = "float32"
    twice: bool = False
    wrap: Wrap | None = None
    children: tuple[Block, ...] = ()


@dataclass(frozen=True)
class Model:
    """``input`` (``"embedding"`` of ``vocab`` tokens, or ``"linear"`` from ``vocab`` features),
    the blocks, an optional final norm, and a head; ``tied``: the head's weight is the embedding's.
    ``mesh``: the meshes (see ``runner.MESHES``); ``root``: the root's ``fully_shard`` call."""

    world_size: int = 2
    mesh: str = "flat"
    dim: int = 8
    vocab: int = 11
    input: str = "embedding"
    tied: bool = False
    blocks: tuple[Block, ...] = ()
    final_norm: str = ""
    head_bias: bool = True
    root: Wrap = Wrap()


# -- the calls ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Forward:
    """A forward on this rank's batch ``batch`` and its loss, kept for the next ``Backward``.
    ``compiled``: through ``torch.compile(model, fullgraph=True)``. ``closed``: (gated block's path,
    the ranks on which its gate is closed). ``bypassed``: blocks not called at all (on every rank)."""

    batch: int = 0
    compiled: bool = False
    closed: tuple[tuple[str, tuple[int, ...]], ...] = ()
    bypassed: tuple[str, ...] = ()


@dataclass(frozen=True)
class Backward:
    """``backward()`` of the sum of the losses of the forwards since the last backward."""


@dataclass(frozen=True)
class Setter:
    """``module.<method>(value)`` on the root (``target=""``) or the fully_shard'ed module at
    ``target``; recursive where PyTorch's method takes ``recurse``."""

    method: str
    value: bool | int
    target: str = ""


@dataclass(frozen=True)
class FinalizeBackward:
    """``root.finalize_backward()`` (PyTorch 2.15's manual backward finalization)."""


@dataclass(frozen=True)
class Unshard:
    """``module.unshard()`` on the root or the fully_shard'ed module at ``target``."""

    target: str = ""


@dataclass(frozen=True)
class Reshard:
    target: str = ""


@dataclass(frozen=True)
class ZeroGrad:
    """``optimizer.zero_grad(set_to_none)``, on every rank or only on ``ranks``."""

    set_to_none: bool = True
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class OptimizerStep:
    """``optimizer.step()``."""


@dataclass(frozen=True)
class ClipGradNorm:
    """``clip_grad_norm_(model.parameters(), max_norm)``, ``torch.nn.utils``' or (``fsdp2_function``)
    fsdp2's (which also takes gradients on several meshes), the same function on both models."""

    max_norm: float = 0.1
    fsdp2_function: bool = False


@dataclass(frozen=True)
class StateDict:
    """``state_dict()`` kept under ``tag`` (model and optimizer); ``load``: ``load_state_dict`` of
    what was kept under ``tag`` instead."""

    tag: int = 0
    load: bool = False


@dataclass(frozen=True)
class Checkpoint:
    """fsdp2: ``fsdp2.checkpoint.save`` of model and optimizer under ``tag`` (a directory shared by
    the ranks), or (``load``) ``fsdp2.checkpoint.load`` of it into the same model and optimizer.
    PyTorch's FSDP2 model keeps and loads its own state dicts instead: a save and load on the same
    world must restore exactly what was saved."""

    tag: int = 0
    load: bool = False


CALLS = (Forward, Backward, Setter, FinalizeBackward, Unshard, Reshard, ZeroGrad, OptimizerStep, ClipGradNorm)
CALLS += (StateDict, Checkpoint)


@dataclass(frozen=True)
class Program:
    model: Model
    calls: tuple = ()
    optimizer: str = "adamw"  # adamw | sgd (momentum 0.9)

    @property
    def world_size(self) -> int:
        return self.model.world_size

    @property
    def compiled(self) -> bool:
        return any(isinstance(c, Forward) and c.compiled for c in self.calls)

    def as_pytest(self, name: str = "test_program", reason: str = "") -> str:
        """The program as a test to paste into ``tests/fuzz/test_findings.py``."""
        doc = f'    """{reason}"""\n' if reason else ""
        return (
            f"def {name}(worlds):\n{doc}"
            f"    program = {format_program(self, indent=4)}\n"
            f"    assert_program_passes(worlds, program)\n"
        )


# -- printing ----------------------------------------------------------------------------------------------


def _fields(obj) -> str:
    """``Name(field=value, ...)`` with only the fields that differ from their defaults."""
    parts = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default is dataclasses.MISSING or value != default:
            parts.append(f"{f.name}={_short(value)}")
    return f"{type(obj).__name__}({', '.join(parts)})"


def _short(value) -> str:
    if dataclasses.is_dataclass(value):
        return _fields(value)
    if isinstance(value, tuple):
        inner = ", ".join(_short(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def format_program(program: Program, indent: int = 0) -> str:
    """The program as Python, one call per line."""
    pad = " " * indent
    model = _short(program.model)
    calls = "".join(f"{pad}        {_short(call)},\n" for call in program.calls)
    optimizer = f",\n{pad}    optimizer={program.optimizer!r}" if program.optimizer != "adamw" else ""
    return f"Program(\n{pad}    model={model},\n{pad}    calls=(\n{calls}{pad}    ){optimizer},\n{pad})"
