"""Replay (spec/replay.md): fingerprints in the history, the first divergence named, RUN untouched.

A recorded run is re-run from one of its checkpoints; every step's fingerprints must
match bit for bit. A deliberate 1-ulp perturbation (``--perturb-at``), a changed
environment, or a checkpoint altered after the fact must each be reported at the
right step, naming the tensor -- the same tensors ``ckptkit diff --tensors`` names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import history, record_environment, run, tiny

import ckptkit
from ckptkit.audit._commands import AuditReport
from ckptkit.audit._recording import first_divergence_in_files
from ckptkit.cli import main
from ckptkit.format._snapshot import encode_snapshot
from ckptkit.format._tree import checkpoint_state
from ckptkit.run import checkpoint_name
from ckptkit.run._difference import Difference, FieldDiff, Rerun, differing_names
from ckptkit.run._fingerprint import (
    combine,
    leaf_digest,
    leaf_digests,
    state_digest,
    tensor_digest,
)
from ckptkit.trainer import TrainerConfig
from ckptkit.trainer._config import knobs
from ckptkit.trainer._replay import replay

pytestmark = pytest.mark.slow

PARAM = "blocks.1.mlp.fc.weight"
NAME = "model:model." + PARAM


def _files(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of a run with its bytes and mtime (ns): replay must leave all of them alone."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.iterdir())}


def _replay(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main(["replay", *argv, "--json", "--quiet"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 steps, a checkpoint every 2, recorded with 1 ulp added to PARAM at the end of step 3."""
    d = tmp_path_factory.mktemp("perturbed")
    run(tiny(**{"train.ckpt_every": 2, "testing.perturb_at": 3, "testing.perturb_param": PARAM}), d, 6)
    return d


# ----------------------------------------------------------------------------- the history schema


def test_every_step_row_carries_params_digest_of_the_parameters_after_it(perturbed: Path) -> None:
    rows = history(perturbed)
    steps = {r["step"]: r for r in rows if r["kind"] == "step"}
    for s in (2, 4, 6):
        ckpt = ckptkit.load(perturbed / checkpoint_name(s))
        named = [(f"model:model.{k}", v) for k, v in ckpt.model["model"].items()]
        assert steps[s - 1]["params_digest"] == state_digest(named)
    digests = {r["step"]: r["tensors"] for r in rows if r["kind"] == "digests"}
    assert sorted(digests) == [1, 2, 3, 4, 5, 6]  # after every step, numbered by steps done
    for s, tensors in digests.items():
        assert combine(tensors.values()) == steps[s - 1]["params_digest"]


def test_checkpoint_rows_hold_the_digest_of_every_leaf_of_the_file(perturbed: Path) -> None:
    rows = [r for r in history(perturbed) if r["kind"] == "checkpoint"]
    assert [(r["step"], r["file"]) for r in rows] == [(s, checkpoint_name(s)) for s in (2, 4, 6)]
    for r in rows:
        on_disk = leaf_digests(checkpoint_state(ckptkit.load(perturbed / r["file"])))
        assert r["tensors"] == on_disk  # the in-memory state that was saved == what the file holds
        assert any(n.startswith("optim:optimizers.adamw.state.") for n in on_disk)
        assert any(n.startswith("teacher:") for n in on_disk)


def test_perturb_at_moves_one_element_of_one_parameter_by_one_ulp(tmp_path: Path) -> None:
    run(tiny(**{"train.ckpt_every": 4}), tmp_path / "a", 4)
    run(tiny(**{"train.ckpt_every": 4, "testing.perturb_at": 3, "testing.perturb_param": PARAM}), tmp_path / "b", 4)
    a = ckptkit.load(tmp_path / "a" / checkpoint_name(4)).model["model"]
    b = ckptkit.load(tmp_path / "b" / checkpoint_name(4)).model["model"]
    assert [k for k in a if not torch.equal(a[k], b[k])] == [PARAM]
    x, y = a[PARAM].view(-1), b[PARAM].view(-1)
    assert torch.equal(x[1:], y[1:]) and y[0] == torch.nextafter(x[0], torch.tensor(float("inf")))


def test_perturb_param_must_name_a_parameter(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--perturb-param 'nope' is not a parameter of the model \(parameters: wte"):
        run(tiny(**{"testing.perturb_at": 1, "testing.perturb_param": "nope"}), tmp_path, 2)


def test_a_config_rebuilt_from_its_snapshot_is_the_same_config() -> None:
    cfg = tiny(
        **{
            "testing.perturb_at": 3,
            "testing.perturb_param": PARAM,
            "model.quant": "int8",
            "train.lr": 1e-3,
            "testing.trip_latch_at": 2,
            "train.rand_depth": True,
        }
    )
    table = json.loads(encode_snapshot(cfg))["config"]
    assert TrainerConfig.from_table(table) == cfg
    assert {f"{t}.{k}" for t, sub in table.items() for k in sub} == {k for k, _ in knobs()}
    del table["testing"]["perturb_param"]  # a key the snapshot lacks takes its default
    assert TrainerConfig.from_table(table).testing.perturb_param == ""
    with pytest.raises(KeyError, match=r"'train\.bogus' is not a config key"):
        TrainerConfig.from_table({"train": {"bogus": 1}})


# ----------------------------------------------------------------------------- replay


def test_replay_of_an_untouched_run_is_identical_and_leaves_the_run_alone(
    perturbed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _files(perturbed)
    code, doc = _replay(capsys, str(perturbed), "--from", "2")
    assert code == 0, doc
    assert doc["ok"] is True and doc["divergence"] is None
    assert (doc["what"], doc["resume_at"], doc["steps"], doc["schema_version"]) == ("replay", 2, 6, 2)
    assert doc["checkpoints_compared"] == 2  # RUN's step 4 and 6 against the replay's, bit for bit
    assert main(["replay", str(perturbed), "--from", "3", "--to", "4", "--quiet"]) == 0  # from the checkpoint at 2
    assert "IDENTICAL: steps 2..3, every history fingerprint and 1 checkpoint(s) bit for bit" in capsys.readouterr().out
    assert _files(perturbed) == before


def test_replay_names_the_step_and_parameter_of_a_recorded_perturbation(
    perturbed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _files(perturbed)
    code, doc = _replay(capsys, str(perturbed), "--from", "2", "--no-perturb")
    assert code == 1
    d = doc["divergence"]
    assert (d["kind"], d["step"]) == ("step", 3)
    assert [f["field"] for f in d["fields"]] == ["params_digest"]  # loss and grad norm of step 3 are untouched
    assert [t["name"] for t in d["tensors"]] == [NAME]
    # The --json tensor keys are spec/replay.md R-P09's, no more and no fewer.
    spec_keys = {"name", "detail", "recorded_digest", "actual_digest", "n_diff", "numel", "max_abs_diff"}
    assert set(d["tensors"][0]) == spec_keys
    ulp = float(torch.finfo(torch.float32).eps)  # element 0 moved by one ulp (a small value: far below eps)
    assert d["tensors"][0]["n_diff"] == 1 and 0 < d["tensors"][0]["max_abs_diff"] < ulp
    assert "step-00000004.ckpt" in d["values"]  # the recorded values: the run's verified checkpoint
    assert d["rerun"]["identical"] is True  # deterministic here: the recording ran something else
    with pytest.raises(ckptkit.ReplayDivergence, match=f"(?s)DIFFERS at step 3.*{NAME}"):
        replay(perturbed, 2, overrides={"testing.perturb_at": None}).raise_for_divergence()
    assert doc["overrides"] == [{"field": "testing.perturb_at", "recorded": 3, "replay": None}]
    assert "the runs' configs differ in testing.perturb_at: the likely cause" in d["hints"]
    assert _files(perturbed) == before
    main(["replay", str(perturbed), "--from", "2", "--no-perturb", "--quiet"])
    out = capsys.readouterr().out
    assert "DIFFERS at step 3: the step row" in out and NAME in out and "1/" in out


def test_replay_with_a_perturbation_names_it_even_without_a_checkpoint_after_it(perturbed: Path) -> None:
    report = replay(perturbed, 2, overrides={"testing.perturb_at": None, "testing.perturb_param": "wpe"})
    assert report.divergence is not None and report.divergence.step == 3  # the recording's own perturbation
    report = replay(perturbed, 4, overrides={"testing.perturb_at": 4, "testing.perturb_param": "wpe"})
    d = report.divergence
    assert d is not None and (d.kind, d.step) == ("step", 4)
    assert {t.name for t in d.tensors} == {"model:model.wpe"}  # named from the per-step digests ...
    assert d.tensors[0].max_abs_diff is None and "unavailable" in d.values  # ... no checkpoint after step 4
    assert d.rerun is not None and d.rerun.identical


def test_a_checkpoint_altered_after_the_fact_is_a_divergence_at_its_own_step(
    perturbed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(perturbed, run_dir)
    path = run_dir / checkpoint_name(4)
    ckpt = ckptkit.load(path)
    ckpt.optim["optimizers"]["adamw"]["state"][3]["exp_avg"].view(-1)[5] += 0.25
    ckptkit.save(path, ckpt)  # re-sealed: every container checksum is valid again
    assert ckptkit.verify(path).ok

    code, doc = _replay(capsys, str(run_dir), "--from", "4")
    assert code == 1
    d = doc["divergence"]
    assert (d["kind"], d["step"], d["file"]) == ("checkpoint", 4, str(path))
    assert [t["name"] for t in d["tensors"]] == ["optim:optimizers.adamw.state.3.exp_avg"]
    assert d["tensors"][0]["max_abs_diff"] is None  # only digests were recorded at step 4

    code, doc = _replay(capsys, str(run_dir), "--from", "2")  # re-derives the recorded values on the way
    d = doc["divergence"]
    assert code == 1 and (d["kind"], d["step"]) == ("checkpoint", 4)
    assert [t["name"] for t in d["tensors"]] == ["optim:optimizers.adamw.state.3.exp_avg"]
    assert d["tensors"][0]["max_abs_diff"] == pytest.approx(0.25, rel=1e-3)

    # ckptkit diff --tensors on the same pair (as written, as altered) names the same tensor.
    assert main(["diff", str(perturbed / checkpoint_name(4)), str(path), "--tensors", "--json"]) == 1
    names = [t["name"] for t in json.loads(capsys.readouterr().out)["tensors"]]
    assert names == [t["name"] for t in d["tensors"]]


def test_diff_tensors_and_replay_name_the_same_tensors(
    perturbed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "replayed"
    code, doc = _replay(capsys, str(perturbed), "--from", "2", "--no-perturb", "--out", str(out))
    assert code == 1
    replayed = [(t["name"], t["max_abs_diff"]) for t in doc["divergence"]["tensors"]]
    pair = (str(perturbed / checkpoint_name(4)), str(out / checkpoint_name(4)))
    assert main(["diff", *pair, "--tensors", "--json"]) == 1
    diffed = [(t["name"], t["max_abs_diff"]) for t in json.loads(capsys.readouterr().out)["tensors"]]
    assert diffed == replayed == [(NAME, replayed[0][1])]


def test_replay_refuses_a_different_environment_and_names_the_fact(
    perturbed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(perturbed, run_dir)
    env = json.loads((run_dir / "environment.json").read_text())
    env["intra_op_threads"] = 977
    record_environment(run_dir, env)  # recorded under 977 threads (an edit alone is damage)
    assert main(["replay", str(run_dir), "--from", "2", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"intra_op_threads: recorded 977, now {torch.get_num_threads()}" in err and "--allow-env-change" in err
    code, doc = _replay(capsys, str(run_dir), "--from", "2", "--allow-env-change")
    assert code == 0  # the steps were really recorded under this thread count
    threads = torch.get_num_threads()  # the replay ran under them: its resume row says so, from its start
    assert doc["environment_differences"] == [{"key": "intra_op_threads", "a": 977, "b": threads, "from_step": 2}]


def test_replay_trouble_is_exit_2(perturbed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(perturbed), "--from", "2", "--to", "7", "--quiet"]) == 2
    assert "--to 7 is outside the replayable range" in capsys.readouterr().err
    assert main(["replay", str(perturbed), "--from", "1", "--quiet"]) == 2
    assert "no checkpoint at or before step 1 (checkpoints: 2, 4, 6)" in capsys.readouterr().err
    assert main(["replay", str(tmp_path), "--from", "1", "--quiet"]) == 2
    assert "no history" in capsys.readouterr().err
    assert main(["replay", str(perturbed), "--from", "2", "--out", str(perturbed / "x"), "--quiet"]) == 2
    assert "replay never writes into RUN" in capsys.readouterr().err


def test_replay_help_shows_an_example_the_exit_codes_and_the_testing_aid(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--help"]) == 0
    out = capsys.readouterr().out
    assert "example:" in out and "exit codes:" in out and "TESTING AID" in out and "--perturb-at" in out


# ----------------------------------------------------------------------------- the library, without the trainer


def test_leaf_digests_are_exact_and_type_strict() -> None:
    assert len({leaf_digest("v", x) for x in (1, 1.0, True, "1", None, b"1", 0.0, -0.0)}) == 8
    assert leaf_digest("v", float("nan")) == leaf_digest("v", float("nan"))
    assert leaf_digest("w", torch.ones(2)) == tensor_digest("w", torch.ones(2))
    assert leaf_digest("a", 1) != leaf_digest("b", 1)
    with pytest.raises(ckptkit.UnsupportedValue, match="v: cannot fingerprint a list"):
        leaf_digest("v", [1])


def test_combine_is_state_digest_and_differing_names_is_symmetric() -> None:
    named = {f"t{i}": torch.full((3,), float(i)) for i in range(4)}
    assert combine(tensor_digest(n, t) for n, t in named.items()) == state_digest(named)
    a, b = {"x": 1, "y": 2}, {"y": 3, "z": 4}
    assert differing_names(a, b) == differing_names(b, a) == ["x", "y", "z"]


def test_first_divergence_in_files_works_on_any_jsonl_history(tmp_path: Path) -> None:
    def write(name: str, rows: list[dict[str, Any]]) -> Path:
        p = tmp_path / name
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return p

    rows = [{"step": s, "loss_bits": f"0x{s:08x}", "params_digest": 100 + s} for s in range(5)]
    a = write("a.jsonl", rows)
    assert first_divergence_in_files(a, write("same.jsonl", rows)) is None
    changed = [dict(r) for r in rows]
    changed[3]["params_digest"] = 7
    changed.append({"step": 3, "params_digest": 103, "loss_bits": "0x00000003"})  # a re-run supersedes row 3
    changed[4]["loss_bits"] = "0xbad"
    d = first_divergence_in_files(a, write("b.jsonl", changed))
    assert d is not None and (d.step, d.field_names) == (4, ("loss_bits",))


def test_first_divergence_in_files_on_two_trainer_histories(perturbed: Path, tmp_path: Path) -> None:
    run(tiny(**{"train.ckpt_every": 2}), tmp_path, 6)
    d = first_divergence_in_files(tmp_path / "history.jsonl", perturbed / "history.jsonl")
    assert d is not None and (d.step, d.field_names) == (3, ("params_digest",))


def test_a_rerun_that_differs_in_its_row_but_in_no_tensor_is_described_not_crashed() -> None:
    """A nondeterministic re-run can disagree on a row field (the loss) while every captured
    tensor matches; the report names the field and no tensor (it raised ValueError before)."""
    rerun = Rerun(False, fields=(FieldDiff("loss_bits", "0x40a00000", "0x40a00001"),))
    d = Difference("step", 7, fields=(FieldDiff("loss_bits", "0x40a00000", "0x40a00002"),), rerun=rerun)
    text = AuditReport(
        what="replay",
        command=("ckptkit", "train"),
        steps=10,
        resume_at=5,
        rows_compared=3,
        checkpoints_compared=0,
        divergence=d,
    ).describe()
    assert (
        "  re-run of step 7 twice here: DIFFERS (nondeterministic in this process):\n"
        "    loss_bits: first 0x40a00000, second 0x40a00001\n"
    ) in text
