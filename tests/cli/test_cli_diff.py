"""``ckptkit diff A B``: what differs between two runs' config snapshots (spec/cli.md, spec/snapshot.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from helpers import Flat

from ckptkit.cli import _diff as cli_diff
from ckptkit.format._snapshot import snapshot_path, write_snapshot


def _cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="ckptkit")
    sub = parser.add_subparsers(dest="command", required=True)
    cli_diff.add_parser(sub)
    code = cli_diff.run(parser.parse_args(["diff", *argv]))
    out, err = capsys.readouterr()
    return code, out, err


def _run_dir(root, name, cfgs):
    """A fake run directory: one placeholder checkpoint and its snapshot per step."""
    d = root / name
    d.mkdir()
    for step, cfg in cfgs.items():
        ckpt = d / f"step-{step:08d}.ckpt"
        ckpt.write_bytes(b"placeholder")
        write_snapshot(snapshot_path(ckpt), cfg)
    return d


def test_diff_of_two_run_directories_differing_in_lr_and_steps_exits_1(tmp_path, capsys):
    a = _run_dir(tmp_path, "a", {10: Flat()})
    b = _run_dir(tmp_path, "b", {10: Flat(lr=2e-3, steps=20)})
    code, out, err = _cli([str(a), str(b)], capsys)
    assert (code, err) == (1, "")
    assert out == (
        f"a: {a}/step-00000010.ckpt.config.json\n"
        f"b: {b}/step-00000010.ckpt.config.json\n"
        "CLASS   KEY    OLD    NEW    NOTE\n"
        "strict  lr     0.001  0.002\n"
        "exempt  steps  10     20     extending the run\n"
        "2 differences: 1 strict, 1 exempt\n"
    )


def test_diff_with_only_exempt_differences_exits_0(tmp_path, capsys):
    a = _run_dir(tmp_path, "a", {10: Flat()})
    b = _run_dir(tmp_path, "b", {10: Flat(steps=20)})
    code, out, _ = _cli([str(a), str(b)], capsys)
    assert code == 0
    assert out.splitlines()[-1] == "1 difference: 0 strict, 1 exempt"


def test_diff_of_identical_snapshots_says_so_and_exits_0(tmp_path, capsys):
    a = _run_dir(tmp_path, "a", {10: Flat()})
    snap = snapshot_path(a / "step-00000010.ckpt")
    code, out, _ = _cli([snap, snap], capsys)
    assert (code, out) == (0, f"a: {snap}\nb: {snap}\nno differences\n")


def test_diff_uses_the_newest_checkpoint_of_a_run_directory(tmp_path, capsys):
    a = _run_dir(tmp_path, "a", {10: Flat(seed=1), 200: Flat(seed=2), 123456789: Flat(seed=3), 9: Flat(seed=4)})
    (a / "step-1.ckpt").write_bytes(b"too few digits: not a checkpoint name")
    code, out, _ = _cli([str(a), str(a / "step-00000010.ckpt")], capsys)
    assert code == 1
    assert out.splitlines()[0] == f"a: {a}/step-123456789.ckpt.config.json"
    assert out.splitlines()[3] == "strict  seed  3    1"


def test_diff_accepts_config_json_at_the_root_of_a_run_directory(tmp_path, capsys):
    a = tmp_path / "a"
    a.mkdir()
    write_snapshot(a / "config.json", Flat(seed=5))
    code, out, _ = _cli([str(a), snapshot_path(_run_dir(tmp_path, "b", {1: Flat()}) / "step-00000001.ckpt")], capsys)
    assert code == 1
    assert out.splitlines()[0] == f"a: {a}/config.json"


def test_diff_json_prints_one_object_with_schema_version(tmp_path, capsys):
    a = _run_dir(tmp_path, "a", {10: Flat()})
    B = dataclasses.make_dataclass("B", [("lr", float), ("steps", int), ("extra", bool)])
    b = _run_dir(tmp_path, "b", {10: B(lr=2e-3, steps=20, extra=True)})
    code, out, _ = _cli([str(a), str(b), "--json"], capsys)
    assert code == 1
    doc = json.loads(out)
    assert doc == {
        "schema_version": 1,
        "old": {
            "path": f"{a}/step-00000010.ckpt.config.json",
            "config_type": f"{Flat.__module__}.Flat",
            "checkpoint": f"{a}/step-00000010.ckpt",
        },
        "new": {
            "path": f"{b}/step-00000010.ckpt.config.json",
            "config_type": "types.B",
            "checkpoint": f"{b}/step-00000010.ckpt",
        },
        "differences": [
            {"key": "extra", "kind": "only_new", "class": "strict", "new": True},
            {"key": "lr", "kind": "changed", "class": "strict", "old": 0.001, "new": 0.002},
            {"key": "seed", "kind": "only_old", "class": "strict", "old": 1},
            {"key": "steps", "kind": "changed", "class": "exempt", "old": 10, "new": 20},
        ],
        "strict": 3,
        "exempt": 1,
    }
    assert out == json.dumps(doc, sort_keys=True, indent=2) + "\n"


def test_diff_table_shows_absent_sides_and_a_changed_config_type(tmp_path, capsys):
    a = _run_dir(tmp_path, "a", {10: Flat()})
    B = dataclasses.make_dataclass("B", [("lr", float), ("steps", int), ("extra", bool)])
    b = _run_dir(tmp_path, "b", {10: B(lr=1e-3, steps=10, extra=True)})
    code, out, _ = _cli([str(a), str(b)], capsys)
    assert code == 1
    assert out.splitlines()[2:] == [
        f"config_type: {Flat.__module__}.Flat -> types.B (informational, not compared)",
        "CLASS   KEY    OLD  NEW   NOTE",
        "strict  extra  -    true  the snapshot never carried this key",
        "strict  seed   1    -     dead key, the config no longer has it",
        "2 differences: 2 strict, 0 exempt",
    ]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "{p}/missing: no such file or directory"),
        (lambda p: p / "empty", "{p}/empty: no step-XXXXXXXX.ckpt and no config.json in this run directory"),
        (
            lambda p: p / "bare" / "step-00000010.ckpt",
            (
                "{p}/bare/step-00000010.ckpt: no config snapshot next to this checkpoint "
                "(expected {p}/bare/step-00000010.ckpt.config.json)"
            ),
        ),
        (
            lambda p: p / "bare",
            (
                "{p}/bare/step-00000010.ckpt: the newest checkpoint has no config snapshot "
                "(expected {p}/bare/step-00000010.ckpt.config.json)"
            ),
        ),
        (
            lambda p: p / "broken.config.json",
            (
                "{p}/broken.config.json: not a config snapshot: invalid UTF-8 JSON (Expecting value: line 1 column 1 "
                "(char 0)); a snapshot is the <ckpt>.config.json file written next to a checkpoint"
            ),
        ),
    ],
)
def test_diff_exits_2_with_one_line_on_stderr_for_a_bad_path(tmp_path, capsys, make, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "step-00000010.ckpt").write_bytes(b"x")
    (tmp_path / "broken.config.json").write_bytes(b"")
    good = _run_dir(tmp_path, "good", {1: Flat()})
    code, out, err = _cli([str(make(tmp_path)), str(good)], capsys)
    assert (code, out) == (2, "")
    assert err == "ckptkit diff: " + message.format(p=tmp_path) + "\n"


def test_diff_help_shows_a_worked_example_and_the_exit_codes(capsys):
    parser = argparse.ArgumentParser(prog="ckptkit")
    cli_diff.add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["diff", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "  $ ckptkit diff runs/a runs/b\n" in out
    assert "  exempt  train.steps  10     20     extending the run\n" in out
    assert "exit codes:\n  0  no strict difference" in out
    assert "  2  trouble: a path is missing, not a snapshot, or unreadable" in out


def test_diff_tensors_needs_checkpoints_not_bare_snapshots(tmp_path, capsys):
    path = tmp_path / "a.config.json"
    write_snapshot(path, Flat())
    code, _, err = _cli([str(path), str(path), "--tensors"], capsys)
    assert code == 2
    assert err == (
        "ckptkit diff: --tensors needs two checkpoints (or run directories that hold one), not bare snapshots\n"
    )
