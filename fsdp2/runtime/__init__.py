"""The FSDP runtime: fully_shard, the per-parameter shards, group lifecycle, hooks, collectives."""
