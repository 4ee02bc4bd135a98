"""RunState.record and ckptkit.audit._recording: one call per step, exact rows, the first difference named."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.audit import first_row_difference
from ckptkit.audit._commands import EnvironmentDifference, compare_runs
from ckptkit.audit._recording import RunRecording, first_difference
from ckptkit.run._history import read_rows


@dataclasses.dataclass
class Cfg:
    steps: int = 6


def _loop(
    run_dir: Path, steps: int, *, nudge_at: int | None = None, resume: bool = False, threads: int | None = None
) -> None:
    """The loop, from its start or resumed; ``threads``: resumed under that intra-op thread count,
    accepting the change."""
    if threads is None:
        _steps(run_dir, steps, nudge_at, resume)
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _steps(run_dir, steps, nudge_at, resume, allow_env_change=True)
    finally:
        torch.set_num_threads(before)


def _steps(run_dir: Path, steps: int, nudge_at: int | None, resume: bool, allow_env_change: bool = False) -> None:
    net = torch.nn.Linear(2, 1)
    with torch.no_grad():
        net.weight.fill_(0.5)
        net.bias.zero_()
    state = ckptkit.RunState(run_dir, config=Cfg())
    state.add_model("net", net)
    start = state.resume(allow_env_change=allow_env_change).step if resume else state.start()
    for step in range(start, steps):
        with torch.no_grad():
            net.weight.add_(0.25 if step != nudge_at else 0.2500001)
        state.record(step, loss=float(net.weight.detach().sum()), lr=torch.tensor(0.1), tag="x")
        if (step + 1) % 2 == 0:
            state.save(step + 1)


def test_record_writes_a_step_row_with_exact_bits_and_a_digests_row(tmp_path: Path) -> None:
    _loop(tmp_path, 2)
    rows, _ = read_rows(tmp_path / "history.jsonl")
    assert [(r["kind"], r["step"]) for r in rows] == [("step", 0), ("digests", 1), ("step", 1), ("digests", 2)]
    assert rows[0]["loss"] == 1.5 and rows[0]["loss_bits"] == "0x3ff8000000000000" and rows[0]["tag"] == "x"
    assert rows[0]["lr_bits"] == "0x3dcccccd"  # a float32 tensor: its own width
    assert set(rows[1]["tensors"]) == {"header:flags", "header:step", "model:net.bias", "model:net.weight"}


def test_a_resumed_loop_sets_aside_what_the_interrupted_run_recorded_after_its_checkpoint(tmp_path: Path) -> None:
    _loop(tmp_path / "ref", 6)
    _loop(tmp_path / "cut", 5)  # checkpoint 4, rows up to step 4
    _loop(tmp_path / "cut", 6, resume=True)
    assert first_difference(RunRecording(tmp_path / "ref"), RunRecording(tmp_path / "cut")) is None
    ref, cut = (read_rows(tmp_path / name / "history.jsonl")[0] for name in ("ref", "cut"))
    assert ref == [r for r in cut if r["kind"] != "resume_check"]  # the resume's verdict is its only row more
    assert [r["verdict"] for r in cut if r["kind"] == "resume_check"] == ["verified"]


def test_each_resume_under_another_environment_and_back_is_recorded_and_reported_from_its_step(
    tmp_path: Path,
) -> None:
    n = torch.get_num_threads()
    _loop(tmp_path / "ref", 8)
    _loop(tmp_path / "cut", 3)  # checkpoint 2
    _loop(tmp_path / "cut", 5, resume=True, threads=n + 1)  # from 2 under n + 1; checkpoint 4
    _loop(tmp_path / "cut", 7, resume=True)  # from 4 under the recording's n: nothing to accept
    _loop(tmp_path / "cut", 8, resume=True, threads=n + 1)  # from 6 under n + 1 again
    resumes = [
        (r["step"], r["env_diffs"]) for r in read_rows(tmp_path / "cut" / "history.jsonl")[0] if r["kind"] == "resume"
    ]
    changed = [{"key": "intra_op_threads", "recorded": n, "current": n + 1}]
    assert resumes == [(2, changed), (4, []), (6, changed)]  # the return to n is a row too: it ends the change
    report = compare_runs("audit", [], str(tmp_path / "ref"), str(tmp_path / "cut"), resume_at=None)
    assert report.ok and report.environment_differences == (
        EnvironmentDifference("intra_op_threads", n, n + 1, 2),
        EnvironmentDifference("intra_op_threads", n, n + 1, 6),
    )
    assert f"  intra_op_threads: a {n}, b {n + 1} from step 6 (a resume accepted the change there)" in report.describe()
    reverse = compare_runs("audit", [], str(tmp_path / "cut"), str(tmp_path / "ref"), resume_at=None)
    assert [(d.a, d.b, d.from_step) for d in reverse.environment_differences] == [(n + 1, n, 2), (n + 1, n, 6)]


@pytest.mark.parametrize(("nudge_at", "likely"), [(3, True), (1, False)])
def test_a_difference_after_a_resume_under_another_environment_names_it_as_the_likely_cause(
    tmp_path: Path, nudge_at: int, likely: bool
) -> None:
    n = torch.get_num_threads()
    _loop(tmp_path / "ref", 6)
    _loop(tmp_path / "cut", 3, nudge_at=nudge_at)  # checkpoint 2; a nudge at 1 is before the resume
    _loop(tmp_path / "cut", 6, nudge_at=nudge_at, resume=True, threads=n + 1)  # from 2 under n + 1
    report = compare_runs("audit", [], str(tmp_path / "ref"), str(tmp_path / "cut"), resume_at=2)
    d = report.divergence
    assert d is not None and (d.kind, d.step) == ("step", nudge_at)
    hint = "the runs ran under different environments from step 2 (intra_op_threads): the likely cause"
    assert (d.hints[:1] == (hint,)) is likely, d.hints  # a difference before the change is not blamed on it
    assert (hint in report.describe()) is likely


def test_the_first_difference_names_the_step_the_fields_and_the_tensor(tmp_path: Path) -> None:
    _loop(tmp_path / "a", 6)
    _loop(tmp_path / "b", 6, nudge_at=3)
    d = first_difference(RunRecording(tmp_path / "a"), RunRecording(tmp_path / "b"))
    assert d is not None and (d.step, d.kind) == (3, "step")
    assert d.field_names == ("loss", "loss_bits") and d.tensor_names == ("model:net.weight",)


@pytest.mark.parametrize(
    ("scalars", "message"),
    [
        ({"kind": "x"}, "record(): 'kind' is a reserved row field"),
        ({"loss_bits": 1.0}, "record(): 'loss_bits' is a reserved row field"),
        ({"loss": None}, "record(): loss must be a number, a string or a one-element tensor (got NoneType)"),
        ({"loss": torch.ones(2)}, "record(): loss must be a scalar (got a tensor of shape [2])"),
    ],
)
def test_a_scalar_that_cannot_be_recorded_is_named(tmp_path: Path, scalars: dict, message: str) -> None:
    state = ckptkit.RunState(tmp_path, config=Cfg())
    state.start()
    with pytest.raises(TypeError, match=re.escape(message)):
        state.record(0, **scalars)


def test_one_rule_for_the_same_checkpoint_sets_the_encoding_aside_and_names_a_difference_of_bytes_alone(
    tmp_path: Path,
) -> None:
    """A container is compared as its state re-encoded (compression is not state); a distributed
    checkpoint file by file -- and when only its bytes differ, the difference says every tensor
    is equal (the layout, not the state, differs), not which tensor differs."""
    import shutil

    import ckptkit.distributed
    from ckptkit.audit._recording import LAYOUT_ONLY, checkpoint_difference
    from ckptkit.format._companions import same_checkpoint

    _loop(tmp_path / "run", 2)
    path = tmp_path / "run" / "step-00000002.ckpt"
    ckptkit.save(tmp_path / "zstd.ckpt", ckptkit.load(path), compression="zstd")
    assert path.read_bytes() != (tmp_path / "zstd.ckpt").read_bytes() and same_checkpoint(path, tmp_path / "zstd.ckpt")

    ckptkit.distributed.save({"w": torch.arange(6.0)}, tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    ckptkit.distributed.save({"w": torch.arange(6.0) + 1}, tmp_path / "c")
    assert same_checkpoint(tmp_path / "a", tmp_path / "b") and not same_checkpoint(tmp_path / "a", tmp_path / "c")
    d = checkpoint_difference(4, str(tmp_path / "a"), str(tmp_path / "c"))
    assert d is not None and d.tensor_names == ("w",) and d.tensors[0].n_diff == 6
    (tmp_path / "b" / "notes.txt").write_bytes(b"")  # a file the other lacks: the same state, not the same bytes
    assert not same_checkpoint(tmp_path / "a", tmp_path / "b")
    d = checkpoint_difference(4, str(tmp_path / "a"), str(tmp_path / "b"))
    assert d is not None and (d.kind, d.step, d.file, d.tensors) == ("checkpoint", 4, "a", ())
    assert d.values == "both runs' a: every tensor and value is bitwise equal, only the bytes differ"
    assert d.layout_only and d.hints == (LAYOUT_ONLY,)


def test_first_row_difference_names_the_first_differing_step_and_field():
    rec = [{"kind": "step", "step": s, "loss_bits": f"0x{s}", "params_digest": s} for s in range(1, 6)]
    rep = [dict(r) for r in rec]
    assert first_row_difference(rec, rep) is None
    rep[3]["params_digest"] = 99
    rep[4]["loss_bits"] = "0xff"
    d = first_row_difference(rec, rep, ["loss_bits", "params_digest"])
    assert (d.step, d.field_names) == (4, ("params_digest",))
    assert d.describe() == "step 4: params_digest: recorded 4, replayed 99"


@pytest.mark.parametrize(
    ("recorded", "replayed"), [(1, 1.0), (1, True), (0.0, False), ([1], [1.0]), ({"a": 1}, {"a": True})]
)
def test_recorded_values_of_another_type_differ_though_python_calls_them_equal(recorded: object, replayed: object):
    # a row read back as 1 where the other run wrote 1.0 is not the same recording (dict != said it was)
    a, b = [{"kind": "step", "step": 0, "x": recorded}], [{"kind": "step", "step": 0, "x": replayed}]
    d = first_row_difference(a, b)
    assert d is not None and (d.step, d.field_names) == (0, ("x",))


def test_a_nan_recorded_by_both_runs_is_the_same_value_and_a_missing_field_differs():
    nan = float("nan")
    assert (
        first_row_difference([{"kind": "step", "step": 0, "x": nan}], [{"kind": "step", "step": 0, "x": nan * 1}])
        is None
    )
    d = first_row_difference([{"kind": "step", "step": 0, "x": None}], [{"kind": "step", "step": 0}])
    assert d is not None and d.field_names == ("x",)


def test_two_recordings_whose_rows_hold_1_and_1_0_differ_there(tmp_path: Path) -> None:
    # the engine compared rows with dict !=, which calls 1 and 1.0 equal; the trainer's re-run did not
    for name, loss in (("a", 1), ("b", 1.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "history.jsonl").write_text(
            json.dumps({"kind": "step", "step": 0, "loss": loss, "time": 1.0}) + "\n"
        )
    d = first_difference(RunRecording(tmp_path / "a"), RunRecording(tmp_path / "b"))
    assert d is not None and (d.kind, d.step, d.field_names) == ("step", 0, ("loss",))
