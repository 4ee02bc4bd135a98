"""Companion binding: a checkpoint records the digest of every file it depends on.

A checkpoint is resumed together with files that sit next to it -- its config
snapshot (``<ckpt>.config.json``), its sidecars (``<ckpt>.<kind>``) and the run's
``environment.json``. They are written *before* the container, so the container,
which every byte of is checksummed, can carry their digests: the **companion
record**, ``monitor["companions"]`` (spec/companions.md, rules R-C01..R-C05)::

    {"snapshot": xxh3_64(snapshot bytes),
     "environment": xxh3_64(environment.json bytes),      # when the run recorded one
     "sidecars": {kind: the sidecar's skeleton digest}}

A companion edited, bit-flipped, or swapped for another run's or another step's
then no longer matches, and is reported as *damaged* -- by ``ckptkit verify`` and
by a resume, which skips that checkpoint as it skips a damaged container. A
checkpoint without a record (written before the binding, or a legacy v1 file)
protects its companions with nothing; readers say so rather than guess.

xxh3-64 detects accidents, not malice (spec/guarantees.md section 5).

This module imports no torch: it is part of the format core.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import CheckpointError, ChecksumMismatch, FormatError, MalformedIndex
from ._container import Source, read_layout
from ._snapshot import SNAPSHOT_SUFFIX, read_small_file, read_snapshot

__all__ = [
    "COMPANIONS_KEY",
    "ENVIRONMENT_FILE",
    "UNBOUND_NOTE",
    "CompanionCheck",
    "check_companions",
    "companion_checks",
    "file_digest",
    "make_record",
    "read_record",
    "rebind",
    "record_of",
    "same_checkpoint",
    "unbound_bytes",
]

COMPANIONS_KEY = "companions"
"""The key of the companion record in the monitor section's tree (R-C01)."""

ENVIRONMENT_FILE = "environment.json"
"""The run's environment record, one per run directory (spec/determinism.md)."""

_U64 = 1 << 64
UNBOUND_NOTE = (
    "records no companion digests (written before companion binding): "
    "its snapshot, sidecars and environment.json are not integrity-checked"
)


def file_digest(path: str | os.PathLike[str], what: str) -> int:
    """xxh3-64 (seed 0) of a small companion file's bytes (R-C02, R-C03).

    Raises:
        CheckpointNotFound: there is no file at ``path``.
        FormatError: the file is larger than 16 MiB (no snapshot or environment
            record is), or cannot be read.
    """
    name = os.fspath(path)
    return xxhash.xxh3_64_intdigest(read_small_file(name, what, missing=f"{what} is missing", hint="R-C02"))


def make_record(*, snapshot: int, environment: int | None, sidecars: Mapping[str, int]) -> dict[str, Any]:
    """The companion record a writer stores under ``monitor["companions"]`` (R-C01)."""
    record: dict[str, Any] = {"snapshot": snapshot, "sidecars": dict(sorted(sidecars.items()))}
    if environment is not None:
        record["environment"] = environment
    return record


def _is_u64(v: Any) -> bool:
    return type(v) is int and 0 <= v < _U64


def record_of(monitor: Any, path: str | None = None) -> dict[str, Any] | None:
    """The companion record in a checkpoint's monitor tree, or None when it has none.

    Raises:
        MalformedIndex: a record that breaks R-C01 (unknown keys, a digest that is
            not a u64, a sidecar kind that is not an identifier).
    """
    if not isinstance(monitor, Mapping) or COMPANIONS_KEY not in monitor:
        return None
    record = monitor[COMPANIONS_KEY]

    def bad(problem: str, actual: Any) -> MalformedIndex:
        return MalformedIndex(
            problem,
            path=path,
            field=f"monitor[{COMPANIONS_KEY!r}]",
            actual=actual,
            hint="the checkpoint is damaged or was written by a newer ckptkit; upgrade, or resume from another (R-C01)",
        )

    if not isinstance(record, Mapping):
        raise bad("the companion record is not a map", type(record).__name__)
    keys = set(record)
    if not {"snapshot", "sidecars"} <= keys <= {"snapshot", "sidecars", "environment"}:
        raise bad("the companion record needs snapshot and sidecars, and may have environment", sorted(map(str, keys)))
    sidecars = record["sidecars"]
    if not isinstance(sidecars, Mapping):
        raise bad("sidecars is not a map", type(sidecars).__name__)
    for key in ("snapshot", "environment"):
        if key in record and not _is_u64(record[key]):
            raise bad(f"{key} is not a u64 digest", repr(record[key]))
    for kind, digest in sidecars.items():
        if not isinstance(kind, str) or not kind.isidentifier() or not _is_u64(digest):
            raise bad("sidecars must map sidecar kinds to u64 digests", f"{kind!r}: {digest!r}")
    return dict(record)


def read_record(ckpt_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The companion record of a checkpoint file, read without torch; None when it has none.

    Reads the header and the indexes only: call it on a checkpoint that verified
    (``ckptkit.verify``), since the digests are trusted as read.

    Raises:
        CheckpointNotFound, FormatError: the checkpoint cannot be parsed.
    """
    with Source(ckpt_path) as src:
        layout = read_layout(src)
    monitor = layout.sections.get("monitor")
    return record_of(None if monitor is None else monitor.tree, os.fspath(ckpt_path))


@dataclass(frozen=True)
class CompanionCheck:
    """One companion of one checkpoint, as ``ckptkit verify`` reports it.

    Attributes:
        path: the companion file.
        kind: ``"snapshot"``, ``"environment"`` or ``"sidecar"``.
        checkpoint: the checkpoint whose record covers it.
        protected: False when the checkpoint records no digests (R-C05).
        error: why it fails, or None.
    """

    path: str
    kind: str
    checkpoint: str
    protected: bool
    error: CheckpointError | None

    @property
    def ok(self) -> bool:
        return self.error is None


def _damaged(path: str, ckpt_path: str, expected: int, actual: int, rule: str) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"damaged: its xxh3-64 does not match the digest {os.path.basename(ckpt_path)} records",
        path=path,
        expected=f"0x{expected:016x}",
        actual=f"0x{actual:016x}",
        hint=f"the file was edited, damaged or swapped after the checkpoint was saved; "
        f"resume from an earlier checkpoint ({rule})",
    )


def _sidecar_digest(path: str) -> int:
    from ._sidecar import sidecar_digest

    return sidecar_digest(path)


def _companions(
    ckpt_path: str, record: Mapping[str, Any], sidecars: Iterable[str] | None
) -> list[tuple[str, str, Any, str]]:
    """(kind, path, how to digest it, rule) for every companion the record binds."""
    base = os.path.dirname(ckpt_path)
    out: list[tuple[str, str, Any, str]] = [("snapshot", ckpt_path + SNAPSHOT_SUFFIX, record["snapshot"], "R-C02")]
    if "environment" in record:
        out.append(("environment", os.path.join(base, ENVIRONMENT_FILE), record["environment"], "R-C03"))
    recorded = record["sidecars"]
    for kind in sorted(set(recorded) | set(sidecars or ())):
        out.append(("sidecar", f"{ckpt_path}.{kind}", recorded.get(kind), "R-C04"))
    return out


def _check_one(kind: str, path: str, want: int | None, rule: str, ckpt_path: str) -> None:
    if want is None:
        raise FormatError(
            f"this sidecar is not among the companions {os.path.basename(ckpt_path)} records",
            path=path,
            hint=f"it was not saved with this checkpoint; resume from another ({rule})",
        )
    what = {"snapshot": "config snapshot", "environment": "environment record", "sidecar": "sidecar"}[kind]
    got = _sidecar_digest(path) if kind == "sidecar" else file_digest(path, what)
    if got != want:
        raise _damaged(path, ckpt_path, want, got, rule)
    if kind == "environment":
        _check_environment(path)


def _check_environment(path: str) -> None:
    """An environment record bound as it is must still be one: a JSON object (a resume reads it).
    A save after the file was damaged binds the damage; this catches it (R-C03)."""
    data = read_small_file(path, "environment record", missing="environment record is missing", hint="R-C03")
    try:
        facts = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(
            f"not valid JSON ({e})",
            path=path,
            field="environment",
            hint="the run's environment record is damaged (R-C03)",
        ) from None
    if not isinstance(facts, dict):
        raise FormatError(
            "not a JSON object", path=path, field="environment", actual=type(facts).__name__, hint="R-C03"
        )


def check_companions(
    ckpt_path: str | os.PathLike[str], record: Mapping[str, Any] | None, *, sidecars: Iterable[str] = ()
) -> None:
    """Refuse a checkpoint whose companions do not match its record (R-C02..R-C04).

    Args:
        ckpt_path: the checkpoint.
        record: its companion record (:func:`record_of`); None checks nothing (R-C05).
        sidecars: the sidecar kinds the reader needs; one the record lacks is refused.

    Raises:
        ChecksumMismatch: a companion is damaged, edited or swapped (the message
            names it and says "damaged").
        CheckpointNotFound: a recorded companion is missing.
        FormatError: a needed sidecar the record does not bind; a sidecar whose
            trailer cannot be read.

    Example:
        >>> check_companions("run/step-00000120.ckpt", read_record("run/step-00000120.ckpt"))  # doctest: +SKIP
    """
    if record is None:
        return
    ckpt_path = os.fspath(ckpt_path)
    for kind, path, want, rule in _companions(ckpt_path, record, sidecars):
        _check_one(kind, path, want, rule, ckpt_path)


def companion_checks(
    ckpt_path: str | os.PathLike[str],
    record: Mapping[str, Any] | None,
    *,
    missing_ok: bool = False,
    sidecars: Iterable[str] = (),
) -> list[CompanionCheck]:
    """Every companion of a checkpoint with its verdict, for ``ckptkit verify``.

    Args:
        ckpt_path: a checkpoint that verified.
        record: its companion record, or None: then the snapshot (if present) is
            listed as unprotected, parsed only.
        missing_ok: a recorded companion that is absent is left out rather than
            failed (a checkpoint verified on its own, away from its run).
        sidecars: sidecar kinds a resume of it would read (those beside it in its run, those
            the run's other checkpoints record); one the record lacks fails (R-C04).
    """
    ckpt_path = os.fspath(ckpt_path)
    out = []
    if record is None:
        snap = ckpt_path + SNAPSHOT_SUFFIX
        if os.path.lexists(snap):
            try:
                read_snapshot(snap)
                error = None
            except CheckpointError as e:
                error = e
            out.append(CompanionCheck(snap, "snapshot", ckpt_path, False, error))
        return out
    for kind, path, want, rule in _companions(ckpt_path, record, sidecars):
        if missing_ok and not os.path.lexists(path):
            continue
        try:
            _check_one(kind, path, want, rule, ckpt_path)
            error = None
        except CheckpointError as e:
            error = e
        out.append(CompanionCheck(path, kind, ckpt_path, True, error))
    return out


def rebind(ckpt_path: str | os.PathLike[str]) -> None:
    """Record, in a checkpoint, the digests of the companions now beside it.

    For a tool that deliberately substitutes a companion in a *private copy* of a run
    (``ckptkit replay`` writes its own plan as the snapshot of the checkpoint it
    resumes); everywhere else a companion that no longer matches is damage. The
    checkpoint is loaded (verified) and saved again, atomically; its sidecars are
    the kinds its record names. A checkpoint without a record is left as it is.
    Imports torch.

    Raises:
        CheckpointNotFound, FormatError: the checkpoint or a companion cannot be read.
        SaveFailed: the checkpoint could not be rewritten; the previous file is intact.
    """
    import dataclasses

    from ._checkpoint import load, save
    from ._sidecar import sidecar_digest

    ckpt_path = os.fspath(ckpt_path)
    ckpt = load(ckpt_path)
    old = record_of(ckpt.monitor, ckpt_path)
    if old is None:
        return
    env = os.path.join(os.path.dirname(ckpt_path), ENVIRONMENT_FILE)
    record = make_record(
        snapshot=file_digest(ckpt_path + SNAPSHOT_SUFFIX, "config snapshot"),
        environment=file_digest(env, "environment record") if os.path.exists(env) else None,
        sidecars={kind: sidecar_digest(f"{ckpt_path}.{kind}") for kind in old["sidecars"]},
    )
    save(ckpt_path, dataclasses.replace(ckpt, monitor={**ckpt.monitor, COMPANIONS_KEY: record}))


def same_checkpoint(path_a: str | os.PathLike[str], path_b: str | os.PathLike[str]) -> bool:
    """The one rule for "the same checkpoint" (``ckptkit audit``, ``replay``, the trainer's
    and any loop's): the same bytes, or the same bytes once each file's companion record is
    set aside (:func:`unbound_bytes`). The record holds digests of the files beside the
    checkpoint, not state of the run: two runs of one experiment may bind snapshots that
    differ in exempt keys (``steps``) or in informational fields (``config_type``). A
    distributed checkpoint (a directory) is the same when it holds the same file names
    with the same bytes (its record is a file of its own, compared like the rest).

    Raises:
        CheckpointNotFound, FormatError: a file that differs cannot be loaded.
    """
    if os.path.isdir(path_a) or os.path.isdir(path_b):
        names = sorted(os.listdir(path_a)) if os.path.isdir(path_a) else None
        if not os.path.isdir(path_b) or names != sorted(os.listdir(path_b)):
            return False
        return all(_same_file_bytes(os.path.join(path_a, n), os.path.join(path_b, n)) for n in names)
    if _same_file_bytes(path_a, path_b):
        return True
    return unbound_bytes(path_a) == unbound_bytes(path_b)


def _same_file_bytes(path_a: str | os.PathLike[str], path_b: str | os.PathLike[str]) -> bool:
    if os.path.getsize(path_a) != os.path.getsize(path_b):
        return False
    with open(path_a, "rb") as fa, open(path_b, "rb") as fb:
        while True:
            ca, cb = fa.read(1 << 20), fb.read(1 << 20)
            if ca != cb:
                return False
            if not ca:
                return True


def unbound_bytes(ckpt_path: str | os.PathLike[str]) -> bytes:
    """The bytes a checkpoint would have without its companion record.

    Two runs of the same experiment write the same state, but a checkpoint binds
    its own snapshot, whose exempt keys (``steps``...) may differ between them: a
    byte comparison of their checkpoints compares these (``ckptkit audit``,
    ``replay``). Loads the file (verifying it) and re-encodes it; imports torch.

    Raises:
        CheckpointNotFound, FormatError: the checkpoint cannot be loaded.
    """
    import dataclasses
    import tempfile

    from ._checkpoint import load, save

    ckpt = load(ckpt_path)
    if record_of(ckpt.monitor) is not None:
        monitor = {k: v for k, v in ckpt.monitor.items() if k != COMPANIONS_KEY}
        ckpt = dataclasses.replace(ckpt, monitor=monitor or None)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "unbound.ckpt")
        save(out, ckpt)
        with open(out, "rb") as f:
            return f.read()
