"""One writer per run directory: the run-directory lease (spec/lease.md R-LS01..R-LS17).

A job holds its run directory's lease from its start or resume to its close: rank 0
acquires it (recording host, pid, start time, ranks and the launcher), refreshes its
heartbeat before every save, and releases it at ``close()``. A second job refuses
(:class:`~ckptkit.errors.RunDirInUse`, naming the holder and what to do); a lease whose
holder is gone -- a dead pid on this host, or a heartbeat older than the lease's time to
live -- is taken over, and the takeover is said.

:class:`Lease` is the one interface; :class:`PlaceLease` implements it once, on the run's
place (:mod:`ckptkit.format._place`): a file in a local run directory, an object under an
``s3://`` prefix, each written only where none is or over the version last seen.
:func:`lease_for` builds it for a run directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import CheckpointNotFound, CommitConflict, LeaseLost, RunDirInUse, UnreadableFile
from ..format._atomic import pid_alive
from ..format._checks import is_int, is_number
from ..format._json import loads_bounded
from ..format._objectstore import StoreUnavailable
from ..format._place import Place, place_for

__all__ = [
    "DEFAULT_TTL_S",
    "LEASE_FILE",
    "TAKEOVER",
    "Holder",
    "Lease",
    "PlaceLease",
    "gone",
    "launcher_pid",
    "lease_for",
    "this_job",
]

#: The lease's file in the run directory.
LEASE_FILE = "lease.json"
#: A lease ckptkit writes is a few hundred bytes; a reader reads no more than this of one (R-LS15).
_MAX_LEASE = 1 << 16
#: How long a holder on another host stays live without a heartbeat (seconds); a heartbeat
#: comes with every save, so a run that saves less often than this should pass a longer one.
DEFAULT_TTL_S = 6 * 3600.0
_LAUNCHED = "TORCHELASTIC_RUN_ID"  # set by torchrun in every rank it starts
#: How the line saying a takeover begins (R-LS04): a diagnostic no ``--quiet`` silences.
TAKEOVER = "took over the run directory's lease from "


@dataclass(frozen=True)
class Holder:
    """The job that holds (or held) a run directory's lease.

    Attributes:
        host: ``socket.gethostname()`` of its rank 0.
        pid: its rank 0's process id there.
        started: when it acquired the lease (Unix seconds).
        ranks: its world size.
        launcher: the pid of the launcher (torchrun's agent) that started its ranks, or None.
        heartbeat: its last refresh (Unix seconds).
        token: unique per acquisition: what tells this job's lease from a later one's.
    """

    host: str
    pid: int
    started: float
    ranks: int
    launcher: int | None
    heartbeat: float
    token: str

    def describe(self) -> str:
        launched = f", launcher pid {self.launcher}" if self.launcher is not None else ""
        return (
            f"pid {self.pid} on {self.host} ({self.ranks} rank(s){launched}; started {_when(self.started)}, "
            f"last heartbeat {_when(self.heartbeat)})"
        )


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def launcher_pid() -> int | None:
    """The pid of the torchrun agent that started this process (its parent), or None outside torchrun."""
    return os.getppid() if _LAUNCHED in os.environ else None


def this_job(ranks: int) -> Holder:
    """The calling process as a lease holder: this host, this pid, now; under torchrun its launcher."""
    now = time.time()
    return Holder(socket.gethostname(), os.getpid(), now, ranks, launcher_pid(), now, uuid.uuid4().hex)


def gone(holder: Holder, ttl_s: float, now: float | None = None) -> str | None:
    """Why ``holder`` no longer runs (R-LS04), or None while it may: a pid that does not exist on
    this host, or no heartbeat for longer than ``ttl_s``."""
    now = time.time() if now is None else now
    if holder.host == socket.gethostname() and not pid_alive(holder.pid):
        return f"no process {holder.pid} runs on this host"
    if now - holder.heartbeat > ttl_s:
        return f"no heartbeat for {now - holder.heartbeat:.0f} s (the lease lives {ttl_s:.0f} s)"
    return None


class Lease(Protocol):
    """A run directory's lease: at most one job holds it (spec/lease.md §2)."""

    def holder(self) -> Holder | None:
        """Who holds it now (None: nobody)."""
        ...

    def acquire(self, me: Holder) -> str | None:
        """Hold it as ``me``: atomically when nobody does; over a holder that is gone (the line
        saying so is returned); silently over this same process's earlier lease.

        Raises:
            RunDirInUse: a live job holds it (or won a race for it).
        """
        ...

    def refresh(self) -> None:
        """Renew the heartbeat; before every save.

        Raises:
            LeaseLost: another job holds it now (this job must not write).
        """
        ...

    def release(self) -> None:
        """Give it up if this job still holds it (``close()``)."""
        ...


def lease_for(run_dir: str | os.PathLike[str], ttl_s: float = DEFAULT_TTL_S) -> PlaceLease:
    """The lease of ``run_dir``, a local directory or an ``s3://`` prefix: ``lease.json`` there."""
    return PlaceLease(place_for(run_dir), ttl_s)


def _check_ttl(ttl_s: float) -> float:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0 seconds (got {ttl_s!r})")
    return float(ttl_s)


#: The largest pid a lease may name: ``pid_t`` is a signed 32-bit integer on every platform ckptkit runs on.
_PID_END = 2**31
#: Times are Unix seconds before the year 10000: what every platform's ``gmtime`` shows (R-LS15).
_TIME_END = 253402300800
_SECONDS = "Unix seconds in [0, 253402300800), before the year 10000"
#: Each field's bound (R-LS15): what a lease ckptkit wrote holds, and what a reader may act on.
_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "host": ("a non-empty string of at most 255 characters", lambda v: isinstance(v, str) and 0 < len(v) <= 255),
    "pid": ("an integer in [1, 2^31)", lambda v: is_int(v, 1, _PID_END)),
    "started": (_SECONDS, lambda v: is_number(v) and 0 <= v < _TIME_END),
    "ranks": ("an integer in [1, 2^31)", lambda v: is_int(v, 1, _PID_END)),
    "launcher": ("null or an integer in [1, 2^31)", lambda v: v is None or is_int(v, 1, _PID_END)),
    "heartbeat": (_SECONDS, lambda v: is_number(v) and 0 <= v < _TIME_END),
    "token": ("a non-empty string of at most 256 characters", lambda v: isinstance(v, str) and 0 < len(v) <= 256),
}


def _decode(raw: bytes, unusable: Callable[[str], RunDirInUse]) -> Holder:
    """The holder a lease file names, every field in its range (R-LS01, R-LS15).

    Raises:
        RunDirInUse: not such a JSON object, or a field out of its range (named): a lease
            this reader cannot judge is refused, never taken over (spec/lease.md §1).
    """
    try:
        doc = loads_bounded(raw.decode("utf-8"), 1)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise unusable("is not a lease ckptkit wrote (not a flat JSON object, R-LS15)") from None
    except ValueError as e:  # deeper than a flat object, an integer longer than 20 digits, NaN
        raise unusable(f"is not a lease ckptkit wrote ({e}; R-LS15)") from None
    if not isinstance(doc, dict) or sorted(doc) != sorted(_FIELDS):
        got = ", ".join(sorted(doc)) if isinstance(doc, dict) else type(doc).__name__
        raise unusable(f"is not a lease ckptkit wrote (fields {got}, expected {', '.join(sorted(_FIELDS))}; R-LS15)")
    for name, (what, ok) in _FIELDS.items():
        if not ok(doc[name]):
            shown = json.dumps(doc[name])
            shown = shown if len(shown) <= 60 else shown[:40] + f"... ({len(shown)} characters)"
            raise unusable(f"is not a lease ckptkit wrote ({name} is {shown}, expected {what}; R-LS15)")
    return Holder(**doc)


def _unusable(path: str, run_dir: str, why: str) -> RunDirInUse:
    return RunDirInUse(f"{path}: the run directory's lease {why}; if no job uses {run_dir}, delete it and start again")


def _judge(run_dir: str, held: Holder | None, me: Holder, ttl_s: float) -> str | None:
    """The line saying a takeover of ``held`` by ``me`` (None: nobody held it, or this very process did).

    Raises:
        RunDirInUse: ``held`` is another job, and it may still run (R-LS03).
    """
    if held is None or (held.host == me.host and held.pid == me.pid):
        return None
    why = gone(held, ttl_s)
    if why is None:
        raise RunDirInUse(
            f"{run_dir}: in use by another job, {held.describe()}: one writer per run directory; "
            f"wait for it to end or stop it (kill {held.pid} on {held.host}), or use another run directory",
            held,
        )
    return f"{TAKEOVER}{held.describe()}: {why}"


def _raced(run_dir: str, now: Holder | None) -> RunDirInUse:
    return RunDirInUse(f"{run_dir}: another job took the lease over while this one did", now)


def _lost(run_dir: str, held: Holder | None) -> LeaseLost:
    who = "nobody holds it now" if held is None else f"it is held by {held.describe()}"
    return LeaseLost(
        f"{run_dir}: this job no longer holds the run directory's lease ({who}): "
        "it stops before writing, so the run directory keeps one writer"
    )


class PlaceLease:
    """:class:`Lease` as the record ``lease.json`` of the run's place (R-LS01, R-LS02, R-LS10..R-LS13):
    created only where none is, renewed and taken over only over the version this job last wrote
    or read, released only while it is this job's. In a local run directory the record is a file
    (created by a hard link, replaced by a rename and read back); under an ``s3://`` prefix an
    object (``If-None-Match: *``, ``If-Match`` on its ETag, a conditional DELETE).

    Args:
        place: where the run lives (:func:`~ckptkit.format._place.place_for`).
        ttl_s: how long a holder on another host is live without a heartbeat.
    """

    def __init__(self, place: Place, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.ttl_s = _check_ttl(ttl_s)
        self.place, self.run_dir, self.path = place, place.where, place.child(LEASE_FILE)
        self.mine: Holder | None = None
        self._version = ""  # of the lease this job wrote last

    def _read(self) -> tuple[Holder, str] | None:
        try:
            found = self.place.read(LEASE_FILE, kind="lease", limit=_MAX_LEASE)
        except StoreUnavailable:
            raise
        except UnreadableFile as e:  # a FIFO, a directory: refused unread
            raise self._unusable(f"cannot be read ({str(e).removeprefix(self.path + ': ')})") from None
        return None if found is None else (_decode(found[0], self._unusable), found[1])

    def _unusable(self, why: str) -> RunDirInUse:
        return _unusable(self.path, self.run_dir, why)

    def holder(self) -> Holder | None:
        found = self._read()
        return None if found is None else found[0]

    def acquire(self, me: Holder) -> str | None:
        body, found = _encode(me), self._read()  # read first: a job refused by a live holder writes nothing
        for _ in range(2):  # a second time only when the holder released it between two requests
            if found is None:
                try:
                    self._version = self.place.create(LEASE_FILE, body)
                except CommitConflict:
                    found = self._read()  # another job created it in between
                    continue
                self.mine = me
                return None
            note = _judge(self.run_dir, found[0], me, self.ttl_s)
            try:  # over exactly the lease judged gone: a renewal or takeover since then wins
                self._version = self.place.replace(LEASE_FILE, body, found[1])
            except (CommitConflict, CheckpointNotFound):
                raise _raced(self.run_dir, self.holder()) from None
            self.mine = me
            return note
        raise _raced(self.run_dir, self.holder())

    def refresh(self) -> None:
        assert self.mine is not None, "refresh() before acquire()"
        renewed = dataclasses.replace(self.mine, heartbeat=time.time())
        try:  # only while the lease is the one this job wrote last (R-LS11)
            self._version = self.place.replace(LEASE_FILE, _encode(renewed), self._version)
        except (CommitConflict, CheckpointNotFound):
            raise _lost(self.run_dir, self.holder()) from None
        self.mine = renewed

    def release(self) -> None:
        if self.mine is None:
            return
        found = None
        with contextlib.suppress(RunDirInUse):
            found = self._read()
        if found is not None and found[0].token == self.mine.token:
            with contextlib.suppress(CommitConflict, CheckpointNotFound):  # taken over in between: theirs
                self.place.delete_if(LEASE_FILE, found[1])
        self.mine = None


def _encode(h: Holder) -> bytes:
    doc: dict[str, Any] = dataclasses.asdict(h)
    return (json.dumps(doc, sort_keys=True, indent=2) + "\n").encode()
