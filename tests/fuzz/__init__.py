"""Differential testing of fsdp2 against PyTorch's FSDP2: generated programs run side by side
(see docs/contributing.md, differential testing)."""
