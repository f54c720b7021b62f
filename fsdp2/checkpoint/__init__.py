"""Communication-free sharded checkpoints in safetensors, with reshard-on-load.

    from fsdp2.checkpoint import save, load
    save("ckpt/step-100", model, optimizer, extra={"step": 100})
    extra = load("ckpt/step-100", model, optimizer)   # any world size / mesh
    load_hf("Llama-3-8B/", model)                       # Hugging Face weights, each rank its shards

See ``format.py`` for the on-disk layout (``chunk_rule.py``: which rank file holds which box;
``file_index.py``: what each rank file's header says of itself), ``writer.py`` for the commit protocol,
``directory.py`` for what saves create and delete, ``lock.py`` for one save at a time per
directory and ``consolidate.py`` for the Hugging Face export.
"""

from .errors import CheckpointError
from .hf_import import HFKeys, load_hf
from .reader import LoadStats, load
from .verify import verify_checkpoint
from .writer import AsyncSave, pending_save, save

__all__ = [
    "save",
    "load",
    "load_hf",
    "verify_checkpoint",
    "CheckpointError",
    "AsyncSave",
    "pending_save",
    "LoadStats",
    "HFKeys",
]
