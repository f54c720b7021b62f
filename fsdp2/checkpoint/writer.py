"""``save``: every rank writes only its own shards; rank 0 commits a manifest.

Commit protocol (why a reader never sees a half-written checkpoint):

1. All ranks read the current ``manifest.json`` (if any) to agree, without talking,
   on the next generation number ``g``. Rank 0 clears leftovers of interrupted
   saves and creates ``PATH/gen-g.partial/``; barrier.
2. Each rank writes ``rank-XXXXX.safetensors`` (its local shards, replicas written
   once) and a JSON sidecar with the file's size, header checksum and chunk list
   (with each chunk's block checksums) into the staging dir, each fsynced.
3. Barrier that also tells every rank whether all writes succeeded.
4. Rank 0 reads the sidecars, checks that chunks tile every tensor, renames
   ``gen-g.partial`` -> ``gen-g``, writes ``manifest.json.tmp``, fsyncs it and
   atomically ``os.replace``s it over ``manifest.json``. That rename is the commit:
   before it the old manifest (and its ``gen-(g-1)`` data, untouched) is the
   checkpoint; after it the new one is. Only then are old generations deleted.
5. Final barrier, so ``save`` returns on every rank after the checkpoint is visible.

A rank that dies before step 4 leaves the old checkpoint intact and the new data
in a ``*.partial`` directory that no manifest references.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from . import _dist
from .errors import CheckpointError
from fsdp2 import compat
from fsdp2.layout.regions import LayoutError, Region, local_region

from .format import (MANIFEST_NAME, Chunk, FileEntry, Manifest, TensorEntry, dtype_name, generation_dir,
                     rank_file_name)
from .integrity import BlockGrid, to_hex
from .safetensors_io import SafetensorsStreamWriter, TensorSpec, fsync_dir
from .staging import SnapshotStaging, process_staging
from .state import flatten

_CRASH_ENV = "FSDP2_CKPT_TEST_CRASH"  # "<stage>:<rank>", test-only fault injection


def _maybe_crash(stage: str, rank: int) -> None:
    """Let tests kill a rank at a chosen point of a save, as a real crash would."""
    if os.environ.get(_CRASH_ENV) == f"{stage}:{rank}":
        os._exit(17)


@dataclass
class LocalShard:
    """A piece of one tensor that this rank is responsible for writing."""

    key: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    region: Region
    data: torch.Tensor  # plain local tensor of shape region.shape


def _first_among_sibling_meshes(mesh) -> bool:
    """True unless another copy of ``mesh`` (a slice of a larger mesh) holds the same data first.

    A DTensor on ``mesh["dp"]`` of a (dp, tp) mesh -- e.g. a norm weight that tensor parallelism
    left alone -- is held identically by every tp peer; the peer at tp coordinate 0 writes it.
    """
    root = compat.root_mesh(mesh)
    if root is mesh or not root.mesh_dim_names or not mesh.mesh_dim_names:
        return True
    root_coord = root.get_coordinate()
    return all(
        c == 0 for name, c in zip(root.mesh_dim_names, root_coord) if name not in mesh.mesh_dim_names
    )


def _owned_region(value: torch.Tensor, rank: int) -> Region | None:
    """The box this rank must write for ``value``, or None if another rank writes it."""
    if not isinstance(value, DTensor):
        # Plain tensors are the same on every rank: the lowest rank writes them.
        return Region.whole(value.shape) if rank == 0 else None
    coord = value.device_mesh.get_coordinate()
    # Replicas along a Replicate mesh dim are identical: coordinate 0 writes.
    if coord is not None and any(isinstance(p, Replicate) and c != 0 for p, c in zip(value.placements, coord)):
        return None
    if not _first_among_sibling_meshes(value.device_mesh):
        return None
    try:
        return local_region(value)
    except LayoutError as e:
        raise CheckpointError(f"cannot save a DTensor: {e}") from None


def plan_local_shards(tensors: dict[str, torch.Tensor], rank: int) -> tuple[list[LocalShard], dict]:
    """This rank's shards to write, and (shape, dtype) of every tensor it knows of."""
    shards, known = [], {}
    for key, value in sorted(tensors.items()):
        known[key] = {"shape": list(value.shape), "dtype": dtype_name(value.dtype)}
        region = _owned_region(value, rank)
        if region is None or region.numel == 0:
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        shards.append(LocalShard(key, tuple(value.shape), value.dtype, region, local.detach()))
    return shards, known


def _read_generation(path: str) -> int:
    manifest = os.path.join(path, MANIFEST_NAME)
    if not os.path.exists(manifest):
        return 0
    with open(manifest) as f:
        return Manifest.from_json(f.read(), manifest).generation


def _clear_leftovers(path: str, keep_generation: int) -> None:
    """Delete data of interrupted saves and of superseded generations (rank 0 only)."""
    keep = generation_dir(keep_generation)
    for name in os.listdir(path):
        if name.startswith("gen-") and name != keep:
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    tmp = os.path.join(path, MANIFEST_NAME + ".tmp")
    if os.path.exists(tmp):
        os.remove(tmp)


def _write_rank_file(staging: str, rank: int, shards: list[LocalShard], known: dict) -> None:
    name = rank_file_name(rank)
    writer = SafetensorsStreamWriter(
        os.path.join(staging, name), [TensorSpec(s.key, s.dtype, s.region.shape) for s in shards])
    chunks = []
    for s in shards:
        itemsize = s.dtype.itemsize
        grid = BlockGrid.of(s.region.offsets, s.region.shape, itemsize,
                            BlockGrid.choose_block_elems(s.region.shape, itemsize))
        crcs = writer.write(s.data, grid)
        chunks.append({"key": s.key, "offsets": list(s.region.offsets), "shape": list(s.region.shape),
                       "block_elems": grid.block_elems, "crc32c": to_hex(crcs)})
    writer.close(fsync=True)
    sidecar = {"file": name, "size": writer.size, "header_crc32c": f"{writer.header_crc:08x}",
               "tensors": known, "chunks": chunks}
    tmp = os.path.join(staging, f"rank-{rank:05d}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(sidecar, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(staging, f"rank-{rank:05d}.json"))


def _build_manifest(staging: str, generation: int, world: int, objects: dict) -> Manifest:
    gen = generation_dir(generation)
    files, tensors = {}, {}
    for rank in range(world):
        sidecar_path = os.path.join(staging, f"rank-{rank:05d}.json")
        with open(sidecar_path) as f:
            side = json.load(f)
        rel = f"{gen}/{side['file']}"
        files[rel] = FileEntry(int(side["size"]), header_crc32c=side["header_crc32c"])
        for key, meta in side["tensors"].items():
            entry = tensors.setdefault(key, TensorEntry(tuple(meta["shape"]), meta["dtype"]))
            if list(entry.shape) != meta["shape"] or entry.dtype != meta["dtype"]:
                raise CheckpointError(f"ranks disagree about {key!r}: {entry.shape}/{entry.dtype} vs "
                                      f"{meta['shape']}/{meta['dtype']} (rank {rank})")
        for c in side["chunks"]:
            tensors[c["key"]].chunks.append(Chunk(rel, c["key"], tuple(c["offsets"]), tuple(c["shape"]),
                                                  int(c["block_elems"]), c["crc32c"]))
    manifest = Manifest(generation, world, files, tensors, objects)
    manifest.validate()  # every tensor exactly tiled, or we refuse to publish
    return manifest


def _publish(path: str, staging: str, generation: int, world: int, objects: dict) -> None:
    manifest = _build_manifest(staging, generation, world, objects)
    for rank in range(world):
        os.remove(os.path.join(staging, f"rank-{rank:05d}.json"))
    final = os.path.join(path, generation_dir(generation))
    os.rename(staging, final)
    fsync_dir(path)
    tmp = os.path.join(path, MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    _maybe_crash("before_publish", 0)
    os.replace(tmp, os.path.join(path, MANIFEST_NAME))  # the commit point
    fsync_dir(path)
    _clear_leftovers(path, keep_generation=generation)


class _SaveJob:
    """One save in progress: the write phase (any thread) and the commit (collective)."""

    def __init__(self, path: str, shards: list[LocalShard], known: dict, objects: dict | None,
                 rank: int, world: int, generation: int, snapshot: SnapshotStaging | None = None):
        self.path, self.shards, self.known, self.objects = path, shards, known, objects
        self.rank, self.world, self.generation = rank, world, generation
        self.staging = os.path.join(path, generation_dir(generation) + ".partial")
        self.snapshot = snapshot  # where async shards were copied; freed once written
        self.error: BaseException | None = None

    def write(self) -> None:
        try:
            if self.snapshot is not None:
                self.snapshot.wait_copied()
            _write_rank_file(self.staging, self.rank, self.shards, self.known)
        except BaseException as e:  # reported to all ranks in commit()
            self.error = e
        self.shards = []  # drop snapshots as soon as they are on disk
        if self.snapshot is not None:
            self.snapshot.release()
        _maybe_crash("after_write", self.rank)

    def commit(self) -> None:
        if not _dist.all_ok(self.error is None):
            if self.error is not None:
                raise CheckpointError(f"writing {self.staging} failed on rank {self.rank}: {self.error}; "
                                      "nothing was published, the previous checkpoint is intact") from self.error
            raise CheckpointError(f"save to {self.path} failed on another rank (see its error); nothing "
                                  "was published, the previous checkpoint is intact")
        publish_error = None
        if self.rank == 0:
            try:
                _publish(self.path, self.staging, self.generation, self.world, self.objects or {})
            except BaseException as e:
                publish_error = e
        if not _dist.all_ok(publish_error is None):
            raise CheckpointError(f"publishing {self.path} failed on rank 0: {publish_error}; the previous "
                                  "checkpoint is intact") from publish_error


class AsyncSave:
    """Handle of an ``async_save=True`` save.

    The files are written by a background thread that only does disk I/O. The
    commit needs collectives (two one-element all-reduces), so it runs in
    ``wait()``, on the caller's thread, never racing the training loop's own
    collectives. Every rank must call ``wait()`` at the same point of its program
    (e.g. right before the next ``save`` or at the end of training).
    """

    def __init__(self, job: _SaveJob):
        self._job = job
        self._thread = threading.Thread(target=job.write, name="fsdp2-checkpoint-writer", daemon=True)
        self._thread.start()
        self._done = False

    def done_writing(self) -> bool:
        """True once this rank's files are on disk (``wait()`` is then quick)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Finish writing and publish the checkpoint (collective across ranks)."""
        if self._done:
            return
        self._thread.join()
        self._done = True
        self._job.commit()


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None, *, async_save: bool = False) -> AsyncSave | None:
    """Save ``model`` (and ``optimizer``, ``extra``) to the checkpoint directory ``path``.

    Collective: when torch.distributed is initialized every rank must call it.
    Each rank writes only the shards it holds; nothing is sent between ranks.
    ``extra`` holds JSON values and (plain) tensors; rank 0's copy is saved.
    With ``async_save=True`` local shards are copied now into a host buffer that is
    allocated once and reused by later saves (pinned, on a side stream, for CUDA
    tensors: see ``staging.py``), written and checksummed by a background thread, and
    the returned handle's ``wait()`` (collective) commits.
    """
    path = os.fspath(path)
    rank, world = _dist.rank_and_world()
    flat = flatten(model, optimizer, extra)
    shards, known = plan_local_shards(flat.tensors, rank)
    objects = json.loads(json.dumps(flat.objects)) if rank == 0 else None  # snapshot, JSON-checked

    prepare_error = None
    generation = 0
    try:
        generation = _read_generation(path) + 1
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            _clear_leftovers(path, keep_generation=generation - 1)
            os.makedirs(os.path.join(path, generation_dir(generation) + ".partial"))
    except BaseException as e:
        prepare_error = e
    if not _dist.all_ok(prepare_error is None):
        raise CheckpointError(f"could not prepare {path} for saving: {prepare_error or 'failed on another rank'}")

    snapshot = None
    if async_save:
        # Copies: training may keep updating parameters while the thread writes.
        snapshot = process_staging()
        for s, copy in zip(shards, snapshot.stage([s.data for s in shards])):
            s.data = copy
    job = _SaveJob(path, shards, known, objects, rank, world, generation, snapshot)
    if async_save:
        return AsyncSave(job)
    job.write()
    job.commit()
    return None
