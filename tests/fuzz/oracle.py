"""What counts as agreeing with the oracle, and the one list of deliberate differences.

The oracle of fsdp2 is PyTorch's FSDP2 on the same world, called the same way: after every call,
what a user can observe on every rank (the call's result, outputs and losses, parameters, every
``.grad`` (None included), optimizer state, state dicts, whether the call raised) must be
bitwise equal. A compiled program (forwards through ``torch.compile(model, fullgraph=True)``,
which PyTorch's FSDP2 cannot run) is also run by eager fsdp2, and its compiled run must equal
that eager run. Where both raise, fsdp2's error must be one of its own (``FSDPUsageError``,
``CheckpointError``) naming the module, or the very error PyTorch raised (from a torch function
the program called on both).

A difference is deliberate only if it is listed in ``DELIBERATE_DIFFERENCES`` with its reason and
the page that documents it: a refusal (fsdp2 raises ``FSDPUsageError`` where the oracle runs, or
PyTorch's FSDP2 raises where fsdp2 does more: the program ends there, passing), a tolerance (two
runs compared within stated bounds instead of bitwise) or an observation each run shows its own
way (not compared).

``KNOWN_UNFIXED`` names the fsdp2 defects this tester has found and that are not fixed yet, each
with a predicate on the program that says whether a program has that defect's ingredients: the
fast tier leaves such programs out (they are in ``tests/fuzz/test_findings.py`` as strict
xfails), the long runs report them as known. Fixing a defect means emptying its entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from tests.fuzz.program import MIXED_PRECISION, Backward, FinalizeBackward, Forward, Program, Setter

# -- deliberate differences ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """Run ``run`` raises an error matching ``error`` at a call of type ``call`` where the run it is
    compared with does not: by design. ``run`` is ``"fsdp2"`` (the program as written: fsdp2 refuses
    with ``FSDPUsageError``) or ``"torch"`` (PyTorch's FSDP2 refuses what fsdp2 supports)."""

    name: str
    reason: str
    run: str
    call: type
    error: str


@dataclass(frozen=True)
class Tolerance:
    """The (oracle, subject) run pairs ``pairs`` of programs where ``applies`` holds are compared
    within ``atol`` + ``rtol`` * max |oracle| (per tensor: rounding of sums scales with the largest
    terms, not with each element) instead of bitwise. Such programs use SGD (the generator
    sees to it): its update keeps a rounding difference that size, where AdamW's can blow one in
    a near-zero gradient up to the learning rate."""

    name: str
    reason: str
    pairs: tuple[tuple[str, str], ...]
    applies: Callable[[Program], bool]
    atol: float
    rtol: float


@dataclass(frozen=True)
class Unobserved:
    """Observations (keys matching ``keys``) that the run pairs ``pairs`` of programs where
    ``applies`` holds are not compared on: each run shows them its own way, by design."""

    name: str
    reason: str
    pairs: tuple[tuple[str, str], ...]
    applies: Callable[[Program], bool]
    keys: str


def _compiled(program: Program) -> bool:
    return program.compiled


def _compiled_under_manual_finalization(program: Program) -> bool:
    return program.compiled and has_ingredients(program, {"set_manual_backward_finalization(True)"})


def _integer_reshard_after_forward(program: Program) -> bool:
    return has_ingredients(program, {"reshard_after_forward int"})


def _several_forwards_before_a_backward_one_compiled(program: Program) -> bool:
    forwards = compiled = 0
    for call in program.calls:
        if isinstance(call, Forward):
            forwards, compiled = forwards + 1, compiled + call.compiled
            if forwards >= 2 and compiled:
                return True
        elif isinstance(call, Backward):
            forwards = compiled = 0
    return False


def _repeated_use_after_a_backward_without_sync(program: Program) -> bool:
    from tests.fuzz.generate import block_paths

    called_twice = any(b.twice for b in block_paths(program.model).values())
    forwards, two_forwards = 0, False
    for call in program.calls:
        forwards = forwards + 1 if isinstance(call, Forward) else 0 if isinstance(call, Backward) else forwards
        two_forwards |= forwards > 1
    without_sync = any(
        isinstance(c, Setter) and c.method in ("set_requires_gradient_sync", "set_requires_all_reduce") and not c.value
        for c in program.calls
    )
    return (called_twice or two_forwards) and without_sync


def _repeated_use_with_a_narrower_reduce_dtype_on_torch_2_15(program: Program) -> bool:
    from tests.fuzz.runner import PYTORCH_HAS_MANUAL_FINALIZATION as torch_2_15

    uses = ("called twice", "two forwards before one backward", "tied weights")
    narrower = "mixed precision fp32-params-fp16-reduce"
    return torch_2_15 and program.compiled and any(has_ingredients(program, {narrower, use}) for use in uses)


def _reduces_in_low_precision(program: Program) -> bool:
    """Some group reduces in bf16 or fp16 (a low reduce dtype, or a low param dtype without one)."""
    from tests.fuzz.generate import block_paths

    wraps = [program.model.root] + [b.wrap for b in block_paths(program.model).values() if b.wrap is not None]
    return any(
        MIXED_PRECISION[w.mp][1] in ("bfloat16", "float16") or MIXED_PRECISION[w.mp][:2] == ("bfloat16", None)
        for w in wraps
    )


def _repeated_use_after_a_backward_without_sync_in_fp32(program: Program) -> bool:
    return _repeated_use_after_a_backward_without_sync(program) and not _reduces_in_low_precision(program)


def _repeated_use_after_a_backward_without_sync_in_low_precision(program: Program) -> bool:
    return _repeated_use_after_a_backward_without_sync(program) and _reduces_in_low_precision(program)


_REDUCED_TWICE = (
    "in the synced backward after one without sync, PyTorch's FSDP2 reduce-scatters a module that ran more than "
    "once twice (the kept sum when the first use's backward ends, the rest at the second); fsdp2 reduce-scatters "
    "their sum once, as for a module that ran once: rounding (docs/composition.md, the nosync+twice cell)"
)

DELIBERATE_DIFFERENCES = (
    Refusal(
        "compiled step on parameters gathered outside it",
        "parameters gathered outside the compiled step (unshard(), an eager forward that kept them for its backward, "
        "or an eager step under set_reshard_after_backward(False)) are refused: call reshard() first "
        "(docs/compile.md, what the compiled step refuses)",
        "fsdp2",
        Forward,
        r"FSDPUsage\w*Error.*gathered outside the compiled step",
    ),
    Refusal(
        "compiled step under set_reshard_after_backward(False)",
        "the compiled step gathers afresh where eager computes with the kept parameters (docs/compile.md)",
        "fsdp2",
        Forward,
        r"FSDPUsage\w*Error.*set_reshard_after_backward",
    ),
    Refusal(
        "sync settings changed between a compiled forward and its backward",
        "a compiled backward does what the settings said when its forward was traced; a change in between is "
        "refused by name (docs/compile.md)",
        "fsdp2",
        Backward,
        r"FSDPUsage\w*Error.*(set_requires_gradient_sync|set_requires_all_reduce)",
    ),
    Refusal(
        "manual finalization of HSDP sums kept for a later all-reduce",
        "finalize_backward() cannot end an iteration whose HSDP sums wait for a later all-reduce "
        "(set_requires_all_reduce(False)): refused by name (docs/frameworks.md, manual finalization)",
        "fsdp2",
        FinalizeBackward,
        r"FSDPUsage\w*Error.*keeps HSDP sums for a later all-reduce",
    ),
    Refusal(
        "a module not run in a forward, in PyTorch's post-backward",
        "PyTorch's FSDP2 fails in its post-backward (AttributeError: 'FSDPParam' object has no attribute "
        "'_unsharded_param') on a group whose module a forward skipped before its parameters were ever gathered, "
        "in accumulation without sync; fsdp2 trains (the group gets no gradient from that forward; "
        "docs/frameworks.md: fsdp2 does more than PyTorch)",
        "torch",
        Backward,
        r"AttributeError.*'FSDPParam' object has no attribute '_unsharded_param'",
    ),
    Refusal(
        "several dtypes among a group's trainable parameters",
        "PyTorch's FSDP2 asserts one dtype among a group's trainable parameters at lazy init; fsdp2 gathers several "
        "dtypes in one group (as bytes) and trains them (docs/frameworks.md: fsdp2 does more than PyTorch)",
        "torch",
        object,
        r"AssertionError.*FSDP expects uniform original parameter dtype",
    ),
    Refusal(
        "mixed precision accumulation whose microbatches reach different parameters",
        "PyTorch's FSDP2 asserts one gradient dtype in a reduce-scatter; in mixed precision a synced backward after "
        "microbatches without sync that reached other parameters holds sums kept in the reduce dtype beside fresh "
        "gradients in param_dtype, and fsdp2 reduces both (docs/frameworks.md: fsdp2 does more than PyTorch)",
        "torch",
        Backward,
        r"AssertionError.*FSDP reduce-scatter expects uniform gradient dtype",
    ),
    Unobserved(
        "the module's parameters around a compiled step",
        "the compiled step gathers parameters into its graph's own buffers and leaves the module's sharded DTensor "
        "parameters registered; eager fsdp2, as PyTorch's FSDP2, registers the gathered parameters on a module that "
        "keeps them after forward (the root by default) until backward (docs/compile.md, differences from eager). "
        "The sharded parameters, their gradients and the optimizer state are compared",
        (("fsdp2-eager", "fsdp2"),),
        _compiled,
        r"^parameter ",
    ),
    Unobserved(
        "the parameters of a module under reshard_after_forward=k between its forward and backward",
        "PyTorch's FSDP2 registers its post-forward copies there ((Replicate(), Shard(0)) on a mesh of k ranks, in "
        "param_dtype), an internal layout; fsdp2 keeps the module's sharded DTensors registered, as after "
        "reshard_after_forward=True, and holds its k-rank rows in buffers of its own (docs/frameworks.md). The "
        "sharded parameters, their gradients and the optimizer state are compared",
        (("torch", "fsdp2"), ("torch", "fsdp2-eager")),
        _integer_reshard_after_forward,
        r"^parameter ",
    ),
    Unobserved(
        "gradients a compiled synced backward writes before finalize_backward()",
        "under manual finalization the compiled graph reduces every group and writes .grad when its backward ends, "
        "where eager fsdp2, as PyTorch 2.15's FSDP2, leaves the root's group unreduced until finalize_backward() "
        "(docs/compile.md, differences from eager). Compiled programs under manual finalization always finalize "
        "with sync on (the generator sees to it), so the parameters and optimizer state after each step are compared",
        (("fsdp2-eager", "fsdp2"),),
        _compiled_under_manual_finalization,
        r"\.grad$",
    ),
    Tolerance(
        "several compiled synced backwards before one finalize_backward()",
        "under manual finalization eager fsdp2, as PyTorch 2.15's FSDP2, reduces the root's group once at "
        "finalize_backward(), the sum of the backwards before it; the compiled graph reduces each backward's "
        "gradient: rounding (docs/compile.md, differences from eager)",
        (("fsdp2-eager", "fsdp2"),),
        _compiled_under_manual_finalization,
        atol=1e-6,
        rtol=1e-5,
    ),
    Tolerance(
        "several forwards before one backward, one of them compiled",
        "each compiled forward's graph reduces its own gradient and the reductions add up in .grad (with an eager "
        "forward's); eager reduces their sum once: rounding, fp32 gradients within 1.5e-8 of eager's, bf16 "
        "parameters within 1e-3 "
        "(docs/compile.md, modules that run more than once per backward)",
        (("fsdp2-eager", "fsdp2"),),
        _several_forwards_before_a_backward_one_compiled,
        atol=2e-3,
        rtol=1e-2,
    ),
    Tolerance(
        "uses of a parameter added in a narrower reduce dtype, compiled",
        "torch 2.15: eager fsdp2, as PyTorch's FSDP2, casts each use's gradient of a parameter used more than once "
        "in a backward to a reduce dtype narrower than the compute dtype before adding (the unsharded parameter's "
        "grad_dtype); the compiled graph adds the uses in the compute dtype and casts their sum (grad_dtype is for "
        "leaves only): reduce-dtype rounding (docs/compile.md)",
        (("fsdp2-eager", "fsdp2"),),
        _repeated_use_with_a_narrower_reduce_dtype_on_torch_2_15,
        atol=2e-3,
        rtol=1e-2,
    ),
    Tolerance(
        "a module run more than once per backward, after a backward without sync",
        _REDUCED_TWICE,
        (("torch", "fsdp2"), ("torch", "fsdp2-eager")),
        _repeated_use_after_a_backward_without_sync_in_fp32,
        atol=1e-6,
        rtol=1e-5,
    ),
    Tolerance(
        "a module run more than once per backward, after a backward without sync, reduced in bf16 or fp16",
        _REDUCED_TWICE + "; in a 16-bit reduce dtype the rounding is that dtype's",
        (("torch", "fsdp2"), ("torch", "fsdp2-eager")),
        _repeated_use_after_a_backward_without_sync_in_low_precision,
        atol=2e-3,
        rtol=1e-2,
    ),
)


def refusal_for(run: str, call, error: str) -> Refusal | None:
    """The deliberate refusal that explains ``run`` raising ``error`` alone, if any."""
    for difference in DELIBERATE_DIFFERENCES:
        if (
            isinstance(difference, Refusal)
            and difference.run == run.removesuffix("-eager")  # fsdp2's refusals are the eager twin's too
            and isinstance(call, difference.call)
            and re.search(difference.error, error, re.DOTALL)
        ):
            return difference
    return None


def tolerance_for(program: Program, pair: tuple[str, str]) -> Tolerance | None:
    """The loosest tolerance that applies (a program may have the ingredients of several)."""
    found = [d for d in DELIBERATE_DIFFERENCES if isinstance(d, Tolerance) and pair in d.pairs and d.applies(program)]
    return max(found, key=lambda d: (d.rtol, d.atol), default=None)


def unobserved(program: Program, pair: tuple[str, str]) -> list[str]:
    """Patterns of the observation keys the pair is not compared on."""
    return [
        d.keys for d in DELIBERATE_DIFFERENCES if isinstance(d, Unobserved) and pair in d.pairs and d.applies(program)
    ]


def rounds_differently(program: Program) -> bool:
    """Whether a tolerance applies to the program (it must then use SGD)."""
    return any(isinstance(d, Tolerance) and d.applies(program) for d in DELIBERATE_DIFFERENCES)


# -- ingredients, and the known unfixed fsdp2 defects --------------------------------------------------------


def ingredients(program: Program) -> frozenset[str]:
    """The features a program is made of, coarsely (no sizes, batches or orders): a failing
    program's ingredients say which programs may fail the same way."""
    from tests.fuzz.generate import block_paths, shard_size

    model = program.model
    found = {f"world {model.world_size}", f"optimizer {program.optimizer}"}
    mesh = model.mesh
    if mesh != "flat":
        found.add(
            "HSDP mesh" if "hsdp" in mesh else "TP mesh" if "tp" in mesh and "slice" not in mesh else f"{mesh} mesh"
        )
    if "unflattened" in mesh:
        found.add("unflattened mesh")
    if "slice" in mesh:
        found.add("sliced mesh")
    k = shard_size(mesh, model.world_size)
    wraps = [model.root] + [b.wrap for b in block_paths(model).values() if b.wrap is not None]
    for wrap in wraps:
        if wrap.reshard is False or wrap.reshard == 1:
            found.add("reshard_after_forward False")
        elif not isinstance(wrap.reshard, bool) and isinstance(wrap.reshard, int) and 1 < wrap.reshard < k:
            found.add("reshard_after_forward int")
        if wrap.mp != "fp32":
            found.add(f"mixed precision {wrap.mp}")
        if MIXED_PRECISION[wrap.mp][1] == "float16":
            found.add("fp16 reduction")
        if wrap.offload:
            found.add("CPU offload")
    for b in block_paths(model).values():
        found.add(f"{b.kind} block" + (" (own fully_shard)" if b.wrap is not None else ""))
        found |= {name for name, on in (("called twice", b.twice), ("frozen", b.frozen)) if on}
        if b.dtype != "float32":
            found.add("second dtype")
    if model.tied:
        found.add("tied weights")
    forwards = 0
    for call in program.calls:
        if isinstance(call, Forward):
            forwards += 1
            found.add("compiled forward" if call.compiled else "forward")
            if forwards > 1:
                found.add("two forwards before one backward")
            for _, ranks in call.closed:
                found.add("gate closed on all ranks" if len(ranks) == model.world_size else "gate closed on some ranks")
            if call.bypassed:
                found.add("block skipped")
        elif isinstance(call, Backward):
            forwards = 0
            found.add("backward")
        elif isinstance(call, Setter):
            found.add(f"{call.method}({call.value!r})" + (" on a block" if call.target else ""))
        else:
            name = type(call).__name__
            if getattr(call, "load", False):
                name += " load"
            if getattr(call, "ranks", None) is not None:
                name += " on some ranks"
            if getattr(call, "set_to_none", True) is False:
                name += "(set_to_none=False)"
            found.add(name)
    return frozenset(found)


def has_ingredients(program: Program, wanted) -> bool:
    return frozenset(wanted) <= ingredients(program)


# name -> (what goes wrong, the ingredients of programs that have it: any one of the sets). Each is a strict xfail in
# tests/fuzz/test_findings.py; fixing one means deleting its entry here and its xfail there.
KNOWN_UNFIXED: dict[str, tuple[str, tuple[frozenset[str], ...]]] = {}


def known_defects(program: Program) -> list[str]:
    return [name for name, (_, sets) in KNOWN_UNFIXED.items() if any(has_ingredients(program, i) for i in sets)]
