"""Gather codecs: how one parameter travels through its group's all-gather.

A codec says which columns (dtype, elements per rank) the parameter takes in the group's
all-gather buffer (fsdp2.runtime.buckets), how this rank's shard is packed into its slots of
them, and how the gathered columns (``world x numel`` blocks) become the unsharded parameter.

- :class:`PlainCodec` (the default): the padded shard, cast to ``param_dtype``; the gathered rows
  are the padded unsharded parameter. A group of only these keeps one fused copy in and one
  fused copy out (fsdp2.runtime.gather).
- :class:`QuantizedCodec` (``AllGatherPolicy``): int8 / float8 values and per-block scales in
  one uint8 column (fsdp2.runtime.quantize), dequantized into ``param_dtype``.
- ``SubclassCodec`` (fsdp2.runtime.extensions): a tensor subclass's own ``fsdp_pre_all_gather`` /
  ``fsdp_post_all_gather``, as PyTorch's FSDP2 calls them.

A codec is its pair of functions of tensors, ``encode`` (a shard to the tensors it sends) and
``decode`` (the gathered rows to the unsharded parameter): the compiled step traces exactly
these, and eager's ``pack`` copies ``encode``'s tensors into the group's buffer unless the codec
writes in place (the default codec casts its shard straight into its slot). ``unpack`` is eager's
in-place form of ``decode``, into the unsharded storage the group keeps between steps.
Codecs hand back the plain copies they need as ``(destination, source)`` pairs, so a group
still copies everything in (and out) with one fused ``_foreach_copy_``; what is not a copy
(quantizing, the extension's post hook) they do themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from fsdp2.layout.shard_layout import ShardLayout
from fsdp2.policies import AllGatherPolicy
from fsdp2.runtime import quantize

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class CodecParam(Protocol):
    """What codecs and the communication buckets (fsdp2.runtime.buckets) use of a parameter.

    fsdp2.runtime.sharded_param.ShardedParam is the one there is; it sits above both (every
    parameter starts on :class:`PlainCodec`), so they name this protocol, not it.
    """

    layout: ShardLayout
    param_dtype: torch.dtype
    device: torch.device
    codec: GatherCodec

    @property
    def local_shard(self) -> torch.Tensor: ...

    def copy_in_pair(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def copy_gathered_out(self, gathered: torch.Tensor) -> None: ...

    def unsharded_storage(self) -> torch.Tensor: ...

    def on_compute_device(self, shard: torch.Tensor) -> torch.Tensor: ...

    def gather_target(self) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class Column:
    """One tensor a parameter contributes to its group's all-gather: ``numel`` elements of
    ``dtype`` per rank (the default codec: its padded shard in ``param_dtype``)."""

    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class GatherCodec:
    """The protocol, with the default codec's answers where a codec has nothing to do.

    Called by fsdp2.runtime.gather, in this order for a gather from the shards: ``prepare``,
    ``columns``, ``pack`` (all-gather stream), then after the collective ``unpack`` and ``finish``
    (compute stream); ``release`` when the group reshards.
    """

    plain = False  # the default codec: the group may fuse its copies across parameters
    # reshard_after_forward=k: this parameter's subgroup rows can be rebuilt from its unsharded form
    # (otherwise the gathered columns themselves are held: see GroupGather.finish).
    rebuilt_from_unsharded = False
    builds_unsharded = False  # makes the unsharded parameter object itself (else: ShardedParam's storage)
    prepares = False  # its columns are known only after prepare()
    holds_memory = False  # release() has something to free (else the group skips calling it)

    def __init__(self, param: CodecParam):
        self.param = param

    def same_as(self, other: "GatherCodec") -> bool:
        """``other`` does what this codec does (so a re-assignment keeps the current one)."""
        return type(other) is type(self)

    def prepare(self) -> None:
        """Before every gather from the shards (e.g. run the tensor subclass's pre-all-gather hook)."""

    def columns(self) -> tuple[Column, ...]:
        raise NotImplementedError

    def pack(self, slots: list[torch.Tensor]) -> Pairs:
        """Fill this rank's ``slots`` (one per column, typed); return the plain copies to fuse.
        By default the copies of :meth:`encode`'s tensors (a codec may write in place instead)."""
        wire, _ = self.encode(self.param.local_shard)
        return [(slot, t.reshape(-1)) for slot, t in zip(slots, wire)]

    def unpack(self, blocks: list[torch.Tensor]) -> Pairs:
        """From the gathered ``world x numel`` ``blocks`` (one per column, views of the group's
        buffer, valid until ``finish``) fill the unsharded parameter; return copies to fuse."""
        raise NotImplementedError

    def finish(self) -> None:
        """After the group's fused copy-out."""

    def unshard_locally(self) -> Pairs:
        """One-rank shard group: nothing is communicated, the shard is the whole parameter."""
        pair = self.param.copy_in_pair(self.param.unsharded_storage())
        return [pair] if pair is not None else []

    def release(self) -> None:
        """The group reshards: free what the codec holds besides the unsharded storage."""

    # -- the same as functions of tensors (the compiled step traces them) -------------------------

    def encode(self, shard: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], object]:
        """``(wire, context)``: the tensors this rank's ``shard`` sends (one per column, on the
        compute device) and what :meth:`decode` needs besides the gathered rows."""
        raise NotImplementedError

    def decode(self, shard: torch.Tensor, wire: tuple[torch.Tensor, ...], context, blocks) -> torch.Tensor:
        """The unsharded parameter from the gathered ``blocks`` (``world x numel`` per column, in
        each column's dtype); ``wire`` and ``context`` are :meth:`encode`'s."""
        raise NotImplementedError


def plain_column(layout: ShardLayout, param_dtype: torch.dtype) -> Column:
    return Column(param_dtype, layout.padded_shard_numel)


def quantized_column(layout: ShardLayout, policy: AllGatherPolicy) -> Column:
    return Column(torch.uint8, quantize.wire_bytes(layout.padded_shard_numel, policy))


class PlainCodec(GatherCodec):
    """The padded shard, cast to ``param_dtype``."""

    plain = True
    rebuilt_from_unsharded = True

    def columns(self) -> tuple[Column, ...]:
        return (plain_column(self.param.layout, self.param.param_dtype),)

    def pack(self, slots: list[torch.Tensor]) -> Pairs:
        pair = self.param.copy_in_pair(slots[0])
        return [pair] if pair is not None else []

    def unpack(self, blocks: list[torch.Tensor]) -> Pairs:
        target = self.param.gather_target()
        if target is None:
            self.param.copy_gathered_out(blocks[0])
            return []
        return [(target, blocks[0])]

    def encode(self, shard: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], object]:
        p = self.param
        return (p.on_compute_device(p.layout.padded_slot(shard)).to(p.param_dtype),), None

    def decode(self, shard: torch.Tensor, wire: tuple[torch.Tensor, ...], context, blocks) -> torch.Tensor:
        return self.param.layout.full_from_rank_rows(blocks[0])


class QuantizedCodec(GatherCodec):
    """Block-quantized values and scales in one uint8 column, dequantized into ``param_dtype``.

    The shard is quantized from its own dtype (the fp32 master, not a bf16 copy of it), padding
    rows as zeros. ``rebuilt_from_unsharded`` is False: reshard_after_forward=k holds the gathered
    wire rows themselves (half the bytes of ``param_dtype`` rows, re-gathered as they are), so
    backward dequantizes exactly what forward did, without quantizing dequantized values again.
    """

    def __init__(self, param: CodecParam, policy: AllGatherPolicy):
        super().__init__(param)
        self.policy = policy

    def same_as(self, other: GatherCodec) -> bool:
        return isinstance(other, QuantizedCodec) and other.policy == self.policy

    def columns(self) -> tuple[Column, ...]:
        return (quantized_column(self.param.layout, self.policy),)

    def quantize(self, shard: torch.Tensor, slot: torch.Tensor) -> None:
        """``shard`` (this rank's, in its own dtype) in wire format into ``slot`` (uint8)."""
        layout = self.param.layout
        shard = self.param.on_compute_device(shard)  # CPU offload: quantize on the device
        if layout.dim != 0 and 0 < layout.local_rows < layout.chunk:
            # Padding inside the slot (not a flat prefix of it): lay the shard out padded first.
            padded = shard.new_zeros(layout.padded_shard_shape)
            layout.shard_rows(padded.view(-1)).copy_(shard)
            shard = padded
        quantize.quantize_into(shard, slot, self.policy, numel=layout.padded_shard_numel)

    def unpack(self, blocks: list[torch.Tensor]) -> Pairs:
        p = self.param
        target = p.gather_target()
        if target is None:
            p.copy_gathered_out(self.dequantized_rows(blocks[0]))
        else:
            quantize.dequantize_from(blocks[0], target, self.policy)
        return []

    def encode(self, shard: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], object]:
        (column,) = self.columns()
        slot = torch.empty(column.numel, dtype=column.dtype, device=self.param.device)  # quantized on the device
        self.quantize(shard, slot)
        return (slot,), None

    def decode(self, shard: torch.Tensor, wire: tuple[torch.Tensor, ...], context, blocks) -> torch.Tensor:
        return self.param.layout.full_from_rank_rows(self.dequantized_rows(blocks[0]))

    def dequantized_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """Every rank's slot (``gathered``: ``world x wire bytes``) decoded into a new
        ``world x padded_shard_numel`` tensor in ``param_dtype``."""
        p = self.param
        rows = torch.empty(p.layout.world, p.layout.padded_shard_numel, dtype=p.param_dtype, device=p.device)
        quantize.dequantize_from(gathered, rows, self.policy)
        return rows
