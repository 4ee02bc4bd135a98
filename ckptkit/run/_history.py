"""``history.jsonl``: one row per step, exact, and identical across a resume.

Rows (spec/trainer.md has the schema) are JSON objects, one per line, keys
sorted. Every row has ``kind`` and ``step``:

* ``start``  -- a fresh run began (environment facts the loss depends on);
* ``probe``  -- a probe forward before step 0;
* ``step``   -- training step ``step`` (0-based) finished; the checkpoint after it
  is ``step + 1``. Floats are stored as JSON numbers *and* as IEEE bit patterns
  (``loss_bits``), so equality is exact even for tools that parse floats loosely;
* ``resume`` -- a resume at ``step`` (the number of steps done), with what
  the resume noted, allowed or overrode;
* ``digests`` -- after every step: per-parameter digests of the state after
  ``step`` steps (spec/replay.md R-P02);
* ``checkpoint`` -- before every checkpoint save: the digest of every tensor and
  value of checkpoint ``step`` (spec/replay.md R-P03);
* ``spike`` / ``rollback`` -- what ``--auto-rollback`` did about a spike at step
  ``step`` (spec/rollback.md R-R10). After a rollback, step numbers repeat: a row's
  *timeline* is the number of ``rollback`` rows before it.
* ``unchecked_store`` -- before a process's first save on an ``s3://`` run directory whose
  store's conditional writes the user vouched for instead of their being checked
  (spec/objectstore.md R-O49); not compared, and readers that do not know it skip it.

Compared fields: :func:`compared_rows` keeps the ``start``, ``probe`` and
``step`` rows minus :data:`WALL_FIELDS` (wall-clock time may differ between
runs; nothing else may). A run that was interrupted and resumed has the same
compared rows as the uninterrupted run.

Crash safety: rows are appended and flushed per step and fsynced before every
checkpoint, so every row of a step before a checkpoint is on disk when the
checkpoint is. On resume at step ``S`` the rows the interrupted run wrote after ``S``
(step rows ``>= S``, other rows ``> S``) are set aside in ``history.interrupted.jsonl``
and the file is rewritten atomically without them and without a torn last line; then
appending continues, and the steps re-run are compared with the rows set aside
(:mod:`ckptkit.run._resume_check`, spec/determinism.md R-D20).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

from ..errors import CheckpointNotFound, FormatError
from ..format._atomic import write_bytes_atomic
from ..format._checks import is_number
from ..format._container import open_regular
from ..format._place import local_only
from ._resume_check import CHECK_KIND, INTERRUPTED_FILE, Overlap, ResumeCheck

__all__ = [
    "COMPARED_KINDS",
    "INTERRUPTED_FILE",
    "HISTORY_FILE",
    "WALL_FIELDS",
    "History",
    "HistoryCheck",
    "append_rows",
    "check_history",
    "compared_rows",
    "digests_row",
    "f32_bits",
    "f64_bits",
    "float_bits",
    "json_float",
    "kept_rows",
    "read_rows",
    "step_row",
]

HISTORY_FILE = "history.jsonl"
WALL_FIELDS = frozenset({"time", "step_ms"})  # wall clock: allowed to differ between runs
# "spike" and "rollback" rows are the spike-rollback protocol's record (spec/rollback.md R-R10).
# "digests" rows are per-step parameter fingerprints (spec/replay.md R-P02); "checkpoint"
# rows are not compared: a run stopped and resumed saves at steps the other did not.
COMPARED_KINDS = frozenset({"start", "probe", "step", "spike", "rollback", "digests"})
# Rows that record what happened during step ``step`` (after its checkpoint ``step``).
_DURING_STEP = frozenset({"step", "spike", "rollback"})


def f32_bits(x: float) -> str:
    """IEEE binary32 bit pattern of ``x`` (which must be a float32 value): ``"0x3f8ccccd"``."""
    return f"0x{struct.unpack('<I', struct.pack('<f', x))[0]:08x}"


def f64_bits(x: float) -> str:
    """IEEE binary64 bit pattern of ``x``: ``"0x3f50624dd2f1a9fc"``."""
    return f"0x{struct.unpack('<Q', struct.pack('<d', x))[0]:016x}"


def float_bits(x: Any) -> str:
    """The exact bit pattern of a float as hex: float32 for 0-d float32 tensors, else float64.

    Example:
        >>> float_bits(1.0)
        '0x3ff0000000000000'
    """
    if hasattr(x, "dtype") and hasattr(x, "numel"):  # a torch tensor: its own width
        import torch

        t = x.detach().cpu().reshape(-1).contiguous()
        if t.numel() != 1:
            raise ValueError(f"float_bits takes one value (got a tensor of {t.numel()} elements)")
        raw: bytes = t.view(torch.uint8).numpy().tobytes()
        return "0x" + raw[::-1].hex()
    return "0x" + struct.pack(">d", float(x)).hex()


def json_float(x: float) -> float | str:
    """``x`` as a JSON value: a number, or ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"``
    (strict JSON has no non-finite numbers)."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _encode(row: dict[str, Any]) -> bytes:
    return (json.dumps(row, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n").encode()


def read_rows(path: str | os.PathLike[str], *, any_kind: bool = False) -> tuple[list[dict[str, Any]], bool]:
    """Every complete row of a history file, and whether a torn last line was dropped.

    Returns ``([], False)`` for a missing file. ``any_kind``: a row may lack ``kind``
    (another trainer's JSON Lines history, compared by its step rows).

    Raises:
        UnreadableFile: the path is no readable regular file (R-025).
        FormatError: a complete line is not a JSON object with ``kind`` and ``step``, or
            longer than :data:`MAX_LINE` (R-027).
    """
    path = os.fspath(path)
    rows: list[dict[str, Any]] = []
    torn = False
    try:
        lines = _lines(path)
        for i, (offset, line, complete) in enumerate(lines):
            if not complete:
                torn = True  # the last write did not finish its line
                break
            if line is None:
                raise FormatError(
                    f"line {i + 1} is longer than {MAX_LINE} bytes (a history row is a few hundred)",
                    path=path,
                    offset=offset,
                    field="history",
                    hint="history.jsonl is written by ckptkit train; do not edit it (R-027)",
                )
            rows.append(_row(line, i, offset, path, any_kind))
    except CheckpointNotFound:
        return [], False
    return rows, torn


def _row(line: bytes, i: int, offset: int, path: str, any_kind: bool) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(
            f"line {i + 1} is not JSON ({e})",
            path=path,
            offset=offset,
            field="history",
            hint="history.jsonl is written by ckptkit train; do not edit it",
        ) from None
    kind = row.get("kind", "step" if any_kind else None) if isinstance(row, dict) else None
    if not isinstance(row, dict) or not isinstance(kind, str) or not isinstance(row.get("step"), int):
        raise FormatError(
            f"line {i + 1} is not a history row (needs kind and step)", path=path, offset=offset, field="history"
        )
    return row


#: The longest line a history row may take (R-027): a row is a few hundred bytes, so a
#: longer line is damage, refused before it is held in memory whole.
MAX_LINE = 1 << 20


def _lines(path: str) -> Iterator[tuple[int, bytes | None, bool]]:
    """``(offset, line, complete)`` of each line of ``path`` without its newline; ``line`` is
    None for one longer than :data:`MAX_LINE` (read past, never held). Memory: one line.

    Raises:
        CheckpointNotFound: no file at ``path``.
        UnreadableFile: it is no readable regular file: a FIFO is not waited on (R-025).
    """
    fd, _ = open_regular(path, "history")
    with os.fdopen(fd, "rb") as f:
        offset = 0
        while line := f.readline(MAX_LINE + 1):
            start, offset = offset, offset + len(line)
            if len(line) > MAX_LINE:
                while not line.endswith(b"\n") and (line := f.readline(MAX_LINE + 1)):
                    offset += len(line)
                yield start, None, line.endswith(b"\n")
            else:
                yield start, line.rstrip(b"\n"), line.endswith(b"\n")


def append_rows(path: str | os.PathLike[str], rows: Iterable[dict[str, Any]]) -> None:
    """Append rows to a history file, opened and closed in the call (for a loop that
    records without holding the file open: :meth:`RunState.record`)."""
    with open(path, "ab") as f:
        f.write(b"".join(_encode(r) for r in rows))


def compared_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows two runs of the same experiment must agree on, without wall-clock fields."""
    return [{k: v for k, v in r.items() if k not in WALL_FIELDS} for r in rows if r["kind"] in COMPARED_KINDS]


def kept_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``step`` rows whose updates the run's final state descends from (spec/rollback.md R-R10).

    A step row is left out when its update was discarded on the spot (the next
    ``step``/``spike``/``rollback`` row is a ``spike`` row with action ``rerun``,
    ``rollback`` or ``unstable``; rows of other kinds in between, such as
    ``digests``, are passed over) or when a later ``rollback`` row abandoned it
    (a row of that timeline with ``step >= to``). The result is the loss curve of
    the run as it stands: one row per step, steps ascending.

    Args:
        rows: every row of ``history.jsonl``, in file order.
    """
    story = [r for r in rows if r["kind"] in _DURING_STEP]
    out: list[dict[str, Any]] = []
    for i, r in enumerate(story):
        if r["kind"] == "rollback":
            while out and out[-1]["step"] >= r["to"]:  # the kept rows are one lineage, steps ascending
                out.pop()
        elif r["kind"] == "step":
            nxt = story[i + 1] if i + 1 < len(story) else None
            if nxt is None or nxt["kind"] != "spike" or nxt.get("action") not in ("rerun", "rollback", "unstable"):
                out.append(r)
    return out


class History:
    """The run's ``history.jsonl``, opened for appending.

    Args:
        run_dir: the run directory (must exist).
        at: ``() -> (step, timeline)``, where the file is made the run's (:meth:`open`) by its
            first writer: the step this process began at and the rollbacks the state lives after
            (``RunState.history`` gives it; without it, :meth:`begin` first).
        log: called with what opening the file noted when a writer opened it.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        at: Callable[[], tuple[int, int]] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self._file: IO[bytes] | None = None
        self._at, self._log = at, log or (lambda _msg: None)
        self._held: dict[str, Any] | None = None  # RunState's resume row, until the next row (hold())
        self.prepared = False  # start_fresh() or resume_at() made the file this run's, in this process
        self._check: ResumeCheck | None = None  # how a resume judges itself (expect()); None: not at all
        self.overlap: Overlap | None = None  # the steps a resume re-runs, compared as they are written
        # An s3:// run's history is written in RunState.work_dir (spec/objectstore.md R-O23).
        self.path = os.path.join(local_only(run_dir, "ckptkit.run.History"), HISTORY_FILE)

    def open(self) -> list[str]:
        """Make the file the run's at ``at()`` (:meth:`begin`), once; returns what that noted, for a
        writer that records the notes itself (the reference trainer's ``resume`` row). Every other
        writer opens it by appending, and the notes are logged.

        Raises:
            ValueError: the history has no ``at`` (and no begin has run), or ``at`` raised it.
        """
        if self.prepared:
            return []
        if self._at is None:
            raise ValueError(f"{self.path}: History.start_fresh(), resume_at() or begin() first")
        return self.begin(*self._at())

    def expect(self, check: ResumeCheck) -> None:
        """Judge the resume this history opens at (:meth:`resume_at`) by ``check``: the steps it
        re-runs are compared with the rows the interrupted process wrote (R-D20)."""
        self._check = check

    def hold(self, row: dict[str, Any]) -> None:
        """Write ``row`` before the next row appended, unless that one is a row of the same kind
        and step (a loop's own ``resume`` row, with its own notes, replaces ``RunState``'s); or at
        :meth:`sync` or :meth:`close`."""
        self._held = row

    def rows(self) -> list[dict[str, Any]]:
        """Every complete row of the file, once it is the run's (:meth:`open`, notes logged)."""
        for note in self.open():
            self._log(note)
        return read_rows(self.path)[0]

    def begin(self, step: int, timeline: int = 0) -> list[str]:
        """Make the file this run's history at ``step`` once per process: :meth:`start_fresh`
        at step 0, else :meth:`resume_at`; a no-op (no notes) once either has run, so every
        writer of the run (``RunState.record``, the spike guard, the loop's own rows) may
        ask for it and none drops what another wrote."""
        if self.prepared:
            return []
        if step == 0:
            return self.start_fresh()
        return self.resume_at(step, timeline)

    def start_fresh(self) -> list[str]:
        """Begin an empty history; return notes. The rows of a run that began here but committed
        no checkpoint (the same run, started again) are set aside as a resume's are, never
        deleted (R-D21); they are not compared: nothing restored them."""
        notes = []
        try:
            rows, _torn = read_rows(self.path)
        except FormatError as e:  # not a history: replaced, as before anything was kept
            rows = []
            notes.append(f"history: replaced a file that is not a history ({e})")
        if rows:
            _keep_aside(os.path.dirname(self.path), 0, 0, rows)
            notes.append(
                f"history: set aside {len(rows)} row(s) of a start that committed no checkpoint in "
                f"{INTERRUPTED_FILE}; the run starts again from step 0"
            )
        write_bytes_atomic(self.path, b"")
        self._open()
        return notes

    def resume_at(self, step: int, timeline: int = 0) -> list[str]:
        """Set aside what the interrupted run wrote after ``step``; return notes about the file.

        Keeps rows of what happened *during* a step (kinds ``step``, ``spike``,
        ``rollback``) with ``step < S`` and other rows with ``step <= S``; the
        rewrite is atomic, so a crash here leaves the old file or the new one.

        After spike rollbacks step numbers repeat, so rows are matched by timeline
        too (spec/rollback.md R-R10): a row's timeline is the number of ``rollback``
        rows before it in the file, and the checkpoint's is its rollback count.
        Rows of earlier timelines are all kept (the abandoned ones included: they
        are the record); rows of later ones are dropped; rows of the checkpoint's
        own timeline follow the rule above. With no rollback this is the rule above.

        Args:
            step: the resumed checkpoint's step ``S``.
            timeline: the resumed checkpoint's rollback count (0 without rollbacks).

        Raises:
            FormatError: a complete line of the file is not a history row.
        """
        rows, torn = read_rows(self.path)
        kept: list[dict[str, Any]] = []
        aside: list[dict[str, Any]] = []
        seen = 0  # seen: rollback rows so far, i.e. the timeline of the row at hand
        for r in rows:
            during = r["kind"] in _DURING_STEP
            keep = seen < timeline or (seen == timeline and (r["step"] < step if during else r["step"] <= step))
            (kept if keep else aside).append(r)
            seen += r["kind"] == "rollback"
        notes = []
        if aside:
            _keep_aside(os.path.dirname(self.path), step, timeline, aside)
            compared = self._check is not None and self._check.mode != "off"
            notes.append(
                f"history: set aside {len(aside)} row(s) the interrupted run wrote after step {step} "
                f"in {INTERRUPTED_FILE}" + ("; the steps re-run are compared with them" if compared else "")
            )
        if torn:
            notes.append("history: dropped a torn last line (the interrupted run died writing it)")
        have = {r["step"] for r in kept if r["kind"] == "step"}
        missing = [s for s in range(step) if s not in have]
        if missing:
            notes.append(
                f"history: {len(missing)} step row(s) before step {step} are missing "
                f"(first: {missing[0]}); the file was edited or lost"
            )
        write_bytes_atomic(self.path, b"".join(_encode(r) for r in kept))
        self._open()
        if self._check is not None:
            self.overlap = Overlap(step, aside, torn, self._check)
        return notes

    def _open(self) -> None:
        self._close()
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open for the run, closed in close()
        self.prepared = True

    def append(self, row: dict[str, Any]) -> None:
        """Append one row and flush it to the OS (fsync waits for :meth:`sync`); a history
        with ``at`` opens first (:meth:`open`), one closed after it was prepared opens again."""
        for note in self.open() if self._at is not None else ():
            self._log(note)
        held, self._held = self._held, None
        if held is not None and (held["kind"], held["step"]) != (row["kind"], row["step"]):
            self._see(held)
        self._see(row)

    def _see(self, row: dict[str, Any]) -> None:
        """Write ``row``; a resume compares it with the interrupted run's (R-D22)."""
        self._write(row)
        if self.overlap is not None:
            self.overlap.see(row, self._write)

    def _write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            if not self.prepared:
                raise ValueError(f"{self.path}: History.start_fresh(), resume_at() or begin() first")
            self._open()
        assert self._file is not None
        self._file.write(_encode(row))
        self._file.flush()

    def sync(self) -> None:
        """Make every appended row (and a held one) durable; called before each checkpoint is
        written. A history with ``at`` opens first, as a writer does: the file is the run's from
        its first checkpoint on (the rows an interrupted run wrote after it dropped), even in a
        run that has recorded nothing yet."""
        for note in self.open() if self._at is not None else ():
            self._log(note)
        if self._held is not None:
            self.append(self._held)
        if self._file is not None:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Write a held row and a resume's verdict not yet written (R-D23), then close the file."""
        if self._held is not None:
            self.append(self._held)
        if self.overlap is not None and self._file is not None:
            self.overlap.end(self._write)
        self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self) -> None:  # a history dropped unclosed (its run ended) closes its file
        self._close()


def _keep_aside(run_dir: str, step: int, timeline: int, rows: list[dict[str, Any]]) -> None:
    """Append the rows a resume sets aside to :data:`INTERRUPTED_FILE` under an ``interrupted``
    row (R-D21), atomically. A resume that crashed before rewriting the history sets the same
    rows aside again: they are kept once."""
    path = os.path.join(run_dir, INTERRUPTED_FILE)
    batch = b"".join(_encode(r) for r in rows)
    header = {"kind": "interrupted", "step": step, "timeline": timeline, "rows": len(rows)}
    try:
        fd, _ = open_regular(path, "history")
        with os.fdopen(fd, "rb") as f:
            before = f.read()
    except CheckpointNotFound:
        before = b""
    if not before.endswith(_encode(header) + batch):
        write_bytes_atomic(path, before + _encode(header) + batch)


@dataclass(frozen=True)
class HistoryCheck:
    """What :func:`check_history` found in a ``history.jsonl`` (spec/trainer.md R-T13).

    Attributes:
        path: the file.
        rows: complete lines that are history rows.
        steps: ``(first, last)`` step of the ``step`` rows, or None when there are none.
        torn: the last line is incomplete (a crash mid-append; a resume drops it).
        problems: one line per damaged or inconsistent row, in file order.
        resumes: each resume's verdict (spec/determinism.md R-D23), in file order: its
            ``resume_check`` row, or for a resume that has none ``{"resumed_at": S, "verdict": None}``.
    """

    path: str
    rows: int
    steps: tuple[int, int] | None
    torn: bool
    problems: tuple[str, ...]
    resumes: tuple[dict[str, Any], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


_BITS = re.compile(r"0x([0-9a-f]{8}|[0-9a-f]{16})")


def _bits_problems(row: dict[str, Any]) -> list[str]:
    """A number that disagrees with its ``_bits`` twin: one of the two was altered."""
    out = []
    for key, bits in sorted(row.items()):
        twin = key[: -len("_bits")]
        if not key.endswith("_bits") or twin not in row or not isinstance(bits, str) or not _BITS.fullmatch(bits):
            continue
        value = row[twin]
        if not is_number(value) or not math.isfinite(value):
            continue  # null, or "NaN"/"Infinity": no exact twin to compare
        if len(bits) == 10 and abs(value) > 3.4028234663852886e38:
            want = None  # no float32 holds it: the number was altered
        else:
            want = f32_bits(value) if len(bits) == 10 else f64_bits(value)
        if want != bits:
            out.append(f"{twin} {json.dumps(value)} disagrees with {key} {bits}")
    return out


def check_history(path: str | os.PathLike[str]) -> HistoryCheck:
    """Check what can be checked in a history file without a checksum (R-T13).

    Every complete line must be a history row (a JSON object with ``kind`` and
    ``step``); each number with a ``_bits`` twin must have exactly those bits; the
    ``step`` rows of each timeline must count up by one (a re-run repeats its step;
    a ``rollback`` row restarts the count at its ``to``; a file that begins with a
    ``start`` row counts from 0; a ``resume`` row must come where the count is, in a
    history that records ``step`` rows).
    A flipped byte that keeps all of that true is not detected.

    Raises:
        CheckpointNotFound: no file at ``path``.
        UnreadableFile: it is no readable regular file (R-025).
    """

    path = os.fspath(path)
    try:
        lines = list(_lines(path))
    except CheckpointNotFound:
        raise CheckpointNotFound(f"{path}: no history here") from None
    torn, problems, rows = bool(lines) and not lines[-1][2], list[str](), 0
    expected: int | None = None
    last: int | None = None
    steps: list[int] = []
    marks: list[dict[str, Any]] = []  # the resume and resume_check rows
    for i, (offset, line, _) in enumerate(lines[:-1] if torn else lines):
        where = f"line {i + 1} (offset {offset})"
        row = _checked_row(line)
        if isinstance(row, str):  # what is wrong with the line: the count starts again after it
            problems.append(f"{where}: {row}")
            expected = None
            continue
        rows += 1
        problems += [f"{where}: {p}" for p in _bits_problems(row)]
        kind, step = row["kind"], row["step"]
        if i == 0 and kind == "start":
            expected = 0
        if kind == "step":
            steps.append(step)
            if row.get("rerun") is True:
                if step != last:
                    problems.append(f"{where}: a re-run of step {step} that does not follow step {step}'s row")
            elif expected is not None and step < expected:
                problems.append(f"{where}: step row {step} out of order (expected step {expected})")
            elif expected is not None and step > expected:
                gap = f"step {expected}" if step == expected + 1 else f"steps {expected}..{step - 1}"
                problems.append(f"{where}: {gap} missing before step row {step}")
            last, expected = step, step + 1
        elif kind == "rollback":
            expected = row["to"] if type(row.get("to")) is int else None
        elif kind == "resume":
            if expected is not None and steps and step != expected:  # a loop that records no step rows counts none
                problems.append(f"{where}: resume at step {step}, but the step rows before it end at {expected - 1}")
            expected = step
        if kind in ("resume", CHECK_KIND):
            marks.append(row)
    first_last = (min(steps), max(steps)) if steps else None
    return HistoryCheck(path, rows, first_last, torn, tuple(problems), _verdicts(marks))


def _checked_row(line: bytes | None) -> dict[str, Any] | str:
    """A line as a history row, or what is wrong with it."""
    if line is None:
        return f"longer than {MAX_LINE} bytes (R-027)"
    try:
        row = json.loads(line)
    except (UnicodeDecodeError, ValueError) as e:
        return f"not JSON ({e})"
    if not isinstance(row, dict) or not isinstance(row.get("kind"), str) or type(row.get("step")) is not int:
        return "not a history row (needs kind and step)"
    return row


def _verdicts(marks: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """Each resume's ``resume_check`` row, or ``{"resumed_at": S, "verdict": None}`` for one without."""
    out: list[dict[str, Any]] = []
    for row in marks:
        if row["kind"] == "resume":
            out.append({"resumed_at": row["step"], "verdict": None})
            continue
        if out and out[-1]["verdict"] is None and out[-1]["resumed_at"] == row.get("resumed_at"):
            out.pop()  # the resume row before it, judged
        out.append(row)
    return tuple(out)


# ---------------------------------------------------------------------------- the rows a loop records


def step_row(step: int, scalars: Mapping[str, Any]) -> dict[str, Any]:
    """The ``step`` row of step ``step`` (0-based): each scalar as a JSON value and, for
    floats and 0-d tensors, its exact bits (``loss_bits``).

    Raises:
        TypeError: a scalar that is not a number, a bool, a string or a one-element tensor.
    """
    row: dict[str, Any] = {"kind": "step", "step": step}
    for name, value in sorted(scalars.items()):
        if name in ("kind", "step", "rerun") or name.endswith("_bits"):
            raise TypeError(f"record(): {name!r} is a reserved row field; name the scalar otherwise")
        if hasattr(value, "numel"):
            if value.numel() != 1:
                raise TypeError(f"record(): {name} must be a scalar (got a tensor of shape {list(value.shape)})")
            row[f"{name}_bits"] = float_bits(value)
            value = value.item()
        elif isinstance(value, float):
            row[f"{name}_bits"] = f64_bits(value)
        elif not isinstance(value, (int, str, bool)) or value is None:
            raise TypeError(
                f"record(): {name} must be a number, a string or a one-element tensor (got {type(value).__name__})"
            )
        row[name] = json_float(value) if isinstance(value, float) else value
    return row


def digests_row(steps_done: int, digests: Mapping[str, int]) -> dict[str, Any]:
    """The ``digests`` row after ``steps_done`` steps: the digest of every leaf of the state,
    by name (:func:`~ckptkit.run.leaf_digests`; spec/replay.md R-P02)."""
    return {"kind": "digests", "step": steps_done, "tensors": dict(sorted(digests.items()))}
