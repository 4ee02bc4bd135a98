"""Spike rollback: what the reference trainer does with a spike verdict.

    ckptkit train --run-dir runs/a --steps 300 --auto-rollback on
    ckptkit train --run-dir runs/a --steps 300 --auto-rollback on --spike-at 200   # TESTING AID: rolls back to 190
    ckptkit train --run-dir runs/u --steps 300 --auto-rollback on --spike-at 200 --spike-repeat 6   # exit 3

Concept: the spike monitor (:mod:`ckptkit.monitor`) says *whether* a step spiked;
:class:`Guard` decides *what happens*, per ``--auto-rollback``:

=====  ========================================================================
off    the monitor keeps its statistics; nothing else
warn   a ``spike`` row in ``history.jsonl``; the update is kept
on     the update is discarded and the step re-run once from the exact state
       before it. A normal re-run was a transient fault: its result is kept. A
       spike again is the data: the whole run state goes back to step N-K, the
       LR is multiplied by ``--lr-drop`` for the rest of the run, the window's
       batches are skipped, and training goes on from N-K. The
       ``--rollback-bound``-th consecutive spike, or a spike past
       ``--rollback-cap`` rollbacks, stops the run (:class:`TrainingUnstable`).
=====  ========================================================================

Where the state at N-K comes from: a :class:`Ring` of the last K+1 pre-step
states, each :meth:`RunState.checkpoint` tree (every tensor cloned) plus the
n-gram sidecar. Every restore from the ring is checked against per-part digests
of the kept copy before training goes on (computed on first use: the copy is
private and never written, and most kept states are never restored). The
ring is derived state, not saved: a resumed run rebuilds it by replaying from
an older checkpoint (or from step 0) and requires the replay to reproduce the
resumed checkpoint exactly.

Invariants (``spec/rollback.md`` R-R01..R-R12):

- A rollback is run state: the record (LR scale, counts, skipped batches, the
  events, ``--spike-at`` arrivals) is saved with every checkpoint
  (``add_value("rollback")``, mode ``on`` only) and is never rewound.
- After ``S`` steps the stream offset is ``(S + pre_batches + skipped_batches) *
  batch * seq_len``; the rule is checked on every rollback and on resume.
- The abandoned timeline's checkpoints are deleted before the rolled-back
  state is saved, so a crash never resumes into the abandoned timeline.

Imports point one way: ``train`` imports this module; the step function, the
LR schedule and the probes are handed in.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from ..checkpoint import Checkpoint, load
from ..codec import dtype_name, tensor_bytes
from ..errors import (
    CheckpointNotFound,
    FormatError,
    MalformedIndex,
    ReplayDivergence,
    StreamOffsetMismatch,
    TrainingUnstable,
    UnsupportedVersion,
)
from ..runstate import checkpoint_name, list_checkpoints
from ..section import sort_key
from ..sidecar import read_sidecar, sidecar_path
from .config import RollbackMode, RollbackSkip, TrainerConfig
from ..history import f32_bits, json_float

if TYPE_CHECKING:
    from ..runstate import RunState
    from ..history import History
    from .loop import Run, StepResult

__all__ = ["RECORD_VERSION", "SPIKE_FACTOR", "VALUE_NAME", "Guard", "Kept", "RollbackState", "Ring", "kept_rows",
           "new_record", "skipped_batches"]

RECORD_VERSION = 1  # the "version" key of the rollback record (R-R08)
SPIKE_FACTOR = 10.0  # --spike-at multiplies every gradient by this (TESTING AID, R-R11)
VALUE_NAME = "rollback"  # the record's add_value name: monitor section values.rollback

Log = Callable[[str], None]


# ----------------------------------------------------------------------------- the record


def new_record() -> dict[str, Any]:
    """The rollback record of a run that has not rolled back (R-R08)."""
    return {
        "version": RECORD_VERSION,
        "lr_scale": 1.0,  # product of --lr-drop over every rollback; multiplies the scheduled LR
        "count": 0,  # rollbacks so far: the timeline index of the rows written now
        "skipped_batches": 0,  # the stream offset rule's term (R-R05)
        "consecutive": 0,  # confirmed spikes in the current chain (R-R07)
        "horizon": None,  # the chain ends once the run applies the update of this step
        "transient": 0,  # spikes whose re-run was normal (R-R04)
        "arrivals": 0,  # executions of step --spike-at so far (TESTING AID, R-R11)
        "rollbacks": [],  # one event per rollback, oldest first (at most --rollback-cap)
    }


_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "version": (int,), "lr_scale": (float,), "count": (int,), "skipped_batches": (int,),
    "consecutive": (int,), "horizon": (int, type(None)), "transient": (int,), "arrivals": (int,),
    "rollbacks": (list,),
}
_EVENT_KEYS = frozenset({"step", "to", "reason", "grad_norm", "median", "ratio", "lr_before", "lr_after",
                         "lr_scale", "skipped"})


def _check_record(state: Any, where: str = "values.rollback") -> dict[str, Any]:
    """Validate a stored record, whole, before anything uses it (R-R08).

    Raises:
        UnsupportedVersion: an unknown ``version``.
        MalformedIndex: a missing or unknown key, a wrong type, a negative count.
    """
    if not isinstance(state, Mapping):
        raise MalformedIndex(f"must be a dict (got {type(state).__name__})", field=where)
    version = state.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise MalformedIndex(f"version must be an int (got {type(version).__name__})", field=f"{where}.version")
    if version != RECORD_VERSION:
        raise UnsupportedVersion("rollback record version not supported", field=f"{where}.version",
                                 expected=RECORD_VERSION, actual=version,
                                 hint="upgrade ckptkit to resume this run")
    missing, unknown = sorted(set(_RECORD_TYPES) - set(state)), sorted(map(str, set(state) - set(_RECORD_TYPES)))
    if missing or unknown:
        raise MalformedIndex(f"{'missing' if missing else 'unknown'} key(s) {', '.join(missing or unknown)}",
                             field=where)
    for key, types in _RECORD_TYPES.items():
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise MalformedIndex(f"must be {' or '.join(t.__name__ for t in types)} (got {value!r})",
                                 field=f"{where}.{key}")
        if isinstance(value, int) and value < 0:
            raise MalformedIndex(f"must be >= 0 (got {value})", field=f"{where}.{key}")
    if not (math.isfinite(state["lr_scale"]) and 0.0 < state["lr_scale"] <= 1.0):
        raise MalformedIndex(f"must be finite, > 0 and <= 1 (got {state['lr_scale']!r})", field=f"{where}.lr_scale")
    for i, event in enumerate(state["rollbacks"]):
        if not isinstance(event, Mapping) or set(event) != _EVENT_KEYS:
            raise MalformedIndex(f"must be a dict with keys {', '.join(sorted(_EVENT_KEYS))}",
                                 field=f"{where}.rollbacks[{i}]")
    return copy.deepcopy(dict(state))


def skipped_batches(values: Mapping[str, Any]) -> int:
    """The skipped-batch count stored with a checkpoint (0 when it has no rollback record).

    The stream offset rule's extra term (R-R05); given a checkpoint's stored
    values by :meth:`RunState.add_data_position`'s ``expected`` rule.

    Raises:
        MalformedIndex / UnsupportedVersion: the stored record is malformed.
    """
    if VALUE_NAME not in values:
        return 0
    return int(_check_record(values[VALUE_NAME])["skipped_batches"])


class RollbackState:
    """The run state a rollback changes: the record, the LR scale, the ``--spike-at`` arrivals.

    Lives on the :class:`~ckptkit.trainer.loop.Run` (``run.rollback``), so a step
    reads the LR scale and the injection from it and ``run_state`` registers it
    (``add_value("rollback")``, mode ``on`` only) wherever the run is restored.
    The record is never rewound by a rollback (R-R08).

    Args:
        cfg: the run config.
    """

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.record = new_record()

    @property
    def lr_scale(self) -> float:
        """Multiplies the scheduled LR (after the schedule and any optimizer load, R-R06)."""
        return float(self.record["lr_scale"])

    @property
    def timeline(self) -> int:
        """Rollbacks so far: history rows written now belong to this timeline (R-R10)."""
        return int(self.record["count"])

    def state(self) -> dict[str, Any]:
        """The record, for ``RunState.add_value`` (a copy)."""
        return copy.deepcopy(self.record)

    def load(self, state: Any) -> None:
        """Restore the record (resume); validated whole first.

        Raises:
            MalformedIndex / UnsupportedVersion: the stored record is malformed.
        """
        self.record = _check_record(state)

    def inject(self, step: int, params: list[torch.Tensor]) -> None:
        """TESTING AID ``--spike-at``: multiply every gradient by :data:`SPIKE_FACTOR` on the
        first ``--spike-repeat`` arrivals at that step (the first only with ``--spike-transient``).

        Called by ``train_step`` after ``backward()``, before the grad norm. The
        arrival count is in the record, so a resumed run fires exactly as the
        uninterrupted one (R-R11). Without mode ``on`` a step runs once per
        timeline, so the in-memory count is enough there.
        """
        tc = self.cfg.train
        if tc.spike_at is None or step != tc.spike_at:
            return
        self.record["arrivals"] += 1
        if self.record["arrivals"] <= (1 if tc.spike_transient else tc.spike_repeat):
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(SPIKE_FACTOR)


# ----------------------------------------------------------------------------- the ring


@dataclass
class Kept:
    """One pre-step state, as the ring keeps it.

    Attributes:
        step: the steps done (the state before step ``step`` runs).
        ckpt: :meth:`RunState.checkpoint` at ``step``, every tensor cloned.
        ngram: the n-gram sidecar ``(table_step, tree)``, cloned; None without one.
        records: whether :attr:`digests` covers the monitors' reports and the
            rollback record (a rollback or re-run never restores them).
    """

    step: int
    ckpt: Checkpoint
    ngram: tuple[int, Any] | None
    records: bool = True
    _digests: dict[str, int] | None = field(default=None, repr=False, compare=False)

    @property
    def digests(self) -> dict[str, int]:
        """Part name -> digest of the kept copy (R-R03), computed on first use.

        The copy shares no memory with the run and nothing writes it, so its digest
        is the kept state's whenever it is taken; deferring it keeps the ring's
        per-step cost to the copy (a state that is never restored is never hashed).
        """
        if self._digests is None:
            self._digests = _digests(self.ckpt, self.ngram, records=self.records)
        return self._digests

    @property
    def nbytes(self) -> int:
        """Tensor bytes held (what the ring costs in memory)."""
        return sum(t.numel() * t.element_size() for t in _tensors((self.ckpt.model, self.ckpt.optim,
                                                                   self.ckpt.teacher, self.ngram)))


class Ring:
    """The pre-step states of the last ``k + 1`` steps, by step (R-R02).

    Keeping step ``s`` drops every state after ``s`` (after a rollback they
    belong to the abandoned timeline) and every state before ``s - k``.
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self._by_step: dict[int, Kept] = {}

    def put(self, kept: Kept) -> None:
        s = kept.step
        self._by_step = {t: v for t, v in self._by_step.items() if s - self.k <= t < s}
        self._by_step[s] = kept

    def get(self, step: int) -> Kept | None:
        return self._by_step.get(step)

    def steps(self) -> list[int]:
        return sorted(self._by_step)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self._by_step.values())


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _clone(tree: Any) -> Any:
    """A deep copy sharing no tensor memory: ``load_state_dict`` may keep references
    (an optimizer keeps the given state tensors), so the ring must never hand out its own."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, Mapping):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_clone(v) for v in tree)
    if isinstance(tree, Checkpoint):
        return dataclasses.replace(tree, model=_clone(tree.model), optim=_clone(tree.optim),
                                   teacher=_clone(tree.teacher), monitor=_clone(tree.monitor))
    return copy.copy(tree)


def _feed(h: Any, value: Any, path: str) -> None:
    """Canonical bytes of a state tree into ``h``: tensors by exact bytes, floats by bits."""
    if isinstance(value, torch.Tensor):  # dtype, shape and exact bytes, fed straight in (no hasher per tensor)
        _held, raw = tensor_bytes(value)
        h.update(b"T" + dtype_name(value.dtype).encode() + struct.pack(f"<I{value.dim()}Q", value.dim(), *value.shape))
        h.update(raw)
    elif isinstance(value, Mapping):
        h.update(b"D" + struct.pack("<Q", len(value)))
        for k in sorted(value, key=sort_key):
            _feed(h, k, path)
            _feed(h, value[k], f"{path}.{k}")
    elif isinstance(value, (list, tuple)):  # a tuple comes back from msgpack as a list
        h.update(b"L" + struct.pack("<Q", len(value)))
        for i, v in enumerate(value):
            _feed(h, v, f"{path}[{i}]")
    elif value is None:
        h.update(b"N")
    elif isinstance(value, bool):
        h.update(b"B1" if value else b"B0")
    elif isinstance(value, int):
        h.update(b"I" + str(value).encode() + b";")
    elif isinstance(value, float):
        h.update(b"F" + struct.pack("<d", value))
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        h.update(b"S" + struct.pack("<Q", len(raw)) + raw)
    elif isinstance(value, bytes):
        h.update(b"Y" + struct.pack("<Q", len(value)) + value)
    else:  # RunState.checkpoint only holds the above (add_* probes refuse the rest)
        raise TypeError(f"{path}: cannot digest a {type(value).__name__}")


def _digest(tree: Any, where: str) -> int:
    h = xxhash.xxh3_64()
    _feed(h, tree, where)
    return h.intdigest()


def _digests(ckpt: Checkpoint, ngram: tuple[int, Any] | None, *, records: bool = True) -> dict[str, int]:
    """Per-part digests of a kept state; the parts are what a restore may choose to keep.

    ``records=False`` leaves out the parts a rollback or re-run never restores (the
    monitors' reports and the rollback record): the ring's states need no digest of
    them, and the report's recent values are the costliest part to digest.
    """
    parts: dict[str, Any] = {"model": ckpt.model, "optim": ckpt.optim, "teacher": ckpt.teacher, "flags": ckpt.flags}
    mon = ckpt.monitor or {}
    for name, state in (mon.get("monitors") or {}).items():
        if records:
            parts[f"monitors.{name}.report"] = state.get("report")
        parts[f"monitors.{name}"] = {k: v for k, v in state.items() if k != "report"}
    for group in ("data", "values"):
        for name, value in (mon.get(group) or {}).items():
            if records or (group, name) != ("values", VALUE_NAME):
                parts[f"{group}.{name}"] = value
    if ngram is not None:
        parts["sidecars.ngram"] = list(ngram)
    return {name: _digest(tree, name) for name, tree in parts.items()}


# ----------------------------------------------------------------------------- the guard


class Guard:
    """The spike-rollback controller of one :func:`~ckptkit.trainer.loop.train` call.

    Args:
        cfg: the run config (``train.auto_rollback`` and the ``rollback_*`` knobs).
        run: the run's objects; ``run.rollback`` holds the record the guard updates.
        rs: the run's :class:`~ckptkit.runstate.RunState` (captures, discard, save).
        step_fn: ``train_step(run, step) -> StepResult``.
        lr_fn: the LR schedule, ``get_lr(step, cfg.train)``.
        probe_fn: the probes before step 0 (replaying from step 0), logging nothing.
        offset_rule: ``expected_offset(step, skipped_batches)``, the stream offset rule.
        log: progress and notes.
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        run: Run,
        rs: RunState,
        *,
        step_fn: Callable[[Run, int], StepResult],
        lr_fn: Callable[[int], float],
        probe_fn: Callable[[], object],
        offset_rule: Callable[[int, int], int],
        log: Log,
    ) -> None:
        tc = cfg.train
        self.cfg, self.run, self.rs = cfg, run, rs
        self.mode = RollbackMode(tc.auto_rollback)
        self.k = tc.rollback_k
        self._step_fn, self._lr_fn, self._probe_fn, self._offset_rule = step_fn, lr_fn, probe_fn, offset_rule
        self._log = log
        if run.rollback is None:
            raise ValueError("run.rollback is None: build the run with ckptkit.trainer.loop.build()")
        self.held: RollbackState = run.rollback  # the record lives on the run (run_state registers it)
        self.ring = Ring(self.k) if self.mode is RollbackMode.ON else None
        self.restored_step: int | None = None  # where training goes on after the last rollback
        self._silent = False  # replaying to rebuild the ring: no rows, no files, no progress
        self._history: History | None = None
        self._emit: Callable[[StepResult], None] = lambda _r: None
        self._save: Callable[[int], object] = lambda _s: None
        self._genesis: Kept | None = None

    @property
    def on(self) -> bool:
        """``--auto-rollback on``: the record is run state and the ring is kept."""
        return self.mode is RollbackMode.ON

    @property
    def record(self) -> dict[str, Any]:
        """The run's rollback record (``run.rollback.record``)."""
        return self.held.record

    def attach(self, history: History, *, emit: Callable[[StepResult], None], save: Callable[[int], object]) -> None:
        """Where rows go: ``emit`` writes a step row (and calls ``on_step``); ``save``
        syncs the history and writes a checkpoint."""
        self._history, self._emit, self._save = history, emit, save

    # ------------------------------------------------------------------ the loop

    def keep(self, step: int) -> None:
        """Keep the state before step ``step`` in the ring (mode ``on``; R-R02)."""
        if self.ring is not None:
            self.ring.put(self._capture(step, records=False))

    def on_spike(self, result: StepResult) -> StepResult | None:
        """Act on a step whose verdict is a spike; its step row is already written.

        Returns:
            The result training goes on with: ``result`` itself (modes off and
            warn), or the re-run's (mode on, a transient spike); None after a
            rollback, with :attr:`restored_step` the step training goes on from.

        Raises:
            TrainingUnstable: the ``--rollback-bound``-th consecutive spike, or a
                spike past ``--rollback-cap`` rollbacks (R-R07).
            ReplayDivergence: a state restored from the ring differs from the one kept.
        """
        if self.mode is RollbackMode.OFF:
            return result
        if self.mode is RollbackMode.WARN:
            self._row(self._spike_row(result, "warn"))
            return result
        assert self.ring is not None
        n = result.step
        # 1. The update is discarded: the state before the step comes back from the ring.
        self.run.monitor.refuse(n)
        self._row(self._spike_row(result, "rerun"))
        self._say(f"spike at step {n} ({_describe(result)}): update discarded; re-running step {n} "
                  "from the state before it")
        self._restore(self._kept(n), stream=True)
        # 2. The re-run (item 8): a fault does not repeat, the data does.
        rerun = dataclasses.replace(self._step_fn(self.run, n), rerun=True)
        if not self._silent:
            self._emit(rerun)
        if not rerun.verdict.is_spike:
            self.record["transient"] += 1
            self._row(self._spike_row(result, "transient", rerun))
            self._say(f"step {n} re-ran normally ({_describe(rerun)}): a transient spike, not the data; "
                      "keeping the re-run, no rollback")
            return rerun
        # 3. Confirmed: roll back, or stop at the bound / the cap.
        chained = self.record["horizon"] is not None and n <= self.record["horizon"]
        consecutive = self.record["consecutive"] + 1 if chained else 1
        tc = self.cfg.train
        if consecutive >= tc.rollback_bound or self.record["count"] >= tc.rollback_cap:
            self._unstable(result, rerun, consecutive)
        self._row(self._spike_row(result, "rollback", rerun))
        self._rollback(result, rerun, consecutive, chained)
        return None

    def _rollback(self, first: StepResult, rerun: StepResult, consecutive: int, chained: bool) -> None:
        tc, run, rec = self.cfg.train, self.run, self.record
        n = first.step
        # Never further back than the previous rollback's target: PaLM restarts repeated
        # spikes from the same checkpoint, and it is the oldest state the ring holds until
        # the run is K steps past it (R-R02).
        to = max(n - self.k, rec["rollbacks"][-1]["to"] if rec["rollbacks"] else 0)
        target = self._kept(to)
        skip = RollbackSkip(tc.rollback_skip) is RollbackSkip.WINDOW
        end = run.stream.offset  # after the spiking batch
        start = target.ckpt.monitor["data"]["train"]
        lr_before = self._lr_fn(to) * rec["lr_scale"]
        for s in range(to, n + 1):  # every update this rollback takes back (R-M06)
            run.monitor.refuse(s)
        self._restore(target, stream=not skip)
        rec["lr_scale"] *= tc.lr_drop
        skipped = None
        if skip:  # the stream keeps its position: the window's batches are never trained on
            rec["skipped_batches"] += n + 1 - to
            skipped = {"start": start, "end": end, "batches": (end - start) // self._batch_bytes()}
        if run.stream.offset != self._offset_rule(to, rec["skipped_batches"]):
            raise StreamOffsetMismatch(
                f"rollback to step {to}: stream offset {run.stream.offset} breaks the offset rule "
                f"(expected {self._offset_rule(to, rec['skipped_batches'])} with {rec['skipped_batches']} "
                "skipped batches); this is a bug in the rollback")
        event = {
            "step": n, "to": to, "reason": rerun.verdict.reason, "grad_norm": rerun.verdict.grad_norm,
            "median": rerun.verdict.median, "ratio": rerun.verdict.ratio, "lr_before": lr_before,
            "lr_after": self._lr_fn(to) * rec["lr_scale"], "lr_scale": rec["lr_scale"], "skipped": skipped,
        }
        rec["count"] += 1
        rec["consecutive"] = consecutive
        rec["horizon"] = max(n, rec["horizon"]) if chained else n
        rec["rollbacks"].append(event)
        self.restored_step = to
        if self._silent:
            return
        self._row(self._rollback_row(event, rerun))
        self._say(f"ROLLED BACK to step {to} (rollback {rec['count']}, {consecutive} in a row): lr "
                  f"{event['lr_before']:.3g} -> {event['lr_after']:.3g} (x{rec['lr_scale']:g} from now on); "
                  + (f"skipping stream bytes [{start}, {end}) ({skipped['batches']} batches)" if skipped
                     else "replaying the same batches"))
        # The abandoned timeline's checkpoints go first, so a crash from here on resumes from
        # a state at or before `to` (which re-runs to this same rollback), never past it; then
        # the rolled-back state is saved, so the rollback itself is durable (R-R09).
        gone = self.rs.discard_after(to)
        if gone:
            self._say(f"deleted {len(gone)} checkpoint(s) of the abandoned timeline: "
                      + ", ".join(os.path.basename(p) for p in gone))
        self._save(to)

    def _unstable(self, first: StepResult, rerun: StepResult, consecutive: int) -> None:
        tc, rec = self.cfg.train, self.record
        bound_hit = consecutive >= tc.rollback_bound
        self._row(self._spike_row(first, "unstable", rerun))
        if self._history is not None and not self._silent:
            self._history.sync()
        # The bound lists the chain's rollbacks; the cap, every rollback of the run (at most cap).
        chain = rec["rollbacks"][len(rec["rollbacks"]) - (consecutive - 1):] if consecutive > 1 else []
        chain = chain if bound_hit else list(rec["rollbacks"])
        lines = [_event_line(i + 1, e) for i, e in enumerate(chain)]
        lines.append(f"  {len(lines) + 1}. step {rerun.step}: {_describe(rerun)}; not rolled back")
        why = (f"{consecutive} consecutive spikes (--rollback-bound {tc.rollback_bound})" if bound_hit else
               f"--rollback-cap {tc.rollback_cap} rollbacks already done in this run")
        ckpts = self.rs.checkpoints()  # a save still in flight is "the newest": named once it is on disk
        resume_from = ckpts[-1][1] if ckpts else None
        where = (f"the last good checkpoint is {resume_from} (the newest; intact: nothing was saved after it, "
                 f"`ckptkit verify {self.rs.run_dir}` checks it); resume from it once the cause is found, "
                 "e.g. with a lower --lr, --grad-clip or another --seed"
                 if resume_from else "no checkpoint was saved yet")
        err = TrainingUnstable(f"training is unstable; investigate: {why}:\n" + "\n".join(lines) + f"\n{where}")
        err.events = chain + [{"step": rerun.step, "reason": rerun.verdict.reason,  # type: ignore[attr-defined]
                               "grad_norm": rerun.verdict.grad_norm, "median": rerun.verdict.median,
                               "ratio": rerun.verdict.ratio}]
        err.checkpoint = resume_from  # type: ignore[attr-defined]
        raise err

    # ------------------------------------------------------------------ capture and restore

    def _capture(self, step: int, *, records: bool = True) -> Kept:
        ckpt = _clone(self.rs.checkpoint(step))
        ngram = None
        if self.run.ngram is not None:
            table_step, tree = self.run.ngram.sidecar()
            ngram = (table_step, _clone(tree))
        return Kept(step, ckpt, ngram, records)

    def _kept(self, step: int) -> Kept:
        assert self.ring is not None
        kept = self.ring.get(step)
        if kept is None:  # the ring holds steps n-k..n by construction (and after a resume, R-R12)
            raise ReplayDivergence(f"rollback: no state kept for step {step} (ring holds {self.ring.steps()}); "
                                   "this is a bug in the rollback ring")
        return kept

    def _restore(self, kept: Kept, *, stream: bool, full: bool = False) -> None:
        """Put the run back to a kept state and check it against the kept digests (R-R03).

        A rollback or re-run (``full=False``) rewinds the monitor's detector and
        keeps its report and the rollback record: they describe the whole run.
        ``full`` restores those too (rebuilding the ring). ``stream=False``
        leaves the stream where it is (skipping the window).

        Everything goes back through the trainer's own RunState registrations
        (:meth:`RunState.restore`), so a rollback restores exactly what a resume
        does, except what it keeps on purpose; the digest check then proves it.
        """
        ck = _clone(kept.ckpt)  # load_state_dict may keep references: the ring keeps its own
        skip = set() if full else {"monitor:spike", f"value:{VALUE_NAME}"}  # the report and record: the whole run's
        if not (stream or full):
            skip.add("data:train")  # the window is skipped: the stream keeps its place (R-R05)
        self.rs.restore(ck, sidecars={} if kept.ngram is None else {"ngram": kept.ngram}, skip=skip)
        if not full:
            self.run.monitor.rewind((ck.monitor or {})["monitors"]["spike"])  # the detector only (R-M07)
        # The check: the live state, digested the same way, must equal what was kept.
        now = _digests(self.rs.checkpoint(kept.step), self._live_ngram(), records=full)
        # (The reports and the record are not in a ring state's digests: never restored.)
        kept_apart = {"data.train"} if not (stream or full) else set()
        differ = sorted(n for n in kept.digests.keys() | now.keys()
                        if n not in kept_apart and kept.digests.get(n) != now.get(n))
        if differ:
            raise ReplayDivergence(
                f"the state restored for step {kept.step} differs from the state kept at step {kept.step} in: "
                f"{', '.join(differ)}; a restore that misses run state cannot roll back exactly (a registration "
                "whose set() or load_state_dict() does not put everything back?)")

    def _live_ngram(self) -> tuple[int, Any] | None:
        return None if self.run.ngram is None else self.run.ngram.sidecar()

    def _batch_bytes(self) -> int:
        return self.cfg.data.batch * self.cfg.data.seq_len

    # ------------------------------------------------------------------ resume: rebuild the ring

    def before_resume(self) -> None:
        """Keep the freshly built state (step 0, before the probes): the replay base of last resort."""
        if self.on:
            self._genesis = self._capture(0)

    def after_resume(self, start: int) -> list[str]:
        """Rebuild the ring of a resumed run (mode on) by replaying; returns notes (R-R12).

        The ring of the uninterrupted run at ``start`` holds the states of steps
        ``start-K .. start``. They are re-derived by replaying from the newest
        checkpoint at or before ``start-K`` (or from step 0: a fresh build and the
        probes), with no rows, no files and no progress, and the replay must land
        on the resumed checkpoint's state exactly.

        Raises:
            ReplayDivergence: the replay does not reproduce the resumed checkpoint.
        """
        if not self.on or start == 0:
            return []
        need = max(start - self.k, 0)
        here, timeline = self._capture(start), self.held.timeline
        base, note = self._replay_base(need)
        self._silent = True
        try:
            if base is None:
                assert self._genesis is not None
                self._restore(self._genesis, stream=True, full=True)
                self._probe_fn()
                frm = 0
            else:
                self._restore(base, stream=True, full=True)
                frm = base.step
            self._replay(frm, start, timeline)
        finally:
            self._silent = False
        now = self._capture(start)
        differ = sorted(n for n in here.digests if here.digests[n] != now.digests.get(n))
        if differ:
            raise ReplayDivergence(
                f"rebuilding the rollback ring: replaying steps {frm}..{start} from {note} did not reproduce "
                f"{checkpoint_name(start)} (differs in: {', '.join(differ)}); this run is not deterministic here, "
                "so a rollback could not be exact; see ReplayDivergence's docstring for the usual causes")
        msg = f"rollback ring rebuilt: replayed steps {frm}..{start} from {note}; it reproduced {checkpoint_name(start)}"
        self._log(msg)
        return [msg]

    def _replay_base(self, need: int) -> tuple[Kept | None, str]:
        """The newest loadable checkpoint at or before ``need``; None means step 0 (genesis)."""
        for step, path in reversed(list_checkpoints(self.rs.run_dir)):
            if step > need:
                continue
            try:
                ckpt = load(path)
                ngram = None
                if self.run.ngram is not None:
                    sc = read_sidecar(sidecar_path(path, "ngram"), expect_step=step)
                    ngram = (sc.table_step, sc.tree)
            except (FormatError, CheckpointNotFound):
                continue  # as resume does: a damaged older checkpoint is passed over
            return Kept(step, ckpt, ngram), os.path.basename(path)
        return None, "step 0 (a fresh build and the probes)"

    def _replay(self, frm: int, to: int, timeline: int) -> None:
        """The training loop of :func:`train` from step ``frm`` until it stands at step ``to``
        of timeline ``timeline`` (after that many rollbacks), without rows, files or progress.

        The digest check after it proves the two loops agree. A replay that passes
        ``to + K + 1`` still short of the timeline has diverged (the rollback that made
        the timeline came from a spike at most K steps after its target); it stops there
        and the check names the difference.
        """
        step = frm
        while step < to or self.held.timeline < timeline:
            if self.held.timeline > timeline or step > to + self.k + 1:
                return
            self.keep(step)
            result = self._step_fn(self.run, step)
            if result.verdict.is_spike:
                got = self.on_spike(result)
                if got is None:
                    assert self.restored_step is not None
                    step = self.restored_step
                    continue
            step += 1

    # ------------------------------------------------------------------ rows and progress

    def _row(self, row: dict[str, Any]) -> None:
        if not self._silent and self._history is not None:
            self._history.append(row)

    def _say(self, msg: str) -> None:
        if not self._silent:
            self._log(msg)

    def _spike_row(self, result: StepResult, action: str, rerun: StepResult | None = None) -> dict[str, Any]:
        v = result.verdict
        row = {"kind": "spike", "step": result.step, "action": action, "mode": self.mode.value,
               "reason": v.reason, "grad_norm": json_float(v.grad_norm), "grad_norm_bits": f32_bits(v.grad_norm),
               "median": _num(v.median), "ratio": _num(v.ratio), "lr": result.lr}
        if self.on:
            row["rerun"] = None if rerun is None else {
                "reason": rerun.verdict.reason, "spike": rerun.verdict.is_spike,
                "grad_norm": json_float(rerun.verdict.grad_norm), "grad_norm_bits": f32_bits(rerun.verdict.grad_norm)}
        return row

    def _rollback_row(self, event: dict[str, Any], rerun: StepResult) -> dict[str, Any]:
        rec = self.record
        return {
            "kind": "rollback", "step": event["step"], "to": event["to"], "reason": event["reason"],
            "grad_norm": json_float(event["grad_norm"]), "grad_norm_bits": f32_bits(rerun.verdict.grad_norm),
            "median": _num(event["median"]), "ratio": _num(event["ratio"]),
            "lr_before": event["lr_before"], "lr_after": event["lr_after"], "lr_scale": event["lr_scale"],
            "skipped": event["skipped"], "skipped_batches": rec["skipped_batches"],
            "abandoned": {"from": event["to"], "to": event["step"]},
            "consecutive": rec["consecutive"], "count": rec["count"],
            "rollbacks": [{"step": e["step"], "to": e["to"], "reason": e["reason"], "lr_after": e["lr_after"]}
                          for e in rec["rollbacks"]],
        }


def _num(x: float | None) -> float | str | None:
    return None if x is None else json_float(x)


def _describe(result: StepResult) -> str:
    v = result.verdict
    median = "none" if v.median is None else f"{v.median:.4g}"
    ratio = "" if v.ratio is None else f", ratio {v.ratio:.3g}"
    return f"{v.reason}: grad norm {v.grad_norm:.4g}, median {median}{ratio}"


def _event_line(i: int, e: Mapping[str, Any]) -> str:
    ratio = "-" if e["ratio"] is None else f"{e['ratio']:.3g}"
    median = "-" if e["median"] is None else f"{e['median']:.4g}"
    skipped = e["skipped"]
    skip = (f"skipped stream bytes [{skipped['start']}, {skipped['end']}) ({skipped['batches']} batches)"
            if skipped else "no batches skipped")
    return (f"  {i}. step {e['step']}: {e['reason']}: grad norm {e['grad_norm']:.4g}, median {median}, ratio {ratio}; "
            f"rolled back to step {e['to']}, lr {e['lr_before']:.3g} -> {e['lr_after']:.3g}, {skip}")


# ----------------------------------------------------------------------------- reading a history


def kept_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``step`` rows whose updates the run's final state descends from (R-R10).

    A step row is left out when its update was discarded on the spot (the next
    ``step``/``spike``/``rollback`` row is a ``spike`` row with action ``rerun``,
    ``rollback`` or ``unstable``; rows of other kinds in between, such as
    ``digests``, are passed over) or when a later ``rollback`` row abandoned it
    (a row of that timeline with ``step >= to``). The result is the loss curve of
    the run as it stands: one row per step, steps ascending.

    Args:
        rows: every row of ``history.jsonl``, in file order.
    """
    story = [r for r in rows if r["kind"] in ("step", "spike", "rollback")]
    out: list[dict[str, Any]] = []
    for i, r in enumerate(story):
        if r["kind"] == "rollback":
            while out and out[-1]["step"] >= r["to"]:  # the kept rows are one lineage, steps ascending
                out.pop()
        elif r["kind"] == "step":
            nxt = story[i + 1] if i + 1 < len(story) else None
            if nxt is None or nxt["kind"] != "spike" or nxt["action"] not in ("rerun", "rollback", "unstable"):
                out.append(r)
    return out
