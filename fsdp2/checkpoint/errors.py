"""The one error type the checkpoint subsystem raises on purpose."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded.

    The message names the checkpoint path, the file and/or tensor key involved and
    what to do about it. When ``load`` raises this, the model and optimizer have
    not been modified.
    """
