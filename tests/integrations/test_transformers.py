"""The Hugging Face ``Trainer`` integration with the real ``transformers.Trainer`` on CPU.

Every run is its own process (tests/_hf_worker.py): ``full_determinism`` switches torch's
global deterministic mode on, which must not leak into the rest of the suite, and "20
steps, process ended, resumed to 40" means a new process. A tiny GPT-2 (dropout on) is
trained 40 steps straight, and 20 steps (the process ends at 25, so steps 21..25 are lost
as in a crash) then resumed with ``train(resume_from_checkpoint=True)`` to 40: weights,
optimizer state, RNG states and every logged loss, bit for bit; with gradient
accumulation too. Step 20 is mid-epoch (12 steps per epoch; 6 with accumulation 2).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import same
from safetensors.torch import load_file

import ckptkit
from ckptkit.cli import main
from ckptkit.integrations.hf_folder import CONFIG_FILE, LAYOUT, STATE_FILE, check_folder, newest_intact

pytestmark = pytest.mark.slow

_WORKER = str(Path(__file__).resolve().parents[1].joinpath("_hf_worker.py"))
_ROOT = str(Path(__file__).resolve().parents[2])


def _start(out: Path, *flags: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": _ROOT, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [sys.executable, _WORKER, str(out), *flags],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait(p: subprocess.Popen[str], code: int = 0) -> str:
    try:
        out, _ = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == code, out
    return out


def _run(out: Path, *flags: str, code: int = 0) -> str:
    return _wait(_start(out, *flags), code)


@pytest.fixture(scope="module")
def built(tmp_path_factory: Any) -> Callable[[int], dict[str, Any]]:
    """Runs at ``gradient_accumulation_steps`` ga, each built once for the module: straight to 40, and
    stopped at 25 (committed: checkpoint-10, checkpoint-20; kept as "pristine") then resumed to 40."""
    cache: dict[int, dict[str, Any]] = {}

    def build(ga: int) -> dict[str, Any]:
        if ga not in cache:
            root = tmp_path_factory.mktemp(f"hf-ga{ga}")
            flags = ["--ga", str(ga)]
            straight, stopped = _start(root / "straight", *flags), _start(root / "stopped", *flags, "--stop", "25")
            _wait(straight), _wait(stopped)
            (root / "stopped" / "result.json").unlink()
            shutil.copytree(root / "stopped", root / "pristine")  # for the tests that damage a copy
            # save_steps is exempt: a resume may change it (and writes checkpoint-40 either way).
            _run(root / "stopped", *flags, "--resume", "--save-steps", "5")
            cache[ga] = {"straight": root / "straight", "resumed": root / "stopped", "pristine": root / "pristine"}
            cache[ga]["ga"] = flags
        return cache[ga]

    return build


@pytest.fixture
def base(built: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """The module's runs, at 2 gradient accumulation steps: the case a resume can get wrong (where in an
    accumulation it stands), which 1 never has."""
    return built(2)


def _losses(folder: Path) -> list[str]:
    rows = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return [float(r["loss"]).hex() for r in rows if "loss" in r]


def test_40_steps_straight_equal_20_steps_then_a_new_process_resumed_to_40(base: dict[str, Any]) -> None:
    a, b = base["straight"] / "checkpoint-40", base["resumed"] / "checkpoint-40"
    assert json.loads((base["resumed"] / "result.json").read_text())["resumed_from"] == str(
        base["resumed"] / "checkpoint-20"
    )
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = ckptkit.load(a / STATE_FILE), ckptkit.load(b / STATE_FILE)
    assert sa.step == sb.step == 40
    assert same(sa.optim, sb.optim)  # AdamW moments and step, the LR schedule
    assert same(sa.monitor["rng"], sb.monitor["rng"])  # Python, NumPy and torch generators
    assert len(_losses(a)) == 40 and _losses(a) == _losses(b)  # every step's loss, as exact bits


def test_a_resume_unpickles_nothing_and_no_checkpoint_holds_a_pickle(base: dict[str, Any]) -> None:
    assert json.loads((base["resumed"] / "result.json").read_text())["pickle_calls"] == []
    folder = base["resumed"] / "checkpoint-20"
    assert sorted(os.listdir(folder)) == sorted(
        [CONFIG_FILE, STATE_FILE, "config.json", "generation_config.json", "model.safetensors", "trainer_state.json"]
    )
    record = ckptkit.load(folder / STATE_FILE).monitor
    assert record["layout"] == LAYOUT
    assert sorted(record["files"]) == sorted(set(os.listdir(folder)) - {STATE_FILE})
    assert {"torch", "transformers", "accelerate", "intra_op_threads"} <= set(record["environment"])


def test_a_changed_training_argument_is_refused_naming_every_strict_key(base: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(base["pristine"], out)
    said = _run(out, *base["ga"], "--resume", "--lr", "0.02", "--seed", "2", code=3)
    assert said.splitlines()[-4:] == [
        f"ConfigDrift: config drift: 2 strict differences from the run's snapshot ({out}/checkpoint-20/{CONFIG_FILE}):",
        "  args.learning_rate 0.01 -> 0.02",
        "  args.seed 1 -> 2",
        "resuming would continue a different run; restore these values, or start a new run in a new directory",
    ]
    names = ["checkpoint-10", "checkpoint-20", "environment.json", "history.jsonl"]
    assert sorted(p.name for p in out.iterdir()) == names  # nothing trained or written
    assert (out / "history.jsonl").read_bytes() == (base["pristine"] / "history.jsonl").read_bytes()


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.json", CONFIG_FILE, "config.json", STATE_FILE])
def test_a_flipped_byte_fails_verify_naming_the_file_and_the_resume_falls_back(
    base: dict[str, Any], tmp_path: Path, capsys: Any, name: str
) -> None:
    out = tmp_path / "run"
    shutil.copytree(base["pristine"], out)
    damaged = out / "checkpoint-20" / name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    assert main(["verify", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [ln for ln in lines if ln.startswith("FAIL")] == [ln for ln in lines if str(damaged) in ln]
    assert any(ln.startswith(f"OK    {out}/checkpoint-10") for ln in lines)
    assert newest_intact(str(out))[0] == str(out / "checkpoint-10")


def test_a_resume_past_a_damaged_checkpoint_continues_from_the_previous_one_bit_exactly(
    base: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    shutil.copytree(base["pristine"], out)
    weights = out / "checkpoint-20" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x80
    weights.write_bytes(bytes(data))
    said = _run(out, *base["ga"], "--resume")
    assert f"skipping {out}/checkpoint-20: {weights}: damaged" in said
    assert json.loads((out / "result.json").read_text())["resumed_from"] == str(out / "checkpoint-10")
    assert _losses(out / "checkpoint-40") == _losses(base["straight"] / "checkpoint-40")


def test_a_torn_folder_is_never_resumed(base: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "run"
    shutil.copytree(base["pristine"], out)
    (out / "checkpoint-20" / STATE_FILE).unlink()  # the save died before its commit
    check = check_folder(str(out / "checkpoint-20"))
    assert [str(p) for p in check.problems] == [
        (
            f"{out}/checkpoint-20: torn: no {STATE_FILE} (the save did not commit, or the folder was not written by "
            "ckptkit.integrations.transformers); a resume skips it (R-HF03)"
        )
    ]
    assert newest_intact(str(out))[0] == str(out / "checkpoint-10")
    assert main(["verify", str(out)]) == 1
    assert f"FAIL  {out}/checkpoint-20: torn: no {STATE_FILE}" in capsys.readouterr().out


def test_a_file_added_after_the_commit_is_not_trusted(base: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(base["pristine"], out)
    (out / "checkpoint-20" / "optimizer.pt").write_bytes(b"planted")
    (problem,) = check_folder(str(out / "checkpoint-20")).problems
    assert str(problem) == (
        f"{out}/checkpoint-20/optimizer.pt: not in the file record of {STATE_FILE}; "
        "the file was added after the commit; a resume does not trust it: remove it (R-HF03)"
    )


def test_verify_json_reports_each_checkpoint_folder(base: dict[str, Any], capsys: Any) -> None:
    assert main(["verify", "--json", str(base["pristine"])]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["ok"] is True
    folders = doc["trainer_checkpoints"]
    assert [(f["path"], f["step"], f["ok"], f["problems"]) for f in folders] == [
        (str(base["pristine"] / "checkpoint-10"), 10, True, []),
        (str(base["pristine"] / "checkpoint-20"), 20, True, []),
    ]
    assert sorted(folders[0]["files"]) == [
        CONFIG_FILE,
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "trainer_state.json",
    ]


def test_without_transformers_the_import_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n    import ckptkit.integrations.transformers\n"
        "except ModuleNotFoundError as e:\n    print(e)"
    )
    env = {**os.environ, "PYTHONPATH": _ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == "ckptkit.integrations.transformers needs transformers: pip install 'ckptkit[transformers]'\n"


def test_inspect_shows_a_folders_files_and_an_output_dirs_folders(base: dict[str, Any], capsys: Any) -> None:
    out = base["pristine"]
    assert main(["inspect", str(out / "checkpoint-20")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{out}/checkpoint-20: transformers checkpoint, step 20, commit {STATE_FILE} ")
    assert [ln.split()[0] for ln in lines[1:6]] == sorted(
        [CONFIG_FILE, "config.json", "generation_config.json", "model.safetensors", "trainer_state.json"]
    )
    assert main(["inspect", "--json", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1
    assert [(c["path"], c["step"], c["committed"]) for c in doc["checkpoints"]] == [
        (str(out / "checkpoint-10"), 10, True),
        (str(out / "checkpoint-20"), 20, True),
    ]


def test_diff_classes_a_trainer_runs_keys_with_the_trainers_exempt_class(
    base: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    other = tmp_path / "other" / "checkpoint-20"
    other.mkdir(parents=True)
    doc = json.loads((base["pristine"] / "checkpoint-20" / CONFIG_FILE).read_text())
    doc["config"]["args"]["learning_rate"] = 0.5
    doc["config"]["args"]["save_steps"] = 7
    (other / CONFIG_FILE).write_text(json.dumps(doc, sort_keys=True, indent=2) + "\n")
    assert main(["diff", str(base["pristine"]), str(other.parent)]) == 1
    assert capsys.readouterr().out.splitlines()[2:] == [
        "CLASS   KEY                 OLD   NEW  NOTE",
        "strict  args.learning_rate  0.01  0.5",
        "exempt  args.save_steps     10    7    exempt (decides when we look, not what the model computes)",
        "2 differences: 1 strict, 1 exempt",
    ]


def test_a_checkpoint_saved_with_save_only_model_is_not_resumed(tmp_path: Path) -> None:
    _run(tmp_path / "run", "--stop", "10", "--save-only-model")
    assert sorted(os.listdir(tmp_path / "run" / "checkpoint-10")) == sorted(
        [CONFIG_FILE, STATE_FILE, "config.json", "generation_config.json", "model.safetensors", "trainer_state.json"]
    )
    said = _run(tmp_path / "run", "--resume", "--save-only-model", code=3)
    assert said.splitlines()[-1] == (
        f"ResumeRefused: {tmp_path}/run/checkpoint-10: saved with save_only_model=True: it holds no optimizer, "
        "scheduler or RNG state, so a resume would not continue the same run; start a new run from its weights instead"
    )


def test_a_training_argument_the_snapshot_cannot_carry_is_refused_when_the_trainer_is_built(tmp_path: Path) -> None:
    said = _run(tmp_path / "run", "--scheduler-kwargs", '{"warmup.steps": 3}', code=3)
    assert said.splitlines()[-1] == (
        "UnsupportedValue: config field args.lr_scheduler_kwargs.'warmup.steps': cannot snapshot the key; "
        "table keys are non-empty strings without '.'"
    )
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # refused before any training


def test_a_new_trainer_resumes_the_model_object_another_trained_and_one_built_by_from_pretrained(
    base: dict[str, Any], tmp_path: Path
) -> None:
    # save_pretrained fills in config.architectures and config.dtype at the first save; the model of a
    # later Trainer has them (the same object, saved since) or was read with them (from_pretrained).
    out = tmp_path / "run"
    _run(out, *base["ga"], "--stop", "10", "--then-resume", "pretrained", "--then-resume", "same")
    folder = str(out / "checkpoint-10")
    assert json.loads((out / "result.json").read_text())["resumed_from"] == [folder, folder]
    assert _losses(out / "checkpoint-20") == _losses(base["straight"] / "checkpoint-20")  # the same run
    model = json.loads((out / "checkpoint-10" / CONFIG_FILE).read_text())["config"]["model"]
    assert (model["architectures"], model["dtype"]) == (["GPT2LMHeadModel"], "float32")  # as config.json says


def test_a_missing_resume_folder_is_refused_in_ckptkits_words_and_transformers(tmp_path: Path) -> None:
    missing = tmp_path / "run" / "checkpoint-7"
    said = _run(tmp_path / "run", "--resume-from", str(missing), code=3)
    assert said.splitlines()[-1] == (
        f"CheckpointNotFound: {missing}: no such checkpoint folder (transformers: \"Can't find a valid checkpoint "
        f'at {missing}"); name an existing checkpoint-N folder, or pass resume_from_checkpoint=True to resume '
        "the newest intact one in output_dir"
    )


def test_diff_tensors_of_two_identical_runs_exits_0_and_says_the_snapshot_differs_in_exempt_keys_only(
    base: dict[str, Any], capsys: Any
) -> None:
    a, b = base["straight"] / "checkpoint-20", base["pristine"] / "checkpoint-20"
    assert main(["diff", "--tensors", str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].split()[:4] == ["exempt", "args.output_dir", f'"{base["straight"]}"', f'"{base["resumed"]}"']
    note = f"exempt: monitor:files.{CONFIG_FILE} (the snapshot file's size and digest: its keys are compared above)"
    assert lines[4:] == ["1 difference: 0 strict, 1 exempt", "tensors: bitwise identical", note]
    assert main(["diff", "--tensors", "--json", str(a), str(b)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["strict"], doc["exempt"], doc["tensors"], doc["notes"]) == (0, 1, [], [note])
