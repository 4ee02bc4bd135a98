"""RunState for a loop that is not the reference trainer (issue 9): every kind of
state it accepts comes back exactly, what it cannot carry is refused when it is
registered, and every refusal on resume lists its reasons before anything is
restored."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Cfg, Loop, same, trained

import ckptkit
from ckptkit import (
    CheckpointNotFound,
    ConfigDrift,
    ResumeRefused,
    RunState,
    StateMismatch,
    StreamOffsetMismatch,
    UnsupportedValue,
)
from ckptkit.run import checkpoint_name, list_checkpoints

# ----------------------------------------------------------------------------- every kind of state comes back


def test_every_registered_kind_of_state_comes_back_exactly(tmp_path: Path) -> None:
    a = trained(tmp_path, steps=4)
    b = Loop(tmp_path, seed=99)  # other weights: the resume must overwrite every one
    info = b.state.resume()
    assert (info.step, info.path) == (4, str(tmp_path / checkpoint_name(4)))
    for name in ("body", "head", "teacher", "opt_body", "opt_head", "sched", "scaler", "monitor"):
        assert same(getattr(a, name).state_dict(), getattr(b, name).state_dict()), name
    assert b.scaler.get_scale() == a.scaler.get_scale() != 1024.0  # grew: the scaler state is real
    assert b.sched.get_last_lr() == a.sched.get_last_lr() != [0.01]
    assert (b.position, b.tokens_seen, b.fp32, b.table_step) == (16, {"total": 64, "by_source": [32, 32]}, True, 4)
    assert same(b.table, a.table)
    assert all(not p.requires_grad for p in b.teacher.parameters())  # restored frozen
    assert b.restored == ["after restore at position 16"]  # after everything else is back
    # ... and the resumed loop trains on exactly as the first one does.
    a.step(4)
    b.step(4)
    assert same(a.body.state_dict(), b.body.state_dict())
    assert same(a.opt_body.state_dict(), b.opt_body.state_dict())


def test_a_save_writes_the_container_its_snapshot_and_each_sidecar(tmp_path: Path) -> None:
    trained(tmp_path, steps=2)
    assert sorted(os.listdir(tmp_path)) == [
        "environment.json",
        "lease.json",  # the run is not closed: its job still holds the run directory (spec/lease.md)
        "step-00000002.ckpt",
        "step-00000002.ckpt.config.json",
        "step-00000002.ckpt.counts",
    ]
    assert ckptkit.verify(tmp_path / checkpoint_name(2)).ok


def test_retention_keeps_the_newest_checkpoints_with_their_companions(tmp_path: Path) -> None:
    trained(tmp_path, steps=8, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6, 8]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == [
        "step-00000006.ckpt",
        "step-00000006.ckpt.config.json",
        "step-00000006.ckpt.counts",
        "step-00000008.ckpt",
        "step-00000008.ckpt.config.json",
        "step-00000008.ckpt.counts",
    ]


def test_discard_after_deletes_the_newer_checkpoints_and_their_companions(tmp_path: Path) -> None:
    loop = trained(tmp_path, steps=6)
    gone = loop.state.discard_after(2)
    assert [os.path.basename(p) for p in gone] == ["step-00000004.ckpt", "step-00000006.ckpt"]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == [
        "step-00000002.ckpt",
        "step-00000002.ckpt.config.json",
        "step-00000002.ckpt.counts",
    ]


# ----------------------------------------------------------------------------- refused when registered


def _module_with_extra_state(extra: Any) -> torch.nn.Module:
    class Odd(torch.nn.Linear):
        def get_extra_state(self) -> Any:
            return extra

        def set_extra_state(self, state: Any) -> None:
            pass

    return Odd(2, 2)


class NoState:
    pass


@pytest.mark.parametrize(
    ("register", "error", "message"),
    [
        (
            lambda rs: rs.add_model("m", NoState()),
            UnsupportedValue,
            "model 'm': a NoState has no state_dict()/load_state_dict()",
        ),
        (
            lambda rs: rs.add_optimizer("o", NoState()),
            UnsupportedValue,
            "optimizer 'o': a NoState has no state_dict()/load_state_dict()",
        ),
        (lambda rs: rs.add_model("m", _module_with_extra_state(object())), UnsupportedValue, "model 'm'"),
        (lambda rs: rs.add_value("v", get=lambda: {"when": object()}, set=print), UnsupportedValue, "value 'v'"),
        (lambda rs: rs.add_monitor("mon", _module_with_extra_state(None)), UnsupportedValue, "monitor 'mon'"),
        (
            lambda rs: rs.add_flag("turbo", get=lambda: True, set=print),
            UnsupportedValue,
            "flag 'turbo' has no bit in this container version (known: fp32_fallback); store it with add_value",
        ),
        (
            lambda rs: rs.add_data_position("d", get=lambda: -1, set=print),
            UnsupportedValue,
            "data position 'd' must be a non-negative int (got -1)",
        ),
        (
            lambda rs: rs.add_data_position("d", get=lambda: 1.5, set=print),
            UnsupportedValue,
            "data position 'd' must be a non-negative int (got 1.5)",
        ),
        (lambda rs: rs.add_sidecar("c", get=lambda: (0, {"x": object()}), set=print), UnsupportedValue, "sidecar 'c'"),
        (lambda rs: rs.add_model("", torch.nn.Linear(1, 1)), ValueError, "model name must be a non-empty string"),
    ],
)
def test_what_the_container_cannot_carry_is_refused_at_registration(
    tmp_path: Path, register: Any, error: type[Exception], message: str
) -> None:
    rs = RunState(tmp_path, config=Cfg())
    with pytest.raises(error) as e:
        register(rs)
    assert message in str(e.value)


def test_a_name_registered_twice_or_a_second_teacher_is_refused(tmp_path: Path) -> None:
    rs = RunState(tmp_path, config=Cfg())
    rs.add_model("net", torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="model 'net' is already registered"):
        rs.add_model("net", torch.nn.Linear(1, 1))
    rs.add_teacher(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="a teacher is already registered"):
        rs.add_teacher(torch.nn.Linear(1, 1))


def test_a_config_the_snapshot_cannot_hold_is_refused_before_training(tmp_path: Path) -> None:
    @dataclasses.dataclass
    class Bad:
        when: object = dataclasses.field(default_factory=object)

    with pytest.raises(UnsupportedValue, match="when"):
        RunState(tmp_path, config=Bad())
    with pytest.raises(ValueError, match="keep must be >= 1 \\(got 0\\)"):
        RunState(tmp_path, config=Cfg(), keep=0)


# ----------------------------------------------------------------------------- refused on resume, nothing restored


def test_start_refuses_a_directory_that_holds_checkpoints(tmp_path: Path) -> None:
    trained(tmp_path, steps=2)
    with pytest.raises(ResumeRefused, match=r"already holds 1 checkpoint\(s\), newest step-00000002.ckpt; resume it"):
        Loop(tmp_path).state.start()


def test_resume_with_nothing_to_resume_says_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFound, match="no checkpoints to resume from"):
        Loop(tmp_path).state.resume()


def test_drift_lists_every_strict_key_and_exempt_keys_pass_with_a_note(tmp_path: Path) -> None:
    trained(tmp_path, steps=2)
    with pytest.raises(ConfigDrift) as e:
        Loop(tmp_path, Cfg(lr=0.02, width=8, steps=20)).state.resume()
    assert [d.key for d in e.value.differences] == ["lr"]
    assert "lr 0.01 -> 0.02" in str(e.value)
    info = Loop(tmp_path, Cfg(steps=20, ckpt_every=5)).state.resume()
    assert [d.key for d in info.exempt_changes] == ["ckpt_every", "steps"]
    assert any(n.startswith("steps 10 -> 20") for n in info.notes)


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_and_says_so(tmp_path: Path) -> None:
    trained(tmp_path, steps=6)
    newest = tmp_path / checkpoint_name(6)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    (tmp_path / (checkpoint_name(4) + ".counts")).unlink()
    logged: list[str] = []
    loop = Loop(tmp_path, log=logged.append)
    info = loop.state.resume()
    assert info.step == 2 and loop.position == 8
    assert [os.path.basename(p) for p, _ in info.skipped] == ["step-00000006.ckpt", "step-00000004.ckpt"]
    assert "does not match" in info.skipped[0][1] and info.skipped[0][1].endswith(
        "the file is damaged; resume from an earlier checkpoint (R-005)"
    )
    assert info.skipped[1][1] == f"{tmp_path / checkpoint_name(4)}.counts: no such sidecar file"
    assert logged[-1] == "falling back to step-00000002.ckpt (step 2)"


def test_a_sidecar_stamped_for_another_step_is_not_mixed_in(tmp_path: Path) -> None:
    trained(tmp_path, steps=4)
    ckpt4 = tmp_path / checkpoint_name(4)
    shutil.copy(tmp_path / (checkpoint_name(2) + ".counts"), str(ckpt4) + ".counts")
    info = Loop(tmp_path).state.resume()
    assert info.step == 2
    assert "train_step" in info.skipped[0][1]


def test_a_stored_position_that_breaks_the_offset_rule_is_refused(tmp_path: Path) -> None:
    trained(tmp_path, steps=2)
    seen: list[Any] = []

    def rule(step: int, values: Any) -> int:
        seen.append(values["tokens"])
        return 5 * step  # the rule changed: 4 examples per step before

    loop = Loop(tmp_path, rule=rule)
    with pytest.raises(
        StreamOffsetMismatch,
        match=r"data position 'train' is 8, but a run at step 2 must be at 10; "
        "the stream offset rule changed or the checkpoint is from another run",
    ):
        loop.state.resume()
    assert seen == [{"total": 32, "by_source": [16, 16]}]  # the rule saw the checkpoint's stored values
    assert loop.position == 0


def test_a_checkpoint_for_other_registrations_is_refused_listing_every_difference(tmp_path: Path) -> None:
    trained(tmp_path, steps=2)
    loop = Loop(tmp_path, seed=5)
    before = {k: v.clone() for k, v in loop.body.state_dict().items()}
    extra = torch.nn.Linear(1, 1)
    loop.state.add_model("adapter", extra)
    loop.state.add_optimizer("adam2", torch.optim.Adam(extra.parameters()))
    with pytest.raises(StateMismatch) as e:
        loop.state.resume()
    assert str(e.value) == (
        f"{tmp_path / checkpoint_name(2)}: does not match this run's registered state: model section lacks adapter; "
        "optim['optimizers'] lacks adam2"
    )
    assert same(before, loop.body.state_dict())  # nothing was restored


def test_a_module_built_differently_is_refused_before_anything_is_restored(tmp_path: Path) -> None:
    """Code changed but the config did not: the drift check cannot see it, the
    layout check does, and lists every tensor instead of half-loading."""
    trained(tmp_path, steps=2)
    loop = Loop(tmp_path, seed=5, width=16)
    before = {k: v.clone() for k, v in loop.head.state_dict().items()}
    with pytest.raises(StateMismatch) as e:
        loop.state.resume()
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / checkpoint_name(2)}: does not match this run's registered state: ")
    assert e.value.problems == (
        "model['body']['bias']: shape [8] in the checkpoint, [16] in the module",
        "model['body']['weight']: shape [8, 4] in the checkpoint, [16, 4] in the module",
        "model['head']['weight']: shape [1, 8] in the checkpoint, [1, 16] in the module",
        "teacher['bias']: shape [8] in the checkpoint, [16] in the module",
        "teacher['weight']: shape [8, 4] in the checkpoint, [16, 4] in the module",
    )
    for line in e.value.problems:
        assert line in msg
    assert same(before, loop.head.state_dict())  # head's bias would have fit: still not restored
    assert loop.position == 0 and loop.restored == []


# ----------------------------------------------------------------------------- restore: an in-memory rollback


def test_restore_puts_a_kept_state_back_except_what_is_skipped(tmp_path: Path) -> None:
    loop = trained(tmp_path, steps=2)
    kept = copy.deepcopy(loop.state.checkpoint(2))  # its tensors are the live ones: keep a copy
    kept_counts = copy.deepcopy(loop.table)
    loop.step(2)
    loop.step(3)
    loop.state.restore(copy.deepcopy(kept), sidecars={"counts": (2, kept_counts)}, skip=["data:train", "value:tokens"])
    assert same(kept.model["body"], loop.body.state_dict())
    assert same(kept.optim["optimizers"]["adamw"], loop.opt_body.state_dict())
    assert same(kept.teacher, loop.teacher.state_dict())
    assert (loop.position, loop.tokens_seen["total"], loop.table_step) == (16, 64, 2)  # skipped ones kept their place
    assert same(loop.table, kept_counts)
    assert loop.restored == ["after restore at position 16"]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"skip": ["data:nope", "model:body"]}, "restore: skip names data:nope, which this RunState does not register"),
        ({"skip": ["teacher"]}, "restore: skip names teacher, which this RunState does not register"),
        ({}, r"restore: no contents given for the registered sidecar\(s\) counts"),
    ],
)
def test_restore_refuses_unknown_skips_and_missing_sidecars(tmp_path: Path, kw: dict[str, Any], message: str) -> None:
    loop = trained(tmp_path, steps=2)
    with pytest.raises(ValueError, match=message):
        loop.state.restore(loop.state.checkpoint(2), **kw)


def test_checkpoints_waits_for_the_save_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bare listing can miss a background save still being written; checkpoints() cannot."""
    rs = RunState(tmp_path, config=Cfg(), async_save=True)
    net = torch.nn.Linear(64, 64)
    rs.add_model("net", net)
    rs.start()
    real = ckptkit.run._file_store.container_writer
    gate = threading.Event()

    def slow_writer(*a: Any, **kw: Any) -> Callable[[Any], None]:
        write = real(*a, **kw)

        def slow(f: Any) -> None:
            gate.wait(10)
            write(f)

        return slow

    monkeypatch.setattr(ckptkit.run._file_store, "container_writer", slow_writer)
    rs.save(1)
    assert list_checkpoints(tmp_path) == []  # still in flight
    gate.set()
    assert [s for s, _ in rs.checkpoints()] == [1]
    rs.close()


def test_a_run_answers_what_a_guard_asks_of_it(tmp_path: Path) -> None:
    """What a guard asks of a run (``guard_view()``): positions, the offset rule, the monitor's
    name, the LR, and scaling it — the LR of every group and the schedulers' base LRs."""
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    pos = {"v": 6}
    skipped = {"n": 2}
    rs = RunState(tmp_path, config=Cfg())
    view = rs.guard_view()
    assert math.isnan(view.lr())  # no optimizer registered yet
    rs.add_model("net", net)
    rs.add_optimizer("sgd", opt)
    rs.add_scheduler("lr", sched)
    rs.add_value("skipped", get=lambda: skipped["n"], set=lambda v: skipped.update(n=v))
    rs.add_data_position(
        "train", get=lambda: pos["v"], set=lambda v: pos.update(v=v), expected=lambda s, vals: 2 * s + vals["skipped"]
    )
    rs.add_data_position("eval", get=lambda: 0, set=lambda v: None)
    monitor = ckptkit.guard.SpikeMonitor()
    rs.add_monitor("spikes", monitor)
    assert view.data_positions() == {"train": 6, "eval": 0}
    assert view.expected_position("train", 3) == 8 and view.expected_position("eval", 3) is None
    assert view.monitor_name(monitor) == "spikes" and view.monitor_name(ckptkit.guard.SpikeMonitor()) is None
    assert view.lr() == 0.1
    view.scale_lr(0.5)
    assert view.lr() == 0.05 and opt.param_groups[0]["initial_lr"] == 0.05 and sched.base_lrs == [0.05]
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05  # the closed-form schedule keeps the drop


def test_the_numpy_rng_state_registered_with_add_value_resumes_as_the_object_set_state_takes(tmp_path: Path) -> None:
    """``np.random.get_state()`` (a tuple holding a uint32 ndarray) is a typed value (spec/container.md §5.4)."""
    import numpy as np

    def run() -> RunState:
        rs = RunState(tmp_path, config=Cfg())
        rs.add_model("net", torch.nn.Linear(2, 2))
        rs.add_value("numpy_rng", get=np.random.get_state, set=np.random.set_state)
        return rs

    np.random.seed(11)
    np.random.standard_normal(3)
    saving = run()
    saving.start()
    saving.save(1)
    saving.close()
    after = np.random.standard_normal(4)
    np.random.seed(0)  # another stream: the resume must put the saved one back
    resuming = run()
    assert resuming.resume().step == 1
    assert np.random.standard_normal(4).tobytes() == after.tobytes()
    resuming.close()
