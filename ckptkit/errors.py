"""The one exception tree of ckptkit.

Every error ckptkit raises on purpose is a :class:`CheckpointError`. Each class
also subclasses the builtin a caller would catch anyway, so ``except ValueError``
around a load keeps working::

    CheckpointError (Exception)
    ├── FormatError (ValueError)              bytes on disk break a rule in spec/
    │   ├── BadMagic                          not a ckptkit file / wrong file kind
    │   ├── UnsupportedVersion                a magic with a version this reader lacks
    │   ├── ReservedBitSet                    a flag bit this reader cannot honour
    │   ├── TruncatedFile                     a length points past the end of the file
    │   ├── ChecksumMismatch                  stored digest != digest of the bytes
    │   ├── MalformedIndex                    a section index breaks the codec rules
    │   ├── BadTensorValue                    tensor bytes that are no value of their dtype
    │   └── SidecarMismatch                   a sidecar does not belong to its checkpoint
    ├── CheckpointNotFound (FileNotFoundError) no checkpoint where one was expected
    │   ├── IncompleteCheckpoint              a save that did not commit (a distributed one, a Trainer folder)
    │   └── NoConsistentCheckpoint            every checkpoint of a run is damaged or unreadable
    ├── UnreadableFile (OSError)              a path that is there but is no readable file
    ├── InsufficientMemory (MemoryError)      a load would allocate more than is available
    ├── SaveFailed (OSError)                  a write failed; the previous file is intact
    │   └── CommitConflict                    another writer committed that checkpoint first (object storage)
    ├── UnsupportedValue (TypeError)          state the container cannot carry
    ├── UnsupportedOption (ValueError)        a storage option or checkpoint id ckptkit does not serve
    ├── ResumeRefused (RuntimeError)          a resume would continue a different run
    │   ├── ConfigDrift                       the config differs in strict keys
    │   ├── EnvironmentDrift                  torch version, threads, ... differ
    │   ├── StreamOffsetMismatch              the data position disagrees with the step
    │   ├── StateMismatch                     stored state does not fit the live objects
    │   ├── LegacyCheckpoint                  a v1 file lacks state the run needs
    │   ├── WorldSizeChanged                  a distributed run resumed at another world size or layout
    │   └── RunDirInUse                       another live job holds the run directory's lease
    ├── LeaseLost (RuntimeError)              this job may no longer write: its lease was taken, its launcher died
    ├── TrainingUnstable (RuntimeError)       spike rollbacks hit their bound
    ├── DistributedFailure (RuntimeError)     a rank failed inside torch.distributed.checkpoint
    ├── ReplicaDivergence (RuntimeError)      ranks hold different copies of replicated run state
    ├── ReplayDivergence (RuntimeError)       a re-run parts from its recording
    ├── ReplayError (ValueError)              a replay that cannot be asked for
    └── AuditError (RuntimeError)             an audited command failed, timed out or could not be stopped

    RunStopped (SystemExit)                   not an error: a requested stop saved the run (exit 75)

``RunStopped`` stands apart on purpose: a loop's ``except Exception`` must not
swallow a preemption, and uncaught it ends the process with :data:`EXIT_STOPPED`.

Format errors carry ``path``, ``offset``, ``field``, ``expected``, ``actual`` and
``hint`` and render one line, e.g.::

    run/step-00000120.ckpt: offset 48 (0x30): flags: reserved bit 5 set (expected 0, got 0x20)
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "EXIT_UNSTABLE",
    "EXIT_STOPPED",
    "AuditError",
    "BadMagic",
    "BadTensorValue",
    "CheckpointError",
    "CheckpointNotFound",
    "ChecksumMismatch",
    "CommitConflict",
    "ConfigDrift",
    "DistributedFailure",
    "EnvironmentDrift",
    "FormatError",
    "IncompleteCheckpoint",
    "InsufficientMemory",
    "LeaseLost",
    "LegacyCheckpoint",
    "MalformedIndex",
    "NoConsistentCheckpoint",
    "ReplayDivergence",
    "ReplayError",
    "ReplicaDivergence",
    "ReservedBitSet",
    "ResumeRefused",
    "RunDirInUse",
    "RunStopped",
    "SaveFailed",
    "SidecarMismatch",
    "StateMismatch",
    "StreamOffsetMismatch",
    "TrainingUnstable",
    "TruncatedFile",
    "UnreadableFile",
    "UnsupportedOption",
    "UnsupportedValue",
    "UnsupportedVersion",
    "WorldSizeChanged",
]


class CheckpointError(Exception):
    """Root of every error ckptkit raises on purpose."""


class FormatError(CheckpointError, ValueError):
    """Bytes on disk break a rule of ``spec/``.

    Attributes:
        path: the file, as the caller named it (``None`` for in-memory bytes).
        offset: absolute byte offset of the offending field, if known.
        field: the field or section, as ``spec/`` names it.
        problem: what is wrong, in words.
        expected / actual: what the rule wants and what the file holds.
        hint: what a person can do about it. A bare rule id (``"R-003"``) is
            expanded with the class's default advice (:attr:`action`).
    """

    #: What to do, when the raiser has nothing more specific to say.
    action = "the file is damaged; resume from an earlier checkpoint"

    def __init__(
        self,
        problem: str,
        *,
        path: str | os.PathLike[str] | None = None,
        offset: int | None = None,
        field: str | None = None,
        expected: Any = None,
        actual: Any = None,
        hint: str | None = None,
    ) -> None:
        self.problem = problem
        self.path = None if path is None else os.fspath(path)
        self.offset = offset
        self.field = field
        self.expected = expected
        self.actual = actual
        self.hint = hint
        super().__init__(self._render())

    def _render(self) -> str:
        parts = []
        if self.path is not None:
            parts.append(self.path)
        if self.offset is not None:
            parts.append(f"offset {self.offset} (0x{self.offset:x})")
        if self.field is not None:
            parts.append(self.field)
        msg = ": ".join([*parts, self.problem])
        if self.expected is not None and self.actual is not None:
            msg += f" (expected {self.expected}, got {self.actual})"
        elif self.expected is not None:
            msg += f" (expected {self.expected})"
        elif self.actual is not None:
            msg += f" (got {self.actual})"
        if self.hint:
            bare_rule = self.hint.startswith("R-") and " " not in self.hint
            msg += f"; {self.action} ({self.hint})" if bare_rule else f"; {self.hint}"
        return msg


class BadMagic(FormatError):
    """The file does not start with a magic this reader knows."""

    action = "not a ckptkit file, or its first bytes are damaged"


class UnsupportedVersion(FormatError):
    """The magic is ckptkit's but the version is newer (or unknown) to this reader."""


class ReservedBitSet(FormatError):
    """A flag bit is set that this reader cannot honour: it would carry state we drop."""


class TruncatedFile(FormatError):
    """A length or offset points past the end of the file (or the file ends early)."""

    action = "the file is incomplete or a length field is damaged; resume from an earlier checkpoint"


class ChecksumMismatch(FormatError):
    """The digest stored in the file does not match the bytes it covers."""


class MalformedIndex(FormatError):
    """A section's msgpack index, or a value in it, breaks the codec rules."""

    action = "the file is damaged or was not written by ckptkit; resume from an earlier checkpoint"


class BadTensorValue(FormatError):
    """A tensor's bytes are no value of its dtype (a bool byte other than 0 or 1), though its digest matches.

    The digest matching means the file holds what its writer wrote: that writer was
    not a correct ckptkit (or the bytes were crafted).
    """

    action = "the file was not written by a correct ckptkit writer; do not load it"


class SidecarMismatch(FormatError):
    """A sidecar exists but belongs to another training step than its checkpoint."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint where one was expected (missing file, empty run directory)."""


class IncompleteCheckpoint(CheckpointNotFound):
    """A checkpoint whose save did not commit: a distributed checkpoint directory that did not
    commit on every rank (no metadata file, or a rank's data file missing; ``missing`` names the
    files), or a Trainer ``checkpoint-N/`` folder without its commit (spec/transformers.md R-HF03)."""

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)

    def __reduce__(self) -> Any:  # crosses processes inside DCP's exception gather
        return (type(self), (str(self), self.missing))


class NoConsistentCheckpoint(CheckpointNotFound):
    """A resume found checkpoints, and every one of them damaged or unreadable (each is
    named, with why, in the message): a problem found, like an invalid file (``ckptkit``
    exits 1), where an empty run directory is a path with nothing to resume (exit 2)."""


class UnreadableFile(CheckpointError, OSError):
    """Something is at the path, but not a file ckptkit can read: a directory, FIFO,
    device or socket, a symlink loop, a permission denied. ``errno`` is the cause's
    where there is one. ``verify`` reports it (``ok=False``) rather than raising.
    """

    def __init__(self, message: str, *, errno: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.errno = errno
        self.filename = path

    def __str__(self) -> str:  # OSError would render "[Errno 40] ..." instead of our sentence
        return self.message


class InsufficientMemory(CheckpointError, MemoryError):
    """A load would allocate more memory than is available or allowed.

    Raised before anything is allocated, naming the largest tensor and the total.
    The limit is the memory available to this process (``MemAvailable``, the cgroup
    limit, the address-space limit ``RLIMIT_AS``) unless ``load(max_memory=...)``
    sets one. A zstd section may declare up to 32768 x its stored size
    (spec/validation.md R-008), so a small file can ask for gigabytes.
    """


class SaveFailed(CheckpointError, OSError):
    """Writing a checkpoint failed.

    The previous file is untouched, except in one case the message states: the new
    file was renamed into place but the directory fsync failed (whole, durability
    unknown). ``errno`` and ``filename`` are copied from the underlying ``OSError``.
    """

    def __init__(self, message: str, *, cause: OSError | None = None, path: str | None = None):
        super().__init__(message)
        self.message = message
        if cause is not None:
            self.errno = cause.errno
            self.strerror = cause.strerror
        self.filename = path

    def __str__(self) -> str:  # OSError would render "[Errno 28] ..." instead of our sentence
        return self.message


class CommitConflict(SaveFailed):
    """A checkpoint on object storage was committed by another writer first: its commit record
    (or one of its objects) already exists, and a conditional put creates an object only once
    (spec/objectstore.md R-O11). Nothing of the other writer's is overwritten; this save wrote
    no commit."""


class UnsupportedValue(CheckpointError, TypeError):
    """A value the container cannot carry; refused at save or registration, never dropped."""


class UnsupportedOption(CheckpointError, ValueError):
    """A storage argument or checkpoint id (a URL, a DCP option) this backend refuses; the message
    names it, says why and what to do instead."""


class ResumeRefused(CheckpointError, RuntimeError):
    """A resume would silently continue a different run, so it does not start."""


class ConfigDrift(ResumeRefused):
    """The config differs from the run's snapshot in strict keys.

    Attributes:
        differences: every strict difference (all of them, never only the first).
    """

    def __init__(self, message: str, differences: list[Any] | None = None) -> None:
        super().__init__(message)
        self.differences = list(differences or [])


class EnvironmentDrift(ResumeRefused):
    """Facts outside the config that change the numbers differ from the recording."""

    def __init__(self, message: str, differences: list[Any] | None = None) -> None:
        super().__init__(message)
        self.differences = list(differences or [])


class StreamOffsetMismatch(ResumeRefused):
    """The data position computed for a resume disagrees with the stored one."""


class StateMismatch(ResumeRefused):
    """The stored state does not fit the objects it would be restored into: a
    registration or key one side lacks, a shape or dtype that differs. Raised
    before anything is written, so the live objects are untouched.

    Attributes:
        problems: every difference, one human line each (the message shows the first 10).
    """

    def __init__(self, message: str, problems: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


class LegacyCheckpoint(ResumeRefused):
    """A legacy (v1) checkpoint lacks state this run needs; ``missing`` names it."""

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class WorldSizeChanged(ResumeRefused):
    """A distributed run resumed at another world size or parallel layout (DDP, FSDP2
    mesh) than it was saved at: the same checkpoint would continue a different
    computation. The message names both sides and what to do (the saved world size,
    or an explicit reshard, after which the run is no longer bit-comparable).

    Attributes:
        saved: the recorded facts (``world_size``, ``layout.<model>``).
        current: this job's facts, the same keys.
    """

    def __init__(self, message: str, saved: dict[str, Any] | None = None, current: dict[str, Any] | None = None):
        super().__init__(message)
        self.saved = dict(saved or {})
        self.current = dict(current or {})

    def __reduce__(self) -> Any:  # crosses processes when one rank tells the others
        return (type(self), (str(self), self.saved, self.current))


class RunDirInUse(ResumeRefused):
    """Another job, alive as far as can be told, holds the run directory's lease (spec/lease.md
    R-LS03): the message names it (host, pid, ranks, start, last heartbeat) and what to do.

    Attributes:
        holder: the :class:`ckptkit.run._lease.Holder` found there.
    """

    def __init__(self, message: str, holder: Any = None) -> None:
        super().__init__(message)
        self.holder = holder


class LeaseLost(CheckpointError, RuntimeError):
    """This job may no longer write its run directory: another job took its lease over, or this
    rank's launcher died (spec/lease.md R-LS06, R-LS07). Raised before a save writes anything."""


#: The exit code of a command that ended with :class:`TrainingUnstable` (``ckptkit train``, spec/cli.md).
EXIT_UNSTABLE = 3


class TrainingUnstable(CheckpointError, RuntimeError):
    """Spike rollbacks reached their bound; the last good checkpoint is intact.

    Attributes:
        events: when a spike guard raised it, the spikes that exhausted the bound, oldest first.
    """

    events: list[dict[str, Any]]


class DistributedFailure(CheckpointError, RuntimeError):
    """A rank failed inside ``torch.distributed.checkpoint`` with an error that is not
    ckptkit's; DCP's ``CheckpointException`` (a ``BaseException``) becomes this.

    Attributes:
        failures: ``{rank: "ExceptionType: message"}`` for every failed rank.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.failures))


class ReplicaDivergence(CheckpointError, RuntimeError):
    """Ranks of a distributed run hold different copies of state that is registered
    as replicated (a monitor, a value, a flag, a sidecar, the config), so "rank 0's
    copy" would silently drop the others'. Nothing was saved.

    Attributes:
        pieces: ``{piece: [[ranks with one copy], [ranks with another], ...]}``.
    """

    def __init__(self, message: str, pieces: dict[str, list[list[int]]] | None = None) -> None:
        super().__init__(message)
        self.pieces = dict(pieces or {})

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.pieces))


class ReplayDivergence(CheckpointError, RuntimeError):
    """A re-run parted from the recording it should reproduce bit for bit.

    Usual causes, most common first:

    - an unseeded or global RNG draw inside a step (``torch.rand`` without a generator);
    - nondeterministic kernels (``torch.use_deterministic_algorithms`` off, atomics on GPU);
    - a different intra-op thread count (reductions split differently);
    - data-order drift (stream offset, shuffling that depends on history);
    - a different torch / numpy version, or a different default dtype;
    - state not restored on resume (scheduler, scaler, EMA teacher, monitor).
    """


class ReplayError(CheckpointError, ValueError):
    """A replay that cannot be asked for (a step outside the recording, a bad override): exit 2."""


class AuditError(CheckpointError, RuntimeError):
    """An audit that could not run: a training process failed, timed out, or ignored the
    stop request (its stderr and a hint are in the message): exit 2."""


EXIT_STOPPED = 75  # EX_TEMPFAIL (sysexits.h): "try again later" -- the run is resumable


class RunStopped(SystemExit):
    """The run saved and stopped on request; uncaught, the process exits with :data:`EXIT_STOPPED`.

    Attributes:
        step: the steps done (the checkpoint's step).
        path: the checkpoint saved (or the one already at that step).
        reason: what asked for the stop (``SIGTERM``, ``CKPTKIT_STOP_AT=20``).
    """

    def __init__(self, step: int, path: str, reason: str) -> None:
        super().__init__(EXIT_STOPPED)
        self.step, self.path, self.reason = step, path, reason
