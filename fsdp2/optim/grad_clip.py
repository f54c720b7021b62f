"""Gradient-norm clipping across parameters that live on different meshes.

With tensor parallelism, TP parameters are DTensors on the (dp, tp) mesh while the rest are
on the dp mesh, and DTensor cannot combine norms across meshes, so
``torch.nn.utils.clip_grad_norm_`` fails there. We take each mesh's norm separately
(a fully reduced scalar) and combine the per-mesh norms, which is the same p-norm.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

from fsdp2 import compat


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.utils.clip_grad_norm_`` that also handles mixed meshes.

    Returns the total norm of all gradients as a plain tensor.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads_by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            grads_by_mesh.setdefault(key, []).append(p.grad)
    if not grads_by_mesh:
        return torch.tensor(0.0)
    mesh_norms = []
    for grads in grads_by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        mesh_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = mesh_norms[0].device
    total = torch.nn.utils.get_total_norm([n.to(device) for n in mesh_norms], norm_type, error_if_nonfinite, foreach)
    # Scaling every local tensor by one coefficient is exact for any placement.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in grads_by_mesh.values():
        locals_ = [compat.local_tensor(g) if isinstance(g, DTensor) else g for g in grads]
        compat.foreach_mul_(locals_, coef.to(locals_[0].device))
    return total
