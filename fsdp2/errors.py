"""The exception raised for misuse of fsdp2, so callers can catch it specifically."""


class FSDPUsageError(ValueError):
    """Bad input to fsdp2. The message names the module/parameter and how to fix it."""
