"""What a training run consists of, and how it is saved and resumed as one thing.

A :class:`RunState` is told, once, every piece of state a run has — modules,
optimizers, schedulers, scalers, the EMA teacher, data positions, monitors, flag
bits, small values, sidecars and the config — and then does ``save(step)`` and
``resume()`` with every check the design record asks for:

* the config snapshot is diffed key by key (:func:`ckptkit.snapshot.check_resume`);
* the environment (torch version, threads, ...) is compared with the recording;
* the newest checkpoint that verifies, *with* consistent sidecars, is chosen, and
  every fallback is said out loud;
* a data position that disagrees with the step is refused;
* a legacy checkpoint is refused unless allowed, with what it lacks named;
* anything registered that the container cannot carry is refused at registration.

Files in the run directory (``spec/runstate.md``)::

    environment.json                    facts recorded when the run started
    step-00000120.ckpt                  the container (written last: it marks a complete save)
    step-00000120.ckpt.config.json      the config snapshot
    step-00000120.ckpt.<kind>           one sidecar per registered kind (e.g. .ngram)

Example::

    rs = RunState("run", config=cfg, keep=3)
    rs.add_model("model", net)
    rs.add_optimizer("adamw", opt)
    rs.add_data_position("train", get=lambda: data.offset, set=data.seek)
    step = rs.resume().step if args.resume else rs.start()
    for step in range(step, cfg.steps):
        ...
        if (step + 1) % cfg.ckpt_every == 0:
            rs.save(step + 1)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .asyncsave import AsyncSaver
from .atomic import clean_stale_temps, write_bytes_atomic
from .checkpoint import Checkpoint, load, save
from .companions import (
    COMPANIONS_KEY,
    ENVIRONMENT_FILE,
    UNBOUND_NOTE,
    check_companions,
    file_digest,
    make_record,
    record_of,
)
from .container import FLAG_NAMES, SECTIONS
from .environment import EnvDiff, capture, check_environment
from .errors import (
    CheckpointNotFound,
    FormatError,
    LegacyCheckpoint,
    ResumeRefused,
    StateMismatch,
    StreamOffsetMismatch,
    UnsupportedValue,
)
from .section import check_plain
from .sidecar import read_sidecar, sidecar_path, write_sidecar
from .snapshot import DEFAULT_EXEMPT, KeyDiff, check_resume, encode_snapshot, read_snapshot, snapshot_path

__all__ = ["ENVIRONMENT_FILE", "ResumeInfo", "RunState", "checkpoint_name", "list_checkpoints", "read_environment"]

_PREFIX, _SUFFIX = "step-", ".ckpt"


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint at ``step``: ``step-00000120.ckpt`` (8+ digits, sortable)."""
    return f"{_PREFIX}{step:08d}{_SUFFIX}"


def read_environment(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The environment facts a run recorded when it started (``environment.json``).

    Raises:
        CheckpointNotFound: the record is missing.
        FormatError: it is not valid JSON.
    """
    env_path = os.path.join(os.fspath(run_dir), ENVIRONMENT_FILE)
    try:
        with open(env_path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointNotFound(f"{env_path}: the run's environment record is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"not valid JSON: {e}", path=env_path, field="environment") from None


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint file in ``run_dir``, oldest first."""
    run_dir = os.fspath(run_dir)
    out = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(run_dir):
            digits = name[len(_PREFIX) : -len(_SUFFIX)]
            if name.startswith(_PREFIX) and name.endswith(_SUFFIX) and digits.isdigit() and len(digits) >= 8:
                out.append((int(digits), os.path.join(run_dir, name)))
    return sorted(out)


@dataclass(frozen=True)
class ResumeInfo:
    """What :meth:`RunState.resume` did.

    Attributes:
        step: the step training continues from.
        path: the checkpoint it came from.
        notes: human lines worth logging (fallbacks, exempt changes, overrides).
        skipped: ``(path, reason)`` for each newer checkpoint that was passed over.
        exempt_changes: config differences that were allowed (``steps`` extended...).
        env_overrides: environment differences accepted with ``allow_env_change``.
        legacy_missing: for a v1 checkpoint loaded with ``allow_legacy``, what it lacked.
    """

    step: int
    path: str
    notes: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    exempt_changes: tuple[KeyDiff, ...] = ()
    env_overrides: tuple[EnvDiff, ...] = ()
    legacy_missing: tuple[str, ...] = ()


@dataclass
class _Entry:
    get: Callable[[], Any]
    set: Callable[[Any], None]
    # add_data_position's rule: (step, the checkpoint's stored values by name) -> position.
    expected: Callable[[int, Mapping[str, Any]], Any] | None = None

    def expected_at(self, step: int, values: Mapping[str, Any]) -> Any:
        """The position the rule wants at ``step`` (None when there is no rule)."""
        return None if self.expected is None else self.expected(step, values)


@dataclass
class _Registry:
    models: dict[str, Any] = field(default_factory=dict)
    optimizers: dict[str, Any] = field(default_factory=dict)
    schedulers: dict[str, Any] = field(default_factory=dict)
    scalers: dict[str, Any] = field(default_factory=dict)
    teacher: Any = None
    monitors: dict[str, Any] = field(default_factory=dict)
    data: dict[str, _Entry] = field(default_factory=dict)
    values: dict[str, _Entry] = field(default_factory=dict)
    flags: dict[str, _Entry] = field(default_factory=dict)
    sidecars: dict[str, _Entry] = field(default_factory=dict)


def _layout_problems(where: str, stored: Mapping[str, Any], live: Mapping[str, Any], problems: list[str]) -> None:
    """Append how a module's stored state_dict differs from its live one in keys,
    shapes or dtypes (worded as ``load(into=...)`` words them): checked before
    anything is restored, so a model built differently (code changed, config
    not) is refused whole, not half-loaded."""
    import torch  # lazily: ``import ckptkit`` stays torch-free for the format tools

    from .codec import dtype_name

    for key in sorted(set(live) | set(stored)):
        at = f"{where}[{key!r}]"
        if key not in stored:
            problems.append(f"{at}: missing from the checkpoint")
        elif key not in live:
            problems.append(f"{at}: in the checkpoint but not in the module")
        elif isinstance(a := stored[key], torch.Tensor) and isinstance(b := live[key], torch.Tensor):
            if a.dtype != b.dtype:
                problems.append(f"{at}: dtype {dtype_name(a.dtype)} in the checkpoint, {dtype_name(b.dtype)} in the module")
            elif a.shape != b.shape:
                problems.append(f"{at}: shape {list(a.shape)} in the checkpoint, {list(b.shape)} in the module")


def _has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class RunState:
    """A run's state, registered once, saved and resumed as a whole.

    Args:
        run_dir: the run directory (created on the first save).
        config: the run's resolved config, a (nested) dataclass instance; snapshot
            next to every checkpoint and diffed on resume. A config the snapshot
            cannot hold raises :class:`~ckptkit.errors.UnsupportedValue` here.
        keep: how many newest checkpoints to keep (older ones, with their
            companions, are deleted after each successful save).
        exempt: config keys allowed to change across a resume (default: the
            progress/cadence keys, see :data:`ckptkit.snapshot.DEFAULT_EXEMPT`).
        compression: container codec per :func:`ckptkit.save`.
        log: called with each human-readable note (default: ignore; notes are also
            returned in :class:`ResumeInfo`).
        async_save: ``save()`` snapshots the state into a reusable buffer and
            returns; the files are written in the background
            (:class:`ckptkit.asyncsave.AsyncSaver`, same bytes as a synchronous
            save). A failed background write is raised by the next ``save()``,
            ``wait()``, ``resume()`` or ``close()``. Costs one copy of the
            checkpoint's tensors in host memory.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        config: Any,
        keep: int = 3,
        exempt: Iterable[str] = DEFAULT_EXEMPT,
        compression: str = "raw",
        log: Callable[[str], None] | None = None,
        async_save: bool = False,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep!r})")
        if not isinstance(async_save, bool):
            raise ValueError(f"async_save must be True or False (got {async_save!r})")
        encode_snapshot(config)  # a config the snapshot cannot hold is refused now, not at the first save
        self.run_dir = os.fspath(run_dir)
        self.config = config
        self.keep = keep
        self.exempt = frozenset(exempt)
        self.compression = compression
        self._log = log or (lambda _msg: None)
        self._reg = _Registry()
        self._after_restore: list[Callable[[], None]] = []
        self._saver: AsyncSaver | None = AsyncSaver(compression=compression) if async_save else None

    # ------------------------------------------------------------------ registration

    def _name(self, kind: str, name: str, taken: dict[str, Any]) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{kind} name must be a non-empty string (got {name!r})")
        if name in taken:
            raise ValueError(f"{kind} {name!r} is already registered")

    def _probe(self, where: str, value: Any) -> None:
        """Refuse at registration what the container could not carry at save."""
        from .codec import encode_tree

        encode_tree(value, where)

    def _stateful(self, kind: str, name: str, obj: Any, taken: dict[str, Any]) -> None:
        self._name(kind, name, taken)
        if not _has_state_dict(obj):
            raise UnsupportedValue(f"{kind} {name!r}: a {type(obj).__name__} has no state_dict()/load_state_dict()")
        self._probe(f"{kind} {name!r}", obj.state_dict())
        taken[name] = obj

    def add_model(self, name: str, module: Any) -> None:
        """Register a module; its ``state_dict()`` goes in the model section."""
        self._stateful("model", name, module, self._reg.models)

    def add_optimizer(self, name: str, optimizer: Any) -> None:
        """Register an optimizer (moments, step counters, param groups)."""
        self._stateful("optimizer", name, optimizer, self._reg.optimizers)

    def add_scheduler(self, name: str, scheduler: Any) -> None:
        """Register an LR scheduler (or anything with ``state_dict``) in the optim section."""
        self._stateful("scheduler", name, scheduler, self._reg.schedulers)

    def add_scaler(self, name: str, scaler: Any) -> None:
        """Register a gradient scaler (``torch.amp.GradScaler``) in the optim section."""
        self._stateful("scaler", name, scaler, self._reg.scalers)

    def add_teacher(self, module: Any) -> None:
        """Register the EMA teacher: saved as the run left it, restored frozen.

        The teacher is never rebuilt from the student on resume (design record item 1).
        """
        if self._reg.teacher is not None:
            raise ValueError("a teacher is already registered")
        self._stateful("teacher", "teacher", module, {})
        self._reg.teacher = module

    def add_monitor(self, name: str, monitor: Any) -> None:
        """Register a monitor (e.g. :class:`ckptkit.monitor.SpikeMonitor`); plain-value state only."""
        self._name("monitor", name, self._reg.monitors)
        if not _has_state_dict(monitor):
            raise UnsupportedValue(f"monitor {name!r}: a {type(monitor).__name__} has no state_dict()/load_state_dict()")
        check_plain(monitor.state_dict(), f"monitor {name!r}")
        self._reg.monitors[name] = monitor

    def add_data_position(
        self,
        name: str,
        *,
        get: Callable[[], int],
        set: Callable[[int], None],  # noqa: A002 - mirrors property naming
        expected: Callable[[int, Mapping[str, Any]], int] | None = None,
    ) -> None:
        """Register a data-stream position (e.g. a byte offset).

        Args:
            get / set: read and restore the position.
            expected: the offset rule, ``expected(step, values)``: the position the
                run must be at after ``step`` steps. Resume refuses a checkpoint whose
                stored position differs (:class:`~ckptkit.errors.StreamOffsetMismatch`,
                design record item 6). ``values`` are the checkpoint's stored
                :meth:`add_value` values by name (``{}`` for a legacy checkpoint), read
                before anything is restored, for a rule that depends on run state:
                e.g. a trainer that skips batches after a spike rollback stores the
                count with ``add_value`` and its rule adds it. A plain rule ignores
                them: ``expected=lambda step, _values: step * batch * seq_len``.
        """
        self._name("data position", name, self._reg.data)
        pos = get()
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
            raise UnsupportedValue(f"data position {name!r} must be a non-negative int (got {pos!r})")
        self._reg.data[name] = _Entry(get, set, expected)

    def add_value(self, name: str, *, get: Callable[[], Any], set: Callable[[Any], None]) -> None:  # noqa: A002
        """Register small run state (msgpack-able plain values: numbers, str, lists, dicts)."""
        self._name("value", name, self._reg.values)
        check_plain(get(), f"value {name!r}")
        self._reg.values[name] = _Entry(get, set)

    def add_flag(self, name: str, *, get: Callable[[], bool], set: Callable[[bool], None]) -> None:  # noqa: A002
        """Register a container flag bit by name (``fp32_fallback`` = bit 0)."""
        if name not in FLAG_NAMES.values():
            raise UnsupportedValue(f"flag {name!r} has no bit in this container version "
                                   f"(known: {', '.join(FLAG_NAMES.values())}); store it with add_value")
        self._name("flag", name, self._reg.flags)
        self._reg.flags[name] = _Entry(get, set)

    def add_sidecar(
        self,
        kind: str,
        *,
        get: Callable[[], tuple[int, Any]],
        set: Callable[[int, Any], None],  # noqa: A002
    ) -> None:
        """Register a sidecar written next to every checkpoint as ``<ckpt>.<kind>``.

        Args:
            get: returns ``(table_step, tree)``.
            set: receives ``(table_step, tree)`` on restore.
        """
        sidecar_path("x", kind)  # validates the kind
        self._name("sidecar", kind, self._reg.sidecars)
        table_step, tree = get()
        self._probe(f"sidecar {kind!r}", tree)
        self._reg.sidecars[kind] = _Entry(get, lambda v: set(*v))

    def after_restore(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every restore: re-apply compute settings (quant format,
        latched fallbacks) that ``load_state_dict`` does not carry (design record item 2)."""
        self._after_restore.append(fn)

    # ------------------------------------------------------------------ save

    def checkpoint(self, step: int) -> Checkpoint:
        """The container contents for ``step``, built from the registered state.

        The tensors are the live ones (``state_dict()`` references): copy them to keep
        this state while training goes on (e.g. for :meth:`restore`).
        """
        r = self._reg
        optim = {k: {n: o.state_dict() for n, o in group.items()}
                 for k, group in (("optimizers", r.optimizers), ("schedulers", r.schedulers), ("scalers", r.scalers))
                 if group}
        monitor = {k: v for k, v in (
            ("data", {n: e.get() for n, e in r.data.items()}),
            ("monitors", {n: m.state_dict() for n, m in r.monitors.items()}),
            ("values", {n: e.get() for n, e in r.values.items()}),
        ) if v}
        flags = 0
        for bit, name in FLAG_NAMES.items():
            if name in r.flags and r.flags[name].get():
                flags |= 1 << bit
        return Checkpoint(
            step=step,
            model={n: m.state_dict() for n, m in r.models.items()} or None,
            optim=optim or None,
            teacher=None if r.teacher is None else r.teacher.state_dict(),
            monitor=monitor or None,
            flags=flags,
        )

    def save(self, step: int) -> str:
        """Save everything at ``step``: snapshot, sidecars, then the container.

        The container is written last, so its presence marks a complete save; each
        file is atomic. Older checkpoints beyond ``keep`` are then deleted.

        With ``async_save``, the state is snapshot and the same files are written,
        in the same order, by a background thread; the returned path exists once
        :meth:`wait` returns.

        Returns:
            The checkpoint path.

        Raises:
            SaveFailed: a write failed (with ``async_save``: the previous save's
                write); earlier checkpoints are intact.
            UnsupportedValue: state that cannot be stored (named by path).
        """
        os.makedirs(self.run_dir, exist_ok=True)
        path = os.path.join(self.run_dir, checkpoint_name(step))
        ckpt = self.checkpoint(step)
        if self._saver is not None:
            self._save_async(path, ckpt)
            return path
        config = encode_snapshot(self.config)
        write_bytes_atomic(snapshot_path(path), config)
        bound = {}
        for kind, entry in self._reg.sidecars.items():
            table_step, tree = entry.get()
            bound[kind] = write_sidecar(sidecar_path(path, kind), train_step=step, table_step=table_step, tree=tree)
        save(path, self._bind(ckpt, config, bound), compression=self.compression)
        self._retain()
        return path

    def _bind(self, ckpt: Checkpoint, config: bytes, sidecars: dict[str, int]) -> Checkpoint:
        """``ckpt`` with the companion record (spec/companions.md): the digests of the
        snapshot, sidecars and environment record just written, so that none of them
        can be edited or swapped without the checkpoint noticing."""
        env_path = os.path.join(self.run_dir, ENVIRONMENT_FILE)
        env = file_digest(env_path, "environment record") if os.path.exists(env_path) else None
        record = make_record(snapshot=xxhash.xxh3_64_intdigest(config), environment=env, sidecars=sidecars)
        return dataclasses.replace(ckpt, monitor={**(ckpt.monitor or {}), COMPANIONS_KEY: record})

    def _save_async(self, path: str, ckpt: Checkpoint) -> None:
        assert self._saver is not None
        config = encode_snapshot(self.config)  # refuses a bad config now, not in the background
        stamps, trees = {}, {name: getattr(ckpt, name) for name in SECTIONS}
        for kind, entry in self._reg.sidecars.items():
            stamps[kind], trees[f"sidecar:{kind}"] = entry.get()

        def write(snap: dict[str, Any]) -> None:
            write_bytes_atomic(snapshot_path(path), config)
            bound = {kind: write_sidecar(sidecar_path(path, kind), train_step=ckpt.step, table_step=table_step,
                                         tree=snap[f"sidecar:{kind}"])
                     for kind, table_step in stamps.items()}
            taken = dataclasses.replace(ckpt, **{name: snap[name] for name in SECTIONS})
            save(path, self._bind(taken, config, bound), compression=self.compression)
            self._retain()

        self._saver.submit(trees, write)

    def wait(self) -> None:
        """Block until a background save (``async_save``) is committed; a no-op otherwise.

        Raises:
            SaveFailed: the background write failed; earlier checkpoints are intact.
        """
        if self._saver is not None:
            self._saver.wait()

    def close(self) -> None:
        """Finish a background save and free its snapshot buffer.

        Raises:
            SaveFailed: the background write failed.
        """
        if self._saver is not None:
            self._saver.close()

    def _companions(self, path: str) -> list[str]:
        return [snapshot_path(path)] + [sidecar_path(path, k) for k in self._reg.sidecars]

    def _delete(self, path: str) -> None:
        # Container first: a crash mid-delete leaves orphan companions (swept by
        # _retain), never a container without its companions.
        for p in [path, *self._companions(path)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def _retain(self) -> None:
        """Delete all but the newest ``keep`` checkpoints, and companions orphaned by a
        crash mid-delete. The new checkpoint is already committed, so a failure here
        is reported and retried by the next save, never raised."""
        ckpts = list_checkpoints(self.run_dir)
        for _step, path in ckpts[: -self.keep]:
            try:
                self._delete(path)
            except OSError as e:
                self._log(f"retention: cannot delete {path} ({e.strerror}); will retry at the next save")
        kept = {p for _s, p in list_checkpoints(self.run_dir)}
        oldest = ckpts[-self.keep :][0][0] if ckpts else None
        for name in sorted(os.listdir(self.run_dir)):
            head, sep, _kind = name.partition(_SUFFIX + ".")
            container = os.path.join(self.run_dir, head + _SUFFIX)
            digits = head[len(_PREFIX) :]
            if (sep and head.startswith(_PREFIX) and digits.isdigit() and container not in kept
                    and oldest is not None and int(digits) < oldest):
                try:
                    os.unlink(os.path.join(self.run_dir, name))
                except FileNotFoundError:
                    pass
                except OSError as e:
                    self._log(f"retention: cannot delete orphan {name} ({e.strerror})")

    def checkpoints(self) -> list[tuple[int, str]]:
        """``(step, path)`` of the run directory's checkpoints, oldest first, once a
        background save in flight has committed: the newest is the newest this run saved.

        Raises:
            SaveFailed: the background write failed; earlier checkpoints are intact.
        """
        self.wait()
        return list_checkpoints(self.run_dir)

    def discard_after(self, step: int) -> list[str]:
        """Delete checkpoints newer than ``step`` (after a rollback they belong to an
        abandoned timeline and must never be resumed). Returns the paths deleted."""
        gone = [p for s, p in self.checkpoints() if s > step]
        for p in gone:
            self._delete(p)
        return gone

    # ------------------------------------------------------------------ start / resume

    def start(self) -> int:
        """Begin a fresh run: refuse a directory that already holds checkpoints.

        Records the environment (``environment.json``) and returns step 0.

        Raises:
            ResumeRefused: the run directory already holds checkpoints (nothing is
                overwritten; resume it, or use another directory).
        """
        existing = list_checkpoints(self.run_dir)
        if existing:
            raise ResumeRefused(
                f"{self.run_dir}: already holds {len(existing)} checkpoint(s), newest "
                f"{os.path.basename(existing[-1][1])}; resume it (--resume) or use a new run directory"
            )
        os.makedirs(self.run_dir, exist_ok=True)
        clean_stale_temps(self.run_dir)
        facts = capture()
        write_bytes_atomic(os.path.join(self.run_dir, ENVIRONMENT_FILE),
                           (json.dumps(facts, sort_keys=True, indent=2) + "\n").encode())
        return 0

    def resume(self, *, allow_legacy: bool = False, allow_env_change: bool = False) -> ResumeInfo:
        """Restore the newest consistent checkpoint, after every check passes.

        Candidates are tried newest first; one that fails to verify, lacks its
        snapshot, or has a missing or mismatched sidecar is skipped, and the
        skip is reported. Nothing is restored until every check has passed.

        Args:
            allow_legacy: accept a v1 checkpoint (which lacks teacher, flags,
                monitor and digests); the run continues loudly.
            allow_env_change: accept a different environment; the differences are
                returned for the caller to record.

        Returns:
            A :class:`ResumeInfo`.

        Raises:
            CheckpointNotFound: no usable checkpoint in the run directory.
            ConfigDrift: the config differs from the snapshot in strict keys (all listed).
            EnvironmentDrift: the environment differs (all facts listed).
            LegacyCheckpoint: a v1 checkpoint without ``allow_legacy``.
            StreamOffsetMismatch: a stored data position disagrees with the step.
            StateMismatch: the checkpoint's contents do not fit what is registered
                (a registration either side lacks, a module's keys, shapes or dtypes).
        """
        self.wait()
        removed = clean_stale_temps(self.run_dir)
        notes = [f"removed {len(removed)} temporary file(s) left by an interrupted save"] if removed else []
        ckpt, path, snapshot, sidecars, skipped = self._newest_consistent()
        for p, why in skipped:
            notes.append(f"skipped {os.path.basename(p)}: {why}")
        if skipped:
            notes.append(f"falling back to {os.path.basename(path)} (step {ckpt.step})")
        if record_of(ckpt.monitor) is None:
            notes.append(f"{os.path.basename(path)} {UNBOUND_NOTE}")
        exempt = check_resume(snapshot, self.config, exempt=self.exempt)
        notes += [d.describe() for d in exempt]
        env = self._check_environment(allow_env_change)
        notes += [f"environment override: {d}" for d in env]
        legacy_missing = self._check_legacy(ckpt, path, allow_legacy)
        if legacy_missing:
            notes.append(f"LEGACY checkpoint {os.path.basename(path)}: proceeding without {', '.join(legacy_missing)}")
        self._check_contents(ckpt, path)
        self.restore(ckpt, sidecars={k: (sc.table_step, sc.tree) for k, sc in sidecars.items()})
        for n in notes:
            self._log(n)
        return ResumeInfo(ckpt.step, path, tuple(notes), tuple(skipped), tuple(exempt), tuple(env),
                          legacy_missing)

    def _newest_consistent(self) -> tuple[Checkpoint, str, Any, dict[str, Any], list[tuple[str, str]]]:
        skipped: list[tuple[str, str]] = []
        candidates = list_checkpoints(self.run_dir)
        if not candidates:
            raise CheckpointNotFound(f"{self.run_dir}: no checkpoints to resume from")
        for named_step, path in reversed(candidates):
            try:
                ckpt = load(path)
                if ckpt.step != named_step:
                    raise FormatError("header step does not match the file name", path=path, offset=8,
                                      field="step", expected=named_step, actual=ckpt.step,
                                      hint="a checkpoint renamed or copied over another; resume from another")
                if not os.path.exists(snapshot_path(path)):
                    raise CheckpointNotFound(f"{snapshot_path(path)}: config snapshot is missing")
                sidecars = {kind: read_sidecar(sidecar_path(path, kind), expect_step=ckpt.step)
                            for kind in self._reg.sidecars}
                # A damaged or swapped companion is damage, like a damaged container
                # (spec/companions.md): it is skipped here, never reported as drift.
                check_companions(path, record_of(ckpt.monitor, path), sidecars=self._reg.sidecars)
                snapshot = read_snapshot(snapshot_path(path))
            except (FormatError, CheckpointNotFound) as e:
                skipped.append((path, str(e)))
                continue
            return ckpt, path, snapshot, sidecars, skipped
        detail = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in skipped)
        raise CheckpointNotFound(f"{self.run_dir}: no consistent checkpoint to resume from ({detail})")

    def _check_environment(self, allow: bool) -> list[EnvDiff]:
        return check_environment(read_environment(self.run_dir), capture(), allow=allow)

    def _check_legacy(self, ckpt: Checkpoint, path: str, allow: bool) -> tuple[str, ...]:
        if not ckpt.legacy:
            return ()
        needed = [m for m in ckpt.missing if m != "flags" or self._reg.flags]
        needed = [m for m in needed if m != "teacher" or self._reg.teacher is not None]
        needed = [m for m in needed if m != "monitor" or self._monitor_registered()]
        missing = tuple(needed)
        if not allow:
            raise LegacyCheckpoint(
                f"{path}: is a legacy v1 checkpoint; it cannot carry: {', '.join(ckpt.missing)}"
                f"{' (this run needs ' + ', '.join(missing) + ')' if missing else ''}; "
                "pass --allow-legacy (allow_legacy=True) to continue without them",
                ckpt.missing,
            )
        return ckpt.missing

    def _monitor_registered(self) -> bool:
        r = self._reg
        return bool(r.data or r.monitors or r.values)

    def _check_contents(self, ckpt: Checkpoint, path: str) -> None:
        """Every registered piece is in the checkpoint and nothing unregistered is."""
        r = self._reg
        problems: list[str] = []

        def compare(where: str, stored: Any, registered: Iterable[str]) -> None:
            have = set(stored or {})
            want = set(registered)
            if want - have:
                problems.append(f"{where} lacks {', '.join(sorted(want - have))}")
            if have - want:
                problems.append(f"{where} carries {', '.join(sorted(map(str, have - want)))} that this run does not register")

        compare("model section", ckpt.model, r.models)
        optim = ckpt.optim or {}
        for group, regs in (("optimizers", r.optimizers), ("schedulers", r.schedulers), ("scalers", r.scalers)):
            compare(f"optim[{group!r}]", optim.get(group), regs)
        if not ckpt.legacy:
            mon = ckpt.monitor or {}
            for group, regs in (("data", r.data), ("monitors", r.monitors), ("values", r.values)):
                compare(f"monitor[{group!r}]", mon.get(group), regs)
            if (ckpt.teacher is None) != (r.teacher is None):
                problems.append("teacher section is " + ("absent but a teacher is registered"
                                                         if ckpt.teacher is None else "present but no teacher is registered"))
        if not problems:
            for name, m in r.models.items():
                _layout_problems(f"model[{name!r}]", ckpt.model[name], m.state_dict(), problems)
            if r.teacher is not None and ckpt.teacher is not None:
                _layout_problems("teacher", ckpt.teacher, r.teacher.state_dict(), problems)
        if problems:
            more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
            raise StateMismatch(f"{path}: does not match this run's registered state: "
                                + "; ".join(problems[:10]) + more, problems)
        mon = ckpt.monitor or {}
        for name, entry in r.data.items():
            stored = mon.get("data", {}).get(name)
            if stored is not None:
                want = entry.expected_at(ckpt.step, mon.get("values") or {})
                if want is not None and stored != want:
                    raise StreamOffsetMismatch(
                        f"{path}: data position {name!r} is {stored}, but a run at step {ckpt.step} must be at {want}; "
                        "the stream offset rule changed or the checkpoint is from another run"
                    )

    def restore(
        self,
        ckpt: Checkpoint,
        *,
        sidecars: Mapping[str, tuple[int, Any]] | None = None,
        skip: Iterable[str] = (),
    ) -> None:
        """Put a checkpoint's contents into the registered objects, unchecked.

        :meth:`resume` is this plus every check; call it directly to go back to a
        state the run itself kept with :meth:`checkpoint` (an in-memory rollback),
        so that what the rollback restores is exactly what is registered. The
        teacher comes back frozen; the ``after_restore`` hooks run last.

        Args:
            ckpt: the contents, e.g. a :meth:`checkpoint` taken earlier and copied
                then (its tensors are the live ones). ``load_state_dict`` may keep
                references to the tensors given (an optimizer does): pass a copy
                that nothing else will use.
            sidecars: ``kind -> (table_step, tree)`` for every registered sidecar
                not skipped.
            skip: registrations to leave as they are, named ``"<kind>:<name>"``
                with kind ``model``, ``optimizer``, ``scheduler``, ``scaler``,
                ``teacher`` (name ``teacher``), ``monitor``, ``data``, ``value``,
                ``flag`` or ``sidecar``: e.g. ``"data:train"`` to keep the stream
                where it is.

        Raises:
            ValueError: a ``skip`` name that is not registered, or a registered
                sidecar missing from ``sidecars``.
        """
        r = self._reg
        groups: dict[str, Mapping[str, Any]] = {
            "model": r.models, "optimizer": r.optimizers, "scheduler": r.schedulers, "scaler": r.scalers,
            "teacher": {"teacher": r.teacher} if r.teacher is not None else {}, "monitor": r.monitors,
            "data": r.data, "value": r.values, "flag": r.flags, "sidecar": r.sidecars,
        }
        skip = set(skip)
        unknown = sorted(s for s in skip if s.partition(":")[2] not in groups.get(s.partition(":")[0], {}))
        if unknown:
            raise ValueError(f"restore: skip names {', '.join(unknown)}, which this RunState does not register")
        sidecars = dict(sidecars or {})
        lacking = sorted(k for k in r.sidecars if f"sidecar:{k}" not in skip and k not in sidecars)
        if lacking:
            raise ValueError(f"restore: no contents given for the registered sidecar(s) {', '.join(lacking)}")

        def todo(kind: str, regs: Mapping[str, Any]) -> list[tuple[str, Any]]:
            return [(name, obj) for name, obj in regs.items() if f"{kind}:{name}" not in skip]

        for name, m in todo("model", r.models):
            m.load_state_dict(ckpt.model[name])
        optim = ckpt.optim or {}
        for group, kind, regs in (("optimizers", "optimizer", r.optimizers), ("schedulers", "scheduler", r.schedulers),
                                  ("scalers", "scaler", r.scalers)):
            for name, obj in todo(kind, regs):
                obj.load_state_dict(optim[group][name])
        if r.teacher is not None and ckpt.teacher is not None and "teacher:teacher" not in skip:
            r.teacher.load_state_dict(ckpt.teacher)
            for p in r.teacher.parameters():
                p.requires_grad_(False)
        mon = ckpt.monitor or {}
        for name, m in todo("monitor", r.monitors):
            if "monitors" in mon:
                m.load_state_dict(mon["monitors"][name])
        for group, kind, regs in (("data", "data", r.data), ("values", "value", r.values)):
            for name, entry in todo(kind, regs):
                if group in mon:
                    entry.set(mon[group][name])
                elif ckpt.legacy and group == "data" and entry.expected_at(ckpt.step, {}) is not None:
                    entry.set(entry.expected_at(ckpt.step, {}))  # v1 stored no position: derive it from the rule
        for bit, name in FLAG_NAMES.items():
            if name in r.flags and f"flag:{name}" not in skip:
                r.flags[name].set(bool(ckpt.flags >> bit & 1))
        for kind, entry in todo("sidecar", r.sidecars):
            entry.set(sidecars[kind])
        for fn in self._after_restore:
            fn()

