"""``save``: every rank writes only its own shards; rank 0 commits a manifest.

Commit protocol (why a reader never sees a half-written checkpoint):

1. All ranks read the current ``manifest.json`` (if any) to agree, without talking,
   on the next generation number ``g``. Rank 0 takes the directory's save lock
   (lock.py), clears what interrupted saves left and creates ``PATH/gen-g.partial/``
   (directory.py); barrier.
2. Each rank writes ``rank-XXXXX.safetensors`` (its local shards, replicas written
   once) into the staging dir, its header indexing its chunks with their block checksums
   (file_index.py, integrity.py), and fsyncs it. The rank at coordinate 0 of a tensor's
   mesh describes the tensor's layout (chunk_rule.py): rank 0 for every mesh holding it,
   which is every mesh of FSDP, HSDP and TP + FSDP; another describing rank writes its
   descriptions to a JSON sidecar, ``rank-XXXXX.json``.
3. Barrier that also tells every rank whether all writes succeeded. If one failed
   (a full disk, or any other error a rank raised between steps 1 and 3), rank 0 deletes
   the staging dir: the disk is not left full, the lock is released. A sum over ranks
   then tells rank 0 how many sidecars there are (usually none).
4. Rank 0 merges its own descriptions and the sidecars' (one entry per tensor, whatever
   the world size), checks them, renames ``gen-g.partial`` -> ``gen-g``, writes
   ``manifest.json.tmp``, fsyncs it and atomically ``os.replace``s it over
   ``manifest.json``. That rename is the commit: before it the old manifest (and its
   ``gen-(g-1)`` data, untouched) is the checkpoint; after it the new one is. Only then
   is the old generation deleted.
5. Final barrier, so ``save`` returns on every rank after the checkpoint is visible.
   Every failure is reported on every rank with the failing rank's reason.

A rank that dies before step 4 leaves the old checkpoint intact and the new data
in a ``*.partial`` directory that no manifest references; the next save deletes it.
One process never runs two saves into one directory: a second ``save`` while an async
save to the same path is pending is refused before anything is touched. The pending save
stays reachable (``pending_save(path)``) even if its handle was dropped, and a process that
exits with one pending warns that it was never published.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import threading
import warnings
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _dist, gc_pause
from .errors import CheckpointError
from fsdp2 import compat
from fsdp2.layout.regions import LayoutError, Region, local_region
from fsdp2.tools.progress import SILENT, ByteProgress

from .chunk_rule import ChunkRule, MeshRanks, rule_from_json
from .directory import CheckpointDir
from .file_index import ChunkRecord, FileIndex, new_save_id, save_id_text, seal
from .format import Manifest, TensorEntry, dtype_name, rank_file_name
from .integrity import BlockGrid, to_hex
from .lock import SaveLock
from .paths import read_checkpoint_text
from .safetensors_io import SafetensorsStreamWriter, TensorSpec
from .staging import SnapshotStaging, process_staging
from .state import first_meta_tensor, flatten, reshard_model

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

    @property
    def nbytes(self) -> int:
        return self.region.numel * self.dtype.itemsize


def _first_among_sibling_meshes(mesh) -> bool:
    """True unless another copy of ``mesh`` (a slice of a larger mesh) holds the same data first.

    A DTensor on ``mesh["dp"]`` of a (dp, tp) mesh -- e.g. a norm weight that tensor parallelism
    left alone -- is held identically by every tp peer; the peers' copy at coordinate 0 of the
    other dims writes it: the copy holding the root's first rank. Read from the ranks, not the dim
    names, so meshes unflattened from a flat world mesh (whose root names none of their dims)
    count the same way.
    """
    root = compat.root_mesh(mesh)
    if root is mesh:
        return True
    return int(root.mesh.flatten()[0]) in mesh.mesh.flatten().tolist()


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


@dataclass(frozen=True)
class Described:
    """A tensor as the manifest lists it: shape, dtype and the rule placing its chunks."""

    shape: tuple[int, ...]
    dtype: str
    rule: ChunkRule

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "mesh": self.rule.mesh.to_json(),
            "placements": self.rule.placement_names(),
        }

    @classmethod
    def from_json(cls, key: str, d: dict) -> "Described":
        return cls(tuple(d["shape"]), d["dtype"], rule_from_json(MeshRanks.from_json(d["mesh"]), d["placements"], key))


class _Describer:
    """The rules of the tensors this rank describes: plain ones on rank 0, a DTensor on the rank at
    coordinate 0 of the copy of its mesh that is written. Mesh ranks are derived once per mesh."""

    def __init__(self, rank: int):
        self.rank = rank
        self._meshes: dict[int, tuple[object, MeshRanks]] = {}

    def rule(self, value: torch.Tensor) -> ChunkRule | None:
        if not isinstance(value, DTensor):
            return ChunkRule.whole_on_rank0() if self.rank == 0 else None
        mesh = value.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None or any(coordinate) or not _first_among_sibling_meshes(mesh):
            return None
        known = self._meshes.get(id(mesh))
        if known is None or known[0] is not mesh:  # the mesh itself is kept, so its id stays its own
            known = self._meshes[id(mesh)] = (mesh, MeshRanks.of(mesh.mesh))
        placements = []
        for p in value.placements:
            if isinstance(p, Replicate):
                placements.append(p)
            elif isinstance(p, compat.StridedShard):
                placements.append(compat.StridedShard(p.dim % value.ndim, split_factor=p.split_factor))
            elif type(p) is Shard:
                placements.append(Shard(p.dim % value.ndim))
            else:
                raise CheckpointError(f"cannot save a DTensor with placement {p!r}; redistribute it first")
        return ChunkRule(known[1], tuple(placements))


def plan_local_shards(tensors: dict[str, torch.Tensor], rank: int) -> tuple[list[LocalShard], dict[str, Described]]:
    """This rank's shards to write, and the tensors it describes (``_Describer``)."""
    shards, described = [], {}
    describer = _Describer(rank)
    for key, value in sorted(tensors.items()):
        rule = describer.rule(value)
        if rule is not None:
            described[key] = Described(tuple(value.shape), dtype_name(value.dtype), rule)
        region = _owned_region(value, rank)
        if region is None or region.numel == 0:
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        shards.append(LocalShard(key, tuple(value.shape), value.dtype, region, local.detach()))
    return shards, described


def plan_rank_tensors(tensors: dict[str, torch.Tensor]) -> list[LocalShard]:
    """This rank's own ``rank_extra`` tensors: written whole, by this rank, into its own file only
    (empty ones too: the file is where their shape and dtype are kept)."""
    for key, value in tensors.items():
        dtype_name(value.dtype)  # raises for dtypes safetensors cannot store
    return [
        LocalShard(key, tuple(v.shape), v.dtype, Region.whole(v.shape), v.detach())
        for key, v in sorted(tensors.items())
    ]


def rank_file_index(shards: list[LocalShard], save_id: str, rank_object) -> tuple[FileIndex, dict[str, BlockGrid]]:
    """The index of a rank file holding ``shards``, its checksums still placeholders (as long as the
    real ones), and each non-empty shard's block grid."""
    grids, records = {}, {}
    for s in shards:
        itemsize = s.dtype.itemsize
        if s.region.numel:
            grid = BlockGrid.of(
                s.region.offsets, s.region.shape, itemsize, BlockGrid.choose_block_elems(s.region.shape, itemsize)
            )
            grids[s.key] = grid
            records[s.key] = ChunkRecord(s.region.offsets, grid.block_elems, "0" * 8 * grid.count)
        else:
            records[s.key] = ChunkRecord(s.region.offsets, 1, "")
    return FileIndex(save_id, records, rank_object), grids


def _write_rank_file(
    staging: str, rank: int, shards: list[LocalShard], save_id: str, rank_object, progress: ByteProgress = SILENT
) -> None:
    """The rank file: its shards, streamed and checksummed block by block, then its header
    rewritten in place with the index of their offsets and checksums (same length: only
    placeholder digits change) and sealed with its own checksum."""
    index, grids = rank_file_index(shards, save_id, rank_object)
    writer = SafetensorsStreamWriter(
        os.path.join(staging, rank_file_name(rank)),
        [TensorSpec(s.key, s.dtype, s.region.shape) for s in shards],
        metadata=index.metadata(),
    )
    try:
        for s in shards:
            grid = grids.get(s.key)
            crcs = writer.write(s.data, grid)
            progress.advance(s.nbytes)
            if grid is not None:
                index.chunks[s.key] = ChunkRecord(s.region.offsets, grid.block_elems, to_hex(crcs))
        writer.rewrite_header(index.metadata(), seal)
        writer.close(fsync=True)
    except BaseException:
        writer.abort()  # close it, so deleting the partial file frees the space
        raise


_SIDECAR = re.compile(r"rank-(\d{5,})\.json")


def _write_sidecar(staging: str, rank: int, described: dict[str, Described]) -> None:
    """A describing rank other than 0: its tensors' descriptions, for rank 0's manifest."""
    tmp = os.path.join(staging, f"rank-{rank:05d}.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"tensors": {k: d.to_json() for k, d in described.items()}}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(staging, f"rank-{rank:05d}.json"))


def _read_sidecars(staging: str, expected: int) -> dict[str, dict[str, Described]]:
    """Rank 0: the sidecars of the other describing ranks, by file name (``expected`` of them)."""
    names = sorted(e.name for e in os.scandir(staging) if _SIDECAR.fullmatch(e.name))
    if len(names) != expected:
        raise CheckpointError(f"{staging} holds {len(names)} layout sidecars, {expected} ranks wrote one")
    out = {}
    for name in names:
        try:
            side = json.loads(read_checkpoint_text(staging, name))
            out[name] = {k: Described.from_json(k, d) for k, d in side["tensors"].items()}
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{os.path.join(staging, name)} is malformed ({e})") from None
    return out


def build_manifest(
    staging: str,
    generation: int,
    world: int,
    objects: dict,
    described: dict[str, Described],
    sidecars: int,
    save_id: str,
    rank_extra: bool,
) -> Manifest:
    """Rank 0's commit: one entry per tensor, from its own descriptions and the ``sidecars`` other
    ranks wrote into ``staging`` (none are read when there are none)."""
    merged = dict(described)
    for name, others in _read_sidecars(staging, sidecars).items() if sidecars else ():
        for key, d in others.items():
            mine = merged.setdefault(key, d)
            if mine != d:
                raise CheckpointError(f"ranks disagree about {key!r}: {mine.to_json()} vs {d.to_json()} (from {name})")
    tensors = {k: TensorEntry(d.shape, d.dtype, rule=d.rule) for k, d in sorted(merged.items())}
    manifest = Manifest(generation, world, {}, tensors, objects, save_id=save_id, rank_extra=rank_extra)
    manifest.validate()  # every rule describes its tensor on this world, or we refuse to publish
    return manifest


class _Stage(Enum):
    WRITING = auto()  # this rank's files are being written (async: by the writer thread)
    WRITTEN = auto()  # written (or failed writing); the collective commit comes next
    COMMITTED = auto()  # published on every rank
    FAILED = auto()  # nothing published; the error is kept and raised again by wait()


# Handles of saves that were started with async_save=True and not yet committed, by directory.
_pending: dict[str, "AsyncSave"] = {}


def _pending_key(path: str) -> str:
    return os.path.realpath(path)


def pending_save(path: str | os.PathLike) -> "AsyncSave | None":
    """The handle of this process's async save to ``path`` that was not waited on yet, or None.

    For a handle that was dropped: ``pending_save(path).wait()`` (every rank) publishes it and
    frees the path for the next save.
    """
    return _pending.get(_pending_key(os.fspath(path)))


@atexit.register
def _warn_unpublished() -> None:
    """A process ending with an async save pending has lost it: say so instead of nothing."""
    for handle in list(_pending.values()):
        warnings.warn(
            f"fsdp2.checkpoint: the async save to {handle.path} was never waited on, so it was not "
            "published (the checkpoint there is still the previous one). Call wait() on its handle "
            "(every rank) before the process ends.",
            RuntimeWarning,
            stacklevel=1,
        )
        # Let the writer thread finish its (staged, unpublished) files: a daemon thread still inside
        # torch or file I/O while the interpreter tears down aborts the process.
        handle.finish_writing()


class _SaveJob:
    """One save in progress: the write phase (any thread) and the commit (collective)."""

    def __init__(
        self,
        directory: CheckpointDir,
        shards: list[LocalShard],
        described: dict[str, Described],
        objects: dict | None,
        rank_object,
        rank: int,
        world: int,
        generation: int,
        previous: Manifest | None,
        lock: SaveLock | None,
        save_id: str,
    ):
        self.directory, self.shards, self.described, self.objects = directory, shards, described, objects
        self.rank_object, self.save_id = rank_object, save_id
        # Whether this rank leaves rank 0 a sidecar of descriptions (only a describing rank other than 0).
        self.writes_sidecar = rank != 0 and bool(described)
        self.rank, self.world, self.generation, self.previous = rank, world, generation, previous
        self.lock = lock  # rank 0 only
        self.path = directory.path
        self.staging = directory.staging(generation)
        self.snapshot: SnapshotStaging | None = None  # where async shards were copied; freed once written
        self.error: BaseException | None = None
        self.stage = _Stage.WRITING

    def write(self, progress: ByteProgress = SILENT) -> None:
        try:
            if self.snapshot is not None:
                self.snapshot.wait_copied()
            _write_rank_file(self.staging, self.rank, self.shards, self.save_id, self.rank_object, progress)
            if self.writes_sidecar:
                _write_sidecar(self.staging, self.rank, self.described)
        except BaseException as e:  # reported to all ranks in commit()
            self.error = e
        self.shards = []  # drop snapshots as soon as they are on disk
        if self.snapshot is not None:
            self.snapshot.release()
        self.stage = _Stage.WRITTEN
        _maybe_crash("after_write", self.rank)

    def record_failure(self, error: BaseException) -> None:
        """This rank's part failed outside ``write`` (its files may be missing): ``commit`` reports ``error``."""
        if self.error is None:
            self.error = error
        self.shards = []
        self.stage = _Stage.WRITTEN

    def commit(self) -> None:
        """Publish (collective). Raises ``CheckpointError`` on every rank if any rank failed."""
        try:
            self._commit()
            self.stage = _Stage.COMMITTED
        except BaseException as e:
            self.stage, self.error = _Stage.FAILED, e
            raise
        finally:
            if self.lock is not None:
                self.lock.release()
            _pending.pop(_pending_key(self.path), None)

    def _commit(self) -> None:
        failure = _dist.first_failure(self.error)
        if failure is not None:
            if self.rank == 0:  # every rank has stopped writing: free the disk
                self.directory.discard(self.generation)
            rank, reason = failure
            raise CheckpointError(
                f"writing {self.staging} failed on rank {rank}: {reason}; nothing was "
                "published, the previous checkpoint is intact"
            ) from self.error
        sidecars, rank_extras = _dist.sum_over_ranks([int(self.writes_sidecar), int(self.rank_object is not None)])
        publish_error = None
        if self.rank == 0:
            try:
                self._publish(sidecars, rank_extras > 0)
            except BaseException as e:
                publish_error = e
                self.directory.discard(self.generation)
        failure = _dist.first_failure(publish_error)
        if failure is not None:
            raise CheckpointError(
                f"publishing {self.path} failed on rank 0: {failure[1]}; nothing was "
                "published, the previous checkpoint is intact"
            ) from publish_error

    def _publish(self, sidecars: int, rank_extra: bool) -> None:
        """Rank 0. Raises only before the commit point (so a failure means nothing was published)."""
        manifest = build_manifest(
            self.staging,
            self.generation,
            self.world,
            self.objects or {},
            self.described,
            sidecars,
            self.save_id,
            rank_extra,
        )
        if sidecars:
            for entry in list(os.scandir(self.staging)):
                if _SIDECAR.fullmatch(entry.name):
                    os.remove(entry.path)
        self.directory.promote(self.generation)
        self.directory.stage_manifest(manifest)
        _maybe_crash("before_publish", 0)
        self.directory.commit_manifest()
        self.directory.retire(self.previous, keep=self.generation)


class AsyncSave:
    """Handle of an ``async_save=True`` save.

    The files are written by a background thread that only does disk I/O. The
    commit needs collectives, so it runs in ``wait()``, on the caller's thread, never
    racing the training loop's own collectives. Every rank must call ``wait()`` at the
    same point of its program (e.g. right before the next ``save`` or at the end of
    training). Until then the save is pending: another ``save`` to the same path is
    refused; a dropped handle is found again with ``pending_save(path)``. ``wait()`` raises the
    save's error on every call once it failed.
    """

    def __init__(self, job: _SaveJob, start: bool = True):
        self._job = job
        self.path = job.path
        self._thread = threading.Thread(target=job.write, name="fsdp2-checkpoint-writer", daemon=True)
        if start:
            self._thread.start()

    def finish_writing(self) -> None:
        """Block until this rank's files are on disk (no commit: that is ``wait()``'s, collective)."""
        if self._thread.ident is not None:  # never started when the save failed before writing
            self._thread.join()

    def done_writing(self) -> bool:
        """True once this rank's files are on disk (``wait()`` is then quick)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Finish writing and publish the checkpoint (collective across ranks)."""
        job = self._job
        if job.stage == _Stage.COMMITTED:
            return
        if job.stage == _Stage.FAILED:
            raise CheckpointError(f"the async save to {job.path} failed: {job.error}") from job.error
        self.finish_writing()
        with gc_pause.paused():  # the commit agrees across ranks: see save
            job.commit()


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict | None = None,
    *,
    rank_extra: Any = None,
    async_save: bool = False,
) -> AsyncSave | None:
    """Save ``model`` (and ``optimizer``, ``extra``) to the checkpoint directory ``path``.

    Collective: when torch.distributed is initialized every rank must call it.
    Each rank writes only the shards it holds; nothing is sent between ranks.
    ``extra`` holds JSON values, (plain) tensors and numpy numbers and arrays; rank 0's
    copy is saved. ``rank_extra`` (same kinds of values) is saved for every rank and
    comes back to the same rank from ``load(..., return_rank_extra=True)`` when the
    world size is unchanged (e.g. per-rank RNG states).
    With ``async_save=True`` local shards are copied now into a host buffer that is
    allocated once and reused by later saves (pinned, on a side stream, for CUDA
    tensors: see ``staging.py``), written and checksummed by a background thread, and
    the returned handle's ``wait()`` (collective) commits.
    Whatever fails on any rank fails the save on every rank with that rank's reason (a
    ``CheckpointError``; once the files are being written, from an async save's ``wait()``),
    and the directory is left as it was: the previous checkpoint, no lock, no partial data.
    Gathered (unsharded) fsdp2 groups are resharded first; values do not change.
    """
    path = os.fspath(path)
    if _pending_key(path) in _pending:  # every rank of the job has the same pending save: all refuse
        raise CheckpointError(
            f"an async save to {path} is still pending: call wait() on its handle (every rank) before "
            "saving there again; fsdp2.checkpoint.pending_save(path) returns the handle if it was dropped. "
            "Nothing was changed"
        )
    # As load's: the save's objects die by refcount; a full collection on one rank would stall the
    # others at the commit. Not over an async save's background write: that runs beside training.
    with gc_pause.paused():
        job = _prepare(path, model, optimizer, extra, rank_extra)
        # From here rank 0 holds the lock and gen-N.partial exists. Whatever fails on one rank (not only
        # I/O) is kept as that rank's write error, so the commit reports it on every rank and cleans up:
        # raising here instead would leave the other ranks waiting in the commit's collective.
        if async_save:
            try:
                # Copies: training may keep updating parameters while the thread writes.
                staging = process_staging()
                copies = staging.stage([s.data for s in job.shards])  # on failure it holds nothing
                job.snapshot = staging
                for s, copy in zip(job.shards, copies):
                    s.data = copy
                handle = AsyncSave(job)
            except BaseException as e:  # wait() reports it on every rank, as it would a failed write
                if job.snapshot is not None:
                    job.snapshot.release()
                    job.snapshot = None
                job.record_failure(e)
                handle = AsyncSave(job, start=False)
            _pending[_pending_key(path)] = handle
            return handle
        try:
            # Async saves show no progress: their thread writes while training prints its own lines.
            with ByteProgress("save", path, sum(s.nbytes for s in job.shards)) as progress:
                job.write(progress)
        except BaseException as e:
            job.record_failure(e)
        job.commit()
    return None


def _prepare(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict | None, rank_extra: Any
) -> _SaveJob:
    """Step 1 of the commit protocol (collective): what to write, the generation, the staging dir."""
    rank, world = _dist.rank_and_world()
    directory = CheckpointDir(path)
    lock = SaveLock(path) if rank == 0 else None
    prepare_error, locked = None, False
    generation, previous = 0, None
    shards, described, objects, rank_object = [], {}, None, None
    try:
        reshard_model(model)
        meta = first_meta_tensor(model)
        if meta is not None:
            raise CheckpointError(
                f"cannot save: {meta} is on the meta device and has no values; "
                "materialize the model (to_empty + initialization or a load) first"
            )
        flat = flatten(model, optimizer, extra, rank_extra, rank)
        shards, described = plan_local_shards(flat.tensors, rank)
        shards += plan_rank_tensors(flat.rank_tensors)
        objects = json.loads(json.dumps(flat.objects)) if rank == 0 else None  # snapshot, JSON-checked
        rank_object = json.loads(json.dumps(flat.rank_object)) if flat.rank_object is not None else None
        previous = directory.manifest()
        generation = (previous.generation if previous is not None else 0) + 1
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            lock.acquire()
            locked = True
            now = directory.manifest()
            if (now.generation if now is not None else 0) != generation - 1:
                raise CheckpointError(
                    f"{path} changed while this save was being prepared (another job saved "
                    "into it); save again, or into a directory of this job's own"
                )
            directory.begin(generation)
    except BaseException as e:
        prepare_error = e
    failure = _dist.first_failure(prepare_error)
    if failure is not None:
        if locked:
            directory.discard(generation)
            lock.release()
        failed_rank, reason = failure
        if isinstance(prepare_error, CheckpointError) and failed_rank == rank:
            raise prepare_error
        where = "" if failed_rank == rank else f" (failed on rank {failed_rank})"
        raise CheckpointError(
            f"could not prepare {path} for saving{where}: {reason}; nothing was changed"
        ) from prepare_error
    # One id for the save, drawn by rank 0: every rank file carries it, so a file from another save
    # (same names, same shapes) is told apart at load.
    save_id = save_id_text(_dist.broadcast_from_rank0(new_save_id() if rank == 0 else 0))
    return _SaveJob(
        directory,
        shards,
        described,
        objects,
        rank_object,
        rank,
        world,
        generation,
        previous,
        lock if locked else None,
        save_id,
    )
