"""Parameters sharing one dtype, packed side by side in one flat communication buffer.

An all-gather or reduce-scatter buffer of a bucket is ``world x numel_per_rank``: row ``r`` is
shard rank ``r``'s slot, and each parameter owns one column block of ``padded_shard_numel``
(see fsdp2.layout.shard_layout for how a tensor maps to its padded shards).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from fsdp2.runtime.sharded_param import ShardedParam


@dataclass
class FlatBucket:
    dtype: torch.dtype
    params: list[ShardedParam]
    sizes: list[int] = field(init=False)  # padded shard numel per parameter
    offsets: list[int] = field(init=False)
    numel_per_rank: int = field(init=False)
    all_dim0_even: bool = field(init=False)  # every parameter sharded on dim 0 without padding

    def __post_init__(self) -> None:
        self.sizes = [p.layout.padded_shard_numel for p in self.params]
        self.offsets = list(itertools.accumulate(self.sizes, initial=0))[:-1]
        self.numel_per_rank = sum(self.sizes)
        self.all_dim0_even = all(p.layout.dim == 0 and p.layout.is_even for p in self.params)

    def columns(self, buffer_2d: torch.Tensor) -> Iterator[tuple[ShardedParam, torch.Tensor]]:
        """(param, its ``world x padded_shard_numel`` block of a ``world x numel_per_rank`` buffer)."""
        for p, off, size in zip(self.params, self.offsets, self.sizes):
            yield p, buffer_2d[:, off : off + size]


def buckets_by_dtype(params: list[ShardedParam], dtype_of: Callable[[ShardedParam], torch.dtype]) -> list[FlatBucket]:
    by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
    for p in params:
        by_dtype.setdefault(dtype_of(p), []).append(p)
    return [FlatBucket(dtype, ps) for dtype, ps in by_dtype.items()]
