"""Helpers shared by test modules: a test module imports what it shares from here, never from
another test module.

- ``models``: the small models of the parity tests (the GPT config, blocks and toy models);
- ``parity``: comparisons of a training run against another: fsdp2 side by side with PyTorch's
  FSDP2, fsdp2 against the unsharded model, compiled fsdp2 against eager fsdp2;
- ``user_collectives``: stand-ins for a user's custom collectives;
- ``quantize_reference``: the float64 reference of the low-precision all-gather's block quantizer.

The checkpoint tests keep theirs in ``tests/checkpoint/ckpt_helpers.py``.
"""
