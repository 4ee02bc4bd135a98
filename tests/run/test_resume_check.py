"""Every resume proves itself (spec/determinism.md R-D20..R-D26): a RunState loop in this process,
"killed" after a checkpoint by abandoning its state, resumed, and judged against its own rows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.errors import ReplayDivergence, RunStopped, UnsupportedOption
from ckptkit.run._history import INTERRUPTED_FILE, History, check_history, read_rows
from ckptkit.run._lease import LEASE_FILE
from ckptkit.run._preemption import STOP_AT_ENV


@dataclasses.dataclass
class Cfg:
    every: int = 2


def _batch(step: int, shuffled: bool) -> torch.Tensor:
    """The step's input: a function of the step, unless the loader "reshuffled" on resume."""
    g = torch.Generator().manual_seed(step * 7 + (1000 if shuffled else 0))
    return torch.rand(3, 2, generator=g)


def _run(
    run_dir: Path,
    steps: int,
    *,
    every: int = 2,
    draw_from: int | None = None,
    shuffled: bool = False,
    check: str | None = None,
    env_change: bool = False,
    said: list[str] | None = None,
    stoppable: bool = False,
) -> ckptkit.RunState:
    """Train to ``steps`` (resuming when the directory holds a checkpoint); returns the state, not
    closed: a test that stops here is a process that died after its last row."""
    torch.manual_seed(0)  # the global generator as a fresh process has it
    net = torch.nn.Linear(2, 1)
    with torch.no_grad():
        net.weight.fill_(0.5)
        net.bias.zero_()
    state = ckptkit.RunState(run_dir, config=Cfg(every), log=None if said is None else said.append)
    state.add_model("net", net)
    start = state.resume_or_start(resume_check=check, allow_env_change=env_change)
    for step in range(start, steps):
        x = _batch(step, shuffled and step == start)
        loss = net(x).pow(2).mean()
        net.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in net.parameters():
                p.sub_(0.1 * p.grad)  # type: ignore[operator]  # backward() filled it
            if draw_from is not None and step >= draw_from:
                net.bias.add_(torch.rand(1) * 1e-3)  # the unseeded global generator
        state.record(step, loss=loss.detach(), data=x)
        if (step + 1) % every == 0:
            state.save(step + 1)
        if stoppable:
            state.step_done(step + 1)
    return state


def _killed(run_dir: Path, steps: int, **kw: Any) -> None:
    """A process that recorded ``steps`` steps and died: its history is left as the kill leaves it."""
    _run(run_dir, steps, **kw)  # never closed: nothing more is written, as after a SIGKILL


def _rows(run_dir: Path, name: str = "history.jsonl") -> list[dict[str, Any]]:
    return read_rows(run_dir / name)[0]


def _verdicts(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in _rows(run_dir) if r["kind"] == "resume_check"]


def test_a_resume_re_runs_what_the_killed_process_recorded_and_says_it_is_the_same_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _killed(tmp_path, 7)  # checkpoint 6, then step 6 recorded
    _killed(tmp_path / "ref", 10)
    _run(tmp_path, 10).close()
    assert capsys.readouterr().err.splitlines() == [
        "resume verified: steps 6..6 reproduce the interrupted run bit for bit (1 step, 4 tensors each)"
    ]
    assert _verdicts(tmp_path) == [
        {
            "kind": "resume_check",
            "step": 7,
            "resumed_at": 6,
            "verdict": "verified",
            "from": 6,
            "to": 6,
            "steps": 1,
            "tensors": 4,
        }
    ]
    aside = _rows(tmp_path, INTERRUPTED_FILE)
    assert aside[0] == {"kind": "interrupted", "rows": 2, "step": 6, "timeline": 0}
    assert [(r["kind"], r["step"]) for r in aside[1:]] == [("step", 6), ("digests", 7)]
    assert check_history(tmp_path / "history.jsonl").resumes == tuple(_verdicts(tmp_path))


def test_a_global_draw_stops_the_resume_at_the_first_re_run_step_naming_the_tensor(tmp_path: Path) -> None:
    _killed(tmp_path, 9, draw_from=5)  # checkpoint 8 (every 2)... resumed from 8: step 8 re-run
    with pytest.raises(ReplayDivergence) as e:
        _run(tmp_path, 12, draw_from=5)
    assert str(e.value).startswith(
        f"{tmp_path}: the resumed run differs from the interrupted run at step 8: tensor model:net.bias; likely cause: "
    )
    assert "investigate with: ckptkit replay " in str(e.value) and str(e.value).endswith("(R-D25)")
    (verdict,) = _verdicts(tmp_path)
    assert verdict["verdict"] == "differed" and verdict["what"] == "tensor model:net.bias" and verdict["at"] == 8
    # both processes' rows are on disk: the re-run's step 8 here, the interrupted one's beside it
    assert [r["step"] for r in _rows(tmp_path) if r["kind"] == "step"][-1] == 8
    assert [r["step"] for r in _rows(tmp_path, INTERRUPTED_FILE) if r["kind"] == "step"] == [8]


def test_warn_goes_on_and_says_it_off_compares_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _killed(tmp_path / "w", 9, draw_from=5)
    _run(tmp_path / "w", 12, draw_from=5, check="warn").close()
    assert (
        "resume at step 8 DIFFERED from the interrupted run at step 8: tensor model:net.bias" in capsys.readouterr().err
    )
    assert [r["step"] for r in _rows(tmp_path / "w") if r["kind"] == "step"] == list(range(12))
    _killed(tmp_path / "o", 9, draw_from=5)
    said: list[str] = []
    _run(tmp_path / "o", 12, draw_from=5, check="off", said=said).close()
    assert [(v["verdict"], v["reason"]) for v in _verdicts(tmp_path / "o")] == [
        ("not checked", "the resume check is off")
    ]
    assert f"history: set aside 2 row(s) the interrupted run wrote after step 8 in {INTERRUPTED_FILE}" in said, said


def test_a_start_that_committed_no_checkpoint_is_set_aside_when_the_run_starts_again(tmp_path: Path) -> None:
    """R-D21: nothing is deleted, also when no checkpoint was committed and the run starts at 0."""
    _killed(tmp_path, 1, every=2)  # one step recorded, no checkpoint
    before = _rows(tmp_path)
    said: list[str] = []
    _run(tmp_path, 4, every=2, said=said).close()
    note = f"history: set aside {len(before)} row(s) of a start that committed no checkpoint in {INTERRUPTED_FILE}"
    assert said == [f"{note}; the run starts again from step 0"]
    aside = _rows(tmp_path, INTERRUPTED_FILE)
    assert aside == [{"kind": "interrupted", "rows": len(before), "step": 0, "timeline": 0}, *before]
    assert [r["step"] for r in _rows(tmp_path) if r["kind"] == "step"] == [0, 1, 2, 3]
    assert _verdicts(tmp_path) == []  # nothing restored, so nothing is compared


def test_a_fresh_start_over_a_file_that_is_no_history_replaces_it_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "history.jsonl").write_bytes(b"not json\n")
    (note,) = History(tmp_path).start_fresh()
    assert note.startswith("history: replaced a file that is not a history (") and "not JSON" in note, note
    assert (tmp_path / "history.jsonl").read_bytes() == b"" and not (tmp_path / INTERRUPTED_FILE).exists()


def test_a_loader_that_reshuffles_on_resume_is_named_as_data(tmp_path: Path) -> None:
    _killed(tmp_path, 9)
    with pytest.raises(ReplayDivergence, match=r"at step 8: data \(recorded '0x[0-9a-f]{16}', re-run '0x"):
        _run(tmp_path, 12, shuffled=True)


def test_a_cooperative_stop_writes_the_verdict_before_it_lets_the_lease_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-LS08: a loop that ends at ``step_done``'s ``RunStopped`` and never reaches ``close()``
    (a plain script: SystemExit) has written every row, its verdict too, before the lease went."""
    _killed(tmp_path, 11, every=4)  # checkpoint 8, then steps 8..10 recorded
    monkeypatch.setenv(STOP_AT_ENV, "9")
    with pytest.raises(RunStopped):
        _run(tmp_path, 12, every=4, stoppable=True)  # re-runs step 8, stops at 9: never closed
    assert [(v["verdict"], v["from"], v["to"]) for v in _verdicts(tmp_path)] == [("verified", 8, 8)]
    assert [r["step"] for r in _rows(tmp_path) if r["kind"] == "step"] == list(range(9))
    assert not (tmp_path / LEASE_FILE).exists()


def test_what_cannot_be_verified_says_why(tmp_path: Path) -> None:
    _killed(tmp_path / "at", 8)  # died right after checkpoint 8: nothing after it
    _run(tmp_path / "at", 10).close()
    _killed(tmp_path / "torn", 8)
    with open(tmp_path / "torn" / "history.jsonl", "ab") as f:
        f.write(b'{"kind":"step","st')
    _run(tmp_path / "torn", 10).close()
    assert [(v["verdict"], v["reason"]) for p in ("at", "torn") for v in _verdicts(tmp_path / p)] == [
        ("not verifiable", "no rows after the checkpoint"),
        ("not verifiable", "a torn last line only"),
    ]


def test_a_resume_that_accepted_another_environment_is_not_comparable(tmp_path: Path) -> None:
    _killed(tmp_path, 9)
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        _run(tmp_path, 12, env_change=True).close()
    finally:
        torch.set_num_threads(before)
    (verdict,) = _verdicts(tmp_path)
    assert verdict["verdict"] == "not comparable"
    assert verdict["reason"].startswith("the resume accepted another environment (intra_op_threads")


def test_the_setting_is_refused_before_anything_is_restored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _killed(tmp_path, 3)
    with pytest.raises(UnsupportedOption, match=r"resume_check='strict': the resume check is one of error, warn, off"):
        _run(tmp_path, 4, check="strict")
    monkeypatch.setenv("CKPTKIT_RESUME_CHECK", "loud")
    with pytest.raises(UnsupportedOption, match=r"CKPTKIT_RESUME_CHECK='loud'"):
        _run(tmp_path, 4)
    assert _verdicts(tmp_path) == []


def test_rows_set_aside_by_a_resume_that_died_before_rewriting_are_kept_once(tmp_path: Path) -> None:
    _killed(tmp_path, 9)
    original = (tmp_path / "history.jsonl").read_bytes()
    History(tmp_path).resume_at(8)
    (tmp_path / "history.jsonl").write_bytes(original)  # as if it died before the rewrite landed
    History(tmp_path).resume_at(8)
    headers = [r for r in _rows(tmp_path, INTERRUPTED_FILE) if r["kind"] == "interrupted"]
    assert headers == [{"kind": "interrupted", "rows": 2, "step": 8, "timeline": 0}]


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kill=st.integers(1, 11), every=st.integers(1, 4))
def test_every_resume_is_verified_over_exactly_the_steps_it_re_ran(
    tmp_path_factory: pytest.TempPathFactory, kill: int, every: int
) -> None:
    run_dir = tmp_path_factory.mktemp("run")
    ref = _run(tmp_path_factory.mktemp("ref"), 12, every=every)
    ref.close()
    _killed(run_dir, kill, every=every)
    resumed = _run(run_dir, 12, every=every)
    resumed.close()
    checkpoint = kill - kill % every
    verdicts = _verdicts(run_dir)
    verdict = verdicts[0] if verdicts else None
    assert len(verdicts) <= 1
    if checkpoint == 0:  # no checkpoint: the resume is a fresh start
        assert verdict is None
    elif checkpoint == kill:
        assert verdict is not None and verdict["verdict"] == "not verifiable"
    else:
        assert verdict is not None and (verdict["verdict"], verdict["from"], verdict["to"]) == (
            "verified",
            checkpoint,
            kill - 1,
        )
    ours = [json.dumps(r) for r in _rows(run_dir) if r["kind"] in ("step", "digests")]
    assert ours == [json.dumps(r) for r in _rows(Path(ref.run_dir)) if r["kind"] in ("step", "digests")]
