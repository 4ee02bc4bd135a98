"""Spike rollback in the reference trainer (spec/rollback.md R-R01..R-R12).

Most tests use the tiny config of ``test_trainer_resume`` with a detector that
judges from step 4 (window 8, min_history 4), K = 3, and ``--spike-at 9``: a
run of a dozen steps rolls back once. The acceptance scenarios of the PRD run
the reference model as shipped (300 steps, ``--spike-at 200``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY_FLAGS, Crash, assert_same_run, examples, history, run, same, tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.cli import main
from ckptkit.errors import (
    MalformedIndex,
    ReplayDivergence,
    StreamOffsetMismatch,
    TrainingUnstable,
    UnsupportedVersion,
)
from ckptkit.format._checkpoint import load, save
from ckptkit.format._sidecar import read_sidecar
from ckptkit.guard._rollback_record import RollbackRecord, skipped_batches
from ckptkit.run import RunState, checkpoint_name, list_checkpoints
from ckptkit.run._history import History, f64_bits, kept_rows, read_rows
from ckptkit.trainer import StepResult, TrainerConfig, train
from ckptkit.trainer._replay import replay

pytestmark = pytest.mark.slow

train_mod = importlib.import_module("ckptkit.trainer._loop")

BATCH = 4 * 16  # bytes a tiny step consumes
PRE = 1  # the warm-up probe batch


def rb(**changes: Any) -> TrainerConfig:
    """The tiny config, rollback on, K = 3, a detector that judges from step 4."""
    return tiny(
        **{
            "monitor.window": 8,
            "monitor.min_history": 4,
            "train.auto_rollback": "on",
            "train.rollback_k": 3,
            "train.ckpt_every": 3,
            **changes,
        }
    )


def kinds(rows: list[dict[str, Any]], *wanted: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["kind"] in wanted]


def story(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The rollback protocol's rows in order: (kind, step, action / to / rerun)."""
    out: list[tuple[Any, ...]] = []
    for r in kinds(rows, "step", "spike", "rollback"):
        if r["kind"] == "step":
            out.append(("step", r["step"], r["rerun"]))
        elif r["kind"] == "spike":
            out.append(("spike", r["step"], r["action"]))
        else:
            out.append(("rollback", r["step"], r["to"]))
    return out


def run_until_row(cfg: TrainerConfig, run_dir: Path, steps: int, nth: int, *, resume: bool) -> None:
    """Train, and die right after the ``nth`` step row (re-runs and re-executions count)."""
    seen = 0

    def on_step(_r: StepResult) -> None:
        nonlocal seen
        seen += 1
        if seen == nth:
            raise Crash(nth)

    with contextlib.suppress(Crash):
        train(cfg.replace(**{"train.steps": steps}), run_dir, resume=resume, log=None, on_step=on_step)


def sections(path: Path) -> dict[str, Any]:
    """The parts of a checkpoint a rollback restores exactly (model, optimizer, teacher, flags)."""
    ck = load(path)
    return {
        "model": ck.model,
        "optim": ck.optim,
        "teacher": ck.teacher,
        "flags": ck.flags,
        "detector": ck.monitor["monitors"]["spike"]["detector"],
    }


def committed(path: Path, within: float = 120.0) -> Path:
    """``path`` once the background save has renamed it into place.

    The trainer saves asynchronously, so two steps after a checkpoint step its file
    may still be in flight; a save commits by rename, so existence means complete.
    """
    deadline = time.monotonic() + within
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} was not committed within {within} s")
        time.sleep(0.01)
    return path


# ----------------------------------------------------------------------------- one rollback, read every way


@pytest.fixture(scope="module")
def rolled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``--spike-at 9``, K = 3, 14 steps; the old timeline's checkpoint 6 copied before it is replaced."""
    d = tmp_path_factory.mktemp("rolled")
    keep = tmp_path_factory.mktemp("old6")

    def on_step(r: StepResult) -> None:
        if r.step == 8 and not (keep / "old").exists():  # checkpoint 6 of the first timeline
            (keep / "old").mkdir()
            for name in ("step-00000006.ckpt", "step-00000006.ckpt.ngram"):
                shutil.copyfile(committed(d / name), keep / "old" / name)

    cfg = rb(**{"testing.spike_at": 9, "train.steps": 14})
    result = train(cfg, d, log=None, on_step=on_step)
    return {"dir": d, "old6": keep / "old", "result": result, "rows": history(d), "cfg": cfg}


def test_a_spike_is_rerun_then_rolled_back_k_steps(rolled: dict[str, Any]) -> None:
    s = story(rolled["rows"])
    i = s.index(("spike", 9, "rerun"))
    assert s[i - 1 : i + 5] == [
        ("step", 9, False),
        ("spike", 9, "rerun"),
        ("step", 9, True),
        ("spike", 9, "rollback"),
        ("rollback", 9, 6),
        ("step", 6, False),
    ]
    assert [x[1] for x in s[i + 4 :]] == list(range(6, 14))  # training goes on from step 6
    assert [r["step"] for r in kept_rows(rolled["rows"])] == list(range(14))
    (rb_row,) = kinds(rolled["rows"], "rollback")
    assert rb_row["rollbacks"] == [{"step": 9, "to": 6, "reason": "grad_norm", "lr_after": rb_row["lr_after"]}]
    assert rb_row["abandoned"] == {"from": 6, "to": 9} and rb_row["consecutive"] == 1 and rb_row["count"] == 1


def test_the_lr_drop_persists_after_the_schedule(rolled: dict[str, Any]) -> None:
    tc = rolled["cfg"].train
    (rb_row,) = kinds(rolled["rows"], "rollback")
    assert rb_row["lr_scale"] == 0.5 and rb_row["lr_after"] == train_mod.get_lr(6, tc) * 0.5
    assert rb_row["lr_before"] == train_mod.get_lr(6, tc)
    after = kinds(rolled["rows"], "step")[-8:]  # steps 6..13 of the second timeline
    assert [r["lr_bits"] for r in after] == [f64_bits(train_mod.get_lr(r["step"], tc) * 0.5) for r in after]
    assert rolled["result"].rollback["lr_scale"] == 0.5


def test_the_window_is_skipped_and_the_offset_rule_counts_it(rolled: dict[str, Any]) -> None:
    (rb_row,) = kinds(rolled["rows"], "rollback")
    # Steps 6..9 read [offset(6), offset(10)) in the abandoned timeline: 4 batches, never trained on again.
    assert rb_row["skipped"] == {"start": (6 + PRE) * BATCH, "end": (10 + PRE) * BATCH, "batches": 4}
    assert rb_row["skipped_batches"] == 4
    after = kinds(rolled["rows"], "step")[-8:]
    assert [r["offset"] for r in after] == [(s + 1 + PRE + 4) * BATCH for s in range(6, 14)]
    ck = load(rolled["dir"] / checkpoint_name(14))
    assert ck.monitor["data"]["train"] == (14 + PRE + 4) * BATCH
    assert skipped_batches(ck.monitor["values"]) == 4


def test_the_rolled_back_state_is_the_state_kept_at_n_minus_k(rolled: dict[str, Any]) -> None:
    """Checkpoint 6 saved at the rollback equals the first timeline's checkpoint 6 in
    model, optimizer (moments, step counters), teacher, n-gram table, flags and the
    monitor's detector; only the stream position and the rollback record differ."""
    new, old = rolled["dir"] / checkpoint_name(6), rolled["old6"] / checkpoint_name(6)
    a, b = sections(new), sections(old)
    assert all(same(a[k], b[k]) for k in a), [k for k in a if not same(a[k], b[k])]
    na, nb = read_sidecar(str(new) + ".ngram"), read_sidecar(str(old) + ".ngram")
    assert na.table_step == nb.table_step == 6 and torch.equal(na.tree["counts"], nb.tree["counts"])
    ma, mb = load(new).monitor, load(old).monitor
    assert mb["data"]["train"] == (6 + PRE) * BATCH and ma["data"]["train"] == (6 + PRE + 4) * BATCH
    assert mb["values"]["rollback"]["count"] == 0 and ma["values"]["rollback"]["count"] == 1
    # The report is never rewound: it keeps the spike and the refused updates.
    report = ma["monitors"]["spike"]["report"]
    assert [s["step"] for s in report["recent_spikes"]] == [9, 9] and report["refused"] == [9, 6, 7, 8, 9]


def test_only_checkpoints_of_the_new_timeline_remain(rolled: dict[str, Any]) -> None:
    steps = [s for s, _ in list_checkpoints(rolled["dir"])]
    assert steps == [3, 6, 9, 12, 14]
    counts = {s: load(p).monitor["values"]["rollback"]["count"] for s, p in list_checkpoints(rolled["dir"])}
    assert counts == {3: 0, 6: 1, 9: 1, 12: 1, 14: 1}  # 9 was rewritten by the second timeline


def test_inspect_shows_the_rollback_record(rolled: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    path = str(rolled["dir"] / checkpoint_name(14))
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "rollback: 1 rollback(s), lr scale 0.5, 4 skipped batch(es)" in out
    assert re.search(r"step 9 -> 6: grad_norm, grad norm [\d.]+, median [\d.]+, ratio [\d.]+; lr ", out)
    assert main(["inspect", path, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["rollback"]
    assert rec["count"] == 1 and rec["rollbacks"][0]["to"] == 6


# ----------------------------------------------------------------------------- modes warn and off, transient


def test_warn_logs_the_spike_keeps_the_update_and_off_only_counts_it(tmp_path: Path) -> None:
    runs = {}
    for mode in ("warn", "off"):
        cfg = rb(**{"train.auto_rollback": mode, "testing.spike_at": 9})
        runs[mode] = run(cfg, tmp_path / mode, 12)
        rows = history(tmp_path / mode)
        assert [r["step"] for r in kinds(rows, "step")] == list(range(12))  # every step once, none re-run
        assert not kinds(rows, "rollback")
        spike_rows = kinds(rows, "spike")
        assert [(r["step"], r["action"]) for r in spike_rows] == ([(9, "warn")] if mode == "warn" else [])
        assert kinds(rows, "step")[9]["spike"] and kinds(rows, "step")[9]["verdict"] == "grad_norm"
        ck = load(tmp_path / mode / checkpoint_name(12))
        assert "rollback" not in ck.monitor["values"]  # not run state outside mode on
    assert runs["warn"].report == runs["off"].report and runs["warn"].report["spikes"] == 1
    steps = [kinds(history(tmp_path / m), "step") for m in ("warn", "off")]
    assert [{k: v for k, v in r.items() if k not in ("time", "step_ms")} for r in steps[0]] == [
        {k: v for k, v in r.items() if k not in ("time", "step_ms")} for r in steps[1]
    ]


def test_a_transient_spike_is_rerun_kept_and_not_rolled_back(tmp_path: Path) -> None:
    cfg = rb(**{"testing.spike_at": 9, "testing.spike_transient": True})
    result = run(cfg, tmp_path / "t", 12)
    rows = history(tmp_path / "t")
    s = story(rows)
    i = s.index(("spike", 9, "rerun"))
    assert s[i : i + 3] == [("spike", 9, "rerun"), ("step", 9, True), ("spike", 9, "transient")]
    assert not kinds(rows, "rollback")
    assert result.rollback["transient"] == 1 and result.rollback["count"] == 0 and result.rollback["lr_scale"] == 1.0
    lineage = kept_rows(rows)
    assert [r["step"] for r in lineage] == list(range(12)) and lineage[9]["rerun"]
    # The re-run's result is used: the run is the run that never spiked, in every learned tensor.
    run(rb(), tmp_path / "clean", 12)
    a, b = sections(tmp_path / "t" / checkpoint_name(12)), sections(tmp_path / "clean" / checkpoint_name(12))
    assert all(same(a[k], b[k]) for k in ("model", "optim", "teacher", "flags"))


def test_rollback_skip_none_replays_the_window_with_the_lower_lr(tmp_path: Path) -> None:
    run(rb(**{"testing.spike_at": 9, "train.rollback_skip": "none"}), tmp_path, 12)
    rows = history(tmp_path)
    (rb_row,) = kinds(rows, "rollback")
    assert rb_row["skipped"] is None and rb_row["skipped_batches"] == 0
    steps = kinds(rows, "step")
    first = {r["step"]: r for r in steps[:10]}  # steps 0..9, then the re-run of 9, then 6..11 again
    again = steps[11:15]
    assert [r["step"] for r in again] == [6, 7, 8, 9]
    assert [r["offset"] for r in again] == [first[r["step"]]["offset"] for r in again]  # the same batches
    assert [r["lr"] for r in again] == [first[r["step"]]["lr"] * 0.5 for r in again]


# ----------------------------------------------------------------------------- the bound and the cap


def test_three_consecutive_spikes_stop_the_run_with_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    knobs = [
        *TINY_FLAGS,
        "--keep",
        "100",
        "--ckpt-every",
        "3",
        "--log-every",
        "1000",
        "--spike-window",
        "8",
        "--spike-min-history",
        "4",
        "--rollback-k",
        "3",
    ]
    code = main(
        [
            "train",
            "--run-dir",
            str(tmp_path),
            "--steps",
            "14",
            "--auto-rollback",
            "on",
            "--spike-at",
            "9",
            "--spike-repeat",
            "6",
            *knobs,
        ]
    )
    err = capsys.readouterr().err
    assert code == 3
    assert "training is unstable; investigate: 3 consecutive spikes (rollback bound 3)" in err
    assert re.search(
        r"1\. step 9: grad_norm: grad norm [\d.]+, median [\d.]+, ratio [\d.]+; rolled back to "
        r"step 6, lr [\d.e-]+ -> [\d.e-]+, skipped data positions \[448, 704\) \(4 batches\)",
        err,
    )
    assert "2. step 9:" in err and "3. step 9:" in err and "not rolled back" in err
    # Step 9 of the third timeline was never applied; checkpoint 9 (before it) is the newest.
    assert f"the last good checkpoint is {tmp_path / checkpoint_name(9)} (the newest; intact" in err
    rows = history(tmp_path)
    assert [(r["step"], r["action"]) for r in kinds(rows, "spike")] == [
        (9, "rerun"),
        (9, "rollback"),
        (9, "rerun"),
        (9, "rollback"),
        (9, "rerun"),
        (9, "unstable"),
    ]
    # The last good checkpoint is intact: it verifies, and it holds both rollbacks.
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 6, 9]
    assert main(["verify", str(tmp_path)]) == 0
    assert load(tmp_path / checkpoint_name(9)).monitor["values"]["rollback"]["count"] == 2


def test_the_rollback_cap_stops_a_run_that_keeps_rolling_back(tmp_path: Path) -> None:
    cfg = rb(**{"testing.spike_at": 9, "testing.spike_repeat": 4, "train.rollback_cap": 1, "train.rollback_bound": 5})
    with pytest.raises(TrainingUnstable, match=r"rollback cap 1: 1 rollbacks already done in this run") as e:
        run(cfg, tmp_path, 14)
    assert e.value.checkpoint == str(tmp_path / checkpoint_name(9))  # type: ignore[attr-defined]
    assert [ev["step"] for ev in e.value.events] == [9, 9]


# ----------------------------------------------------------------------------- resume: the same run, bit for bit


def test_a_resume_before_the_spike_rebuilds_the_ring_from_an_older_checkpoint(tmp_path: Path) -> None:
    cfg = rb(**{"testing.spike_at": 9, "train.ckpt_every": 2})
    run(cfg, tmp_path / "ref", 13)
    run(cfg, tmp_path / "cut", 8)  # state 8: the rollback to 6 needs states 5..8, in no checkpoint of this process
    result = run(cfg, tmp_path / "cut", 13, resume=True)
    assert any("rollback ring rebuilt: replayed steps 4..8 from step-00000004.ckpt" in n for n in result.resume_notes)
    assert_same_run(tmp_path / "ref", tmp_path / "cut", 13)


def test_a_resume_with_no_older_checkpoint_replays_from_step_0(tmp_path: Path) -> None:
    cfg = rb(**{"testing.spike_at": 9, "train.ckpt_every": 100})
    run(cfg, tmp_path / "ref", 12)
    run(cfg, tmp_path / "cut", 7)  # the only checkpoint is 7; the ring needs 4..7
    result = run(cfg, tmp_path / "cut", 12, resume=True)
    assert any("replayed steps 0..7 from step 0" in n for n in result.resume_notes)
    assert_same_run(tmp_path / "ref", tmp_path / "cut", 12)


def test_a_crash_right_after_the_rollback_resumes_the_new_timeline(tmp_path: Path) -> None:
    cfg = rb(**{"testing.spike_at": 9})
    run(cfg, tmp_path / "ref", 13)
    # Rows: steps 0..9, the re-run of 9, then step 6 of the new timeline: die there.
    run_until_row(cfg, tmp_path / "cut", 13, 12, resume=False)
    assert [s for s, _ in list_checkpoints(tmp_path / "cut")] == [3, 6]  # 9 is gone with its timeline
    assert load(tmp_path / "cut" / checkpoint_name(6)).monitor["values"]["rollback"]["count"] == 1
    run(cfg, tmp_path / "cut", 13, resume=True)
    assert_same_run(tmp_path / "ref", tmp_path / "cut", 13)


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    spike = draw(st.integers(4, 9))
    n = spike + draw(st.integers(1, 5))
    repeat = draw(st.sampled_from([1, 2, 4]))  # transient; rolled back once; twice (a chain of two)
    quant = draw(st.booleans())
    return {
        "n": n,
        "changes": {
            "testing.spike_at": spike,
            "testing.spike_repeat": repeat,
            "train.rollback_k": draw(st.integers(0, 4)),
            "train.rollback_skip": draw(st.sampled_from(["window", "none"])),
            "train.ckpt_every": draw(st.integers(1, 5)),
            "train.aux": draw(st.booleans()),
            "model.ngram": draw(st.booleans()),
            "train.seed": draw(st.integers(0, 2**32)),
            # The fp32 latch may trip in the window a rollback takes back (it is restored with the state).
            "model.quant": "int8" if quant else "none",
            "testing.trip_latch_at": draw(st.none() | st.integers(0, n - 1)) if quant else None,
        },
        # Each interruption: a clean stop at a step count, or a crash after the k-th step row
        # (re-runs and the new timeline's rows count, so crashes land before, at and after a rollback).
        "cuts": draw(st.lists(st.tuples(st.booleans(), st.integers(1, n + 6)), min_size=1, max_size=2)),
        "replay_from": draw(st.integers(0, n)),  # replay the reference from the checkpoint nearest this step
    }


@settings(max_examples=examples(0.12), suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_interrupted_and_resumed_equals_uninterrupted_across_rollbacks(
    tmp_path_factory: pytest.TempPathFactory, sc: dict[str, Any]
) -> None:
    cfg = rb(**sc["changes"])
    n = sc["n"]
    ref, cut = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("cut")
    run(cfg, ref, n)
    for crash, at in sc["cuts"]:
        saved = list_checkpoints(cut)
        if crash:
            run_until_row(cfg, cut, n, at, resume=bool(saved))
        elif at < n and (not saved or saved[-1][0] < at):  # a clean stop ahead of where the run is
            run(cfg, cut, at, resume=bool(saved))
    run(cfg, cut, n, resume=bool(list_checkpoints(cut)))
    assert_same_run(ref, cut, n)
    # ... and replaying the reference from one of its checkpoints reproduces it (R-P15 when a
    # re-run or rollback follows that checkpoint, the plain replay otherwise).
    kept = [s for s, _ in list_checkpoints(ref)]
    frm = max([s for s in kept if s <= sc["replay_from"]] or kept[:1])
    report = replay(ref, frm)
    assert report.ok, report.describe()


def test_resume_checks_the_offset_rule_with_the_stored_skipped_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a skip the offset is no longer a function of the step alone; the stored
    count makes the rule exact again. Ignoring it refuses the resume."""
    cfg = rb(**{"testing.spike_at": 9})
    run(cfg, tmp_path, 12)
    monkeypatch.setattr(train_mod, "skipped_batches", lambda values: 0)
    with pytest.raises(
        StreamOffsetMismatch, match=r"data position 'train' is 1088, but a run at step 12 must be at 832"
    ):
        run(cfg, tmp_path, 13, resume=True)


# ----------------------------------------------------------------------------- the checks that guard exactness


def test_a_restore_that_misses_run_state_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every restore from the ring is compared with the digests of the kept copy: a
    restore that forgets the n-gram table is caught, by name."""
    monkeypatch.setattr(train_mod.BigramTable, "load_sidecar", lambda self, *a, **kw: None)
    with pytest.raises(ReplayDivergence, match=r"state restored for step 9 differs .* in: sidecars\.ngram"):
        run(rb(**{"testing.spike_at": 9}), tmp_path, 12)


def test_the_abandoned_timeline_is_deleted_before_the_rollback_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, int]] = []

    class Recording(RunState):
        def discard_after(self, step: int) -> list[str]:
            calls.append(("discard_after", step))
            return super().discard_after(step)

        def save(self, step: int) -> str:
            calls.append(("save", step))
            return super().save(step)

    monkeypatch.setattr(train_mod, "RunState", Recording)
    run(rb(**{"testing.spike_at": 9}), tmp_path, 10)
    assert calls == [
        ("save", 3),
        ("save", 6),
        ("save", 9),
        ("discard_after", 6),
        ("save", 6),
        ("save", 9),
        ("save", 10),
    ]


def test_a_malformed_rollback_record_is_refused_whole() -> None:
    with pytest.raises(MalformedIndex, match=r"values\.rollback\.skipped_batches: must be int"):
        skipped_batches({"rollback": {**RollbackRecord().state(), "skipped_batches": "4"}})
    with pytest.raises(MalformedIndex, match=r"values\.rollback: unknown key\(s\) extra"):
        skipped_batches({"rollback": {**RollbackRecord().state(), "extra": 1}})
    assert skipped_batches({}) == 0
    with pytest.raises(
        UnsupportedVersion,
        match=r"values\.rollback\.version: rollback record version not supported "
        r"\(expected 2, got 1\)",
    ):
        skipped_batches({"rollback": {**RollbackRecord().state(), "version": 1}})


# ----------------------------------------------------------------------------- history, without training


def _rows(*spec: tuple[str, int]) -> list[dict[str, Any]]:
    out = []
    for kind, step in spec:
        row: dict[str, Any] = {"kind": kind, "step": step}
        if kind == "rollback":
            row["to"] = step - 2
        if kind == "spike":
            row["action"] = "rerun"
        out.append(row)
    return out


def test_history_resume_keeps_the_abandoned_timeline_and_drops_what_follows_the_checkpoint(tmp_path: Path) -> None:
    rows = _rows(
        ("start", 0),
        ("step", 0),
        ("step", 1),
        ("step", 2),
        ("step", 3),
        ("spike", 3),
        ("step", 3),
        ("rollback", 3),
        ("step", 1),
        ("step", 2),
        ("step", 3),
    )
    for timeline, step, keep in ((1, 2, 9), (0, 2, 3), (1, 1, 8)):
        (tmp_path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        h = History(tmp_path)
        h.resume_at(step, timeline)
        h.close()
        got, _ = read_rows(tmp_path / "history.jsonl")
        assert got == rows[:keep]


def test_kept_rows_is_the_lineage_of_the_final_state() -> None:
    rows = _rows(
        ("step", 0),
        ("step", 1),
        ("step", 2),
        ("step", 3),
        ("digests", 4),
        ("spike", 3),
        ("step", 3),
        ("spike", 3),
        ("rollback", 3),
        ("step", 1),
        ("step", 2),
        ("step", 3),
        ("step", 4),
    )
    rows[7]["action"] = "rollback"
    got = kept_rows(rows)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4] and got[1] is rows[9]
    rows[7]["action"] = "transient"  # the re-run of 3 was normal and kept; then a rollback to 1
    assert [r["step"] for r in kept_rows(rows[:8])] == [0, 1, 2, 3] and kept_rows(rows[:8])[3] is rows[6]


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("train.auto_rollback", "yes", "--auto-rollback must be one of off, warn, on (got 'yes')"),
        ("train.rollback_skip", "all", "--rollback-skip must be one of window, none (got 'all')"),
        ("train.rollback_k", -1, "--rollback-k must be >= 0 (got -1)"),
        ("train.lr_drop", 0.0, "--lr-drop must be finite, > 0.0 and <= 1.0 (got 0.0)"),
        ("train.lr_drop", 1.0000000000000002, "--lr-drop must be finite, > 0.0 and <= 1.0 (got 1.0000000000000002)"),
        ("train.rollback_bound", 0, "--rollback-bound must be >= 1 (got 0)"),
        ("train.rollback_cap", -1, "--rollback-cap must be >= 0 (got -1)"),
        ("testing.spike_at", -1, "--spike-at must be >= 0 (got -1)"),
        ("testing.spike_repeat", 0, "--spike-repeat must be >= 1 (got 0)"),
    ],
)
def test_rollback_config_errors_name_the_flag(key: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainerConfig().replace(**{key: value})


def test_rollback_on_refuses_a_retention_that_could_leave_no_checkpoint() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            "--auto-rollback on needs (--keep - 1) x --ckpt-every >= --rollback-k (got (1 - 1) x 50 < 10): a crash "
            "while a rollback is saved could leave no checkpoint to resume from; use --keep 2 or more"
        ),
    ):
        TrainerConfig().replace(**{"train.auto_rollback": "on", "train.keep": 1})
    with pytest.raises(ValueError, match=re.escape("(got (2 - 1) x 4 < 10)") + ".*use --keep 4 or more"):
        TrainerConfig().replace(**{"train.auto_rollback": "on", "train.keep": 2, "train.ckpt_every": 4})
    ok = TrainerConfig().replace(**{"train.auto_rollback": "on", "train.keep": 3, "train.ckpt_every": 5})
    assert (ok.train.keep - 1) * ok.train.ckpt_every == ok.train.rollback_k  # the boundary is accepted
    assert TrainerConfig().replace(**{"train.keep": 1}).train.keep == 1  # warn (the default) keeps nothing in memory


def test_rollback_config_boundaries_are_accepted() -> None:
    cfg = TrainerConfig().replace(
        **{
            "train.rollback_k": 0,
            "train.lr_drop": 1.0,
            "train.rollback_bound": 1,
            "train.rollback_cap": 0,
            "testing.spike_at": 0,
            "testing.spike_repeat": 1,
        }
    )
    assert cfg.train.lr_drop == 1.0 and cfg.train.auto_rollback.value == "warn"


# ----------------------------------------------------------------------------- the PRD's acceptance runs


def test_acceptance_spike_at_200_rolls_back_to_190_and_training_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ckptkit train --steps 300 --spike-at 200 --auto-rollback on`` on the reference model as shipped."""
    assert (
        main(
            [
                "train",
                "--run-dir",
                str(tmp_path),
                "--steps",
                "300",
                "--spike-at",
                "200",
                "--auto-rollback",
                "on",
                "--quiet",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 300 and out["rollback"]["count"] == 1 and out["rollback"]["lr_scale"] == 0.5
    rows = history(tmp_path)
    (rb_row,) = kinds(rows, "rollback")
    assert (rb_row["step"], rb_row["to"], rb_row["lr_scale"]) == (200, 190, 0.5)
    assert rb_row["skipped"]["batches"] == 11
    assert [(r["step"], r["action"]) for r in kinds(rows, "spike")] == [(200, "rerun"), (200, "rollback")]
    lineage = kept_rows(rows)
    assert [r["step"] for r in lineage] == list(range(300))
    tc = TrainerConfig().train
    assert all(r["lr"] == train_mod.get_lr(r["step"], tc) * 0.5 for r in lineage[190:])
    assert all(r["verdict"] == "ok" for r in lineage[190:])  # the rest of training proceeds normally
    assert lineage[-1]["loss"] < lineage[190]["loss"]
    assert main(["verify", str(tmp_path)]) == 0


def test_acceptance_without_auto_rollback_on_the_spike_is_logged_and_training_continues(tmp_path: Path) -> None:
    assert main(["train", "--run-dir", str(tmp_path), "--steps", "205", "--spike-at", "200", "--quiet"]) == 0
    rows = history(tmp_path)
    assert [(r["step"], r["action"]) for r in kinds(rows, "spike")] == [(200, "warn")]
    assert not kinds(rows, "rollback")
    assert [r["step"] for r in kinds(rows, "step")] == list(range(205))


# ----------------------------------------------------------------------------- replay through rollbacks (R-P15)


@pytest.fixture(scope="module")
def replayable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--spike-at 9``, K = 3, 14 steps: one re-run and one rollback to 6 in the recording."""
    d = tmp_path_factory.mktemp("replayable")
    train(rb(**{"testing.spike_at": 9, "train.steps": 14}), d, log=None)
    return d


def _files(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir())}


@pytest.mark.parametrize(
    ("argv", "ring"),
    [
        (["--from", "3"], "0..3 from step 0"),  # 3..9, the re-run of 9, then 6..13 of the new timeline
        (["--from", "6"], "3..6 from step-00000003.ckpt"),  # the rolled-back checkpoint 6: 6..13
        (["--from", "3", "--to", "9"], "0..3 from step 0"),  # before the spike, its rows superseded: 3..8
    ],
)
def test_replay_goes_through_the_recorded_rollback_bit_for_bit_and_leaves_the_run_alone(
    replayable: Path, capsys: pytest.CaptureFixture[str], argv: list[str], ring: str
) -> None:
    before = _files(replayable)
    assert main(["replay", str(replayable), *argv]) == 0
    out, err = capsys.readouterr()
    assert f"rollback ring rebuilt: replayed steps {ring}" in err  # from RUN's checkpoint at or before start - K
    assert (
        "note: the recording re-ran or rolled back at step(s) 9 (--auto-rollback on): the replay's guarded loop "
        "went through them, every history row compared in order (R-P15)"
    ) in out
    start, end = int(argv[1]), int(argv[3]) if len(argv) > 2 else 14
    assert f"IDENTICAL: steps {start}..{end - 1}, every history fingerprint" in out
    assert _files(replayable) == before


def test_replay_through_a_rollback_names_the_perturbed_step_and_parameter(
    replayable: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(replayable), "--from", "3", "--perturb-at", "7", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    d = report["divergence"]
    assert any("(R-P15)" in n for n in report["notes"]) and (d["kind"], d["step"]) == ("step", 7)
    assert [f["field"] for f in d["fields"]] == ["params_digest"]
    assert [t["name"] for t in d["tensors"]] == ["model:model.wte"]  # --perturb-at's default: the first parameter


def test_replay_of_a_run_that_stopped_unstable_stops_the_same_way(tmp_path: Path) -> None:
    cfg = rb(**{"testing.spike_at": 9, "testing.spike_repeat": 6})
    with pytest.raises(TrainingUnstable):
        run(cfg, tmp_path, 14)
    report = replay(tmp_path, 3)
    assert report.ok and report.steps == 10, report.describe()
    assert any("(R-P15)" in n for n in report.notes)
    assert any(
        n.startswith("the replay stopped: ") and "training is unstable; investigate: 3 consecutive spikes" in n
        for n in report.notes
    ), report.notes


def test_a_checkpoint_after_the_rollback_altered_and_resealed_is_named(replayable: Path, tmp_path: Path) -> None:
    shutil.copytree(replayable, tmp_path / "altered")
    path = tmp_path / "altered" / checkpoint_name(12)
    ckpt = load(path)
    ckpt.model["model"]["ln_f.weight"].view(-1)[0] += 1.0  # a valid file, with other contents
    save(path, ckpt)
    report = replay(tmp_path / "altered", 3)
    d = report.divergence
    assert d is not None and (d.kind, d.step, d.file) == ("checkpoint", 12, str(path))
    assert [t.name for t in d.tensors] == ["model:model.ln_f.weight"]
    text = report.describe()
    assert f"DIFFERS at step 12: {path} differs between the recording and the replay (every recorded row" in text
    assert "altered after the fact" in text
