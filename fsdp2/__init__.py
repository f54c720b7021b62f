"""fsdp2: fully sharded data parallel on DTensor."""
