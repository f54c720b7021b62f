"""Communication-free sharded checkpoints in safetensors, with reshard-on-load.

    from fsdp2.checkpoint import save, load
    save("ckpt/step-100", model, optimizer, extra={"step": 100})
    extra = load("ckpt/step-100", model, optimizer)   # any world size / mesh

See ``format.py`` for the on-disk layout, ``writer.py`` for the commit protocol,
``directory.py`` for what saves create and delete, ``lock.py`` for one save at a time per
directory and ``consolidate.py`` for the Hugging Face export.
"""

from .errors import CheckpointError
from .reader import LoadStats, load
from .writer import AsyncSave, save

__all__ = ["save", "load", "CheckpointError", "AsyncSave", "LoadStats"]
