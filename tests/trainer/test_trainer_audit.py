"""The determinism audit (spec/replay.md R-P11..R-P13): the same run twice, compared bit for bit."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
from helpers import TINY_FLAGS, run, tiny

from ckptkit.cli import main
from ckptkit.cli._train import add_parser as add_train_parser
from ckptkit.cli._train import config_from_args
from ckptkit.format._checkpoint import load, save
from ckptkit.run import checkpoint_name
from ckptkit.trainer._audit import compare_runs, knob_flags

pytestmark = pytest.mark.slow


def _train_args(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers())
    return parser.parse_args(["train", "--run-dir", "x", *flags])


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"model.quant": "int8", "train.quant_check": True, "testing.trip_latch_at": 3, "train.lr": 1.2345e-3},
        {
            "train.aux": False,
            "model.ngram": False,
            "testing.perturb_at": 2,
            "testing.perturb_param": "wpe",
            "monitor.multiplier": 2.5,
            "train.seed": 2**64 - 1,
        },
    ],
)
def test_knob_flags_reproduce_the_config_on_the_train_command_line(changes: dict[str, object]) -> None:
    cfg = tiny(**changes)
    assert config_from_args(_train_args(knob_flags(cfg))) == cfg


def test_audit_of_the_same_config_in_two_processes_is_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["audit", *TINY_FLAGS, "--steps", "3", "--keep-dir", str(tmp_path), "--json", "--quiet"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    assert doc["schema_version"] == 2 and doc["what"] == "audit"  # the one report of every audit (R-P13)
    assert doc["ok"] is True and doc["divergence"] is None and doc["resume_at"] is None
    assert doc["checkpoints_compared"] == 3  # --ckpt-every 1 and every checkpoint kept, by default
    assert doc["environment"]["torch"] and doc["environment_differences"] == []
    assert (tmp_path / "a" / "history.jsonl").is_file() and (tmp_path / "b" / "history.jsonl").is_file()


def test_audit_resume_at_compares_a_stopped_and_resumed_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", *TINY_FLAGS, "--steps", "4", "--resume-at", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "b: cooperative stop at step 2, resumed in a fresh process" in out  # it trains to --steps 2 itself
    assert "IDENTICAL: 4 steps, every history fingerprint and 4 checkpoint(s) bit for bit" in out
    assert "intra_op_threads" in out  # the environment is shown


def test_audit_refuses_a_resume_point_outside_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", *TINY_FLAGS, "--steps", "3", "--resume-at", "3", "--quiet"]) == 2
    assert "--resume-at must be in 1 ..= 2 (--steps 3) (got 3)" in capsys.readouterr().err


# Two independent runs of the same config (a checkpoint at every step), shared by the compare_runs tests;
# a test that edits a run edits its own copy.
_TWIN_CFG = tiny(**{"train.ckpt_every": 1, "train.keep": 100})


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    a, c = tmp_path_factory.mktemp("twin_a"), tmp_path_factory.mktemp("twin_c")
    run(_TWIN_CFG, a, 4)
    run(_TWIN_CFG, c, 4)
    return a, c


def test_compare_runs_names_the_first_divergence_the_tensor_and_the_config_difference(
    tmp_path: Path, twins: tuple[Path, Path]
) -> None:
    a, c = twins
    perturbed = _TWIN_CFG.replace(**{"testing.perturb_at": 1, "testing.perturb_param": "blocks.0.attn.qkv.weight"})
    run(perturbed, tmp_path / "b", 4)
    report = compare_runs(a, tmp_path / "b")
    d = report.divergence
    assert not report.ok and d is not None and (d.kind, d.step) == ("step", 1)
    assert [f.field for f in d.fields] == ["params_digest"]
    assert [t.name for t in d.tensors] == ["model:model.blocks.0.attn.qkv.weight"]
    first = d.tensors[0]
    assert first.n_diff == 1 and first.max_abs_diff is not None and first.max_abs_diff > 0
    assert d.rerun is not None and d.rerun.identical
    assert "testing.perturb_at" in d.hints[0]
    doc = report.to_json()
    assert doc["divergence"]["fields"] == [
        {"field": "params_digest", "a": d.fields[0].recorded, "b": d.fields[0].replayed}
    ]
    assert compare_runs(a, c).ok


def test_compare_runs_names_a_checkpoint_whose_bytes_differ_while_every_row_matches(
    tmp_path: Path, twins: tuple[Path, Path]
) -> None:
    a, c = twins
    shutil.copytree(c, tmp_path / "b")
    path = tmp_path / "b" / checkpoint_name(2)
    ckpt = load(path)
    ckpt.teacher["wte"].view(-1)[0] += 1.0  # no fingerprint covers the teacher: only the file can tell
    save(path, ckpt)
    d = compare_runs(a, tmp_path / "b").divergence
    assert d is not None and (d.kind, d.step, d.file) == ("checkpoint", 2, checkpoint_name(2))
    assert [t.name for t in d.tensors] == ["teacher:wte"] and d.tensors[0].n_diff == 1
    assert "state outside the fingerprints" in d.hints[0]


def test_audit_help_shows_an_example_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--help"]) == 0
    out = capsys.readouterr().out
    assert "example:" in out and "exit codes:" in out and "--resume-at" in out and "--perturb-at" in out
