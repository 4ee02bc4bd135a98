"""The files of a run directory: checkpoint names, discovery, retention, a step's companions.

The layout both stores and every tool that reads a run directory (verify, replay,
audit, recording) share: a step's name (``step-00000120.ckpt`` or ``.dcp``), how
checkpoints are found and which are kept, the environment record, and writing and
checking a step's companions. The names, discovery and the environment record are
public through :mod:`ckptkit.run` (spec/runstate.md "Files in the run directory").
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import xxhash

from ..errors import (
    CheckpointError,
    CheckpointNotFound,
    FormatError,
    NoConsistentCheckpoint,
    ResumeRefused,
    SaveFailed,
    UnreadableFile,
)
from ..format._atomic import clean_stale_temps, write_bytes_atomic
from ..format._companions import ENVIRONMENT_FILE, check_companions, file_digest, make_record, record_of
from ..format._io import file_kind
from ..format._objectstore import StoreUnavailable
from ..format._place import Place, list_run_dir
from ..format._sidecar import Sidecar, read_sidecar, sidecar_path, write_sidecar
from ..format._snapshot import Snapshot, read_small_file, read_snapshot, snapshot_path
from ._history import HISTORY_FILE, INTERRUPTED_FILE

__all__ = [
    "CKPT_SUFFIX",
    "DAMAGED",
    "DCP_SUFFIX",
    "ENVIRONMENT_FILE",
    "SET_ASIDE",
    "TRAINER_COMMIT",
    "RunRecords",
    "check_step",
    "checkpoint_name",
    "debris",
    "fallback_notes",
    "is_damage",
    "is_fallback_note",
    "list_checkpoints",
    "newest_consistent",
    "read_companions",
    "read_environment",
    "read_sidecars",
    "refuse_existing",
    "remove_companions",
    "remove_debris",
    "restorable",
    "retain",
    "run_checkpoints",
    "set_aside",
    "step_of",
    "step_paths",
    "sweep_note",
    "trainer_checkpoints",
    "whole_checkpoints",
    "write_companions",
]

T = TypeVar("T")

_PREFIX, CKPT_SUFFIX = "step-", ".ckpt"
#: A distributed run's checkpoints are ``ckptkit.distributed`` directories, ``step-00000120.dcp/``.
DCP_SUFFIX = ".dcp"
#: A Hugging Face ``Trainer`` output directory's checkpoints are ``checkpoint-N/`` folders, each
#: committed by this file, written last (spec/transformers.md R-HF02; ``ckptkit.integrations.hf_folder``
#: checks them): the audit and replay find them here, beside a recorded run's ``history.jsonl``.
TRAINER_COMMIT = "ckptkit-state.ckpt"
_TRAINER_PREFIX = "checkpoint-"


def checkpoint_name(step: int, suffix: str = CKPT_SUFFIX) -> str:
    """File name of the checkpoint at ``step``: ``step-00000120.ckpt`` (8+ digits, sortable);
    ``suffix=DCP_SUFFIX`` names a distributed run's checkpoint directory."""
    return f"{_PREFIX}{step:08d}{suffix}"


def read_environment(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The environment facts a run recorded when it started (``environment.json``).

    Raises:
        CheckpointNotFound: the record is missing.
        UnreadableFile: it is no readable regular file (R-025).
        FormatError: it is not valid JSON, or over 16 MiB.
    """
    env_path = os.path.join(os.fspath(run_dir), ENVIRONMENT_FILE)
    data = read_small_file(
        env_path, "environment record", missing="the run's environment record is missing", hint="R-025"
    )
    try:
        facts = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"not valid JSON: {e}", path=env_path, field="environment") from None
    if not isinstance(facts, dict):
        raise FormatError("not a JSON object", path=env_path, field="environment", actual=type(facts).__name__)
    return facts


def list_checkpoints(run_dir: str | os.PathLike[str], suffix: str = CKPT_SUFFIX) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint file in ``run_dir``, oldest first
    (``suffix=DCP_SUFFIX``: every distributed checkpoint directory, committed or not)."""
    run_dir = os.fspath(run_dir)
    out = []
    for name in list_run_dir(run_dir):
        step = step_of(name, suffix)
        if step is not None:
            out.append((step, os.path.join(run_dir, name)))
    return sorted(out)


def run_checkpoints(run_dir: str | os.PathLike[str]) -> dict[int, str]:
    """Step -> path of every committed checkpoint in ``run_dir``, of either store: ``.ckpt``
    files, or a distributed run's ``.dcp`` directories (:func:`whole_checkpoints`: debris an
    interrupted save left is not a checkpoint, so no comparison ever reads it); in a Trainer
    output directory its committed ``checkpoint-N/`` folders, in a torchtitan checkpoint folder
    its committed ``step-N/`` directories (:func:`trainer_checkpoints`)."""
    from ..distributed._format import METADATA_NAME

    return dict(
        whole_checkpoints(run_dir)
        + whole_checkpoints(run_dir, DCP_SUFFIX)
        + trainer_checkpoints(run_dir)
        + trainer_checkpoints(run_dir, _PREFIX, METADATA_NAME)  # torchtitan's step-N/ (torchtitan.md R-TT04)
    )


def trainer_checkpoints(
    run_dir: str | os.PathLike[str], prefix: str = _TRAINER_PREFIX, commit: str = TRAINER_COMMIT
) -> list[tuple[int, str]]:
    """``(step, path)`` of every committed ``<prefix>N/`` folder a trainer wrote (one holding
    its ``commit`` file, written last; a torn one is not a checkpoint), oldest first: by default
    a Hugging Face Trainer's ``checkpoint-N/`` (:data:`TRAINER_COMMIT`)."""
    run_dir = os.fspath(run_dir)
    out = []
    for name in list_run_dir(run_dir):
        digits, path = name[len(prefix) :], os.path.join(run_dir, name)
        if name.startswith(prefix) and digits.isdecimal() and os.path.isfile(os.path.join(path, commit)):
            out.append((int(digits), path))
    return sorted(out)


def step_of(name: str, suffix: str = CKPT_SUFFIX) -> int | None:
    """The step a checkpoint name says (``step-00000120.ckpt`` -> 120); None for any other name."""
    digits = name[len(_PREFIX) : -len(suffix)]
    if name.startswith(_PREFIX) and name.endswith(suffix) and digits.isdecimal() and len(digits) >= 8:
        return int(digits)
    return None


def debris(run_dir: str | os.PathLike[str], suffix: str | None = None) -> list[tuple[str, str]]:
    """What an interrupted save or deletion left in ``run_dir``, never a checkpoint (R-023):
    ``(name, why)``, sorted (``suffix``: of one store's names only; None: of both). A
    ``step-N.dcp/`` without ``metadata.ckdcp`` never committed (a kill during its save, or
    during retention, which uncommits first); a companion (``step-N<suffix>.config.json``,
    ``.<kind>``) whose checkpoint is not there was written before a container that never
    came, or outlived one retention deleted. Only a run's one writer removes it, where no
    save of its own is in flight (start, resume)."""
    from ..distributed._format import METADATA_NAME

    run_dir = os.fspath(run_dir)
    out = []
    for sfx in [suffix] if suffix else [CKPT_SUFFIX, DCP_SUFFIX]:
        whole = set()
        for _step, path in list_checkpoints(run_dir, sfx):
            name = os.path.basename(path)
            if sfx == DCP_SUFFIX and not os.path.isfile(os.path.join(path, METADATA_NAME)):
                out.append(
                    (name, f"an uncommitted checkpoint (no {METADATA_NAME}): its save or its deletion was cut off")
                )
            else:
                whole.add(name)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for name in os.listdir(run_dir):
                head, sep, _kind = name.partition(sfx + ".")
                if sep and head.startswith(_PREFIX) and head[len(_PREFIX) :].isdigit() and head + sfx not in whole:
                    out.append((name, f"a companion without its checkpoint ({head + sfx} is not a whole checkpoint)"))
    return sorted(out)


def whole_checkpoints(run_dir: str | os.PathLike[str], suffix: str = CKPT_SUFFIX) -> list[tuple[int, str]]:
    """:func:`list_checkpoints` without :func:`debris`: what a run directory holds that was
    committed, whole or damaged."""
    left = {name for name, _why in debris(run_dir, suffix)}
    return [(s, p) for s, p in list_checkpoints(run_dir, suffix) if os.path.basename(p) not in left]


def remove_debris(run_dir: str | os.PathLike[str]) -> list[str]:
    """Remove :func:`debris` (of both stores' names); returns the names removed (one that will
    not go is left, and said again next time)."""
    gone = []
    for name, _why in debris(run_dir):
        path = os.path.join(os.fspath(run_dir), name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            continue
        gone.append(name)
    return gone


def sweep_note(removed: list[str]) -> list[str]:
    """The one line a start or resume says about what it removed (nothing: no line)."""
    if not removed:
        return []
    names = sorted(os.path.basename(p.rstrip(os.sep)) for p in removed)
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return [f"removed what interrupted saves left (none of it a checkpoint): {shown}"]


def retain(
    stage: str,
    listed: list[tuple[int, str]],
    keep: int,
    delete: Callable[[str], None],
    log: Callable[[str], None],
    suffix: str = CKPT_SUFFIX,
) -> None:
    """Delete all but the newest ``keep`` of the checkpoints ``listed`` (oldest first), and the
    companions in the run's ``stage`` a crash mid-delete orphaned (``delete`` removes a checkpoint
    and its companions). The new checkpoint is already committed, so a failure here is reported and
    retried by the next save, never raised."""
    kept = {p.rpartition("/")[2] for _s, p in listed[-keep:]}
    for _step, path in listed[:-keep]:
        try:
            delete(path)
        except (OSError, CheckpointError) as e:
            kept.add(path.rpartition("/")[2])
            why = e if isinstance(e, CheckpointError) else e.strerror
            log(f"retention: cannot delete {path} ({why}); will retry at the next save")
    oldest = listed[-keep:][0][0] if listed else None
    for name in sorted(list_run_dir(stage)):
        head, sep, _kind = name.partition(suffix + ".")
        step = step_of(head + suffix, suffix)
        if sep and step is not None and head + suffix not in kept and oldest is not None and step < oldest:
            try:
                os.unlink(os.path.join(stage, name))
            except FileNotFoundError:
                pass
            except OSError as e:
                log(f"retention: cannot delete orphan {name} ({e.strerror})")


#: How a piece set aside is renamed: ``damaged-<n>.<name>``, a name no store, sweep or retention
#: reads as a checkpoint or companion (so never removed by them, R-028).
DAMAGED = "damaged-"
#: How the line saying so begins: a diagnostic no ``--quiet`` silences.
SET_ASIDE = "set aside "


def set_aside(paths: Iterable[str], step: int, log: Callable[[str], None]) -> None:
    """Rename each of ``paths`` that is there but is no file (a directory, FIFO, device: a damaged
    step a resume passed over, R-026) to ``damaged-<n>.<name>`` and say so: the save of ``step``
    then writes where it stood, and nothing is deleted (spec/runstate.md R-028).

    Raises:
        SaveFailed: it cannot be renamed (named, with what to do).
    """
    for path in paths:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if stat.S_ISREG(mode) or stat.S_ISLNK(mode):  # a save's rename replaces these
            continue
        head, name = os.path.split(path)
        n = 1
        while os.path.lexists(os.path.join(head, f"{DAMAGED}{n}.{name}")):
            n += 1
        aside = f"{DAMAGED}{n}.{name}"
        try:
            os.rename(path, os.path.join(head, aside))
        except OSError as e:
            raise SaveFailed(
                f"{path}: is {file_kind(mode)} where step {step}'s save writes a file, and cannot be set aside "
                f"({e.strerror}); move it away and save again (R-028)"
            ) from None
        log(
            f"{SET_ASIDE}{name} as {aside}: it is {file_kind(mode)} where step {step}'s save writes a file "
            "(a damaged step); nothing was deleted (R-028)"
        )


def step_paths(path: str, kinds: Iterable[str]) -> list[str]:
    """Where a save of the checkpoint at ``path`` writes: it, its snapshot, its sidecars of ``kinds``."""
    return [path, snapshot_path(path), *(sidecar_path(path, k) for k in kinds)]


def write_companions(path: str, step: int, config: bytes, sidecars: Mapping[str, tuple[int, Any]]) -> dict[str, Any]:
    """Write the snapshot, then each sidecar (stamped ``step``), of the checkpoint at ``path``,
    and return its companion record (spec/companions.md): their digests and that of the
    run's ``environment.json``, for the checkpoint, written after them, to carry.

    Raises:
        SaveFailed: a write failed; earlier checkpoints are intact.
        UnsupportedValue: a sidecar value the codec cannot carry.
    """
    write_bytes_atomic(snapshot_path(path), config)
    bound = {
        kind: write_sidecar(sidecar_path(path, kind), train_step=step, table_step=table_step, tree=tree)
        for kind, (table_step, tree) in sidecars.items()
    }
    env_path = os.path.join(os.path.dirname(path), ENVIRONMENT_FILE)
    env = file_digest(env_path, "environment record") if os.path.exists(env_path) else None
    return make_record(snapshot=xxhash.xxh3_64_intdigest(config), environment=env, sidecars=bound)


def check_step(path: str, named: int, stored: int, *, field: str, what: str, offset: int | None = None) -> None:
    """A checkpoint's stored step must be the one its name says.

    Raises:
        FormatError: it is not (a checkpoint renamed or copied over another).
    """
    if stored != named:
        raise FormatError(
            f"{what} does not match the {'file' if offset is not None else 'directory'} name",
            path=path,
            offset=offset,
            field=field,
            expected=named,
            actual=stored,
            hint="a checkpoint renamed or copied over another; resume from another",
        )


def remove_companions(path: str, kinds: Iterable[str]) -> None:
    """Remove the snapshot and the sidecars of ``kinds`` beside the checkpoint at ``path`` (the
    checkpoint itself goes first: a crash in between leaves orphans retention sweeps, never a
    checkpoint without its companions)."""
    for p in [snapshot_path(path), *(sidecar_path(path, k) for k in kinds)]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def read_sidecars(path: str, step: int, kinds: Iterable[str]) -> dict[str, Sidecar]:
    """Each sidecar of ``kinds`` beside the checkpoint at ``path``, checked to be stamped ``step``.

    Raises:
        CheckpointNotFound: a sidecar is missing.
        FormatError: one is damaged or belongs to another step (R-021).
    """
    return {kind: read_sidecar(sidecar_path(path, kind), expect_step=step) for kind in kinds}


def restorable(sidecars: Mapping[str, Sidecar]) -> dict[str, tuple[int, Any]]:
    """``kind -> (table_step, tree)``: read sidecars in the form ``RunState.restore`` takes."""
    return {kind: (sc.table_step, sc.tree) for kind, sc in sidecars.items()}


def read_companions(path: str, step: int, kinds: Iterable[str], tree: Any) -> dict[str, Sidecar]:
    """The companions of the checkpoint at ``path`` (its companion record in ``tree``, the
    checkpoint's monitor state), checked: the snapshot is there and parses, each sidecar of
    ``kinds`` is stamped ``step``, and every digest the record holds matches. A damaged or
    swapped companion is damage, like a damaged container (spec/companions.md): a resume
    skips the checkpoint, never reports it as drift.

    Returns:
        The sidecars by kind.

    Raises:
        CheckpointNotFound: the snapshot or a sidecar is missing.
        FormatError: a companion is damaged or does not match the record.
    """
    if not os.path.exists(snapshot_path(path)):
        if record_of(tree, path) is None:  # no companions ever: a ckptkit.save file, not a run's checkpoint
            raise CheckpointNotFound(
                f"{snapshot_path(path)}: config snapshot is missing, and {os.path.basename(path)} records no "
                "companions: a file written by ckptkit.save, not RunState.save, has no config or environment to "
                "resume; move it out of the run directory, load it into the registered objects and let "
                "state.save(step) write the run's first checkpoint (docs/adopting.md section 5)"
            )
        raise CheckpointNotFound(f"{snapshot_path(path)}: config snapshot is missing")
    sidecars = read_sidecars(path, step, kinds)
    check_companions(path, record_of(tree, path), sidecars=sidecars)
    read_snapshot(snapshot_path(path))
    return sidecars


def refuse_existing(run_dir: str, existing: list[tuple[int, str]]) -> None:
    """``start()`` never overwrites: refuse a run directory that already holds checkpoints.

    Raises:
        ResumeRefused: ``existing`` is not empty.
    """
    if existing:
        raise ResumeRefused(
            f"{run_dir}: already holds {len(existing)} checkpoint(s), newest "
            f"{os.path.basename(existing[-1][1])}; resume it (--resume) or use a new run directory"
        )


def is_damage(e: BaseException) -> bool:
    """``e`` says a checkpoint is damaged or cannot be read, which a resume passes over for an older
    one (R-026): never drift, and never an object store that still failed after every retry, which
    says nothing of the checkpoint (R-O50)."""
    return isinstance(e, (FormatError, CheckpointNotFound, UnreadableFile)) and not isinstance(e, StoreUnavailable)


def newest_consistent(
    run_dir: str, candidates: list[tuple[int, str]], check: Callable[[int, str], T]
) -> tuple[T, str, list[tuple[str, str]]]:
    """The newest of ``candidates`` that ``check(step, path)`` accepts: ``(what check returned,
    its path, (path, why) for each newer one it refused)``. A refusal is a
    :class:`FormatError`, :class:`CheckpointNotFound` or :class:`UnreadableFile` (damage or a
    piece that cannot be read, never drift). An object store that still throttles or fails after
    every retry is no refusal: it says nothing of the checkpoint, and is raised (R-O50).

    Raises:
        CheckpointNotFound: no candidates.
        NoConsistentCheckpoint: none accepted (each refusal listed).
        StoreUnavailable: the object store failed a read past its retries.
    """
    if not candidates:
        raise CheckpointNotFound(f"{run_dir}: no checkpoints to resume from")
    skipped: list[tuple[str, str]] = []
    for named_step, path in reversed(candidates):
        try:
            return check(named_step, path), path, skipped
        except CheckpointError as e:
            if not is_damage(e):
                raise
            skipped.append((path, str(e)))
    detail = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in skipped)
    raise NoConsistentCheckpoint(f"{run_dir}: no consistent checkpoint to resume from ({detail})")


def fallback_notes(skipped: list[tuple[str, str]], path: str, step: int) -> list[str]:
    """The lines a resume says for the checkpoints it passed over (:func:`is_fallback_note`)."""
    notes = [f"{_SKIPPED}{os.path.basename(p)}: {why}" for p, why in skipped]
    if skipped:
        notes.append(f"{_FELL_BACK}{os.path.basename(path)} (step {step})")
    return notes


_SKIPPED, _FELL_BACK = "skipped ", "falling back to "


def is_fallback_note(note: str) -> bool:
    """Whether a resume note says a checkpoint was passed over: a diagnostic no ``--quiet`` silences."""
    return note.startswith((_SKIPPED, _FELL_BACK))


#: The run's records a run appends to in its place's stage, brought once the lease is held and
#: sent before each commit record and at the close (spec/objectstore.md R-O23, R-D21).
_APPENDED = (HISTORY_FILE, INTERRUPTED_FILE)


class RunRecords:
    """What every store shares of the :class:`~ckptkit.run._store.Store` protocol about the run's own
    records, on the run's place (:mod:`ckptkit.format._place`): ``environment.json`` and the history,
    written as files in the place's stage (a local run directory itself; for an ``s3://`` prefix a
    private folder), brought from and sent to the place whole."""

    place: Place
    suffix: str  # the store's checkpoint names: step-N.ckpt, or a distributed run's step-N.dcp
    _leased = False  # rank 0 holds the lease: from here on, and only from here, records are sent (R-LS16)

    @property
    def work_dir(self) -> str:
        """Where the run's appended files (``history.jsonl``) are written: the place's stage."""
        return self.place.stage

    def leased(self) -> None:
        """Rank 0 holds the lease now: the history and the rows earlier resumes set aside (R-D21), as
        they stand now, into the stage; from here on, and only from here, records go to the place
        (R-LS16). A copy brought before the lease could be older than the holder's last one, and
        would be sent over it."""
        if not self._leased:
            self._leased = True
            for name in _APPENDED:
                self.place.bring(name)

    def send_records(self) -> None:
        """The history and the rows set aside, each when it changed (R-O23), and only by a job that
        holds the lease (R-LS16): a job that never held it has nobody's records in its stage."""
        if self._leased:
            for name in _APPENDED:
                self.place.send(name)

    def begin(self, environment: bytes) -> None:
        """Rank 0, a fresh run: make the stage, remove dead writers' temp files, record the environment."""
        os.makedirs(self.place.stage, exist_ok=True)
        clean_stale_temps(self.place.stage)
        write_bytes_atomic(os.path.join(self.place.stage, ENVIRONMENT_FILE), environment)
        self.place.send(ENVIRONMENT_FILE)  # one whole object; a fresh run replaces it

    def environment(self) -> dict[str, Any]:
        if not self.place.bring(ENVIRONMENT_FILE):
            raise CheckpointNotFound(f"{self.place.child(ENVIRONMENT_FILE)}: the run's environment record is missing")
        return read_environment(self.place.stage)

    def _here(self, path: str) -> str:
        """The stage's copy of the checkpoint at ``path`` (locally ``path`` itself)."""
        return os.path.join(self.place.stage, path.rpartition("/")[2])

    def steps(self, suffix: str, *, committed: bool = False) -> list[tuple[int, str]]:
        """``(step, path)`` of the checkpoints named ``...suffix`` at the place, oldest first
        (``committed``: only those committed; a ``.dcp`` directory is once it holds its metadata)."""
        from ..distributed._format import METADATA_NAME

        found = self.place.names(suffix, marker=METADATA_NAME if suffix == DCP_SUFFIX else None)
        named = [(step_of(n, suffix), n) for n, done in found.items() if done or not committed]
        return sorted((s, self.place.child(n)) for s, n in named if s is not None)

    def listing(self) -> list[tuple[int, str]]:
        return self.steps(self.suffix)

    def snapshot(self, path: str) -> Snapshot:
        return read_snapshot(snapshot_path(self._here(path)))

    def any_checkpoints(self) -> bool:
        """A checkpoint of either store is at the place (``resume_or_start``); what an interrupted
        save left is none (R-023, R-O15)."""
        return any(self.steps(s, committed=True) for s in (CKPT_SUFFIX, DCP_SUFFIX))

    def began(self) -> bool:
        """The run's environment record, or what an interrupted save left, is at the place."""
        if self.place.began() or os.path.isfile(os.path.join(self.place.stage, ENVIRONMENT_FILE)):
            return True
        return any(debris(self.place.stage, suffix) for suffix in (CKPT_SUFFIX, DCP_SUFFIX))
