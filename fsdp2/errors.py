"""The exception raised for misuse of fsdp2, so callers can catch it specifically."""


class FSDPUsageError(ValueError):
    """Bad input to fsdp2. The message names the module/parameter and how to fix it."""


class FSDPDeepcopyError(FSDPUsageError, AssertionError):
    """``copy.deepcopy`` of a fully_shard'ed module. Also an AssertionError, the type PyTorch's
    FSDP2 raises there, so code written against PyTorch catches it."""
