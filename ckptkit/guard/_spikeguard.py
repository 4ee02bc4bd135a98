"""Spike rollback for any RunState loop: the PRD's auto-rollback as a library class.

    guard = ckptkit.SpikeGuard(state, ckptkit.RollbackConfig(mode="on"))
    guard.run(step_fn, start, stop, save_every=50)       # step_fn(step) -> grad norm

or, for a loop that wants control, one call per step::

    step = start
    while step < stop:
        outcome = guard.step(step, step_fn)
        if isinstance(outcome, ckptkit.guard.RolledBack):
            step = outcome.to                            # training goes on from the restored state
            continue
        step += 1

The monitor (:class:`~ckptkit.guard.SpikeMonitor`) judges each step's grad
norm against the rolling median; the guard decides what happens, per ``mode``:

=====  ========================================================================
off    the monitor keeps its statistics; nothing else
warn   a ``spike`` row in ``history.jsonl``; the update is kept (the default)
on     the update is discarded and the step re-run once from the exact state
       before it. A normal re-run was a transient fault: its result is kept. A
       spike again is the data: the registered state goes back to step N-K, the
       LR is multiplied by ``lr_drop`` for the rest of the run, the window's
       data is skipped (the registered data position keeps its place), and
       training goes on from N-K. The ``bound``-th consecutive spike, or a spike
       past ``cap`` rollbacks, stops the run (:class:`TrainingUnstable`:
       "training is unstable; investigate").
=====  ========================================================================

Where the state at N-K comes from: a ring of the last K+1 pre-step states
(``ckptkit.guard._ring``), each :meth:`RunState.checkpoint` cloned; every restore is
checked against digests of the kept copy. The ring is derived state, not saved: a
resumed run rebuilds it by replaying from an older checkpoint (or from the state
the guard was built with) and requires the replay to reproduce the resumed state
exactly. spec/rollback.md is the contract (R-R01..R-R12).

torch is imported lazily (``import ckptkit`` stays torch-free).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import (
    CheckpointNotFound,
    FormatError,
    ReplayDivergence,
    StreamOffsetMismatch,
    TrainingUnstable,
    UnreadableFile,
)
from ..format._checks import is_number
from ..format._tree import clone, digests, localized
from ..run import RunState
from ..run._fingerprint import checkpoint_digests
from ..run._history import f32_bits, json_float
from ..run._rng import global_rngs_kept
from ._config import MODES, RollbackConfig
from ._monitor import SpikeMonitor, Verdict
from ._ring import Kept, Ring
from ._rollback_record import VALUE_NAME, RollbackEvent, RollbackRecord

if TYPE_CHECKING:
    from ._faults import GradSpike

__all__ = ["MODES", "Continue", "Executed", "Outcome", "RolledBack", "SpikeGuard"]

INJECTION_VALUE = "spike_injection"  # the testing aid's arrival count (values.spike_injection)

Log = Callable[[str], None]
StepFn = Callable[[int], Any]


@dataclass(frozen=True)
class Executed:
    """One execution of a step.

    Attributes:
        step: the step (0-based).
        result: what ``step_fn`` returned.
        verdict: the monitor's judgement of it.
        lr: the LR the step ran with.
        rerun: True for the re-run of a spiking step from the state before it (R-R04).
    """

    step: int
    result: Any
    verdict: Verdict
    lr: float
    rerun: bool = False


@dataclass(frozen=True)
class Continue:
    """The step is done; training goes on with step ``executed.step + 1``."""

    executed: Executed

    @property
    def result(self) -> Any:
        return self.executed.result


@dataclass(frozen=True)
class RolledBack:
    """A confirmed spike rolled the run back: training goes on from step ``to``."""

    to: int
    event: RollbackEvent


Outcome = Continue | RolledBack


def _scalars(result: Any, step: int) -> tuple[float, float]:
    """(grad norm, loss) of what a step returned: a number, a 0-dim tensor, or an
    object with ``grad_norm`` (and optionally ``loss``) attributes."""
    gn: Any = getattr(result, "grad_norm", result)
    loss: Any = getattr(result, "loss", 0.0)
    values = []
    for name, v in (("grad norm", gn), ("loss", loss)):
        if hasattr(v, "numel"):
            if v.numel() != 1:
                raise TypeError(
                    f"step {step}: step_fn must return the step's grad norm as a scalar "
                    f"(got a {name} tensor of shape {list(v.shape)}); return e.g. "
                    "clip_grad_norm_(...) or its .item()"
                )
            v = v.item()
        if not is_number(v):
            raise TypeError(
                f"step {step}: step_fn must return the step's grad norm as a number "
                f"(got {type(v).__name__} for the {name}); return e.g. clip_grad_norm_(...).item()"
            )
        values.append(float(v))
    if values[0] < 0:
        raise ValueError(
            f"step {step}: step_fn returned a negative grad norm ({values[0]!r}); "
            "a grad norm is >= 0 (NaN and inf are spikes, judged by the monitor)"
        )
    return values[0], values[1]


class _Effects:
    """Where a step's rows, files and notes go; a ring rebuild uses a silent one."""

    def __init__(self, guard: SpikeGuard, *, live: bool) -> None:
        self.guard, self.live = guard, live

    def row(self, row: dict[str, Any]) -> None:
        if self.live:
            self.guard.state.history.append(row)

    def executed(self, e: Executed) -> None:
        if self.live and self.guard.on_step is not None:
            self.guard.on_step(e)

    def say(self, msg: str) -> None:
        if self.live:
            self.guard.log(msg)

    def rollback_durable(self, to: int) -> None:
        """R-R09: the abandoned timeline's checkpoints go first, so a crash from here on
        resumes from a state at or before ``to`` (which re-runs to this same rollback);
        then the rolled-back state is saved, so the rollback itself is durable."""
        if not self.live:
            return
        gone = self.guard.state.discard_after(to)
        if gone:
            self.say(
                f"deleted {len(gone)} checkpoint(s) of the abandoned timeline: "
                + ", ".join(os.path.basename(p) for p in gone)
            )
        self.guard.save(to)


class SpikeGuard:
    """Spike detection and rollback for the loop of ``state`` (spec/rollback.md).

    Construct it after registering the run's state and before ``resume()``: the
    state at construction is the replay base of last resort for rebuilding the ring.

    Its ``spike`` and ``rollback`` rows go into the run's history (:attr:`RunState.history`,
    R-R10); a step the guard re-runs is recorded ``"rerun": true`` by :meth:`RunState.record`,
    from ``step_fn`` or ``on_step`` alike.

    Args:
        state: the run's :class:`RunState`, everything registered.
        config: what it does with a spike, a :class:`~ckptkit.RollbackConfig`
            (``RollbackConfig()``: mode ``"warn"``, the PRD's); :attr:`config` holds it.
        monitor: the spike monitor; registered as ``"spike"`` unless ``state``
            already registers it (default: ``SpikeMonitor()``, window 50, 3x median).
        lr: the LR schedule ``lr(step)`` of a loop that sets the LR itself every step
            (it multiplies by :attr:`lr_scale`). Without it the guard scales the
            registered optimizers' LR and the registered schedulers' base LRs.
        save: ``save(step)`` writes a checkpoint (default: ``state.history.sync()`` then
            ``state.save(step)``).
        on_step: called with every :class:`Executed` (the loop's own row, progress).
        prepare: run after the construction state is restored for a replay from
            step 0 (what the loop does before its first step, e.g. probes).
        inject: TESTING AID, a :class:`ckptkit.testing.GradSpike`.
        log: progress and notes (default: ignore).

    The hooks are keyword arguments, not config: they are the loop's code, not its settings.

    Raises:
        ValueError: ``skip_data`` with no (or an ambiguous) data position.
    """

    def __init__(
        self,
        state: RunState,
        config: RollbackConfig,
        *,
        monitor: SpikeMonitor | None = None,
        lr: Callable[[int], float] | None = None,
        save: Callable[[int], object] | None = None,
        on_step: Callable[[Executed], None] | None = None,
        prepare: Callable[[], object] | None = None,
        inject: GradSpike | None = None,
        log: Log | None = None,
    ) -> None:
        if not isinstance(config, RollbackConfig):
            raise TypeError(f"SpikeGuard: config must be a ckptkit.RollbackConfig (got {type(config).__name__})")
        self.config = cfg = config
        self.state, self.mode, self.k, self.lr_drop = state, cfg.mode, cfg.k, cfg.lr_drop
        self._run = state.guard_view()  # data positions, the LR, the history's timeline, replays
        self.bound, self.cap, self.on_step = cfg.bound, cfg.cap, on_step
        self.log: Log = log or (lambda _msg: None)
        self._lr, self._prepare, self._inject = lr, prepare, inject
        self.save: Callable[[int], object] = save or self._default_save
        self.monitor = monitor or SpikeMonitor()
        name = self._run.monitor_name(self.monitor)
        if name is None:
            state.add_monitor("spike", self.monitor)
        self._monitor_name = name or "spike"
        self.data = self._data_position(cfg.data) if cfg.skip_data and self.on else None
        self.record = RollbackRecord()
        self._keeps = {f"monitor:{self._monitor_name}"}  # what a rollback never rewinds (R-R03)
        if self.on:
            # Per rank: a rollback's skipped data positions are each rank's own (the rest is the same on every rank).
            state.add_value(VALUE_NAME, get=lambda: self.record.state(), set=self._load_record, per_rank=True)
            self._run.use_timeline(lambda: self.record.count)  # a resumed history keeps the restored timeline's rows
            self._keeps.add(f"value:{VALUE_NAME}")
        if inject is not None:
            state.add_value(INJECTION_VALUE, get=inject.state, set=inject.load)
            self._keeps.add(f"value:{INJECTION_VALUE}")
        self._leave_out = frozenset(
            {f"monitors.{self._monitor_name}.report", f"values.{VALUE_NAME}", f"values.{INJECTION_VALUE}"}
        )
        self.ring = Ring(cfg.k) if self.on else None
        self._genesis = self._capture(0) if self.on else None
        self._live, self._quiet = _Effects(self, live=True), _Effects(self, live=False)

    @property
    def on(self) -> bool:
        return self.mode == "on"

    @property
    def lr_scale(self) -> float:
        """Multiplies the LR: 1.0 until a rollback drops it (R-R06)."""
        return self.record.lr_scale

    def _data_position(self, name: str | None) -> str:
        positions = sorted(self._run.data_positions())
        if name is None and len(positions) == 1:
            return positions[0]
        if name is not None and name in positions:
            return name
        if not positions:
            raise ValueError(
                "SpikeGuard(mode='on') skips the spike's data through a registered data position, and "
                "this RunState registers none: register it with state.add_data_position(...), or pass "
                "RollbackConfig(skip_data=False) to replay the same data after a rollback"
            )
        raise ValueError(
            f"SpikeGuard: data={name!r} names no registered data position "
            f"(registered: {', '.join(positions)}); pass RollbackConfig(data=<one of them>)"
        )

    def _load_record(self, stored: Any) -> None:
        self.record = RollbackRecord.from_state(stored)

    def _default_save(self, step: int) -> str:
        self.state.history.sync()
        return self.state.save(step)

    # ------------------------------------------------------------------ the loop

    def run(self, step_fn: StepFn, start: int, stop: int, *, save_every: int | None = None) -> int:
        """Train steps ``start..stop-1`` with :meth:`step`; returns the step reached (``stop``).

        A resumed run (``start > 0``, mode on) first rebuilds the ring (:meth:`rebuild`).
        With ``save_every``, a checkpoint is saved every ``save_every`` steps and at ``stop``.
        After every step it calls :meth:`RunState.step_done`, so a requested stop
        (:meth:`RunState.preemptible`, ``CKPTKIT_STOP_AT``) saves and ends the run there.

        Raises:
            As :meth:`step` and :meth:`rebuild`.
        """
        if start > 0 and self.on and not self.ring.steps():  # type: ignore[union-attr]
            self.rebuild(start, step_fn)
        step = start
        while step < stop:
            outcome = self.step(step, step_fn)
            if isinstance(outcome, RolledBack):
                step = outcome.to
                continue
            step += 1
            if save_every and (step % save_every == 0 or step == stop):
                self.save(step)
            self.state.step_done(step)  # a requested stop (preemption, ckptkit audit) saves and exits here
        return step

    def step(self, step: int, step_fn: StepFn) -> Outcome:
        """Run step ``step`` (``step_fn(step)``) and act on its verdict.

        Returns:
            :class:`Continue` with the execution training goes on with (the first,
            or a transient spike's re-run), or :class:`RolledBack` to step N-K.

        Raises:
            TrainingUnstable: the ``bound``-th consecutive spike, or one past ``cap`` rollbacks.
            ReplayDivergence: a state restored from the ring differs from the one kept.
            TypeError / ValueError: ``step_fn`` returned no scalar grad norm.
        """
        return self._step(step, step_fn, self._live)

    def _step(self, n: int, step_fn: StepFn, fx: _Effects) -> Outcome:
        if self.ring is not None:
            self.ring.put(self._capture(n, leave_out=self._leave_out))
        first = self._execute(n, step_fn, fx, rerun=False)
        if not first.verdict.is_spike or self.mode == "off":
            return Continue(first)
        if self.mode == "warn":
            fx.row(self._spike_row(first, "warn"))
            fx.say(f"spike at step {n} ({_describe(first.verdict)}): kept (mode warn)")
            return Continue(first)
        # 1. The update is discarded: the state before the step comes back from the ring.
        self.monitor.refuse(n)
        fx.row(self._spike_row(first, "rerun"))
        fx.say(
            f"spike at step {n} ({_describe(first.verdict)}): update discarded; re-running step {n} "
            "from the state before it"
        )
        self._restore(self._kept(n), keep_data=False)
        # 2. The re-run: a fault does not repeat, the data does.
        rerun = self._execute(n, step_fn, fx, rerun=True)
        if not rerun.verdict.is_spike:
            self.record = dataclasses.replace(self.record, transient=self.record.transient + 1)
            fx.row(self._spike_row(first, "transient", rerun))
            fx.say(
                f"step {n} re-ran normally ({_describe(rerun.verdict)}): a transient spike, not the data; "
                "keeping the re-run, no rollback"
            )
            return Continue(rerun)
        # 3. Confirmed: roll back, or stop at the bound / the cap.
        rec = self.record
        chained = rec.horizon is not None and n <= rec.horizon
        consecutive = rec.consecutive + 1 if chained else 1
        if consecutive >= self.bound or rec.count >= self.cap:
            self._unstable(first, rerun, consecutive, fx)
        fx.row(self._spike_row(first, "rollback", rerun))
        event = self._rollback(first, rerun, consecutive, chained, fx)
        return RolledBack(event.to, event)

    def _execute(self, n: int, step_fn: StepFn, fx: _Effects, *, rerun: bool) -> Executed:
        lr = self._lr_now(n)
        # The re-run's rows say so (R-R04), whether the loop records it in step_fn or in on_step.
        with self._run.replaying(rerun=True) if rerun else contextlib.nullcontext():
            if self._inject is not None:
                self._inject.arm(n)
            try:
                result = step_fn(n)
            finally:
                if self._inject is not None:
                    self._inject.disarm()
            grad_norm, loss = _scalars(result, n)
            e = Executed(n, result, self.monitor.observe(n, grad_norm, loss), lr, rerun)
            fx.executed(e)
        return e

    def _lr_now(self, step: int) -> float:
        if self._lr is not None:
            return self._lr(step) * self.record.lr_scale
        return self._run.lr()

    # ------------------------------------------------------------------ rollback

    def _rollback(
        self, first: Executed, rerun: Executed, consecutive: int, chained: bool, fx: _Effects
    ) -> RollbackEvent:
        n, rec = first.step, self.record
        # Never further back than the previous rollback's target: PaLM restarts repeated
        # spikes from the same point, and it is the oldest state the ring holds until
        # the run is K steps past it (R-R02).
        to = max(n - self.k, rec.rollbacks[-1].to if rec.rollbacks else 0)
        target = self._kept(to)
        skipped = None
        if self.data is not None:
            start = target.ckpt.monitor["data"][self.data]
            skipped = {"start": start, "end": self._run.data_positions()[self.data], "batches": n + 1 - to}
        for s in range(to, n + 1):  # every update this rollback takes back (R-M06)
            self.monitor.refuse(s)
        self._restore(target, keep_data=self.data is not None)
        scale = rec.lr_scale * self.lr_drop
        lr_before, lr_after = self._drop_lr(to, target, rec.lr_scale, scale)
        v = rerun.verdict
        event = RollbackEvent(
            step=n,
            to=to,
            reason=v.reason,
            grad_norm=v.grad_norm,
            median=v.median,
            ratio=v.ratio,
            lr_before=lr_before,
            lr_after=lr_after,
            lr_scale=scale,
            skipped=skipped,
        )
        self.record = dataclasses.replace(
            rec,
            lr_scale=scale,
            count=rec.count + 1,
            consecutive=consecutive,
            skipped_batches=rec.skipped_batches + (skipped["batches"] if skipped else 0),
            horizon=max(n, rec.horizon or 0) if chained else n,
            rollbacks=(*rec.rollbacks, event),
        )
        self._check_offset_rule(to)
        fx.row(self._rollback_row(event, rerun))
        fx.say(
            f"ROLLED BACK to step {to} (rollback {self.record.count}, {consecutive} in a row): lr "
            f"{lr_before:.3g} -> {lr_after:.3g} (x{scale:g} from now on); "
            + (
                f"skipping data positions [{skipped['start']}, {skipped['end']}) ({skipped['batches']} batches)"
                if skipped
                else "replaying the same data"
            )
        )
        fx.rollback_durable(to)
        return event

    def _drop_lr(self, to: int, target: Kept, old: float, new: float) -> tuple[float, float]:
        """The LR of step ``to`` before and after the drop (R-R06). A loop with an ``lr``
        schedule multiplies by :attr:`lr_scale` itself; otherwise the restored optimizers'
        LR and the schedulers' base LRs (state at ``to``, at that state's scale) are scaled."""
        if self._lr is not None:
            return self._lr(to) * old, self._lr(to) * new
        stored = (target.ckpt.monitor or {}).get("values", {}).get(VALUE_NAME)
        at_target = RollbackRecord.from_state(stored).lr_scale if stored is not None else 1.0
        lr_at_target = self._lr_now(to)
        self._run.scale_lr(new / at_target)
        return lr_at_target * old / at_target, self._lr_now(to)

    def _check_offset_rule(self, to: int) -> None:
        for name, position in self._run.data_positions().items():
            want = self._run.expected_position(name, to)
            if want is not None and position != want:
                raise StreamOffsetMismatch(
                    f"rollback to step {to}: data position {name!r} is {position}, but its rule expects {want} "
                    f"with {self.record.skipped_batches} skipped batches; the rule must add "
                    "ckptkit.guard._rollback_record.skipped_batches(values) (spec/rollback.md R-R05)"
                )

    def _unstable(self, first: Executed, rerun: Executed, consecutive: int, fx: _Effects) -> None:
        rec = self.record
        bound_hit = consecutive >= self.bound
        fx.row(self._spike_row(first, "unstable", rerun))
        if fx.live:
            self.state.history.sync()
        # The bound lists the chain's rollbacks; the cap, every rollback of the run.
        chain = list(rec.rollbacks[len(rec.rollbacks) - (consecutive - 1) :]) if consecutive > 1 else []
        chain = chain if bound_hit else list(rec.rollbacks)
        lines = [_event_line(i + 1, e) for i, e in enumerate(chain)]
        lines.append(f"  {len(lines) + 1}. step {rerun.step}: {_describe(rerun.verdict)}; not rolled back")
        why = (
            f"{consecutive} consecutive spikes (rollback bound {self.bound})"
            if bound_hit
            else f"rollback cap {self.cap}: {rec.count} rollbacks already done in this run"
        )
        ckpts = self.state.checkpoints()  # a save still in flight is "the newest": named once it is on disk
        resume_from = ckpts[-1][1] if ckpts else None
        where = (
            f"the last good checkpoint is {resume_from} (the newest; intact: nothing was saved after it, "
            f"`ckptkit verify {self.state.run_dir}` checks it); resume from it once the cause is found, "
            "e.g. with a lower LR, gradient clipping or another seed"
            if resume_from
            else "no checkpoint was saved yet"
        )
        err = TrainingUnstable(f"training is unstable; investigate: {why}:\n" + "\n".join(lines) + f"\n{where}")
        v = rerun.verdict
        err.events = [
            *(dataclasses.asdict(e) for e in chain),
            {"step": rerun.step, "reason": v.reason, "grad_norm": v.grad_norm, "median": v.median, "ratio": v.ratio},
        ]
        err.checkpoint = resume_from  # type: ignore[attr-defined]
        raise err

    # ------------------------------------------------------------------ capture and restore

    def _capture(self, step: int, *, leave_out: frozenset[str] = frozenset()) -> Kept:
        return Kept(step, clone(self.state.checkpoint(step)), clone(self.state.sidecar_contents()), leave_out)

    def _kept(self, step: int) -> Kept:
        assert self.ring is not None
        kept = self.ring.get(step)
        if kept is None:  # the ring holds steps n-k..n by construction (and after a rebuild, R-R12)
            raise ReplayDivergence(
                f"rollback: no state kept for step {step} (ring holds {self.ring.steps()}); "
                "a resumed loop must call SpikeGuard.rebuild(start, step_fn) before its first step"
            )
        return kept

    def _restore(self, kept: Kept, *, keep_data: bool, full: bool = False) -> None:
        """Put the run back to a kept state and check it against the kept digests (R-R03).

        A re-run or rollback keeps what describes the whole run (the monitor's report,
        the record) and rewinds the monitor's detector; ``full`` (a ring rebuild)
        restores everything. ``keep_data`` leaves the data position where it is.
        """
        ck = clone(kept.ckpt)  # load_state_dict may keep references: the ring keeps its own
        skip = set() if full else set(self._keeps)
        if keep_data and self.data is not None:
            skip.add(f"data:{self.data}")
        self.state.restore(ck, sidecars=clone(kept.sidecars), skip=skip)
        if not full:
            self.monitor.rewind((ck.monitor or {})["monitors"][self._monitor_name])  # the detector only (R-M07)
        apart = set(self._leave_out) if not full else set()
        if keep_data and self.data is not None:
            apart.add(f"data.{self.data}")
        now = digests(self.state.checkpoint(kept.step), self.state.sidecar_contents(), leave_out=frozenset(apart))
        differ = sorted(
            n for n in kept.digests.keys() | now.keys() if n not in apart and kept.digests.get(n) != now.get(n)
        )
        if differ:
            raise ReplayDivergence(
                f"the state restored for step {kept.step} differs from the state kept at step {kept.step} in: "
                f"{', '.join(differ)}; a restore that misses run state cannot roll back exactly (a registration "
                "whose set() or load_state_dict() does not put everything back?)"
            )

    # ------------------------------------------------------------------ resume: rebuild the ring

    def rebuild(self, start: int, step_fn: StepFn) -> list[str]:
        """Rebuild the ring of a run resumed at ``start`` (mode on); returns notes (R-R12).

        The uninterrupted run's ring at ``start`` holds the states of steps
        ``start-K .. start``; they are re-derived by replaying ``step_fn`` from the
        newest checkpoint at or before ``start-K`` (or from the state at construction,
        then ``prepare``), with no rows, files or notes, and the replay must land on
        the resumed state exactly.

        Raises:
            ReplayDivergence: the replay does not reproduce the resumed state.
        """
        if not self.on or start == 0:
            return []
        here, timeline = self._capture(start), self.record.count
        # The replay redraws nothing the resumed run then trusts, and records nothing (R-R12).
        with global_rngs_kept(), self._run.replaying():
            frm, note = self._replay_from(max(start - self.k, 0))
            self._replay(frm, start, timeline, step_fn)
        now = self._capture(start)
        name = os.path.basename(self.state.checkpoint_path(start))
        differ = sorted(n for n in here.digests if here.digests[n] != now.digests.get(n))
        miss = self._ring_miss(here, now)
        if differ or miss is not None:
            at, tensors = miss if miss is not None else (start, _differing_leaves(here, now))
            history = self.state.history  # the divergence, where audit and replay read it (R-R12)
            history.append({"kind": "rebuild", "step": at, "from": frm, "to": start, "tensors": tensors})
            history.sync()
            first = ", ".join(sorted(tensors)[:5]) or "a sidecar"
            raise ReplayDivergence(
                f"rebuilding the rollback ring: replaying steps {frm}..{start} from {note} did not reproduce "
                f"the run's state after step {at} (resumed from {name}; differs in: {first}); this run is not "
                "deterministic here, so a rollback could not be exact; see ReplayDivergence's docstring for the "
                "usual causes"
            )
        msg = f"rollback ring rebuilt: replayed steps {frm}..{start} from {note}; it reproduced {name}"
        self.log(msg)
        return [msg]

    def _ring_miss(self, here: Kept, now: Kept) -> tuple[int, dict[str, dict[str, int | None]]] | None:
        """The first rebuilt ring state whose tensors differ from the run's recorded ``digests``
        row for that step (the state after it, :meth:`RunState.record`), as ``(steps done, {name:
        {recorded, rebuilt}})``; None when every recorded one matches (or none was recorded)."""
        if self.ring is None:
            return None
        recorded = {r["step"]: r["tensors"] for r in self.state.history.rows() if r["kind"] == "digests"}
        # The guard's own state (its monitor, its record) moves after the loop records a step: the
        # loop's state is what the recorded row and the ring state must agree on.
        own = tuple(
            f"monitor:{p}"
            for p in (f"monitors.{self._monitor_name}.", f"values.{VALUE_NAME}.", f"values.{INJECTION_VALUE}")
        )
        for step in self.ring.steps():
            kept = self.ring.get(step)
            if step not in recorded or kept is None:
                continue
            mine = checkpoint_digests(localized(kept.ckpt))
            both = (n for n in mine.keys() & recorded[step].keys() if not n.startswith(own))
            bad = sorted(n for n in both if mine[n] != recorded[step][n])
            if bad:
                return step, {n: {"recorded": recorded[step][n], "rebuilt": mine[n]} for n in bad}
        return None

    def _replay_from(self, need: int) -> tuple[int, str]:
        """Restore the replay base (the newest loadable checkpoint at or before ``need``, else
        the state at construction, then ``prepare``): ``(its step, what it is)``."""
        base, note = self._replay_base(need)
        if base is not None:
            self._restore(base, keep_data=False, full=True)
            return base.step, note
        assert self._genesis is not None
        self._restore(self._genesis, keep_data=False, full=True)
        if self._prepare is not None:
            self._prepare()
        return 0, note

    def _replay_base(self, need: int) -> tuple[Kept | None, str]:
        """The newest loadable checkpoint at or before ``need``; None means the construction state."""
        for step, path in reversed(self.state.checkpoints()):
            if step > need:
                continue
            try:
                ckpt, sidecars = self.state.load_checkpoint(step)
            except (FormatError, CheckpointNotFound, UnreadableFile):
                continue  # as resume does: a damaged or unreadable older checkpoint is passed over
            return Kept(step, ckpt, sidecars), os.path.basename(path)
        return None, "step 0 (the state the guard was built with)"

    def _replay(self, frm: int, to: int, timeline: int, step_fn: StepFn) -> None:
        """The guarded loop from ``frm`` until it stands at step ``to`` of timeline
        ``timeline`` (after that many rollbacks), silently. A replay that passes
        ``to + K + 1`` still short of the timeline has diverged (the rollback that made
        the timeline came from a spike at most K steps after its target); it stops
        there and the digest check names the difference."""
        step = frm
        while step < to or self.record.count < timeline:
            if self.record.count > timeline or step > to + self.k + 1:
                return
            outcome = self._step(step, step_fn, self._quiet)
            step = outcome.to if isinstance(outcome, RolledBack) else step + 1

    # ------------------------------------------------------------------ rows

    def _spike_row(self, first: Executed, action: str, rerun: Executed | None = None) -> dict[str, Any]:
        v = first.verdict
        row = {
            "kind": "spike",
            "step": first.step,
            "action": action,
            "mode": self.mode,
            "reason": v.reason,
            "grad_norm": json_float(v.grad_norm),
            "grad_norm_bits": f32_bits(v.grad_norm),
            "median": _num(v.median),
            "ratio": _num(v.ratio),
            "lr": first.lr,
        }
        if self.on:
            row["rerun"] = (
                None
                if rerun is None
                else {
                    "reason": rerun.verdict.reason,
                    "spike": rerun.verdict.is_spike,
                    "grad_norm": json_float(rerun.verdict.grad_norm),
                    "grad_norm_bits": f32_bits(rerun.verdict.grad_norm),
                }
            )
        return row

    def _rollback_row(self, event: RollbackEvent, rerun: Executed) -> dict[str, Any]:
        rec = self.record
        return {
            "kind": "rollback",
            "step": event.step,
            "to": event.to,
            "reason": event.reason,
            "grad_norm": json_float(event.grad_norm),
            "grad_norm_bits": f32_bits(rerun.verdict.grad_norm),
            "median": _num(event.median),
            "ratio": _num(event.ratio),
            "lr_before": event.lr_before,
            "lr_after": event.lr_after,
            "lr_scale": event.lr_scale,
            "skipped": event.skipped,
            "skipped_batches": rec.skipped_batches,
            "abandoned": {"from": event.to, "to": event.step},
            "consecutive": rec.consecutive,
            "count": rec.count,
            "rollbacks": [e.row() for e in rec.rollbacks],
        }


def _differing_leaves(a: Kept, b: Kept) -> dict[str, dict[str, int | None]]:
    """The tensors and values two kept states differ in, named as ``ckptkit diff --tensors``
    names them, with both digests (empty when only a sidecar differs)."""
    da, db = (checkpoint_digests(localized(k.ckpt)) for k in (a, b))
    return {
        n: {"recorded": da.get(n), "rebuilt": db.get(n)}
        for n in sorted(da.keys() | db.keys())
        if da.get(n) != db.get(n)
    }


def _num(x: float | None) -> float | str | None:
    return None if x is None else json_float(x)


def _describe(v: Verdict) -> str:
    median = "none" if v.median is None else f"{v.median:.4g}"
    ratio = "" if v.ratio is None else f", ratio {v.ratio:.3g}"
    return f"{v.reason}: grad norm {v.grad_norm:.4g}, median {median}{ratio}"


def _event_line(i: int, e: RollbackEvent) -> str:
    ratio = "-" if e.ratio is None else f"{e.ratio:.3g}"
    median = "-" if e.median is None else f"{e.median:.4g}"
    s = e.skipped
    skip = f"skipped data positions [{s['start']}, {s['end']}) ({s['batches']} batches)" if s else "no data skipped"
    return (
        f"  {i}. step {e.step}: {e.reason}: grad norm {e.grad_norm:.4g}, median {median}, ratio {ratio}; "
        f"rolled back to step {e.to}, lr {e.lr_before:.3g} -> {e.lr_after:.3g}, {skip}"
    )
