"""Hypothesis strategies of programs: a model and its wrapping (``models``), then a training script's
calls on it (``programs``), drawn step by step from the state the calls so far leave.

What the generator does not make, because PyTorch's FSDP2 itself hangs or has no defined result
there (so there is no oracle):

- calls that issue collectives (forward, backward, setters, ``unshard``, ``clip_grad_norm_``,
  checkpoints) on only some ranks. Rank-dependent are the batches, gates closed on some ranks,
  and ``zero_grad`` on some ranks (an optimizer step on some ranks leaves the others without
  optimizer state, which sharded checkpoints rightly refuse);
- ``clip_grad_norm_`` after ``zero_grad(set_to_none=True)`` on some ranks only, until every rank
  sets the gradients to None again: which parameters have a gradient may then differ across
  ranks, and PyTorch's own ``clip_grad_norm_`` issues a collective per gradient it finds (gloo
  aborts);
- a gate closed on some ranks only (a parameter used on some ranks, not on others) unless
  ``set_reduce_scatter_unused_params(True)`` is on: without it PyTorch reduce-scatters only the
  parameters with gradients, whose set then differs across ranks;
- a block skipped (not called) on some ranks only: its all-gather would be missing there;
- after ``set_requires_all_reduce(False)`` under HSDP, gates closed or blocks skipped: PyTorch's
  FSDP2 adds the kept partial sums to the next reduce-scatter's output, whose size changes when
  the set of parameters with gradients does (it raises a size mismatch in ``foreach_reduce``);
- a tied weight shared by two ``fully_shard`` calls (PyTorch's FSDP2 does not support it);
- ``finalize_backward()`` outside manual finalization, manual finalization switched while a
  backward waits for its ``finalize_backward()`` or on a module that is not the root, and
  module-level gradient sync settings together with manual finalization;
- on torch < 2.15 (whose FSDP2 has no manual finalization), a backward with gradient sync under
  manual finalization, or one left without its ``finalize_backward()``: there the oracle is
  PyTorch's automatic finalization of microbatches without sync that a finalize with sync on
  completes, which is all it can tell (the newest tier draws the rest against PyTorch 2.15);
- in a compiled program, a forgotten ``finalize_backward()`` or one with gradient sync off: the
  compiled step writes the gradients eager leaves pending until a finalize with sync on (a
  deliberate difference, ``oracle.DELIBERATE_DIFFERENCES``);
- settings other than gradient sync changed between a forward and its backward.

Compiled forwards go through ``torch.compile(model, backend="aot_eager", fullgraph=True)``. A
program that a tolerance of ``oracle.DELIBERATE_DIFFERENCES`` applies to uses SGD.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from tests.fuzz import oracle
from tests.fuzz.runner import PYTORCH_HAS_MANUAL_FINALIZATION

from tests.fuzz.program import (
    MIXED_PRECISION,
    Backward,
    Block,
    Checkpoint,
    ClipGradNorm,
    FinalizeBackward,
    Forward,
    Model,
    OptimizerStep,
    Program,
    Reshard,
    Setter,
    StateDict,
    Unshard,
    Wrap,
    ZeroGrad,
)


def _chance(draw, one_in: int) -> bool:
    """True once in ``one_in`` draws; shrinks to False (a failing program loses the feature if it can)."""
    return draw(st.integers(0, one_in - 1)) == one_in - 1


MESHES_BY_WORLD = {
    2: ("flat", "hsdp", "hsdp-unflattened", "dp-slice", "dp-slice-whole", "unflattened-slice"),
    4: (
        "flat",
        "hsdp",
        "hsdp-unflattened",
        "dp-slice",
        "dp-slice-whole",
        "unflattened-slice",
        "tp",
        "tp-unflattened",
        "ep",
    ),
}
TP_MESHES = ("tp", "tp-unflattened")
HSDP_MESHES = ("hsdp", "hsdp-unflattened")


def shard_size(mesh: str, ws: int) -> int:
    return ws // 2 if mesh in ("hsdp", "hsdp-unflattened", "tp", "tp-unflattened", "dp-slice") else ws


# -- the model ------------------------------------------------------------------------------------------------


@st.composite
def wraps(draw, mesh: str, ws: int, mp: str, offload: bool) -> Wrap:
    k = shard_size(mesh, ws)
    divisors = [d for d in range(1, k + 1) if k % d == 0]
    reshard = draw(st.sampled_from([None, True, False, *divisors]))
    if _chance(draw, 10):  # now and then a call with its own policy
        mp = draw(st.sampled_from(sorted(MIXED_PRECISION)))
    return Wrap(reshard=reshard, mp=mp, offload=offload)


@st.composite
def blocks(draw, mesh: str, ws: int, mp: str, offload: bool, depth: int = 0) -> Block:
    kinds = ["linear", "mlp", "gated"] + (["nested"] if depth == 0 else []) + ["experts"]
    kind = draw(st.sampled_from(kinds))
    children = ()
    if kind == "nested":
        children = tuple(draw(st.lists(blocks(mesh, ws, mp, offload, depth + 1), min_size=1, max_size=2)))
    frozen = kind != "nested" and _chance(draw, 8)
    # A second dtype: mostly on frozen parameters (PyTorch wants one dtype among a group's trainable ones).
    dtype = "bfloat16" if kind not in ("nested", "experts") and _chance(draw, 10) else "float32"
    return Block(
        kind=kind,
        bias=draw(st.booleans()),
        norm=draw(st.sampled_from(["", "layer", "rms"])) if kind == "mlp" else "",
        frozen=frozen or (dtype != "float32" and not _chance(draw, 4)),
        dtype=dtype,
        twice=_chance(draw, 7),
        wrap=draw(wraps(mesh, ws, mp, offload)) if kind == "experts" or not _chance(draw, 3) else None,
        children=children,
    )


@st.composite
def models(draw, world_sizes=(2, 4)) -> Model:
    ws = draw(st.sampled_from(world_sizes))
    mesh = draw(st.sampled_from(MESHES_BY_WORLD[ws]))
    mp = draw(st.sampled_from(["fp32"] * 4 + sorted(MIXED_PRECISION)))
    offload = _chance(draw, 8)
    embedding = draw(st.booleans())
    body = tuple(draw(st.lists(blocks(mesh, ws, mp, offload), min_size=1, max_size=4)))
    if mesh == "ep" and not any(b.kind == "experts" for b in body):
        body += (Block(kind="experts", wrap=Wrap(mp=mp, offload=offload)),)
    return Model(
        world_size=ws,
        mesh=mesh,
        dim=draw(st.sampled_from([4, 6, 8])) if mesh not in TP_MESHES else draw(st.sampled_from([4, 8])),
        vocab=draw(st.sampled_from([5, 7, 11])),
        input="embedding" if embedding else "linear",
        tied=embedding and _chance(draw, 5),
        blocks=body,
        final_norm=draw(st.sampled_from(["", "", "layer", "rms"])),
        head_bias=draw(st.booleans()),
        root=draw(wraps(mesh, ws, mp, offload)),
    )


def block_paths(model: Model) -> dict[str, Block]:
    found = {}

    def walk(prefix, body):
        for i, b in enumerate(body):
            found[f"{prefix}{i}"] = b
            walk(f"{prefix}{i}.inner.", b.children)

    walk("blocks.", model.blocks)
    return found


# -- the calls ------------------------------------------------------------------------------------------------


class _State:
    """What the calls so far leave: what the next call may be."""

    def __init__(self, model: Model, compiled: bool):
        self.model = model
        self.compiled = compiled
        self.batches = 0
        self.unused_params = False  # set_reduce_scatter_unused_params on the root
        self.manual = False
        self.awaiting_finalize = False  # a backward under manual finalization not finalized yet
        self.sync = True
        self.module_sync = False  # gradient sync set on a module other than the root
        self.unsharded = False  # unshard() or set_reshard_after_backward(False) left parameters gathered
        self.keep_after_backward = False
        # zero_grad(set_to_none=True) on some ranks only: which parameters have a gradient may differ
        # across ranks until every rank sets them to None again (a skipped block gets none).
        self.grads_differ = False
        self.saved_state_dicts: list[int] = []
        self.checkpoints: list[int] = []
        self.paths = block_paths(model)
        self.gates = [p for p, b in self.paths.items() if b.kind in ("gated", "experts")]
        self.wrapped = [p for p, b in self.paths.items() if b.wrap is not None]
        self.hsdp = model.mesh in HSDP_MESHES
        self.partial_all_reduce = False  # set_requires_all_reduce(False) was called


@st.composite
def _forward(draw, s: _State) -> Forward:
    compiled = s.compiled and not s.unsharded and not _chance(draw, 5)
    closed = []
    for path in s.gates if not s.partial_all_reduce else ():
        choice = draw(st.integers(0, 5))
        if choice == 1:
            closed.append((path, tuple(range(s.model.world_size))))
        elif choice == 2 and s.unused_params:
            ranks = draw(st.lists(st.integers(0, s.model.world_size - 1), min_size=1, unique=True))
            closed.append((path, tuple(sorted(ranks))))
    bypassed = tuple(p for p in s.paths if "inner" not in p and not s.partial_all_reduce and _chance(draw, 10))
    s.batches += 1
    return Forward(batch=s.batches - 1, compiled=compiled, closed=tuple(closed), bypassed=bypassed)


def _setters(draw, s: _State) -> list:
    """Zero or more setters between steps."""
    out = []
    for _ in range(draw(st.integers(0, 3 if s.compiled else 2))):  # compiled programs are few: make them busy
        options = ["set_requires_gradient_sync", "set_reduce_scatter_unused_params", "set_reshard_after_backward"]
        options += ["set_reshard_after_forward", "set_manual_backward_finalization"]
        if s.hsdp:
            options.append("set_requires_all_reduce")
        method = draw(st.sampled_from(options))
        value = draw(st.booleans())
        target = ""
        if method == "set_manual_backward_finalization":
            if s.awaiting_finalize or s.module_sync:
                continue
            s.manual = value
        elif method == "set_reduce_scatter_unused_params":
            s.unused_params = value
        elif method == "set_requires_gradient_sync":
            if s.wrapped and not s.manual and _chance(draw, 5):
                target = draw(st.sampled_from(s.wrapped))
                s.module_sync = True
            else:
                s.sync = value
        elif method == "set_requires_all_reduce":
            s.partial_all_reduce |= not value
        elif method == "set_reshard_after_backward":
            if s.compiled and not value:
                continue  # refused by the compiled step (a deliberate difference): rarely worth a trace
            s.keep_after_backward = not value
        elif method == "set_reshard_after_forward" and s.wrapped and draw(st.booleans()):
            target = draw(st.sampled_from(s.wrapped))
        out.append(Setter(method, value, target))
    return out


@st.composite
def _step(draw, s: _State) -> list:
    """One training step: setters, microbatches (forwards, backwards), maybe finalize, clip, step, zero."""
    calls = _setters(draw, s)
    if s.compiled and s.unsharded:
        calls.append(Reshard())
        s.unsharded = False
    if _chance(draw, 10):
        target = draw(st.sampled_from(["", *s.wrapped]))
        calls.append(Unshard(target=target))
        s.unsharded = True
        if _chance(draw, 2):
            calls.append(Reshard(target=target))
            s.unsharded = False
    for micro in range(draw(st.integers(1, 3))):
        if micro > 0 and _chance(draw, 3):
            calls.append(Setter("set_requires_gradient_sync", not s.sync))
            s.sync = not s.sync
        if s.manual and s.sync and not PYTORCH_HAS_MANUAL_FINALIZATION:
            calls.append(Setter("set_requires_gradient_sync", False))  # what the oracle can tell (see above)
            s.sync = False
        for _ in range(1 + _chance(draw, 6)):  # now and then two forwards, one backward
            calls.append(draw(_forward(s)))
        calls.append(Backward())
        s.unsharded = s.keep_after_backward
        if s.manual:
            s.awaiting_finalize = True
    forgotten = PYTORCH_HAS_MANUAL_FINALIZATION and not s.compiled and _chance(draw, 4)
    if s.manual and s.awaiting_finalize and not forgotten:
        if not s.sync and (draw(st.booleans()) or not PYTORCH_HAS_MANUAL_FINALIZATION or s.compiled):
            calls.append(Setter("set_requires_gradient_sync", True))
            s.sync = True
        calls.append(FinalizeBackward())
        s.awaiting_finalize = False
    if _chance(draw, 6) and not s.grads_differ:
        calls.append(
            ClipGradNorm(max_norm=draw(st.sampled_from([0.01, 0.1, 10.0])), fsdp2_function=draw(st.booleans()))
        )
    if not _chance(draw, 6):
        calls.append(OptimizerStep())
    if not _chance(draw, 6):
        ranks = (draw(st.integers(0, s.model.world_size - 1)),) if _chance(draw, 10) else None
        zero = ZeroGrad(set_to_none=not _chance(draw, 4), ranks=ranks)
        calls.append(zero)
        if zero.set_to_none:
            s.grads_differ = ranks is not None
    if _chance(draw, 10):
        calls.append(_save_or_load(draw, StateDict, s.saved_state_dicts))
    if _chance(draw, 12):
        calls.append(_save_or_load(draw, Checkpoint, s.checkpoints))
    return calls


def _save_or_load(draw, kind, saved: list[int]):
    """A ``StateDict`` or ``Checkpoint`` call: load one saved earlier, or save a new one."""
    if saved and draw(st.booleans()):
        return kind(tag=draw(st.sampled_from(saved)), load=True)
    saved.append(len(saved))
    return kind(tag=saved[-1])


@st.composite
def programs(draw, world_sizes=(2, 4), compiled: bool | None = False, max_steps: int = 4) -> Program:
    """A model and the calls of ``1..max_steps`` training steps. ``compiled``: True, False, or None
    (drawn; compiled programs cost a trace each, so they are the rarer)."""
    model = draw(models(world_sizes))
    if compiled is None:
        compiled = _chance(draw, 10)
    if compiled and model.mesh == "ep":
        compiled = False  # the compiled step over two meshes is refused by name (docs/compile.md)
    s = _State(model, compiled)
    if _chance(draw, 4):
        s.unused_params = True
        calls = [Setter("set_reduce_scatter_unused_params", True)]
    else:
        calls = []
    for _ in range(draw(st.integers(1, max_steps))):
        calls += draw(_step(s))
    program = Program(model=model, calls=tuple(calls), optimizer=draw(st.sampled_from(["adamw", "adamw", "sgd"])))
    if oracle.rounds_differently(program):
        program = dataclasses.replace(program, optimizer="sgd")
    return program
