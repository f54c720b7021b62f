"""Shard geometry: which box of a tensor a rank holds, and padded flat communication layouts."""
