"""Newton-Schulz orthogonalization of a matrix, as ``torch.optim.Muon`` computes it, and its flop count.

The quintic iteration (Keller Jordan's Muon) maps ``X`` to roughly ``U V^T`` (``X = U S V^T``).
We do exactly what torch 2.11-2.13's Muon does, in the same order and dtype (bfloat16), so an
owner rank that orthogonalizes a whole matrix gets the bits an unsharded ``torch.optim.Muon``
gets from the same input.
"""

from __future__ import annotations

import torch

# torch.optim.Muon's defaults (torch 2.11 and 2.13 agree).
DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_EPS = 1e-7
DEFAULT_STEPS = 5
DTYPE = torch.bfloat16  # the iteration runs in bfloat16, whatever the input's dtype


def newton_schulz(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The orthogonalized ``matrix`` (2-D), in bfloat16; ``matrix`` itself is not modified."""
    a, b, c = coefficients
    x = matrix.to(DTYPE, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide side: the Gram matrix is the smaller square
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G@G
        x = torch.addmm(x, poly, x, beta=a)  # a*X + (b*G + c*G@G) @ X
    return x.T if tall else x


def newton_schulz_flops(shape: tuple[int, int] | torch.Size, steps: int) -> int:
    """Multiply-add flops (2 per multiply-add) of :func:`newton_schulz` on a matrix of ``shape``.

    Per step, with ``m <= n`` the matrix's short and long side: the Gram matrix ``2 m^2 n``,
    the polynomial ``2 m^3`` and the update ``2 m^2 n``.
    """
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m**3)
