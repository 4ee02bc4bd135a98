"""ckptkit.SpikeGuard on a plain PyTorch loop (spec/rollback.md, the library contract).

The loop: a linear model, AdamW, a ``LambdaLR`` schedule, a data position that is
the index of the next example, a detector that judges from step 4 (window 8,
min_history 4), K = 3. ``GradSpike`` (the testing aid) multiplies the gradient
of one step by 10.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.format._tree import tensors
from ckptkit.guard._rollback_record import skipped_batches
from ckptkit.run._history import kept_rows, read_rows
from ckptkit.testing import GradSpike


@dataclasses.dataclass
class Cfg:
    seed: int = 0
    steps: int = 20  # exempt from drift: extending a run is a resume


def _lr(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


_OPEN: list[ckptkit.RunState] = []


@pytest.fixture(autouse=True)
def _close_histories() -> Any:
    yield
    while _OPEN:
        _OPEN.pop().close()


class Toy:
    """A plain loop with the guard: what an outside user writes."""

    def __init__(
        self,
        run_dir: Path,
        mode: str = "on",
        *,
        spike_at: int | None = None,
        repeat: int = 2,
        k: int = 3,
        register_data: bool = True,
        **guard_kw: Any,
    ) -> None:
        g = ckptkit.torch_generator(0, 0, stream=1)
        self.net = torch.nn.Linear(4, 1)
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=0.05)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _lr)
        self.pos = 0
        self.state = ckptkit.RunState(run_dir, config=Cfg(), keep=100)
        self.state.add_model("net", self.net)
        self.state.add_optimizer("adamw", self.opt)
        self.state.add_scheduler("lr", self.sched)
        if register_data:
            self.state.add_data_position(
                "train",
                get=lambda: self.pos,
                set=self._seek,
                expected=lambda step, values: step + skipped_batches(values),
            )
        inject = None if spike_at is None else GradSpike([self.net], at=spike_at, repeat=repeat)
        monitor = ckptkit.guard.SpikeMonitor(ckptkit.SpikeConfig(window=8, min_history=4))
        knobs = {n: guard_kw.pop(n) for n in ("lr_drop", "skip_data", "data", "bound", "cap") if n in guard_kw}
        config = ckptkit.RollbackConfig(mode=mode, k=k, **knobs)
        self.guard = ckptkit.SpikeGuard(self.state, config, monitor=monitor, inject=inject, **guard_kw)
        _OPEN.append(self.state)
        self.lrs: list[tuple[int, float]] = []

    def _seek(self, pos: int) -> None:
        self.pos = pos

    def start(self) -> int:
        return self.state.start()

    def resume(self) -> int:
        return self.state.resume().step

    def step(self, step: int) -> float:
        g = ckptkit.torch_generator(0, self.pos, stream=2)  # example i is a function of (seed, i)
        x = torch.randn(8, 4, generator=g)
        y = x.sum(dim=1, keepdim=True)
        self.pos += 1
        self.lrs.append((step, self.opt.param_groups[0]["lr"]))
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.opt.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.net.parameters(), float("inf"))
        self.opt.step()
        self.sched.step()
        return gn.item()


def rows(run_dir: Path, *kinds: str) -> list[dict[str, Any]]:
    got, _ = read_rows(run_dir / "history.jsonl")
    return [r for r in got if r["kind"] in kinds]


def test_a_confirmed_spike_rolls_back_k_steps_drops_the_lr_and_skips_the_data(tmp_path: Path) -> None:
    toy = Toy(tmp_path, spike_at=9)
    toy.guard.run(toy.step, toy.start(), 14, save_every=2)
    (rb,) = rows(tmp_path, "rollback")
    assert (rb["step"], rb["to"], rb["lr_scale"], rb["count"]) == (9, 6, 0.5, 1)
    assert rb["rollbacks"] == [{"step": 9, "to": 6, "reason": "grad_norm", "lr_after": rb["lr_after"]}]
    assert [(r["step"], r["action"]) for r in rows(tmp_path, "spike")] == [(9, "rerun"), (9, "rollback")]
    # The LR drop works through the registered LambdaLR: every later step runs at half the schedule.
    after = [(s, lr) for s, lr in toy.lrs[11:]]  # 0..9, the re-run of 9, then 6..13
    assert [s for s, _ in after] == list(range(6, 14))
    assert all(lr == pytest.approx(0.05 * _lr(s) * 0.5, rel=1e-12) for s, lr in after)
    assert rb["lr_before"] == pytest.approx(0.05 * _lr(6)) and rb["lr_after"] == pytest.approx(0.05 * _lr(6) * 0.5)
    # The data of steps 6..9 is skipped through the registered data position.
    assert rb["skipped"] == {"start": 6, "end": 10, "batches": 4}
    ck = ckptkit.load(tmp_path / "step-00000014.ckpt")
    assert ck.monitor["data"]["train"] == 14 + 4 and skipped_batches(ck.monitor["values"]) == 4
    # Checkpoints of the abandoned timeline are gone; the record is in every later one.
    assert [s for s, _ in toy.state.checkpoints()] == [2, 4, 6, 8, 10, 12, 14]
    assert toy.guard.record.count == 1 and toy.guard.lr_scale == 0.5


def test_step_returns_a_typed_outcome(tmp_path: Path) -> None:
    toy = Toy(tmp_path, spike_at=9)
    toy.start()
    outcomes = [toy.guard.step(s, toy.step) for s in range(10)]
    assert all(isinstance(o, ckptkit.guard.Continue) for o in outcomes[:9])
    back = outcomes[9]
    assert isinstance(back, ckptkit.guard.RolledBack) and back.to == 6 and back.event.step == 9
    with pytest.raises(dataclasses.FrozenInstanceError):
        toy.guard.record.count = 5  # type: ignore[misc]
    first = outcomes[0]
    assert isinstance(first, ckptkit.guard.Continue)
    assert isinstance(first.result, float) and first.executed.verdict.reason == "warming_up"


def test_a_transient_spike_keeps_the_rerun_and_does_not_roll_back(tmp_path: Path) -> None:
    toy = Toy(tmp_path, spike_at=9, repeat=1)
    toy.start()
    outcomes = [toy.guard.step(s, toy.step) for s in range(12)]
    assert all(isinstance(o, ckptkit.guard.Continue) for o in outcomes)
    ninth = outcomes[9]
    assert isinstance(ninth, ckptkit.guard.Continue)
    assert ninth.executed.rerun and toy.guard.record.transient == 1 and toy.guard.record.count == 0
    assert [(r["step"], r["action"]) for r in rows(tmp_path, "spike")] == [(9, "rerun"), (9, "transient")]
    clean = Toy(tmp_path / "clean")
    clean.guard.run(clean.step, clean.start(), 12)
    assert all(
        torch.equal(a, b) for a, b in zip(toy.net.state_dict().values(), clean.net.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("mode", ["warn", "off"])
def test_warn_logs_the_spike_and_off_only_counts_it(tmp_path: Path, mode: str) -> None:
    toy = Toy(tmp_path, mode, spike_at=9)
    toy.guard.run(toy.step, toy.start(), 12)
    assert [(r["step"], r["action"]) for r in rows(tmp_path, "spike")] == ([(9, "warn")] if mode == "warn" else [])
    assert not rows(tmp_path, "rollback") and toy.guard.monitor.report()["spikes"] == 1
    assert [s for s, _ in toy.lrs] == list(range(12))


def test_three_consecutive_spikes_stop_the_run(tmp_path: Path) -> None:
    toy = Toy(tmp_path, spike_at=9, repeat=6)
    with pytest.raises(
        ckptkit.TrainingUnstable,
        match=re.escape("training is unstable; investigate: 3 consecutive spikes (rollback bound 3):"),
    ) as e:
        toy.guard.run(toy.step, toy.start(), 14, save_every=3)
    assert "the last good checkpoint is" in str(e.value) and [ev["step"] for ev in e.value.events] == [9, 9, 9]
    assert [(r["step"], r["action"]) for r in rows(tmp_path, "spike")][-1] == (9, "unstable")


def test_a_resume_after_a_rollback_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    ref = Toy(tmp_path / "ref", spike_at=9)
    ref.guard.run(ref.step, ref.start(), 16, save_every=2)
    first = Toy(tmp_path / "cut", spike_at=9)
    first.guard.run(first.step, first.start(), 12, save_every=2)  # after the rollback
    again = Toy(tmp_path / "cut", spike_at=9)  # a new process: nothing in memory survives
    again.guard.run(again.step, again.resume(), 16, save_every=2)
    name = "step-00000016.ckpt"
    assert (tmp_path / "ref" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes()
    assert list(rows(tmp_path / "ref", "step", "spike", "rollback")) == list(
        rows(tmp_path / "cut", "step", "spike", "rollback")
    )


def test_a_resume_before_the_spike_rebuilds_the_ring_and_rolls_back_the_same(tmp_path: Path) -> None:
    ref = Toy(tmp_path / "ref", spike_at=9)
    ref.guard.run(ref.step, ref.start(), 14, save_every=2)
    first = Toy(tmp_path / "cut", spike_at=9)
    first.guard.run(first.step, first.start(), 8, save_every=2)
    again = Toy(tmp_path / "cut", spike_at=9)
    start = again.resume()
    assert again.guard.rebuild(start, again.step) == [
        "rollback ring rebuilt: replayed steps 4..8 from step-00000004.ckpt; it reproduced step-00000008.ckpt"
    ]
    again.guard.run(again.step, start, 14, save_every=2)
    name = "step-00000014.ckpt"
    assert (tmp_path / "ref" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes()


def test_a_nondeterministic_step_is_refused_when_the_ring_is_rebuilt(tmp_path: Path) -> None:
    first = Toy(tmp_path)
    first.guard.run(first.step, first.start(), 6, save_every=3)
    again = Toy(tmp_path)
    start = again.resume()

    def noisy(step: int) -> float:
        gn = again.step(step)
        with torch.no_grad():
            again.net.weight.add_(torch.rand(again.net.weight.shape) * 1e-3)  # the global RNG: not (seed, step)
        return gn

    with pytest.raises(
        ckptkit.ReplayDivergence,
        match=r"replaying steps 3\.\.6 from step-00000003\.ckpt did not reproduce the run's state after step 6 "
        r"\(resumed from step-00000006\.ckpt; differs in: model:net\.",
    ):
        again.guard.rebuild(start, noisy)


def test_the_ring_never_shares_memory_with_the_run(tmp_path: Path) -> None:
    toy = Toy(tmp_path, spike_at=9)
    toy.start()
    for s in range(10):
        toy.guard.step(s, toy.step)
        live = {t.untyped_storage().data_ptr() for t in tensors(toy.state.checkpoint(s).model)}
        ring = toy.guard.ring
        assert ring is not None
        for kept in ring.steps():
            entry = ring.get(kept)
            assert entry is not None
            ck = entry.ckpt
            assert not live & {t.untyped_storage().data_ptr() for t in tensors((ck.model, ck.optim))}


def test_kept_rows_are_one_lineage(tmp_path: Path) -> None:
    toy = Toy(tmp_path, spike_at=9)
    toy.guard.run(toy.step, toy.start(), 14)
    got, _ = read_rows(tmp_path / "history.jsonl")
    assert [r["step"] for r in kept_rows(got)] == []  # the toy writes no step rows of its own
    assert kept_rows(
        [
            {"kind": "step", "step": 0},
            {"kind": "step", "step": 1},
            {"kind": "spike", "step": 1, "action": "rerun"},
            {"kind": "step", "step": 1},
        ]
    ) == [{"kind": "step", "step": 0}, {"kind": "step", "step": 1}]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (None, "step 0: step_fn must return the step's grad norm as a number (got NoneType for the grad norm)"),
        (
            torch.ones(3),
            "step 0: step_fn must return the step's grad norm as a scalar (got a grad norm tensor of shape [3])",
        ),
        ("1.0", "step 0: step_fn must return the step's grad norm as a number (got str for the grad norm)"),
    ],
)
def test_a_step_fn_that_returns_no_scalar_grad_norm_is_refused(tmp_path: Path, returned: Any, message: str) -> None:
    toy = Toy(tmp_path)
    toy.start()
    with pytest.raises(TypeError, match=re.escape(message)):
        toy.guard.step(0, lambda _s: returned)


def test_a_negative_grad_norm_is_refused_and_a_non_finite_one_is_a_spike(tmp_path: Path) -> None:
    toy = Toy(tmp_path, "warn")
    toy.start()
    with pytest.raises(ValueError, match=re.escape("step 0: step_fn returned a negative grad norm (-1.0)")):
        toy.guard.step(0, lambda _s: -1.0)
    out = toy.guard.step(1, lambda _s: float("nan"))
    assert isinstance(out, ckptkit.guard.Continue) and out.executed.verdict.reason == "non_finite_grad_norm"
    assert [r["reason"] for r in rows(tmp_path, "spike")] == ["non_finite_grad_norm"]


def test_mode_on_without_a_data_position_says_so_at_construction(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            "SpikeGuard(mode='on') skips the spike's data through a registered data position, and this RunState "
            "registers none: register it with state.add_data_position(...), or pass RollbackConfig(skip_data=False)"
        ),
    ):
        Toy(tmp_path, register_data=False)
    toy = Toy(tmp_path / "replays", register_data=False, skip_data=False, spike_at=9)
    toy.guard.run(toy.step, toy.start(), 12)
    (rb,) = rows(tmp_path / "replays", "rollback")
    assert rb["skipped"] is None and rb["skipped_batches"] == 0


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"mode": "yes"}, "mode must be one of off, warn, on (got 'yes')"),
        ({"k": -1}, "k must be an int >= 0 (got -1)"),
        ({"bound": 0}, "bound must be an int >= 1 (got 0)"),
        ({"lr_drop": 0.0}, "lr_drop must be a float, finite, > 0 and <= 1 (got 0.0)"),
    ],
)
def test_bad_knobs_are_named(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ckptkit.RollbackConfig(**kw)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"mode": "yes"}, "mode must be one of off, warn, on (got 'yes')"),
        ({"k": -1}, "k must be an int >= 0 (got -1)"),
        ({"k": True}, "k must be an int >= 0 (got True)"),
        ({"bound": 0}, "bound must be an int >= 1 (got 0)"),
        ({"cap": -1}, "cap must be an int >= 0 (got -1)"),
        ({"lr_drop": 1.5}, "lr_drop must be a float, finite, > 0 and <= 1 (got 1.5)"),
        ({"lr_drop": float("nan")}, "lr_drop must be a float, finite, > 0 and <= 1 (got nan)"),
    ],
)
def test_a_rollback_config_refuses_a_bad_knob_when_it_is_made(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ckptkit.RollbackConfig(**kw)


def test_a_rollback_config_is_frozen_and_takes_a_mode_enum() -> None:
    import enum

    class Mode(str, enum.Enum):  # a config's enum, as the trainer's is
        ON = "on"

    cfg = ckptkit.RollbackConfig(mode=Mode.ON, k=0, bound=1, cap=0, lr_drop=1.0)  # each boundary, accepted
    assert cfg.mode == "on" and cfg.on
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.k = 3  # type: ignore[misc]


def test_a_guard_takes_its_knobs_in_one_rollback_config(tmp_path: Path) -> None:
    state = ckptkit.RunState(tmp_path, config=Cfg())
    with pytest.raises(TypeError, match=re.escape("SpikeGuard: config must be a ckptkit.RollbackConfig (got str)")):
        ckptkit.SpikeGuard(state, "on")  # type: ignore[arg-type]
    guard = ckptkit.SpikeGuard(state, ckptkit.RollbackConfig())
    assert guard.config == ckptkit.RollbackConfig() and guard.mode == "warn"


def _noisy(toy: Toy) -> Any:
    """The toy's step plus a draw from the global generator (not a function of (seed, step))."""

    def step(step: int) -> float:
        gn = toy.step(step)
        with torch.no_grad():
            toy.net.weight.add_(torch.rand(toy.net.weight.shape) * 1e-3)
        return gn

    return step


def _process(run_dir: Path, mode: str, steps: tuple[int, int] | None) -> Toy:
    """A fresh "process": the global generator seeded as a new process seeds it, then a start
    (``steps``: train ``start..stop``) or a resume to step 12."""
    torch.manual_seed(1234)
    toy = Toy(run_dir, mode, k=3)
    if steps is not None:
        toy.guard.run(_noisy(toy), toy.start(), steps[1], save_every=6)
    else:
        toy.guard.run(_noisy(toy), toy.resume(), 12, save_every=6)
    return toy


def test_rebuilding_the_ring_never_hides_a_step_that_draws_from_the_global_generator(tmp_path: Path) -> None:
    """R-R12: the replay that rebuilds the ring (here from step 0: no checkpoint at or before
    6 - K) redraws the global generator as the first process did; the resumed run must not
    go on from those redrawn states, or a nondeterministic step would pass an audit as the
    same run. Guarded or not, a resumed run draws what a fresh process draws."""
    ref = _process(tmp_path / "ref", "on", (0, 12))
    runs = {}
    for mode in ("on", "off"):
        _process(tmp_path / mode, mode, (0, 6))
        runs[mode] = _process(tmp_path / mode, mode, None)
    assert torch.equal(runs["on"].net.weight, runs["off"].net.weight)  # the guard added no draws of its own
    assert not torch.equal(runs["on"].net.weight, ref.net.weight)  # the divergence shows, as without a guard
    assert runs["on"].guard.ring is not None and runs["on"].guard.ring.steps()  # the ring was rebuilt


def test_a_ring_rebuild_that_diverges_names_the_first_tensors(tmp_path: Path) -> None:
    """From a checkpoint base, the global draw makes the replay miss the resumed state: the
    refusal names the tensors, as ``ckptkit diff --tensors`` does, not only the section."""
    first = Toy(tmp_path, k=3)
    first.guard.run(_noisy(first), first.start(), 12, save_every=3)
    again = Toy(tmp_path, k=3)
    start = again.resume()
    with pytest.raises(ckptkit.ReplayDivergence) as e:
        again.guard.rebuild(start, _noisy(again))
    said = str(e.value)
    assert "did not reproduce the run's state after step 12 (resumed from step-00000012.ckpt; differs in: " in said
    assert re.search(r"differs in: model:net\.(bias|weight)[^;]*\); this run is not deterministic", said), said
    rows = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    row = next(r for r in reversed(rows) if r["kind"] == "rebuild")  # where audit and replay read it
    assert (row["kind"], row["step"], row["from"], row["to"]) == ("rebuild", 12, 9, 12)
    assert "model:net.weight" in row["tensors"] and set(row["tensors"]["model:net.weight"]) == {"recorded", "rebuilt"}


class Recorded(Toy):
    """The toy with ``state.record`` after every step: the composition docs/adopting.md shows."""

    def record_step(self, step: int) -> float:
        gn = self.step(step)
        self.state.record(step, grad_norm=gn, lr=self.opt.param_groups[0]["lr"])
        return gn


def test_guard_rows_and_record_rows_share_one_history_and_none_is_lost(tmp_path: Path) -> None:
    """R-R10: the guard's spike and rollback rows and ``record``'s step and digests rows go
    through one history object, in order, whoever writes first; a resume drops only what
    the interrupted run wrote after its checkpoint. ``ckptkit verify RUN`` is clean."""
    from ckptkit.cli import main

    def loop(run_dir: Path, stop: int, *, resume: bool) -> Recorded:
        toy = Recorded(run_dir, "on", spike_at=9)
        start = toy.resume() if resume else toy.start()
        toy.guard.run(toy.record_step, start, stop, save_every=2)
        toy.state.close()
        return toy

    loop(tmp_path / "ref", 14, resume=False)
    loop(tmp_path / "cut", 8, resume=False)
    loop(tmp_path / "cut", 14, resume=True)
    for run in ("ref", "cut"):
        got, torn = read_rows(tmp_path / run / "history.jsonl")
        assert not torn
        kinds = [(r["kind"], r["step"]) for r in got if r["kind"] != "resume"]
        assert ("rollback", 9) in kinds and ("spike", 9) in kinds
        steps = [s for k, s in kinds if k == "step"]
        assert steps == [*range(10), 9, *range(6, 14)], steps  # 0..9, the re-run of 9, then 6..13 after the rollback
        assert main(["verify", str(tmp_path / run)]) == 0
    ref, cut = (read_rows(tmp_path / run / "history.jsonl")[0] for run in ("ref", "cut"))
    assert ref == [r for r in cut if r["kind"] != "resume_check"]  # the resume's verdict is its only row more
    assert [r["reason"] for r in cut if r["kind"] == "resume_check"] == ["no rows after the checkpoint"]


@pytest.mark.parametrize("repeat", [1, 2], ids=["transient", "rollback"])
def test_a_rerun_recorded_from_on_step_is_marked_and_the_run_verifies(tmp_path: Path, repeat: int) -> None:
    """A loop that records in ``on_step`` (after ``step_fn`` returned) records the guard's re-run
    of a spiking step ``"rerun": true`` as one recording in ``step_fn`` does (the state marks it,
    whoever calls ``record``): ``ckptkit verify RUN`` is clean (it said "step row 9 out of order")."""
    from ckptkit.cli import main

    states: list[ckptkit.RunState] = []

    def record(e: ckptkit.guard.Executed) -> None:  # after step_fn returned: outside it
        states[0].record(e.step, grad_norm=e.result)

    toy = Toy(tmp_path, "on", spike_at=9, repeat=repeat, on_step=record)
    states.append(toy.state)
    toy.guard.run(toy.step, toy.start(), 14, save_every=2)
    toy.state.close()
    steps = [r for r in rows(tmp_path, "step") if r["step"] == 9]
    assert [r.get("rerun", False) for r in steps] == ([False, True] if repeat == 1 else [False, True, False])
    assert main(["verify", str(tmp_path)]) == 0
