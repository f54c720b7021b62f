"""The exception raised for misuse of fsdp2, so callers can catch it specifically.

Where PyTorch's FSDP2 raises another built-in type for the same misuse, fsdp2 raises a subclass
that is also that type, so code written against PyTorch (``except AssertionError``,
``pytest.raises(RuntimeError)``) catches fsdp2's error too.
"""


class FSDPUsageError(ValueError):
    """Bad input to fsdp2. The message names the module/parameter and how to fix it."""


class FSDPUsageAssertionError(FSDPUsageError, AssertionError):
    """A misuse for which PyTorch's FSDP2 raises AssertionError (fully_shard applied twice, a
    tensor subclass's all-gather hooks malformed, a shard dim out of range)."""


class FSDPUsageNotImplementedError(FSDPUsageError, NotImplementedError):
    """A combination PyTorch's FSDP2 refuses with NotImplementedError."""


class FSDPUsageRuntimeError(FSDPUsageError, RuntimeError):
    """A misuse for which PyTorch raises RuntimeError (unmaterialized meta parameters, a state dict
    that does not fit, reset_iter_state off the root, overlapping meshes)."""


class FSDPUsageTypeError(FSDPUsageError, TypeError):
    """An argument of the wrong type where PyTorch's FSDP2 raises TypeError."""


class FSDPDeepcopyError(FSDPUsageAssertionError):
    """``copy.deepcopy`` of a fully_shard'ed module. Also an AssertionError, the type PyTorch's
    FSDP2 raises there, so code written against PyTorch catches it."""
