"""The float64 reference of the low-precision all-gather's block quantizer (fsdp2.runtime.quantize).

A second implementation written plainly in float64: fp32 rounding applied where the format says
"in fp32"; e4m3 encoded from a table of its 127 non-negative finite values, nearest, ties to even.
"""

from __future__ import annotations

import math

import torch

from fsdp2 import AllGatherPolicy
from fsdp2.runtime.quantize import SLOT_ALIGN

_codes = torch.arange(127, dtype=torch.int64)  # e4m3fn codes 0x00..0x7E: the non-negative finite values
_exp, _man = _codes >> 3, (_codes & 7).double()
E4M3_GRID = torch.where(_exp == 0, _man / 8 * 2.0**-6, (1 + _man / 8) * 2.0 ** (_exp - 7).double())
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # E4M3_GRID[-1] is 448


def to_fp32(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to fp32 (still float64)."""
    return x.to(torch.float32).double()


def e4m3_encode(t: torch.Tensor) -> torch.Tensor:
    """Codes of float64 values in [-448, 448]: nearest grid value, ties to the even code."""
    mag = t.abs()
    hi = torch.searchsorted(E4M3_GRID, mag).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    up = (E4M3_GRID[hi] - mag < mag - E4M3_GRID[lo]) | ((E4M3_GRID[hi] - mag == mag - E4M3_GRID[lo]) & (hi % 2 == 0))
    return torch.where(up, hi, lo) | (t.signbit().long() << 7)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    return torch.where(codes >= 128, -1.0, 1.0).double() * E4M3_GRID[codes & 127]


def reference_quantize(x: torch.Tensor, policy: AllGatherPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """(wire bytes, per-block scales as float64) of a finite 1-D ``x``."""
    size, numel = policy.block_size, x.numel()
    nblocks = math.ceil(numel / size)
    padded = torch.zeros(nblocks * size, dtype=torch.float64)
    padded[:numel] = to_fp32(x.double())
    blocks = padded.view(nblocks, size)
    scale = to_fp32(blocks.abs().amax(dim=1) / QMAX[policy.dtype]).to(policy.scale_dtype)
    s = scale.double()
    t = to_fp32(blocks / s[:, None]).clamp(-QMAX[policy.dtype], QMAX[policy.dtype])  # IEEE: x/0 is +-inf, 0/0 NaN
    t[t.isnan()] = 0.0
    if policy.dtype == torch.int8:
        codes = t.round().to(torch.int8).view(torch.uint8)  # round() on float64 is half to even
    else:
        codes = e4m3_encode(t).to(torch.uint8)
    scale_bytes = scale.view(torch.uint8)
    used = codes.numel() + scale_bytes.numel()
    pad = torch.zeros(-used % SLOT_ALIGN, dtype=torch.uint8)
    return torch.cat([codes.flatten(), scale_bytes, pad]), s


def reference_dequantize(wire: torch.Tensor, numel: int, policy: AllGatherPolicy, dtype: torch.dtype) -> torch.Tensor:
    size = policy.block_size
    nblocks = math.ceil(numel / size)
    codes = wire[: nblocks * size]
    scales = wire[nblocks * size : nblocks * size + nblocks * policy.scale_dtype.itemsize].view(policy.scale_dtype)
    if policy.dtype == torch.int8:
        values = codes.view(torch.int8).double()
    else:
        values = e4m3_decode(codes.long())
    product = to_fp32(values.view(nblocks, size) * scales.double()[:, None])  # exact in float64, then fp32
    return product.flatten()[:numel].to(dtype)
