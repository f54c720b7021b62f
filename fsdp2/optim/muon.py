"""``fsdp2.optim.Muon``: ``torch.optim.Muon``'s update on fsdp2-sharded parameters, each matrix orthogonalized once.

Per step, for the matrices of every param group with ``use_muon=True``:

1. momentum, elementwise on each rank's shards (``buf.lerp_(grad, 1 - momentum)``, Nesterov);
2. one all-to-all per shard group sends the updates' shards, in bfloat16, to each matrix's owner
   rank (owners balanced by Newton-Schulz flops, see :mod:`fsdp2.optim.whole_matrix`);
3. each owner runs Newton-Schulz on its whole matrices; one all-to-all sends the shards back;
4. decoupled weight decay and the shape-adjusted learning rate, elementwise on the shards.

Newton-Schulz casts its input to bfloat16 first and returns bfloat16, so sending both ways in
bfloat16 changes no bit: the result is the unsharded ``torch.optim.Muon``'s for the same gradients.
Groups with ``use_muon=False`` take an AdamW step (``torch.optim.AdamW``'s update) on the shards.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.adamw import adamw

from fsdp2 import compat
from fsdp2.optim.newton_schulz import (
    DEFAULT_COEFFICIENTS,
    DEFAULT_EPS,
    DEFAULT_STEPS,
    DTYPE,
    newton_schulz,
    newton_schulz_flops,
)
from fsdp2.optim.whole_matrix import Sharding, WholeMatrixSchedule

# Keys of a Muon group that mean nothing to an AdamW group (dropped there, so state dicts stay honest).
_MUON_ONLY = ("momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn", "flatten")
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return compat.local_tensor(tensor) if isinstance(tensor, DTensor) else tensor


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The 2-D matrix a parameter is orthogonalized as: itself, or ``shape[0] x rest`` when flattened."""
    return (shape[0], math.prod(shape[1:]))


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, int]) -> float:
    """``torch.optim.Muon``'s learning-rate scaling for a ``rows x cols`` matrix."""
    rows, cols = shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))  # "match_rms_adamw" (Moonshot's)


class Muon(Optimizer):
    """Muon for fsdp2 (or plain) parameters, with an AdamW fallback for non-matrix parameters.

    Arguments, defaults and the update of ``torch.optim.Muon`` (torch 2.11-2.13): ``lr=1e-3``,
    ``weight_decay=0.1``, ``momentum=0.95``, ``nesterov=True``, ``ns_coefficients=(3.4445,
    -4.7750, 2.0315)``, ``eps=1e-7``, ``ns_steps=5``, ``adjust_lr_fn=None`` ("original":
    ``sqrt(max(1, rows/cols))``; or "match_rms_adamw": ``0.2 * sqrt(max(rows, cols))``).

    Beyond it:

    - ``flatten=True``: parameters of more than 2 dims (conv kernels) are orthogonalized as
      ``shape[0] x prod(shape[1:])`` matrices (and their lr adjusted for that shape); without
      it such a parameter in a Muon group is an error, as in torch.
    - A param group with ``"use_muon": False`` takes AdamW steps instead, with its own ``lr``,
      ``weight_decay``, ``betas`` and ``eps`` (defaults: ``adamw_lr`` and ``adamw_weight_decay``,
      which default to ``lr`` and ``weight_decay``; ``adamw_betas=(0.9, 0.999)``,
      ``adamw_eps=1e-8``). :func:`muon_param_groups` splits a model the usual way.

    State: ``momentum_buffer`` (Muon) or ``step``/``exp_avg``/``exp_avg_sq`` (AdamW) per
    parameter, DTensors sharded like the parameter, so ``fsdp2.checkpoint`` saves, loads and
    reshards it as it does ``torch.optim.AdamW``'s. ``newton_schulz_flops`` counts the
    Newton-Schulz flops this rank ran (see :func:`fsdp2.optim.newton_schulz.newton_schulz_flops`).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        flatten: bool = False,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
    ) -> None:
        self._adamw_defaults = {
            "lr": lr if adamw_lr is None else adamw_lr,
            "betas": adamw_betas,
            "eps": adamw_eps,
            "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
        }
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "flatten": flatten,
            "use_muon": True,
        }
        super().__init__(params, defaults)
        self.newton_schulz_flops = 0
        self._schedule: WholeMatrixSchedule | None = None
        self._schedule_key: tuple | None = None

    # -- param groups --------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        use_muon = param_group.get("use_muon", True)
        if not use_muon:
            for key, value in self._adamw_defaults.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if use_muon:
            _check_muon_group(group, len(self.param_groups) - 1)
        else:
            for key in _MUON_ONLY:
                group.pop(key, None)
            _check_adamw_group(group, len(self.param_groups) - 1)

    # -- step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrices = []
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if p.grad is not None:
                        if torch.is_complex(p):
                            raise RuntimeError("fsdp2.optim.Muon does not support complex parameters")
                        if p.grad.is_sparse:
                            raise RuntimeError("fsdp2.optim.Muon does not support sparse gradients")
                        matrices.append((p, group))
            else:
                self._adamw_step(group)
        if matrices:
            self._muon_step(matrices)
        return loss

    def _muon_step(self, matrices: list[tuple[torch.Tensor, dict]]) -> None:
        updates = []
        for p, group in matrices:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - group["momentum"])
            updates.append(grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)

        def orthogonalize(i: int, whole: torch.Tensor) -> torch.Tensor:
            group = matrices[i][1]
            matrix = whole.reshape(_matrix_shape(whole.shape))
            self.newton_schulz_flops += newton_schulz_flops(matrix.shape, group["ns_steps"])
            result = newton_schulz(matrix, tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"])
            return result.reshape(whole.shape)

        orthogonal = self._schedule_for(matrices).apply(updates, orthogonalize, DTYPE)
        for (p, group), update in zip(matrices, orthogonal):
            lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
            local = _local(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], _matrix_shape(p.shape)))

    def _schedule_for(self, matrices: list[tuple[torch.Tensor, dict]]) -> WholeMatrixSchedule:
        """The owner schedule of the matrices that have gradients; rebuilt only when that set changes."""
        key = tuple((id(p), group["ns_steps"]) for p, group in matrices)
        if key != self._schedule_key:
            self._schedule = WholeMatrixSchedule(
                [p for p, _ in matrices],
                costs=[newton_schulz_flops(_matrix_shape(p.shape), group["ns_steps"]) for p, group in matrices],
                names=[_param_name(group, p) for p, group in matrices],
            )
            self._schedule_key = key
        return self._schedule

    def expected_comm_bytes(self) -> int:
        """Bytes this rank hands to ``all_to_all`` in a step, for the Muon parameters that now have gradients.

        What ``count_comm()`` records as ``all_to_all`` for that step: per shard group, this
        rank's shards of every matrix (to the owners) plus every rank's shard of the matrices
        it owns and one status element per rank (back), in bfloat16. Summed over a group of N
        ranks: ``2 x (2 x numel of the matrices + N^2)`` bytes.
        """
        matrices = [(p, g) for g in self.param_groups if g["use_muon"] for p in g["params"] if p.grad is not None]
        return self._schedule_for(matrices).bytes_sent(DTYPE.itemsize) if matrices else 0

    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        has_complex = False
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("fsdp2.optim.Muon: AdamW does not support sparse gradients")
            state = self.state[p]
            if not state:
                scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state["step"] = torch.tensor(0.0, dtype=scalar_dtype)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            has_complex |= torch.is_complex(p)
            params.append(_local(p))
            grads.append(_local(p.grad))
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            has_complex=has_complex,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def _param_name(group: dict, p: torch.Tensor) -> str:
    names = group.get("param_names")
    if names:
        for name, q in zip(names, group["params"]):
            if q is p:
                return f"parameter {name!r}"
    return f"a parameter of shape {tuple(p.shape)}"


def _check_muon_group(group: dict, index: int) -> None:
    where = f"fsdp2.optim.Muon param group {index}"
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}: Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"{where}: learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= group["momentum"]:
        raise ValueError(f"{where}: momentum should be >= 0 but is: {group['momentum']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"{where}: weight decay should be >= 0 but is: {group['weight_decay']}")
    if group["adjust_lr_fn"] not in _ADJUST_LR_FNS:
        raise ValueError(
            f"{where}: adjust_lr_fn {group['adjust_lr_fn']!r} is not supported; use one of {_ADJUST_LR_FNS}"
        )
    if not 0 < group["ns_steps"] < 100:
        raise ValueError(f"{where}: ns_steps must be between 1 and 99, got {group['ns_steps']}")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError(f"{where}: ns_coefficients must be 3 numbers (a, b, c), got {group['ns_coefficients']}")
    for p in group["params"]:
        name = _param_name(group, p)
        if p.ndim < 2 or (p.ndim > 2 and not group["flatten"]):
            hint = ", or pass flatten=True to orthogonalize it as a shape[0] x rest matrix" if p.ndim > 2 else ""
            raise ValueError(
                f"{where}: {name} has shape {tuple(p.shape)}; Muon orthogonalizes 2-D matrices. Optimize it with "
                "AdamW instead: put it in a group with 'use_muon': False (fsdp2.optim.muon_param_groups(model) "
                f"does so for embeddings, the head and every non-matrix parameter){hint}."
            )
        Sharding.of(p, name)  # refuses tensor-parallel + FSDP parameters now, not at the first step


def _check_adamw_group(group: dict, index: int) -> None:
    where = f"fsdp2.optim.Muon AdamW param group {index}"
    beta1, beta2 = group["betas"]
    if not 0.0 <= group["lr"]:
        raise ValueError(f"{where}: learning rate should be >= 0 but is: {group['lr']}")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"{where}: eps should be >= 0 but is: {group['eps']}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"{where}: betas must be in [0, 1), got {group['betas']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"{where}: weight decay should be >= 0 but is: {group['weight_decay']}")


def default_use_muon(model: nn.Module) -> Callable[[str, nn.Parameter], bool]:
    """The usual split: Muon for 2-D weights of hidden layers; AdamW for embeddings
    (``nn.Embedding`` modules and modules named ``*embed*``), heads (modules named ``*head*``),
    and every parameter that is not 2-D (biases, norms)."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}

    def use_muon(name: str, param: nn.Parameter) -> bool:
        modules = name.split(".")[:-1]
        named_out = any("embed" in part or "head" in part for part in modules)
        return param.ndim == 2 and id(param) not in embeddings and not named_out

    return use_muon


def muon_param_groups(model: nn.Module, use_muon: Callable[[str, nn.Parameter], bool] | None = None) -> list[dict]:
    """``[{'params': [(name, p), ...]}, {'params': [...], 'use_muon': False}]`` for ``Muon(...)``.

    ``use_muon(name, param)`` picks the Muon parameters (default: :func:`default_use_muon`);
    the rest go to the AdamW group. Frozen parameters are left out; empty groups are dropped.
    Pass extra AdamW settings by editing the second dict (e.g. ``groups[1]["lr"] = 3e-4``).
    """
    rule = use_muon or default_use_muon(model)
    muon, other = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if rule(name, p) else other).append((name, p))
    groups = [{"params": muon, "use_muon": True}, {"params": other, "use_muon": False}]
    return [g for g in groups if g["params"]]
