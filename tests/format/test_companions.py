"""A checkpoint's companions -- its config snapshot, its sidecars and the run's
``environment.json`` -- are bound to it by digests the checkpoint records
(spec/companions.md): an edited, damaged or swapped companion is found by
``ckptkit verify`` (naming the file) and makes a resume fall back exactly as a
damaged checkpoint does, never report "drift"."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import TINY_FLAGS, Cfg, Loop, fixture_generator, trained

import ckptkit
from ckptkit import CheckpointNotFound, ChecksumMismatch
from ckptkit.cli import main
from ckptkit.run import checkpoint_name

TRAIN_FLAGS = [*TINY_FLAGS, "--ckpt-every", "2", "--keep", "10", "--log-every", "1000"]


def snapshot_of(run_dir: Path, step: int) -> Path:
    return run_dir / (checkpoint_name(step) + ".config.json")


def edit_value(path: Path, key: str, value: object) -> None:
    """What a person does by hand: change one value, keep the file well formed."""
    doc = json.loads(path.read_text())
    doc["config"][key] = value
    path.write_text(json.dumps(doc, sort_keys=True, indent=2) + "\n")


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def resume(run_dir: Path, cfg: Cfg | None = None):
    logged: list[str] = []
    loop = Loop(run_dir, cfg, log=logged.append)
    return loop, loop.state.resume(), logged


# ----------------------------------------------------------------------------- resume (RunState)


@pytest.mark.parametrize("damage", ["edit", "flip"])
def test_a_damaged_snapshot_is_damage_not_drift_and_the_resume_falls_back(tmp_path: Path, damage: str) -> None:
    trained(tmp_path, steps=4)
    snap = snapshot_of(tmp_path, 4)
    if damage == "edit":
        edit_value(snap, "lr", 0.03)
    else:
        flip_byte(snap, snap.read_bytes().index(b'"width"') + 2)  # "width" -> "whdth": parses, a dead key
    loop, info, logged = resume(tmp_path)
    assert info.step == 2 and loop.position == 8
    assert [os.path.basename(p) for p, _ in info.skipped] == [checkpoint_name(4)]
    why = info.skipped[0][1]
    assert why.startswith(f"{snap}: damaged: ") and "drift" not in why
    assert f"does not match the digest {checkpoint_name(4)} records" in why
    assert logged[-1] == f"falling back to {checkpoint_name(2)} (step 2)"


def test_a_snapshot_swapped_in_from_another_run_is_found(tmp_path: Path) -> None:
    trained(tmp_path / "a", steps=4)
    trained(tmp_path / "b", steps=4, cfg=Cfg(lr=0.03))
    shutil.copy(snapshot_of(tmp_path / "b", 4), snapshot_of(tmp_path / "a", 4))
    _, info, _ = resume(tmp_path / "a")
    assert info.step == 2 and "damaged" in info.skipped[0][1]


def test_a_sidecar_swapped_in_from_another_run_at_the_same_step_is_found(tmp_path: Path) -> None:
    """The step stamp (R-021) cannot tell two runs' step-4 sidecars apart; the binding can."""
    trained(tmp_path / "a", steps=4)
    b = trained(tmp_path / "b", steps=3)
    b.table["counts"][0] += 5
    b.step(3)
    b.state.save(4)
    name = checkpoint_name(4) + ".counts"
    shutil.copy(tmp_path / "b" / name, tmp_path / "a" / name)
    _, info, _ = resume(tmp_path / "a")
    assert info.step == 2
    assert info.skipped[0][1].startswith(f"{tmp_path / 'a' / name}: damaged: ")


def test_every_snapshot_damaged_refuses_naming_each_file(tmp_path: Path) -> None:
    trained(tmp_path, steps=4)
    for step in (2, 4):
        edit_value(snapshot_of(tmp_path, step), "lr", 0.03)
    with pytest.raises(CheckpointNotFound) as e:
        Loop(tmp_path).state.resume()
    message = str(e.value)
    assert message.startswith(f"{tmp_path}: no consistent checkpoint to resume from")
    for step in (2, 4):
        assert f"{snapshot_of(tmp_path, step)}: damaged" in message
    assert "drift" not in message


def test_a_damaged_environment_record_refuses_naming_it(tmp_path: Path) -> None:
    trained(tmp_path, steps=4)
    env = tmp_path / "environment.json"
    env.write_text(env.read_text().replace('"intra_op_threads": ', '"intra_op_threads": 1'))
    with pytest.raises(CheckpointNotFound) as e:
        Loop(tmp_path).state.resume()
    assert f"{env}: damaged: " in str(e.value)


def test_an_unparsable_snapshot_of_an_unbound_checkpoint_is_skipped_too(tmp_path: Path) -> None:
    """A checkpoint without companion digests (written before the binding) still
    skips a snapshot that does not parse, and says its companions are unprotected."""
    trained(tmp_path, steps=4)
    _strip_binding(tmp_path / checkpoint_name(4))
    snap = snapshot_of(tmp_path, 4)
    snap.write_bytes(snap.read_bytes()[:-3])
    _, info, _logged = resume(tmp_path)
    assert info.step == 2 and "not a config snapshot" in info.skipped[0][1]


def test_resume_of_an_unbound_checkpoint_says_its_companions_are_unprotected(tmp_path: Path) -> None:
    trained(tmp_path, steps=2)
    _strip_binding(tmp_path / checkpoint_name(2))
    _, info, _ = resume(tmp_path)
    assert info.step == 2
    assert (
        f"{checkpoint_name(2)} records no companion digests (written before companion binding): "
        "its snapshot, sidecars and environment.json are not integrity-checked"
    ) in info.notes


def _strip_binding(path: Path) -> None:
    """Re-save a checkpoint without the companion record: a file from before the binding."""
    import ckptkit

    ckpt = ckptkit.load(path)
    monitor = {k: v for k, v in (ckpt.monitor or {}).items() if k != "companions"} or None
    ckptkit.save(
        path,
        ckptkit.Checkpoint(
            step=ckpt.step, model=ckpt.model, optim=ckpt.optim, teacher=ckpt.teacher, monitor=monitor, flags=ckpt.flags
        ),
    )


def test_the_record_is_the_digest_of_each_companion_file(tmp_path: Path) -> None:
    import xxhash

    import ckptkit
    from ckptkit.format._sidecar import read_sidecar

    trained(tmp_path, steps=2)
    path = tmp_path / checkpoint_name(2)
    record = ckptkit.load(path).monitor["companions"]
    side = read_sidecar(str(path) + ".counts")
    assert record == {
        "environment": xxhash.xxh3_64_intdigest((tmp_path / "environment.json").read_bytes()),
        "sidecars": {"counts": side.digest},
        "snapshot": xxhash.xxh3_64_intdigest(snapshot_of(tmp_path, 2).read_bytes()),
    }


def test_an_async_save_records_the_same_bytes(tmp_path: Path) -> None:
    trained(tmp_path / "sync", steps=2)
    loop = Loop(tmp_path / "async", async_save=True)
    loop.state.start()
    for i in range(2):
        loop.step(i)
    loop.state.save(2)
    loop.state.close()
    for name in (checkpoint_name(2), checkpoint_name(2) + ".config.json", checkpoint_name(2) + ".counts"):
        assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "async" / name).read_bytes(), name


def test_check_companions_raises_a_checksum_mismatch(tmp_path: Path) -> None:
    from ckptkit.format._companions import check_companions, read_record

    trained(tmp_path, steps=2)
    path = str(tmp_path / checkpoint_name(2))
    check_companions(path, read_record(path), sidecars=("counts",))
    edit_value(snapshot_of(tmp_path, 2), "lr", 0.5)
    with pytest.raises(ChecksumMismatch, match="damaged"):
        check_companions(path, read_record(path), sidecars=("counts",))


# ----------------------------------------------------------------------------- the reference trainer's --resume


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["edit", "flip"])
def test_ckptkit_train_resume_falls_back_from_a_damaged_snapshot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    run = str(tmp_path)
    assert main(["train", "--run-dir", run, "--steps", "4", "--quiet", *TRAIN_FLAGS]) == 0
    snap = snapshot_of(tmp_path, 4)
    if damage == "edit":
        doc = json.loads(snap.read_text())
        doc["config"]["train"]["lr"] = doc["config"]["train"]["lr"] * 2
        snap.write_text(json.dumps(doc, sort_keys=True, indent=2) + "\n")
    else:
        flip_byte(snap, snap.read_bytes().index(b'"lr"') + 1)
    capsys.readouterr()
    assert main(["train", "--run-dir", run, "--steps", "6", "--resume", *TRAIN_FLAGS]) == 0
    out, err = capsys.readouterr()
    assert f"skipped {checkpoint_name(4)}: {snap}: damaged: " in err
    assert f"falling back to {checkpoint_name(2)} (step 2)" in err
    assert "drift" not in err
    assert out.splitlines()[0] == f"step 6: {tmp_path / checkpoint_name(6)}"


# ----------------------------------------------------------------------------- ckptkit verify


def verify(capsys: pytest.CaptureFixture[str], *paths: Path) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["verify", *map(str, paths)])
    return code, capsys.readouterr().out.splitlines()


def test_verify_run_checks_every_companion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trained(tmp_path, steps=4)
    code, lines = verify(capsys, tmp_path)
    assert code == 0
    assert f"OK    {snapshot_of(tmp_path, 4)}  snapshot, bound to {checkpoint_name(4)}" in lines
    assert f"OK    {tmp_path / 'environment.json'}  environment, bound to 2 checkpoints" in lines
    assert not [line for line in lines if not line.startswith("OK    ")]


@pytest.mark.parametrize("damage", ["edit", "flip"])
def test_verify_run_names_a_damaged_snapshot_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    trained(tmp_path, steps=4)
    snap = snapshot_of(tmp_path, 4)
    edit_value(snap, "lr", 0.03) if damage == "edit" else flip_byte(snap, 10)
    for target in (tmp_path, tmp_path / checkpoint_name(4)):
        code, lines = verify(capsys, target)
        assert code == 1
        fails = [line for line in lines if line.startswith("FAIL")]
        assert fails == [
            (
                f"FAIL  {snap}: damaged: its xxh3-64 does not match the digest {checkpoint_name(4)} "
                f"records (expected 0x{_recorded(tmp_path, 4):016x}, got 0x{_digest(snap):016x}); "
                "the file was edited, damaged or swapped after the checkpoint was saved; "
                "resume from an earlier checkpoint (R-C02)"
            )
        ]


def _recorded(run_dir: Path, step: int) -> int:
    from ckptkit.format._companions import read_record

    record = read_record(run_dir / checkpoint_name(step))
    assert record is not None
    return int(record["snapshot"])


def _digest(path: Path) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(path.read_bytes())


def test_verify_names_a_damaged_environment_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trained(tmp_path, steps=2)
    env = tmp_path / "environment.json"
    env.write_bytes(env.read_bytes().replace(b"true", b"false", 1))
    code, lines = verify(capsys, tmp_path)
    assert code == 1
    assert [line.split(": damaged")[0] for line in lines if line.startswith("FAIL")] == [f"FAIL  {env}"]


def test_verify_run_fails_a_missing_snapshot_a_lone_checkpoint_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trained(tmp_path / "run", steps=2)
    snapshot_of(tmp_path / "run", 2).unlink()
    code, lines = verify(capsys, tmp_path / "run")
    assert code == 1
    assert f"FAIL  {snapshot_of(tmp_path / 'run', 2)}: config snapshot is missing" in lines
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(tmp_path / "run" / checkpoint_name(2), alone)
    code, lines = verify(capsys, alone / checkpoint_name(2))
    assert code == 0 and len(lines) == 1 and lines[0].startswith("OK ")


def test_verify_of_a_checkpoint_also_verifies_the_sidecar_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trained(tmp_path, steps=2)
    side = tmp_path / (checkpoint_name(2) + ".counts")
    flip_byte(side, len(side.read_bytes()) - 16 - 64 - 1)  # a tensor byte: the trailer still reads
    code, lines = verify(capsys, tmp_path / checkpoint_name(2))
    assert code == 1
    assert next(line for line in lines if line.startswith("FAIL")).startswith(f"FAIL  {side}: ")


def test_verify_warns_that_an_unbound_checkpoints_companions_are_unprotected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trained(tmp_path, steps=2)
    _strip_binding(tmp_path / checkpoint_name(2))
    edit_value(snapshot_of(tmp_path, 2), "lr", 0.03)  # nothing can notice this
    code, lines = verify(capsys, tmp_path)
    assert code == 0
    assert (
        f"WARN  {snapshot_of(tmp_path, 2)}: not protected: {checkpoint_name(2)} records no companion "
        "digests (written before companion binding); it parses, nothing more is checked"
    ) in lines
    flip_byte(snapshot_of(tmp_path, 2), 0)  # "{" -> "z": no longer JSON
    code, lines = verify(capsys, tmp_path)
    assert code == 1
    assert any(line.startswith(f"FAIL  {snapshot_of(tmp_path, 2)}: not a config snapshot") for line in lines)


def test_verify_json_lists_companions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trained(tmp_path, steps=2)
    flip_byte(snapshot_of(tmp_path, 2), 10)
    capsys.readouterr()
    assert main(["verify", str(tmp_path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and all(f["ok"] for f in doc["files"])
    by_path = {c["path"]: c for c in doc["companions"]}
    assert sorted(by_path) == [str(tmp_path / "environment.json"), str(snapshot_of(tmp_path, 2))]
    snap = by_path[str(snapshot_of(tmp_path, 2))]
    assert snap["kind"] == "snapshot" and snap["protected"] is True and snap["error"]["type"] == "ChecksumMismatch"
    assert snap["checkpoints"] == [str(tmp_path / checkpoint_name(2))]


def test_two_runs_differing_in_an_exempt_key_differ_only_in_the_record(tmp_path: Path) -> None:
    """Each binds its own snapshot (``steps`` differs), so the bytes differ; with the
    records set aside they are the same checkpoint (what audit and replay compare)."""
    from ckptkit.format._companions import unbound_bytes

    trained(tmp_path / "a", steps=2, cfg=Cfg(steps=10))
    trained(tmp_path / "b", steps=2, cfg=Cfg(steps=20))
    a, b = tmp_path / "a" / checkpoint_name(2), tmp_path / "b" / checkpoint_name(2)
    assert a.read_bytes() != b.read_bytes()
    assert unbound_bytes(a) == unbound_bytes(b)


def test_the_same_checkpoint_is_one_rule_the_record_set_aside_and_every_other_byte_counted(tmp_path: Path) -> None:
    """``same_checkpoint`` (what audit, replay and the trainer's comparisons use): two files that
    differ only in their companion records are the same checkpoint; one more differing byte
    anywhere else (a tensor's, here) is not."""
    import torch

    from ckptkit.audit._recording import RunRecording, first_difference
    from ckptkit.format._companions import same_checkpoint

    trained(tmp_path / "a", steps=2, cfg=Cfg(steps=10))
    trained(tmp_path / "b", steps=2, cfg=Cfg(steps=20))
    a, b = tmp_path / "a" / checkpoint_name(2), tmp_path / "b" / checkpoint_name(2)
    assert a.read_bytes() != b.read_bytes() and same_checkpoint(a, b) and same_checkpoint(a, a)
    assert first_difference(RunRecording(tmp_path / "a"), RunRecording(tmp_path / "b")) is None
    ckpt = ckptkit.load(b)
    weight = ckpt.model["body"]["weight"]
    weight.view(torch.int32).view(-1)[0] ^= 1  # one bit of one tensor
    ckptkit.save(b, ckpt)
    assert not same_checkpoint(a, b)
    d = first_difference(RunRecording(tmp_path / "a"), RunRecording(tmp_path / "b"))
    assert d is not None and d.kind == "checkpoint" and d.tensor_names == ("model:body.weight",)


def test_verifying_a_run_and_its_companions_does_not_import_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    trained(tmp_path, steps=2)
    code = (
        "import sys, ckptkit.format._companions; from ckptkit.cli import main; "
        f"assert main(['verify', {str(tmp_path)!r}]) == 0; assert 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# ----------------------------------------------------------------------------- the run fixtures


ROOT = Path(__file__).resolve().parents[2]
RUNS: dict[str, dict[str, Any]] = json.loads((ROOT / "fixtures" / "MANIFEST.json").read_text())["runs"]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_verify_reports_each_run_fixture_as_the_manifest_says(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    run = ROOT / "fixtures" / "runs" / name
    want: dict[str, dict[str, object]] = RUNS[name]["companions"]
    capsys.readouterr()
    code = main(["verify", str(run), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == (1 if any(c["error"] for c in want.values()) else 0)
    got = {Path(c["path"]).name: c for c in doc["companions"]}
    for file, entry in want.items():
        if entry["error"] is None:
            assert file not in got or (got[file]["ok"] and got[file]["protected"] == entry["protected"]), file
        else:
            assert got[file]["error"] == {
                "type": entry["error"],
                "message": str(entry["message"]).replace("<run>", str(run)),
            }, file
    if name == "unbound":
        assert got[checkpoint_name(7) + ".config.json"]["protected"] is False


def test_the_generator_rebuilds_the_run_fixtures_byte_for_byte(tmp_path: Path) -> None:
    import hashlib

    generate = fixture_generator()
    assert generate.build_runs(tmp_path) == RUNS
    for name, entry in RUNS.items():
        files = entry["files"]
        assert sorted(p.name for p in (ROOT / "fixtures" / "runs" / name).iterdir()) == sorted(files)
        for file, facts in files.items():
            assert (
                hashlib.sha256((ROOT / "fixtures" / "runs" / name / file).read_bytes()).hexdigest() == facts["sha256"]
            )


def test_resume_skips_a_checkpoint_whose_record_is_malformed(tmp_path: Path) -> None:
    import ckptkit

    trained(tmp_path, steps=4)
    path = tmp_path / checkpoint_name(4)
    ckpt = ckptkit.load(path)
    ckpt.monitor["companions"]["history"] = 0
    ckptkit.save(path, ckpt)
    _, info, _ = resume(tmp_path)
    assert info.step == 2
    assert "the companion record needs snapshot and sidecars" in info.skipped[0][1] and "(R-C01" in info.skipped[0][1]


# ----------------------------------------------------------------------------- history.jsonl


def _trained_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    assert main(["train", "--run-dir", str(tmp_path), "--steps", "4", "--quiet", *TRAIN_FLAGS]) == 0
    capsys.readouterr()
    return tmp_path / "history.jsonl"


@pytest.mark.slow
def test_verify_checks_what_it_can_in_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hist = _trained_history(tmp_path, capsys)
    code, lines = verify(capsys, tmp_path)
    assert code == 0
    assert lines[-1].startswith(f"OK    {hist}  history, ") and "steps 0..3" in lines[-1]
    original = hist.read_bytes()

    rows = original.split(b"\n")
    step_lines = [i for i, r in enumerate(rows) if b'"kind":"step"' in r]
    # A digit of one loss changed: its loss_bits twin disagrees.
    i = step_lines[1]
    row = json.loads(rows[i])
    row["loss"] = row["loss"] * 2
    rows[i] = json.dumps(row, sort_keys=True, separators=(",", ":")).encode()
    hist.write_bytes(b"\n".join(rows))
    code, lines = verify(capsys, tmp_path)
    assert code == 1
    assert [line for line in lines if line.startswith("FAIL")] == [
        (
            f"FAIL  {hist}: line {i + 1} (offset {sum(len(r) + 1 for r in rows[:i])}): "
            f"loss {json.dumps(row['loss'])} disagrees with loss_bits {row['loss_bits']}"
        )
    ]

    # A step row lost, a line that is not JSON, and a torn tail.
    rows = original.split(b"\n")
    del rows[step_lines[2]]
    rows.insert(1, b"{not json")
    hist.write_bytes(b"\n".join(rows) + b'{"kind":"st')
    code, lines = verify(capsys, tmp_path)
    assert code == 1
    fails = [line for line in lines if line.startswith(("FAIL", "WARN"))]
    assert fails[0].startswith(f"FAIL  {hist}: line 2 (offset ") and "not JSON" in fails[0]
    assert fails[1].endswith("step 2 missing before step row 3")
    assert fails[2] == f"WARN  {hist}: torn last line (a crash mid-append); the next resume drops it"


def test_check_history_follows_reruns_rollbacks_and_resumes(tmp_path: Path) -> None:
    from ckptkit.run._history import check_history

    def rows(*pairs: tuple[str, int, dict[str, object]]) -> Path:
        path = tmp_path / "history.jsonl"
        path.write_text("".join(json.dumps({"kind": k, "step": s, **extra}) + "\n" for k, s, extra in pairs))
        return path

    good = rows(
        ("start", 0, {}),
        ("step", 0, {}),
        ("step", 1, {}),
        ("step", 1, {"rerun": True}),
        ("rollback", 1, {"to": 0}),
        ("step", 0, {}),
        ("step", 1, {}),
        ("resume", 2, {}),
        ("step", 2, {}),
    )
    check = check_history(good)
    assert check.ok and check.rows == 9 and check.steps == (0, 2) and not check.torn
    bad = rows(("start", 0, {}), ("step", 1, {}), ("step", 1, {}), ("resume", 5, {}))
    assert check_history(bad).problems == (
        "line 2 (offset 29): step 0 missing before step row 1",
        "line 3 (offset 57): step row 1 out of order (expected step 2)",
        "line 4 (offset 85): resume at step 5, but the step rows before it end at 1",
    )
    # a loop that records no step rows: its guard's rows and a resume under another environment
    unrecorded = rows(("spike", 13, {}), ("rollback", 13, {"to": 10}), ("resume", 18, {"env_diffs": []}))
    assert check_history(unrecorded).ok
