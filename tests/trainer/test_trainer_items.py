"""One regression test per item of the ADR-0021 inventory, for the reference trainer.

Each test first shows the fix working (interrupted + resumed == uninterrupted,
or the refusal that protects it), then removes the fix *in the test* -- a
RunState subclass that drops a registration, or a monkeypatched function that
brings the old bug back -- and shows the same check failing. The docstring
says which line of ``ckptkit/trainer/_loop.py`` the removal stands for.
"""

from __future__ import annotations

import importlib
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import artifacts, assert_same_run, history, run, tiny

from ckptkit.errors import ConfigDrift, SidecarMismatch, StreamOffsetMismatch
from ckptkit.format import _snapshot as snapshot
from ckptkit.format._checkpoint import load
from ckptkit.format._sidecar import read_sidecar
from ckptkit.run import RunState, checkpoint_name
from ckptkit.run import _drift as drift
from ckptkit.run import _field_coverage as field_coverage
from ckptkit.trainer import TrainerConfig
from ckptkit.trainer._config import knobs

pytestmark = pytest.mark.slow

train_mod = importlib.import_module("ckptkit.trainer._loop")


def resumed_matches(tmp: Path, cfg: TrainerConfig, *, stop: int, n: int, name: str = "") -> bool:
    """Train ``n`` steps straight, and ``stop`` then resume to ``n``; True iff the two agree."""
    ref, cut = tmp / f"ref{name}", tmp / f"cut{name}"
    run(cfg, ref, n)
    run(cfg, cut, stop)
    run(cfg, cut, n, resume=True)
    try:
        assert_same_run(ref, cut, n)
    except AssertionError:
        return False
    return True


def runstate_without(method: str) -> type[RunState]:
    """A RunState whose ``method`` registers nothing: the fix that used it, removed."""
    return type(f"RunStateWithout_{method}", (RunState,), {method: lambda self, *a, **kw: None})


# ----------------------------------------------------------------------------- item 1: the EMA teacher


class _Recording(RunState):
    """Remembers the student and the teacher it is given."""

    last: _Recording | None = None

    def add_model(self, name: str, module: Any) -> None:
        self.student = module
        _Recording.last = self
        super().add_model(name, module)

    def add_teacher(self, module: Any) -> None:
        self.teacher = module
        super().add_teacher(module)


class _TeacherRebuiltOnResume(_Recording):
    """The old bug: the teacher is a fresh copy of the student after every resume."""

    def resume(self, **kw: Any) -> Any:
        info = super().resume(**kw)
        self.teacher.load_state_dict(self.student.state_dict())
        return info


def test_item1_teacher_is_restored_as_the_run_left_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The teacher is in the container and restored frozen, never rebuilt from the student.

    Removing ``rs.add_teacher(run.teacher)`` makes the resume refuse (the
    checkpoint carries a teacher nobody registered); rebuilding it from the
    student after resume (the original bug, simulated below) changes the JEPA
    target from the first resumed step and the runs part.
    """
    cfg = tiny(**{"train.ckpt_every": 2, "train.ema_decay": 0.5})
    monkeypatch.setattr(train_mod, "RunState", _Recording)
    assert resumed_matches(tmp_path, cfg, stop=4, n=6)
    rec = _Recording.last
    assert rec is not None
    assert not any(p.requires_grad for p in rec.teacher.parameters())
    assert any(not torch.equal(t, s) for t, s in zip(rec.teacher.parameters(), rec.student.parameters(), strict=True))
    assert load(tmp_path / "cut" / checkpoint_name(6)).teacher is not None

    monkeypatch.setattr(train_mod, "RunState", _TeacherRebuiltOnResume)
    assert not resumed_matches(tmp_path, cfg, stop=4, n=6, name="-bug")


def test_item1_no_teacher_section_without_aux(tmp_path: Path) -> None:
    run(tiny(**{"train.aux": False}), tmp_path, 2)
    assert load(tmp_path / checkpoint_name(2)).teacher is None


# ----------------------------------------------------------------------------- item 2 (+ compute settings)


def test_item2_fp32_latch_is_persisted_in_flags_bit0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-way fp32 fallback survives a resume: container flags bit 0.

    Removing ``rs.add_flag("fp32_fallback", ...)`` makes the resumed run train
    int8 factors again after the latch tripped, and the runs part.
    """
    cfg = tiny(**{"model.quant": "int8", "testing.trip_latch_at": 1, "train.ckpt_every": 3})
    assert resumed_matches(tmp_path, cfg, stop=3, n=6)
    assert load(tmp_path / "cut" / checkpoint_name(3)).fp32_fallback
    rows = [r for r in history(tmp_path / "cut") if r["kind"] == "step"]
    assert [r["compute"] for r in rows] == ["int8"] + ["fp32"] * 5
    assert rows[1]["latch"].startswith("--trip-latch-at 1")

    monkeypatch.setattr(train_mod, "RunState", runstate_without("add_flag"))
    assert not resumed_matches(tmp_path, cfg, stop=3, n=6, name="-bug")


def test_item2_compute_settings_are_reapplied_after_restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed --quant run trains the forward its log names (after_restore).

    The latch comes back through ``add_flag``, but ``load_state_dict`` does not
    touch the factor layers' compute format: without
    ``rs.after_restore(run.apply_compute_settings)`` the resumed run logs
    ``fp32`` while training int8 -- "a second experiment wearing the first one's
    name" -- and the runs part.
    """
    cfg = tiny(**{"model.quant": "int8", "testing.trip_latch_at": 1, "train.ckpt_every": 3})
    monkeypatch.setattr(train_mod, "RunState", _Recording)
    assert resumed_matches(tmp_path, cfg, stop=3, n=5)
    rec = _Recording.last
    assert rec is not None
    assert all(layer.quant_bits is None for layer in rec.student.factor_layers())

    monkeypatch.setattr(train_mod, "RunState", runstate_without("after_restore"))
    assert not resumed_matches(tmp_path, cfg, stop=3, n=5, name="-bug")


def test_item2_resumed_int8_run_keeps_training_int8(tmp_path: Path) -> None:
    """Without a latch the resumed run is int8 from its first step (the forward is re-applied)."""
    cfg = tiny(**{"model.quant": "int8", "train.ckpt_every": 2})
    assert resumed_matches(tmp_path, cfg, stop=2, n=4)
    assert {r["compute"] for r in history(tmp_path / "cut") if r["kind"] == "step"} == {"int8"}


# ----------------------------------------------------------------------------- item 3: the mask


def _mask_from_global_rng(t: int, mask_frac: float, mask_span: int, *, seed: int, step: int, rows: int) -> np.ndarray:
    """The original bug: a mask from an unseeded global RNG."""
    starts = np.random.random((rows, t)) < mask_frac / mask_span
    return np.stack([np.convolve(s, np.ones(mask_span, dtype=bool))[:t] > 0 for s in starts])


def test_item3_mask_is_a_function_of_seed_and_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs agree whatever the global RNGs hold, because the mask is
    ``mask_stream(seq_len, mask_frac, mask_span, seed=, step=, rows=batch)``.

    Replacing that call in ``_aux_loss`` with a draw from a global RNG (the
    original bug, simulated below) makes two identical runs differ.
    """
    cfg = tiny(**{"train.mask_frac": 0.5, "train.mask_span": 2, "train.seed": 5})

    def two_runs(tag: str) -> tuple[bytes, bytes]:
        out = []
        for i in (0, 1):
            torch.manual_seed(i)
            np.random.seed(i)
            random.seed(i)
            run(cfg, tmp_path / f"{tag}{i}", 3)
            out.append(artifacts(tmp_path / f"{tag}{i}", 3)[checkpoint_name(3)])
        return out[0], out[1]

    a, b = two_runs("ok")
    assert a == b
    assert resumed_matches(tmp_path, cfg, stop=1, n=3)
    aux = [r["aux_loss"] for r in history(tmp_path / "cut") if r["kind"] == "step"]
    assert any(x != 0.0 for x in aux)  # the mask is not empty: the check has something to compare

    monkeypatch.setattr(train_mod, "mask_stream", _mask_from_global_rng)
    a, b = two_runs("bug")
    assert a != b


# ----------------------------------------------------------------------------- item 4: the spike monitor


def test_item4_monitor_report_survives_a_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stability report after a resume is the uninterrupted run's, exactly.

    Removing ``rs.add_monitor("spike", run.monitor)`` restarts the window and
    every counter empty on resume (the original StressMonitor bug): the report
    counts only post-resume steps.
    """
    cfg = tiny(**{"train.ckpt_every": 3, "monitor.window": 4, "monitor.min_history": 2})
    straight = run(cfg, tmp_path / "ref", 7)
    run(cfg, tmp_path / "cut", 3)
    resumed = run(cfg, tmp_path / "cut", 7, resume=True)
    assert resumed.report == straight.report
    assert straight.report["observed"] == 7
    verdicts = [r["verdict"] for r in history(tmp_path / "cut") if r["kind"] == "step"]
    assert verdicts[:2] == ["warming_up", "warming_up"] and "warming_up" not in verdicts[2:]

    monkeypatch.setattr(train_mod, "RunState", runstate_without("add_monitor"))
    run(cfg, tmp_path / "cut-bug", 3)
    resumed = run(cfg, tmp_path / "cut-bug", 7, resume=True)
    assert resumed.report != straight.report
    assert resumed.report["observed"] == 4


# ----------------------------------------------------------------------------- item 5: rand_depth reaches drift


def test_item5_rand_depth_reaches_the_drift_check(tmp_path: Path) -> None:
    """``--rand-depth`` samples the depth per step from (seed, step), so it is in
    the snapshot and a resume that flips it (or ``--min-depth``) is refused.

    Marking ``TrainConfig.rand_depth`` ``metadata={"snapshot": False}`` (the
    original ``#[serde(skip)]``) lets the flipped resume through: item 8's
    coverage test fails on that, and the exempt-set simulation below shows
    what it would cost.
    """
    cfg = tiny(**{"model.n_layer": 3, "train.rand_depth": True, "train.ckpt_every": 2})
    run(cfg, tmp_path / "long", 12)
    assert len({r["depth"] for r in history(tmp_path / "long") if r["kind"] == "step"}) > 1
    run(cfg, tmp_path / "run", 2)
    for key, value in (("train.rand_depth", False), ("train.min_depth", 2)):
        with pytest.raises(ConfigDrift) as e:
            run(cfg.replace(**{key: value}), tmp_path / "run", 4, resume=True)
        assert [d.key for d in e.value.differences] == [key]
    assert len([r for r in history(tmp_path / "run") if r["kind"] == "step"]) == 2  # nothing ran


def test_item5_a_blind_drift_check_would_resume_a_different_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the check prevents: with rand_depth exempt, the flipped resume runs and parts from the real run."""
    cfg = tiny(**{"model.n_layer": 3, "train.rand_depth": True, "train.ckpt_every": 2})

    class Blind(RunState):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **{**kw, "exempt": drift.DEFAULT_EXEMPT | {"rand_depth"}})

    monkeypatch.setattr(train_mod, "RunState", Blind)
    run(cfg, tmp_path / "ref", 6)
    run(cfg, tmp_path / "cut", 2)
    run(cfg.replace(**{"train.rand_depth": False}), tmp_path / "cut", 6, resume=True)  # not refused
    ref = [r["depth"] for r in history(tmp_path / "ref") if r["kind"] == "step"]
    cut = [r["depth"] for r in history(tmp_path / "cut") if r["kind"] == "step"]
    assert ref[:2] == cut[:2] and ref[2:] != cut[2:]


# ----------------------------------------------------------------------------- item 6: the stream offset


@pytest.mark.parametrize(("warmup_probe", "quant_check", "pre"), [(False, False, 0), (True, False, 1), (True, True, 2)])
def test_item6_stream_lands_at_step_plus_pre_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warmup_probe: bool, quant_check: bool, pre: int
) -> None:
    """After ``S`` steps the stream is at ``(S + pre_batches) * batch * seq_len``,
    pre_batches counting the probe batches (warm-up, quant check).

    Computing the resume offset without the probes (``pre_batches`` -> 0, the
    original ``skip = step * batch * seq_len``) is refused with
    StreamOffsetMismatch instead of re-training on seen batches.
    """
    cfg = tiny(
        **{
            "train.warmup_probe": warmup_probe,
            "train.quant_check": quant_check,
            "model.quant": "int8",
            "train.ckpt_every": 2,
        }
    )
    assert train_mod.pre_batches(cfg) == pre
    assert resumed_matches(tmp_path, cfg, stop=2, n=4)
    per = 4 * 16  # batch * seq_len of the tiny config
    rows = [r for r in history(tmp_path / "cut") if r["kind"] == "step"]
    assert [r["offset"] for r in rows] == [(s + 1 + pre) * per for s in range(4)]
    assert load(tmp_path / "cut" / checkpoint_name(2)).monitor["data"]["train"] == (2 + pre) * per

    if pre:
        monkeypatch.setattr(train_mod, "pre_batches", lambda cfg: 0)
        with pytest.raises(StreamOffsetMismatch, match="must be at"):
            run(cfg, tmp_path / "cut", 6, resume=True)


def test_item6_an_unstored_offset_retrains_seen_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Removing ``rs.add_data_position(...)`` puts the resumed stream back at the
    probe batch: the runs part."""
    cfg = tiny(**{"train.ckpt_every": 2})
    assert resumed_matches(tmp_path, cfg, stop=2, n=4)
    monkeypatch.setattr(train_mod, "RunState", runstate_without("add_data_position"))
    assert not resumed_matches(tmp_path, cfg, stop=2, n=4, name="-bug")


# ----------------------------------------------------------------------------- item 7: the sidecar stamp


def test_item7_every_checkpoint_has_an_ngram_sidecar_stamped_with_its_step(tmp_path: Path) -> None:
    """``.ngram`` is written with every checkpoint, the final one included, and
    stamped with the training step (its table step equals it: one update per step).

    Without ``rs.add_sidecar("ngram", ...)`` no sidecar is written and the
    resumed run starts from an empty table: ``resumed_matches`` fails.
    """
    cfg = tiny(**{"train.ckpt_every": 3})
    run(cfg, tmp_path, 7)  # checkpoints at 3, 6 and the final 7
    for step in (3, 6, 7):
        sc = read_sidecar(tmp_path / (checkpoint_name(step) + ".ngram"), expect_step=step)
        assert sc.train_step == step and sc.table_step == step
        assert int(sc.tree["counts"].sum()) == step * 4 * 16


def test_item7_a_sidecar_from_another_step_is_never_paired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash between the sidecar and container writes can leave model@S over
    tables@S-k. The stamp catches it: the resume skips that checkpoint, says so,
    and falls back to the previous consistent one -- and the run still matches.

    Without the stamp check (simulated: RunState reads the sidecar of step 2
    under step 4's name without ``expect_step``), the checkpoint's record of its
    sidecar's digest (spec/companions.md R-C04) still refuses the pair; and
    without that too, the trainer's own check -- the table step must equal the
    training step -- is the last line.
    """
    cfg = tiny(**{"train.ckpt_every": 2})
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    run(cfg, ref, 6)
    run(cfg, cut, 4)
    stale = cut / (checkpoint_name(2) + ".ngram")
    shutil.copyfile(stale, cut / (checkpoint_name(4) + ".ngram"))
    result = run(cfg, cut, 6, resume=True)
    assert any("skipped step-00000004.ckpt" in n and "training step 2" in n for n in result.resume_notes)
    assert_same_run(ref, cut, 6)

    # The bug: the stale sidecar accepted for step 4 (stamp check switched off).
    from ckptkit.run import _files as runstate

    real = runstate.read_sidecar
    monkeypatch.setattr(runstate, "read_sidecar", lambda path, expect_step=None: real(path))
    bug = tmp_path / "bug"
    run(cfg, bug, 4)
    shutil.copyfile(bug / (checkpoint_name(2) + ".ngram"), bug / (checkpoint_name(4) + ".ngram"))
    result = run(cfg, bug, 6, resume=True)
    assert any("skipped step-00000004.ckpt" in n and ".ngram: damaged" in n for n in result.resume_notes)
    monkeypatch.setattr(runstate, "check_companions", lambda *a, **k: None)  # the binding off as well
    bare = tmp_path / "bare"
    run(cfg, bare, 4)
    shutil.copyfile(bare / (checkpoint_name(2) + ".ngram"), bare / (checkpoint_name(4) + ".ngram"))
    with pytest.raises(SidecarMismatch, match="table step differs from the training step"):
        run(cfg, bare, 6, resume=True)  # the trainer's own table_step check is the last line


# ----------------------------------------------------------------------------- item 8: snapshot coverage

# Flips for fields whose automatic flip breaks a rule of the config.
FLIPS = {"model.n_head": 4, "model.d_model": 66, "model.quant": "int8"}


def test_item8_snapshot_carries_every_config_field() -> None:
    """Every field of TrainerConfig is in the snapshot and reaches diff_keys,
    strict unless it decides only when we look (steps, log_every, ckpt_every).

    Adding a field with ``metadata={"snapshot": False}`` -- or any snapshot
    that drops one (simulated below for rand_depth) -- fails this test.
    """
    report = field_coverage.assert_field_coverage(TrainerConfig, flips=FLIPS)
    assert len(report.fields) == len(report.written) == len(knobs())  # one CLI flag per key, all carried
    assert {
        "train.rand_depth",
        "train.min_depth",
        "train.seed",
        "testing.trip_latch_at",
        "train.ema_decay",
        "model.quant",
        "data.path",
        "monitor.window",
    } <= set(report.written)
    # The testing aids are their own table, not knobs of the user's loop.
    aids = (
        "trip_latch_at",
        "perturb_at",
        "perturb_param",
        "global_draw_from",
        "spike_at",
        "spike_repeat",
        "spike_transient",
    )
    assert [k for k in report.written if k.startswith("testing.")] == sorted(f"testing.{a}" for a in aids)
    assert not {f"train.{a}" for a in aids} & set(report.written)

    def blind(cfg: Any) -> dict[str, Any]:
        table = snapshot.snapshot_config(cfg)
        del table["train"]["rand_depth"]
        return table

    with pytest.raises(AssertionError) as broken:
        field_coverage.assert_field_coverage(TrainerConfig, flips=FLIPS, snapshot=blind)
    assert "\n  train.rand_depth: " in str(broken.value)


def test_item8_only_the_cadence_keys_are_exempt() -> None:
    base = TrainerConfig()
    exempt = []
    for key in ("train.steps", "train.log_every", "train.ckpt_every", "train.keep", "train.lr", "data.batch"):
        table, _, name = key.partition(".")
        changed = base.replace(**{key: getattr(getattr(base, table), name) + 1})
        (d,) = drift.diff_keys(base, changed)
        if d.exempt:
            exempt.append(key)
    assert exempt == ["train.steps", "train.log_every", "train.ckpt_every"]
