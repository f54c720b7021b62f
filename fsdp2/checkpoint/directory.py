"""``CheckpointDir``: what saves create in a checkpoint directory, and the only code that deletes.

    PATH/manifest.json            the commit point (see format.py)
    PATH/gen-000003/              data of the published generation
    PATH/gen-000004.partial/      a save in progress, or one that was interrupted
    PATH/manifest.json.tmp        the next manifest, before its atomic rename
    PATH/.fsdp2-save.lock         held while a save runs (lock.py)

Every generation directory a save creates gets a marker file (``.fsdp2-generation``) before
any data, and keeps it when ``gen-N.partial`` is renamed to ``gen-N``. A save deletes only
what a save made and recorded: in a marked generation directory the files a save writes
(``rank-NNNNN.safetensors``/``.json``/``.json.tmp`` and the marker), in the generation the
replaced manifest named the files that manifest lists; then the directory itself if that
left it empty. Anything else in the checkpoint directory -- a user's ``gen-images/``, notes
dropped into a generation directory, an unmarked ``gen-000005`` -- stays.
"""

from __future__ import annotations

import os
import re
import warnings

from .errors import CheckpointError
from .format import MANIFEST_NAME, Manifest, generation_dir
from .paths import read_checkpoint_text
from .safetensors_io import fsync_dir

MARKER_NAME = ".fsdp2-generation"
_GENERATION = re.compile(r"gen-\d{6,}(\.partial)?")
_WRITTEN_BY_SAVE = re.compile(r"rank-\d{5,}\.(safetensors|json|json\.tmp)|" + re.escape(MARKER_NAME))
_MANIFEST_TMP = MANIFEST_NAME + ".tmp"


def write_durably(path: str, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class CheckpointDir:
    """The on-disk layout of one checkpoint directory (rank 0 does every change)."""

    def __init__(self, path: str):
        self.path = path

    def staging(self, generation: int) -> str:
        return os.path.join(self.path, generation_dir(generation) + ".partial")

    def final(self, generation: int) -> str:
        return os.path.join(self.path, generation_dir(generation))

    # -- reading ---------------------------------------------------------------------------------

    def manifest(self) -> Manifest | None:
        """The published manifest, None if there is none."""
        if not os.path.lexists(os.path.join(self.path, MANIFEST_NAME)):
            return None
        text = read_checkpoint_text(self.path, MANIFEST_NAME)
        manifest = Manifest.from_json(text, os.path.join(self.path, MANIFEST_NAME))
        manifest.json_bytes = len(text.encode())
        return manifest

    def leftovers(self) -> list[str]:
        """Names of unpublished save data: what an interrupted save leaves behind."""
        if not os.path.isdir(self.path):
            return []
        names = [
            e.name
            for e in os.scandir(self.path)
            if self._is_ours(e)
            or e.name == _MANIFEST_TMP
            or (e.name.endswith(".partial") and _GENERATION.fullmatch(e.name))
        ]
        return sorted(names)

    # -- the steps of a save ---------------------------------------------------------------------

    def begin(self, generation: int) -> None:
        """Clear what interrupted saves left and create ``gen-<generation>.partial`` (marked)."""
        os.makedirs(self.path, exist_ok=True)
        self.clear_leftovers(keep=generation_dir(generation - 1))
        for name in (self.staging(generation), self.final(generation)):
            if os.path.lexists(name):
                raise CheckpointError(
                    f"{name} exists and holds files fsdp2 did not write; move it out of "
                    f"the checkpoint directory {self.path}, then save again"
                )
        staging = self.staging(generation)
        os.makedirs(staging)
        try:
            write_durably(os.path.join(staging, MARKER_NAME), "written by fsdp2.checkpoint.save\n")
        except BaseException:
            # Unmarked, it would never be recognised as ours: remove it while we know it is.
            for name in os.listdir(staging):
                os.remove(os.path.join(staging, name))
            os.rmdir(staging)
            raise

    def promote(self, generation: int) -> None:
        """Rename the staging directory to its final name (still unpublished)."""
        os.rename(self.staging(generation), self.final(generation))
        fsync_dir(self.path)

    def stage_manifest(self, manifest: Manifest) -> None:
        write_durably(os.path.join(self.path, _MANIFEST_TMP), manifest.to_json())

    def commit_manifest(self) -> None:
        """The commit point: before this rename the old manifest is the checkpoint, after it the new."""
        os.replace(os.path.join(self.path, _MANIFEST_TMP), os.path.join(self.path, MANIFEST_NAME))
        fsync_dir(self.path)

    def retire(self, previous: Manifest | None, keep: int) -> None:
        """After a commit: delete the superseded generation and leftovers. Never raises."""
        try:
            if previous is not None and previous.generation != keep:
                old = generation_dir(previous.generation)
                listed = {name.split("/", 1)[1] for name in previous.file_names() if name.startswith(old + "/")}
                self._remove_generation(old, listed)
            self.clear_leftovers(keep=generation_dir(keep))
        except OSError as e:  # the new checkpoint is published; stale data only costs disk
            warnings.warn(f"checkpoint {self.path} is saved, but removing superseded data failed: {e}")

    def discard(self, generation: int) -> None:
        """After a failed save (every rank stopped writing): delete its data. Never raises."""
        try:
            for name in (self.staging(generation), self.final(generation)):
                if os.path.isdir(name) and not os.path.islink(name):
                    self._remove_generation(os.path.basename(name), set())
            if os.path.lexists(os.path.join(self.path, _MANIFEST_TMP)):
                os.remove(os.path.join(self.path, _MANIFEST_TMP))
        except OSError as e:
            warnings.warn(f"could not remove the data of the failed save in {self.path}: {e}")

    def clear_leftovers(self, keep: str) -> None:
        """Delete marked generation directories other than ``keep`` and a stray manifest.json.tmp."""
        for entry in list(os.scandir(self.path)):
            if entry.name != keep and self._is_ours(entry):
                self._remove_generation(entry.name, set())
        if os.path.lexists(os.path.join(self.path, _MANIFEST_TMP)):
            os.remove(os.path.join(self.path, _MANIFEST_TMP))

    # -- helpers -----------------------------------------------------------------------------------

    def _is_ours(self, entry: os.DirEntry) -> bool:
        if not (_GENERATION.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
            return False
        marker = os.path.join(entry.path, MARKER_NAME)
        return os.path.isfile(marker) and not os.path.islink(marker)

    def _remove_generation(self, name: str, listed: set[str]) -> None:
        """Remove what a save wrote in ``name`` (all of it if marked, else ``listed``), then the
        directory if nothing else is left in it."""
        directory = os.path.join(self.path, name)
        if not os.path.isdir(directory) or os.path.islink(directory):
            return
        marked = os.path.isfile(os.path.join(directory, MARKER_NAME))
        if not marked and not listed:
            return  # not ours
        # The marker goes last: a crash half way must leave the rest recognisable as ours.
        entries = sorted(os.scandir(directory), key=lambda e: e.name == MARKER_NAME)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                continue
            if entry.name in listed or (marked and _WRITTEN_BY_SAVE.fullmatch(entry.name)):
                os.remove(entry.path)
        try:
            os.rmdir(directory)
        except OSError:
            if os.listdir(directory):
                warnings.warn(f"kept {directory}: it holds files fsdp2 did not write")
