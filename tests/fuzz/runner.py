"""Runs one program on one rank: the same model built from one seed, sharded by PyTorch's FSDP2
(``torch``, the oracle) and by fsdp2 (``fsdp2``, the program as written; for a compiled program
also ``fsdp2-eager``, every forward eager), the calls made on each in turn. After every call each
run's observation (what a user can see on this rank) is compared against its oracle on every
rank; the ranks exchange their verdicts over the harness's world and stop together at the first
difference, hang or raise.

A hang: the program runs on process groups of its own whose collectives time out after
``HANG_S`` seconds (``COMPILED_HANG_S`` around compiled calls, where one rank may still be
tracing); the timeout's error names the call that hung.

On a torch without PyTorch 2.15's manual backward finalization the oracle of a program under
manual finalization is PyTorch's automatic finalization of the same gradients: the backwards
without sync that the next ``finalize_backward()`` (with sync on) completes are, for the oracle,
one synced backward (fsdp2's gradients must stay as they were until that finalize). That is all
it can tell: which gradients a synced backward writes before its finalize is 2.15's to say, so the
generator draws such programs only where PyTorch's FSDP2 has the method.
"""

from __future__ import annotations

import copy
import gc
import os
import re
import shutil
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp

from tests.fuzz import build, oracle
from tests.fuzz.program import (
    Backward,
    Checkpoint,
    ClipGradNorm,
    FinalizeBackward,
    Forward,
    OptimizerStep,
    Program,
    Reshard,
    Setter,
    StateDict,
    Unshard,
    ZeroGrad,
)

# Seconds a collective may wait before the program counts as hung: the partner of an eager call is
# at most one call behind; a compiled call's partner may still be tracing (slow on a busy machine).
HANG_S = float(os.environ.get("FSDP2_FUZZ_HANG_S", 8))
COMPILED_HANG_S = float(os.environ.get("FSDP2_FUZZ_COMPILED_HANG_S", 120))
SEED = 0
PYTORCH_HAS_MANUAL_FINALIZATION = hasattr(torch_fsdp.FSDPModule, "finalize_backward")
# Errors that mean a collective never completed on some rank.
HANG_ERRORS = re.compile(r"Timed out|timed out|Connection closed by peer|Connection reset by peer")


@dataclass
class Outcome:
    """How a program ended, the same on every rank. ``status``: passed, refused (both raised, or a
    deliberate refusal), differs, hang, crash (a rank died: ``check.outcome`` tells), broken (the
    oracle itself hung, or the tester failed: a program the generator should not make)."""

    status: str
    call: int = -1  # the call it ended at (-1: building the model)
    detail: str = ""
    calls_run: int = 0
    seconds: float = 0.0
    # The ranks may have left the program at different collectives (a hang, an error on some ranks):
    # the world's process groups no longer pair up.
    desynced: bool = False


@dataclass
class Run:
    name: str
    fully_shard: object
    model: object = None
    optimizer: object = None
    compiled: object = None
    params: list = field(default_factory=list)
    names: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    saved: dict = field(default_factory=dict)
    last: dict | None = None  # the observation after the last call
    previous: dict | None = None  # the one before
    before_deferred: dict | None = None  # before a backward whose reduction the oracle makes early


def _error_text(error: BaseException) -> str:
    """The error's type, message and where it was raised (the last frames)."""
    message = "".join(traceback.format_exception_only(type(error), error)).strip()
    if len(message) > 3000:  # dynamo quotes a whole stack: keep its head (the error) and tail
        message = message[:2000] + "\n[...]\n" + message[-1000:]
    frames = traceback.extract_tb(error.__traceback__)[-3:]
    where = "".join(f"\n    at {f.filename}:{f.lineno} in {f.name}" for f in frames)
    return f"{type(error).__module__}.{type(error).__qualname__}: {message}{where}"


# -- observations ---------------------------------------------------------------------------------------------


def _snap(value):
    if value is None:
        return None
    if isinstance(value, (int, float, bool)):
        return ("number", float(value))
    if hasattr(value, "to_local"):
        layout = f"{tuple(value.placements)} on ranks {value.device_mesh.mesh.tolist()}"
        return ("DTensor", layout, value.dtype, value.to_local().detach().clone())
    if isinstance(value, torch.Tensor):
        return ("Tensor", None, value.dtype, value.detach().clone())
    return ("object", repr(value))


def observe(run: Run, result) -> dict:
    """What a user sees on this rank after a call."""
    if isinstance(result, dict):  # a state dict
        seen = {f"state_dict[{key!r}]": _snap(value) for key, value in result.items()}
    else:
        seen = {"result": _snap(result)}
    for name, p in run.model.named_parameters():
        seen[f"parameter {name}"] = _snap(p)
    for name, p in zip(run.names, run.params):
        seen[f"sharded {name}"] = _snap(p)
        seen[f"{name}.grad"] = _snap(p.grad)
        for key, value in sorted(run.optimizer.state.get(p, {}).items()):
            seen[f"optimizer state {name}[{key!r}]"] = _snap(value)
    return seen


def _same(a, b, tolerance) -> str | None:
    if a is None or b is None:
        return None if a is b else f"{_kind(a)} in the oracle, {_kind(b)} here"
    if a[0] != b[0] or (a[0] != "number" and a[:3] != b[:3] and a[0] != "object"):
        return f"{a[:3]} in the oracle, {b[:3]} here"
    if a[0] == "object":
        return None if a == b else f"{a[1]} in the oracle, {b[1]} here"
    x, y = (a[1], b[1]) if a[0] == "number" else (a[3], b[3])
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if x.shape != y.shape:
        return f"shape {tuple(x.shape)} vs {tuple(y.shape)}"
    if torch.equal(x, y) or (x.isnan().all() and y.isnan().all()):
        return None
    if x.is_floating_point():
        diff = (x.double() - y.double()).abs()
        if tolerance is not None:
            bound = tolerance.atol + tolerance.rtol * x.double().abs().max()
            if bool((diff <= bound).all()):
                return None
        largest = diff.nan_to_num(float("inf")).max().item()
        return (
            f"differs by up to {largest:.3g}: {x.flatten()[:4].tolist()} in the oracle, {y.flatten()[:4].tolist()} here"
        )
    return f"{x.flatten()[:6].tolist()} in the oracle, {y.flatten()[:6].tolist()} here"


def _kind(v) -> str:
    return "None" if v is None else v[0]


def compare(expected: dict, actual: dict, tolerance=None, keys=None) -> list[str]:
    found = []
    for key in keys if keys is not None else sorted(set(expected) | set(actual)):
        if key not in expected or key not in actual:
            found.append(f"{key}: {'missing' if key not in actual else 'unexpected'}")
            continue
        problem = _same(expected[key], actual[key], tolerance)
        if problem:
            found.append(f"{key}: {problem}")
    return found


# -- calls ----------------------------------------------------------------------------------------------------


def _module(run: Run, target: str):
    return run.model.get_submodule(target) if target else run.model


def _route(run: Run, spec, call: Forward, rank: int) -> None:
    closed = {path: ranks for path, ranks in call.closed}
    for path in build.block_specs(spec):
        block = run.model.get_submodule(path)
        block.bypassed = path in call.bypassed
        if hasattr(block, "gate_open"):
            block.gate_open = rank not in closed.get(path, ())


class Context:
    def __init__(self, program: Program, rank: int, meshes, folder: str):
        self.program, self.rank, self.meshes, self.folder = program, rank, meshes, folder
        self.deferred = _oracle_synced_backwards(program)


def _oracle_synced_backwards(program: Program) -> dict[int, int]:
    """Without PyTorch 2.15: the backwards the oracle runs with gradient sync because under manual
    finalization a ``finalize_backward()`` with sync on completes them. Maps every call from such a
    backward up to that finalize (excluded) to the backward's index."""
    if PYTORCH_HAS_MANUAL_FINALIZATION:
        return {}
    deferred, manual, sync, waiting = {}, False, True, None
    for i, call in enumerate(program.calls):
        if isinstance(call, Setter) and not call.target:
            if call.method == "set_manual_backward_finalization":
                manual = bool(call.value)
            elif call.method == "set_requires_gradient_sync":
                sync = bool(call.value)
        elif isinstance(call, Backward):
            waiting = i if (manual and not sync) else None
        elif isinstance(call, FinalizeBackward):
            if waiting is not None and sync and manual:
                deferred.update(dict.fromkeys(range(waiting, i), waiting))
            waiting = None
    return deferred


def execute(ctx: Context, run: Run, index: int, call):
    """Make ``call`` on ``run``; returns the call's result (a loss, a norm, ...)."""
    oracle_run = run.name == "torch"
    if isinstance(call, Forward):
        _route(run, ctx.program.model, call, ctx.rank)
        x = build.batch(ctx.program.model, call.batch, ctx.meshes.data_rank)
        model = run.model
        if call.compiled and run.name == "fsdp2":
            if run.compiled is None:
                run.compiled = torch.compile(run.model, backend="aot_eager", fullgraph=True)
            model = run.compiled
        loss = build.loss_of(model(x))
        run.pending.append(loss)
        return loss.detach()
    if isinstance(call, Backward):
        if not run.pending:
            return None
        loss = run.pending[0]
        for more in run.pending[1:]:
            loss = loss + more
        run.pending.clear()
        if oracle_run and ctx.deferred.get(index) == index:
            run.model.set_requires_gradient_sync(True)
            loss.backward()
            run.model.set_requires_gradient_sync(False)
        else:
            loss.backward()
        return None
    if isinstance(call, Setter):
        module = _module(run, call.target)
        if oracle_run and not PYTORCH_HAS_MANUAL_FINALIZATION and call.method == "set_manual_backward_finalization":
            return None  # the oracle finalizes automatically (see the module's docstring)
        getattr(module, call.method)(call.value)
        return None
    if isinstance(call, FinalizeBackward):
        if oracle_run and not PYTORCH_HAS_MANUAL_FINALIZATION:
            return None
        run.model.finalize_backward()
        return None
    if isinstance(call, Unshard):
        _module(run, call.target).unshard()
        return None
    if isinstance(call, Reshard):
        _module(run, call.target).reshard()
        return None
    if isinstance(call, ZeroGrad):
        if call.ranks is None or ctx.rank in call.ranks:
            run.optimizer.zero_grad(set_to_none=call.set_to_none)
        return None
    if isinstance(call, OptimizerStep):
        run.optimizer.step()
        return None
    if isinstance(call, ClipGradNorm):
        clip = torch.nn.utils.clip_grad_norm_
        if call.fsdp2_function:
            from fsdp2 import clip_grad_norm_ as clip
        return clip(list(run.model.parameters()), call.max_norm)
    if isinstance(call, StateDict):
        if call.load:
            model_state, optimizer_state = run.saved[("state_dict", call.tag)]
            run.model.load_state_dict(model_state)
            run.optimizer.load_state_dict(optimizer_state)
            return None
        state = run.model.state_dict()
        run.saved[("state_dict", call.tag)] = (copy.deepcopy(state), copy.deepcopy(run.optimizer.state_dict()))
        return state
    if isinstance(call, Checkpoint):
        if oracle_run:  # the oracle of a save and load on the same world: its own state dicts
            if call.load:
                model_state, optimizer_state = run.saved[("checkpoint", call.tag)]
                run.model.load_state_dict(model_state)
                run.optimizer.load_state_dict(optimizer_state)
            else:
                saved = (copy.deepcopy(run.model.state_dict()), copy.deepcopy(run.optimizer.state_dict()))
                run.saved[("checkpoint", call.tag)] = saved
            return None
        from fsdp2 import checkpoint

        path = os.path.join(ctx.folder, f"{run.name}-{call.tag}")
        if call.load:
            checkpoint.load(path, run.model, run.optimizer)
        else:
            checkpoint.save(path, run.model, run.optimizer)
        return None
    raise TypeError(f"unknown call {call!r}")


# -- one program ----------------------------------------------------------------------------------------------


def _runs(program: Program) -> list[Run]:
    from fsdp2 import fully_shard

    runs = [Run("torch", torch_fsdp.fully_shard), Run("fsdp2", fully_shard)]
    if program.compiled:
        runs.append(Run("fsdp2-eager", fully_shard))
    return runs


# (oracle, subject) pairs compared after every call.
def _pairs(runs: list[Run]) -> list[tuple[Run, Run]]:
    by_name = {r.name: r for r in runs}
    if "fsdp2-eager" in by_name:
        return [(by_name["torch"], by_name["fsdp2-eager"]), (by_name["fsdp2-eager"], by_name["fsdp2"])]
    return [(by_name["torch"], by_name["fsdp2"])]


def _setup(ctx: Context, run: Run) -> None:
    spec = ctx.program.model
    model = build.build_model(spec, SEED)
    build.parallelize(model, spec, ctx.meshes)
    build.wrap_model(model, spec, ctx.meshes, run.fully_shard)
    run.model = model
    seen, run.params, run.names = set(), [], []
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            run.params.append(p)
            run.names.append(name)
    if ctx.program.optimizer == "sgd":
        run.optimizer = torch.optim.SGD(run.params, lr=0.1, momentum=0.9)
    else:
        run.optimizer = torch.optim.AdamW(run.params, lr=1e-2)


def _module_names(program: Program) -> set[str]:
    return {"FuzzModel"} | {cls.__name__ for cls in build.BLOCKS.values()}


def _acceptable_error(fsdp2_error: str, oracle_error: str, program: Program) -> bool:
    """Both raised: fsdp2's error is its own and names the module, or is PyTorch's very error."""
    if fsdp2_error.splitlines()[0] == oracle_error.splitlines()[0]:
        return True
    own = re.search(r"FSDPUsage\w*Error|CheckpointError", fsdp2_error) is not None
    return own and any(name in fsdp2_error for name in _module_names(program))


def _decide(program: Program, index: int, call, reports: list[dict]) -> Outcome | None:
    """Every rank's (errors by run, differences) after a call -> how the program ends, or None."""
    where = "building the model" if index < 0 else f"call {index}: {call!r}"
    for rank, report in enumerate(reports):
        for name, error in report["errors"].items():
            if error and HANG_ERRORS.search(error):
                status = "broken" if name == "torch" else "hang"
                return Outcome(status, index, f"{where}: {name} on rank {rank} hung:\n{error}", desynced=True)
    for rank, report in enumerate(reports):
        if report["differences"]:
            lines = "\n".join(report["differences"][:12])
            return Outcome("differs", index, f"{where}: on rank {rank}:\n{lines}")
    names = list(reports[0]["errors"])
    raised = {name: [r["errors"][name] for r in reports] for name in names}
    if not any(e for errors in raised.values() for e in errors):
        return None
    outcome = _judge_errors(program, index, call, where, names, raised)
    outcome.desynced = any(any(errors) and not all(errors) for errors in raised.values())
    return outcome


def _judge_errors(program: Program, index: int, call, where: str, names: list[str], raised: dict) -> Outcome:
    refused = None  # a deliberate refusal between one pair; the next pair is still judged (eager vs compiled)
    for oracle_name, subject in _pair_names(names):
        for rank, (expected, actual) in enumerate(zip(raised[oracle_name], raised[subject])):
            sides = ((subject, oracle_name, actual, expected), (oracle_name, subject, expected, actual))
            for alone, other, error, others_error in sides:  # an error one side raised alone
                if error and not others_error:
                    # The eager twin's refusals are fsdp2's against PyTorch, never against the compiled run.
                    refusal = (
                        None if (alone, other) == ("fsdp2-eager", "fsdp2") else oracle.refusal_for(alone, call, error)
                    )
                    if refusal is not None:
                        refused = refused or Outcome(
                            "refused", index, f"{where}: deliberate difference {refusal.name!r}"
                        )
                        continue
                    return Outcome(
                        "differs", index, f"{where}: {alone} raised on rank {rank}, {other} did not:\n{error}"
                    )
            if expected and actual and not _acceptable_error(actual, expected, program):
                return Outcome(
                    "differs",
                    index,
                    f"{where}: both raised on rank {rank}, but {subject}'s error is not an FSDPUsageError naming the "
                    f"module:\n{subject}: {actual}\n{oracle_name}: {expected}",
                )
    if refused is not None:
        return refused
    first = next(e for errors in raised.values() for e in errors if e)
    return Outcome("refused", index, f"{where}: every run raised:\n{first}")


def _pair_names(names: list[str]) -> list[tuple[str, str]]:
    if "fsdp2-eager" in names:
        return [("torch", "fsdp2-eager"), ("fsdp2-eager", "fsdp2")]
    return [("torch", "fsdp2")]


def _exchange(report: dict) -> list[dict]:
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report, group=build.control_group())
    return reports


def run_program(rank: int, ws: int, program: Program, status_dir: str | None = None, patience: float = 1) -> Outcome:
    """The harness's entry point: run ``program`` on this rank; every rank returns the same outcome.
    ``status_dir``: where each rank notes the call it is in (read back if a rank dies or hangs);
    ``patience``: a factor on the hang timeouts."""
    assert ws == program.world_size, (ws, program.world_size)
    start = time.monotonic()
    folder = [tempfile.mkdtemp(prefix="fsdp2-fuzz-") if rank == 0 else None]
    dist.broadcast_object_list(folder, group=build.control_group())
    if program.compiled:
        torch._dynamo.reset()
    runs = _runs(program)
    status = os.path.join(status_dir, f"rank{rank}") if status_dir else None
    try:
        with build.short_timeouts(HANG_S * patience), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*returned a view tensor")
            warnings.filterwarnings("ignore", message=".*reshard_after_forward=1")
            outcome = _run_calls(program, rank, ws, runs, folder[0], status, patience)
    finally:
        for run in runs:
            run.model = run.optimizer = run.compiled = None
            run.pending.clear()
            run.saved.clear()
        if program.compiled:
            torch._dynamo.reset()
        gc.collect()
        dist.barrier(group=build.control_group())
        if rank == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
    outcome.seconds = time.monotonic() - start
    return outcome


def _note(status: str | None, text: str) -> None:
    if status:
        with open(status, "w") as f:
            f.write(text)


def _run_calls(
    program: Program, rank: int, ws: int, runs: list[Run], folder: str, status: str | None, patience: float
) -> Outcome:
    """Building, then each call: every rank does its part, then all exchange their reports and
    decide together (an error in this code on one rank still reaches the exchange)."""
    ctx = None
    for index in range(-1, len(program.calls)):
        call = program.calls[index] if index >= 0 else None
        report = {"errors": {}, "differences": [], "tester": None}
        try:
            if index < 0:
                ctx = Context(program, rank, build.meshes(program.model.mesh, ws), folder)
            slow = program.compiled and (index < 0 or isinstance(call, (Forward, Backward)))
            build.set_timeout((COMPILED_HANG_S if slow else HANG_S) * patience)
            for run in runs:
                what = "building the model" if index < 0 else f"call {index}: {call!r}"
                _note(status, f"{what}, run {run.name}")
                report["errors"][run.name] = _call_and_observe(ctx, run, index, call)
            _note(status, f"comparing after {what}")
            report["differences"] = _differences(ctx, runs, index, call, report["errors"])
        except Exception:  # noqa: BLE001 - the tester's own error, reported as such
            report["tester"] = traceback.format_exc()
        reports = _exchange(report)
        failed = next((r["tester"] for r in reports if r["tester"]), None)
        if failed:
            return Outcome("broken", index, f"the tester failed at call {index}:\n{failed}", desynced=True)
        outcome = _decide(program, index, call, reports)
        if outcome is not None:
            outcome.calls_run = index + 1
            return outcome
    return Outcome("passed", len(program.calls) - 1, calls_run=len(program.calls))


def _call_and_observe(ctx: Context, run: Run, index: int, call) -> str | None:
    """Make the call (or build the model) on ``run`` and observe it; the error text if it raised."""
    try:
        result = None
        if index < 0:
            _setup(ctx, run)
        else:
            result = execute(ctx, run, index, call)
    except Exception as error:  # noqa: BLE001 - compared with the oracle's
        return _error_text(error)
    previous, run.last = run.last, observe(run, result)
    run.previous = previous
    if index >= 0 and ctx.deferred.get(index) == index:
        run.before_deferred = previous
    return None


def _differences(ctx: Context, runs: list[Run], index: int, call, errors: dict) -> list[str]:
    found = []
    for expected_run, actual_run in _pairs(runs):
        if errors[expected_run.name] or errors[actual_run.name]:
            continue
        pair = (expected_run.name, actual_run.name)
        tolerance = oracle.tolerance_for(ctx.program, pair)
        skip = oracle.unobserved(ctx.program, pair)
        expected, actual = (
            {k: v for k, v in seen.items() if not any(re.search(pattern, k) for pattern in skip)}
            for seen in (expected_run.last, actual_run.last)
        )
        if expected_run.name == "torch" and index in ctx.deferred:
            # The oracle reduced at this backward; PyTorch 2.15 (and fsdp2) at the next finalize.
            grads = [k for k in actual if k.endswith(".grad")]
            found += [
                f"{actual_run.name}: {d} (a gradient changed before finalize_backward)"
                for d in compare(actual_run.before_deferred, actual, keys=grads)
            ]
            others = [k for k in expected if not k.endswith(".grad")]
            found += [
                f"{actual_run.name} against {expected_run.name}: {d}"
                for d in compare(expected, actual, tolerance, others)
            ]
            continue
        found += [f"{actual_run.name} against {expected_run.name}: {d}" for d in compare(expected, actual, tolerance)]
    return found
