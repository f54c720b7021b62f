"""Block-quantized all-gather payloads: 1-byte values plus one scale per block, in a uint8 buffer.

Only the communicated copy of a parameter is quantized; the sharded (master) parameter is never
touched. Each rank quantizes its padded shard slot, one uint8 all-gather moves values and scales
of a whole group together, and every rank dequantizes the gathered rows into ``param_dtype``.

Quantization, per block of ``block_size`` consecutive elements of a slot (computed in fp32)::

    scale = absmax(block) / qmax        rounded to policy.scale_dtype (bf16 or fp32)
    code  = cast(clamp(x / scale, -qmax, qmax))   x / scale rounded to fp32 first
    x'    = code * scale                rounded to fp32, then to the output dtype

- int8: symmetric, ``qmax = 127``, ``cast`` rounds half to even. Error per element is at most
  half a step, ``scale / 2``, i.e. about ``absmax / 254``.
- float8_e4m3fn: ``qmax = 448`` (the format's largest finite value), so the block's absmax maps
  to the top of the format and ``cast`` rounds to nearest even: relative error at most 2^-4 for
  elements whose scaled value ``|x| / scale`` is at least 2^-6 (e4m3's smallest normal);
  smaller ones land on e4m3's subnormal grid, absolute error at most ``2^-10 * scale``.
- The clamp acts where the stored scale is a little below absmax / qmax (fp32 or bf16
  rounding), where the scale underflowed to 0, and on infinities.
- A block of zeros gets scale 0 and codes 0 (0/0 is NaN, read as code 0): it comes back as
  exact zeros, as does a block whose scale underflows to 0 (absmax below ~1e-43).
- A block holding inf or NaN gets an inf/NaN scale, and codes 0 for its NaNs, ``+-qmax`` for
  its infs: the whole block dequantizes to NaN. A divergence stays visible (it is not turned
  into finite values), and it spreads no further than its block.

Wire format of one slot of ``numel`` elements (``nblocks = ceil(numel / block_size)``)::

    [ values: nblocks * block_size bytes | scales: nblocks * scale bytes | zeros to 16-byte multiple ]

Values are the raw bytes of int8 / float8_e4m3fn codes; the tail block is zero-padded (its
padding codes are 0). ``block_size`` is a multiple of 16 and every slot a multiple of 16 bytes,
so in a buffer of slots side by side (one per parameter, as fsdp2's flat gather buffer lays
out its columns, see :mod:`fsdp2.layout.shard_layout`) and of ranks one after another, every value
and scale region starts 16-byte aligned: scales view as fp32 / bf16 in place, with no copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fsdp2.policies import BLOCK_SIZE_MULTIPLE, AllGatherPolicy

# A block of whole multiples of 16 elements ends 16-byte aligned, and so does every slot.
SLOT_ALIGN = BLOCK_SIZE_MULTIPLE


def _regions(numel: int, policy: AllGatherPolicy) -> tuple[int, int, int]:
    """(blocks, value bytes, scale bytes) of a slot of ``numel`` elements."""
    nblocks = -(-numel // policy.block_size)
    return nblocks, nblocks * policy.block_size, nblocks * policy.scale_dtype.itemsize


def wire_bytes(numel: int, policy: AllGatherPolicy) -> int:
    """Bytes one rank's slot of ``numel`` elements occupies in the quantized all-gather."""
    _, values, scales = _regions(numel, policy)
    return -(-(values + scales) // SLOT_ALIGN) * SLOT_ALIGN


def quantize_into(shard: torch.Tensor, out: torch.Tensor, policy: AllGatherPolicy, numel: int | None = None) -> None:
    """Write ``shard`` (any float dtype and shape, read flat) in wire format into ``out``.

    ``out`` is a 1-D uint8 tensor of ``wire_bytes(numel, policy)`` bytes; ``numel`` defaults to
    ``shard.numel()`` and may be larger: the slot's missing tail (a rank's padding) reads as zeros.
    """
    numel = shard.numel() if numel is None else numel
    _check_wire(out, (wire_bytes(numel, policy),), "out")
    if not shard.is_floating_point() or shard.numel() > numel:
        raise ValueError(
            f"quantize_into: shard must be floating point with at most {numel} elements, "
            f"got {shard.dtype} {tuple(shard.shape)}"
        )
    nblocks, nvalues, nscales = _regions(numel, policy)
    if not nblocks:
        return
    x = shard.reshape(-1).float()  # fp32 arithmetic for every input (bf16/fp16 convert exactly)
    if x.numel() < nvalues:
        x = F.pad(x, (0, nvalues - x.numel()))  # tail block (and missing rows) quantize as zeros
    blocks = x.view(nblocks, policy.block_size)
    scale = _round_to(blocks.abs().amax(dim=1, keepdim=True) / policy.qmax, policy.scale_dtype)
    out[nvalues : nvalues + nscales].view(policy.scale_dtype).copy_(scale.view(-1))
    # NaN codes (0/0 in a zero block, or NaN inputs) become 0; infinities clamp to +-qmax.
    codes = (blocks / scale).clamp_(-policy.qmax, policy.qmax).nan_to_num_(0.0)
    if policy.dtype == torch.int8:
        codes.round_()  # half to even; float8's cast rounds by itself
    out[:nvalues].view(policy.dtype).view(nblocks, policy.block_size).copy_(codes)
    out[nvalues + nscales :].zero_()  # alignment padding: deterministic bytes on the wire


def _round_to(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``scale`` rounded (to nearest even) to ``dtype``'s precision, still in fp32.

    Quantizing must divide by exactly the scale that is stored. Spelled in integer ops for
    bf16 because inductor drops a ``.to(torch.bfloat16).float()`` round trip inside a kernel.
    """
    if dtype == torch.float32:
        return scale
    # Round half to even at bit 16, then drop the low 16 bits.
    bits = scale.view(torch.int32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
    return torch.where(scale.isnan(), scale, bits.view(torch.float32))  # keep NaN payloads NaN


def dequantize_from(gathered: torch.Tensor, out: torch.Tensor, policy: AllGatherPolicy) -> None:
    """Decode every rank's slot: ``gathered`` (``world x wire_bytes(n)`` uint8) into ``out`` (``world x n``).

    Both may be column blocks of wider row-major buffers (row strides differ from their widths),
    e.g. one parameter's columns of a group's gathered buffer and of its unsharded storage.
    """
    world, numel = out.shape
    _check_wire(gathered, (world, wire_bytes(numel, policy)), "gathered")
    if not out.is_floating_point() or out.stride(-1) != 1:
        raise ValueError(
            f"dequantize_from: out must be floating point with unit stride along dim 1, "
            f"got {out.dtype} strides {out.stride()}"
        )
    nblocks, nvalues, nscales = _regions(numel, policy)
    if not nblocks:
        return
    size = policy.block_size
    codes = gathered[:, :numel].view(policy.dtype)  # the tail block's padding codes are skipped
    scales = gathered[:, nvalues : nvalues + nscales].view(policy.scale_dtype)
    if out.dtype == torch.float32 or out.dtype == policy.scale_dtype:
        # Codes and scales are exact in out's dtype and their product rounds once (bf16
        # arithmetic runs in fp32): compute in place, no temporary.
        product = out
        product.copy_(codes)
        scales = scales.to(out.dtype)
    else:  # e.g. fp32 scales into bf16, or fp16 out: fp32, then one rounding into ``out``
        product = codes.float()
        scales = scales.float()
    full = numel // size
    if full:
        product[:, : full * size].view(world, full, size).mul_(scales[:, :full, None])
    if numel > full * size:
        product[:, full * size :].mul_(scales[:, full:])
    if product is not out:
        out.copy_(product)


def _check_wire(buffer: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if buffer.dtype != torch.uint8 or tuple(buffer.shape) != shape or buffer.stride(-1) != 1:
        raise ValueError(
            f"{name} must be a uint8 tensor of shape {shape} with unit stride along its last dim, "
            f"got {buffer.dtype} {tuple(buffer.shape)} strides {buffer.stride()}"
        )
