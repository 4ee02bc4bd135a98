"""The reference trainer under torchrun: 2 gloo ranks, real processes, real SIGKILL (spec/trainer.md R-T14).

First the parts that need no second process (the data rule, the refusals); then the jobs.
Every job is ``python -m torch.distributed.run --standalone --nproc_per_node 2 -m ckptkit
train ...`` in its own session, bounded by a timeout and killed as a whole (the agent
and both ranks) when a test ends, however it ends. One uninterrupted run per
parallelism is shared by the tests (module-scoped), so the file starts few jobs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import TINY_FLAGS, examples, history, run, tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.audit._commands import stop_job
from ckptkit.cli import main
from ckptkit.errors import ConfigDrift, RunDirInUse
from ckptkit.run._history import compared_rows
from ckptkit.run._lease import lease_for, this_job
from ckptkit.trainer._data import ByteStream, data_fingerprint, load_bytes
from ckptkit.trainer._digests import param_digests
from ckptkit.trainer._loop import build, deterministic_torch, expected_offset, intra_op_threads, run_state
from ckptkit.trainer._parallel import Ranks, check_fits

STEPS, EVERY = 40, 10  # the "done when" run: --steps 40 --ckpt-every 10
FLAGS = [*TINY_FLAGS, "--ckpt-every", str(EVERY), "--keep", "100", "--quiet"]
JOB_TIMEOUT_S = 120


def _name(step: int) -> str:
    return f"step-{step:08d}.dcp"


def _launch(run_dir: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A 2-rank torchrun job in a session of its own."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv = [sys.executable, *launcher, "-m", "ckptkit", "train", "--run-dir", str(run_dir), *FLAGS, *flags]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True
    )


def _kill(proc: subprocess.Popen[str]) -> None:
    stop_job(proc)


def _stray(run_dir: Path) -> list[str]:
    """Processes still running with ``run_dir`` on their command line (a rank left behind)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmd:
            out.append(f"{pid}: {cmd}")
    return out


def job(run_dir: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a job to its end (bounded); its exit code, stdout and stderr."""
    proc = _launch(run_dir, *flags, env=env)
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        _kill(proc)
    assert not _stray(run_dir), _stray(run_dir)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ok(run_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    done = job(run_dir, *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def artifacts(run_dir: Path, step: int) -> dict[str, bytes]:
    """Every file of the checkpoint at ``step``: the DCP directory's files, snapshot, sidecars."""
    out = {}
    for top in sorted(p for p in run_dir.iterdir() if p.name.startswith(_name(step))):
        for f in sorted([top] if top.is_file() else top.rglob("*")):
            if f.is_file():
                out[str(f.relative_to(run_dir))] = f.read_bytes()
    return out


def assert_same_run(a: Path, b: Path, step: int) -> None:
    """Checkpoint ``step`` identical byte for byte (every rank's file), and identical compared history rows."""
    fa, fb = artifacts(a, step), artifacts(b, step)
    assert sorted(fa) == sorted(fb)
    assert any(name.endswith("metadata.ckdcp") for name in fa), sorted(fa)
    for name in fa:
        same = fa[name] == fb[name]
        assert same, f"{name} differs between the uninterrupted and the resumed run"
    ra, rb = compared_rows(history(a)), compared_rows(history(b))
    assert len(ra) == len(rb)
    for i, (x, y) in enumerate(zip(ra, rb, strict=True)):
        assert x == y, f"compared history row {i} differs"


# ----------------------------------------------------------------------------- the data rule, refusals


@given(
    world=st.integers(1, 4),
    rows=st.integers(1, 3),
    seq_len=st.integers(1, 8),
    offset=st.integers(0, 10_000),
)
def test_the_ranks_rows_of_a_global_batch_are_the_single_process_batch(
    world: int, rows: int, seq_len: int, offset: int
) -> None:
    data = bytes(range(251)) * 3
    batch = world * rows
    one = ByteStream(data)
    one.seek(offset)
    x, y = one.next_batch(batch, seq_len)
    parts = []
    for rank in range(world):
        part = ByteStream(data, rank=rank, world=world)
        part.seek(offset)
        parts.append(part.next_batch(batch, seq_len))
        assert part.offset == one.offset == offset + batch * seq_len  # the offset is global: R-T03 unchanged
        assert Ranks(rank, world).rows(batch) == slice(rank * rows, (rank + 1) * rows)
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)


def test_a_batch_that_does_not_split_over_the_ranks_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"^--batch 4 must be a multiple of the world size 3: each rank"):
        check_fits(tiny(), Ranks(0, 3))
    check_fits(tiny(), Ranks(1, 2))
    with pytest.raises(ValueError, match=r"^--spike-at hooks the gradients .* use it with --parallel ddp$"):
        check_fits(tiny(**{"train.parallel": "fsdp", "testing.spike_at": 3}), Ranks(0, 2))
    check_fits(tiny(**{"train.parallel": "fsdp", "testing.spike_at": 3}), Ranks(0, 1))  # one process: nothing sharded


def test_parallel_is_a_config_key_so_a_resume_under_the_other_is_drift(tmp_path: Path) -> None:
    run(tiny(), tmp_path, 2)
    with pytest.raises(ConfigDrift, match=r"train\.parallel"):
        run(tiny(**{"train.parallel": "fsdp"}), tmp_path, 4, resume=True)
    with pytest.raises(ValueError, match=r"^--parallel must be one of ddp, fsdp \(got 'zero'\)$"):
        tiny(**{"train.parallel": "zero"})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--resume", "--reshard", "--dist-timeout", "0"], "--dist-timeout must be > 0 seconds (got 0.0)"),
        (["--reshard"], "--reshard needs --resume (it changes how a saved run is continued)"),
    ],
)
def test_train_cli_refuses_bad_distributed_flags_in_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--run-dir", str(tmp_path), *argv]) == 2
    assert capsys.readouterr().err == f"ckptkit train: {message}\n"


def test_audit_cli_refuses_nproc_with_a_command_and_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--nproc-per-node", "2", "--", "python", "t.py", "--run-dir", "{run_dir}"]) == 2
    assert "--nproc-per-node starts `ckptkit train` under torchrun" in capsys.readouterr().err
    assert main(["audit", "--nproc-per-node", "0"]) == 2
    assert capsys.readouterr().err == "ckptkit audit: --nproc-per-node must be >= 1 (got 0)\n"


# ----------------------------------------------------------------------------- 2-rank jobs


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The uninterrupted 2-rank run of STEPS steps under a parallelism, trained once per module."""
    runs: dict[str, Path] = {}

    def get(parallel: str) -> Path:
        if parallel not in runs:
            run_dir = tmp_path_factory.mktemp(f"straight-{parallel}") / "run"
            ok(run_dir, "--steps", str(STEPS), *_PARALLEL[parallel])
            runs[parallel] = run_dir
        return runs[parallel]

    return get


# Seed 3 under FSDP2: step 0's aux mask is empty, so the predictor and mask_emb get their first
# gradient (and AdamW its state for them) at step 1. A resume holds that state in checkpoint order,
# the live run in creation order; the checkpoint's bytes must not depend on which (R-DC13).
_PARALLEL = {"ddp": ["--parallel", "ddp"], "fsdp": ["--parallel", "fsdp", "--seed", "3"]}


def _steps_done(run_dir: Path) -> int:
    """Step rows rank 0 has written so far (a torn last line is not a row yet)."""
    with contextlib.suppress(FileNotFoundError):
        return (run_dir / "history.jsonl").read_bytes().count(b'"kind":"step"')
    return 0


def _kill_after_first_checkpoint(run_dir: Path, *flags: str, at: int, every: int = EVERY, steps: int = STEPS) -> None:
    """Start the job; SIGKILL the whole job once its first checkpoint (step ``every``) is committed
    and rank 0 has finished step ``at`` after it (never after the run's end at ``steps``)."""
    proc = _launch(run_dir, *flags)
    try:
        committed = run_dir / _name(every) / "metadata.ckdcp"
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (committed.exists() and _steps_done(run_dir) >= at):
            assert proc.poll() is None, f"the job ended before step {at}: {proc.communicate()[1][-2000:]}"
            assert time.monotonic() < deadline, f"step {at} not reached in time"
            time.sleep(0.002)
    finally:
        _kill(proc)
    assert not _stray(run_dir), _stray(run_dir)
    assert not (run_dir / _name(steps) / "metadata.ckdcp").exists(), "the job finished before the kill"


@pytest.mark.slow
@settings(max_examples=examples(0.01), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.integers(EVERY + 1, STEPS - 5))
def test_a_whole_job_sigkilled_after_its_first_checkpoint_resumes_to_the_same_bytes(
    at: int, straight: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The kill step is hypothesis's draw (printed with a failure, the same in every CI run), not
    # an unprinted random one. FSDP2 with a parameter whose optimizer state comes late (_PARALLEL),
    # whose shards are where a resume can go wrong; DDP's whole-job kill is the knob property's
    # other layout and the kills of the tests below (their reference is DDP).
    parallel = "fsdp"
    reference = straight(parallel)
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    _kill_after_first_checkpoint(run_dir, "--steps", str(STEPS), *_PARALLEL[parallel], at=at)
    ok(run_dir, "--steps", str(STEPS), *_PARALLEL[parallel], "--resume")
    assert_same_run(reference, run_dir, STEPS)
    resumes = [r for r in history(run_dir) if r["kind"] == "resume"]
    assert len(resumes) == 1
    # rank 0 compared the steps the killed job had recorded after its checkpoint (determinism.md R-D20)
    (verdict,) = [r for r in history(run_dir) if r["kind"] == "resume_check"]
    assert (verdict["verdict"], verdict["from"]) == ("verified", EVERY) and verdict["to"] >= at - 1, verdict


@pytest.mark.slow
def test_a_job_whose_resume_differs_stops_every_rank_with_exit_1_naming_the_step(tmp_path: Path) -> None:
    """spec/determinism.md R-D25 under torchrun: rank 0 compares, its error ends the job, no rank hangs."""
    run_dir = tmp_path / "run"
    planted = ["--steps", "20", "--global-draw-from", "12"]
    _kill_after_first_checkpoint(run_dir, *planted, at=EVERY + 4, steps=20)
    resumed = job(run_dir, *planted, "--resume", "--dist-timeout", "20")
    assert resumed.returncode != 0
    said = f"{run_dir}: the resumed run differs from the interrupted run at step 12: tensor model:"
    assert said in resumed.stderr, resumed.stderr[-3000:]
    assert [r["verdict"] for r in history(run_dir) if r["kind"] == "resume_check"] == ["differed"]
    assert not _stray(run_dir), _stray(run_dir)


def _same_checkpoints_after(a: Path, b: Path, start: int) -> list[int]:
    """Every checkpoint after ``start`` that both runs hold is the same bytes; their steps."""
    steps = sorted(
        int(p.name[5:13]) for p in b.iterdir() if p.name.endswith(".dcp") and (p / "metadata.ckdcp").exists()
    )
    later = [s for s in steps if s > start]
    for s in later:
        fa, fb = artifacts(a, s), artifacts(b, s)
        assert sorted(fa) == sorted(fb), s
        differ = [name for name in fa if fa[name] != fb[name]]
        assert not differ, f"step {s}: {differ} differ between the uninterrupted and the resumed run"
    return later


_KNOBS = st.fixed_dictionaries(
    {
        "--seed": st.integers(0, 2**16).map(str),
        "--parallel": st.sampled_from(["ddp", "fsdp"]),
        "--ema-decay": st.sampled_from(["0.99", "0.5"]),  # the teacher: slow or fast
        "--quant": st.sampled_from(["none", "int8"]),
    }
)


@pytest.mark.slow
@settings(max_examples=examples(0.02), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(knobs=_KNOBS, aux=st.booleans(), rand_depth=st.booleans(), at=st.integers(6, 15))
def test_a_job_killed_at_any_step_under_any_knobs_resumes_to_the_same_bytes(
    knobs: dict[str, str], aux: bool, rand_depth: bool, at: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    flags = [*(x for kv in knobs.items() for x in kv), "--aux" if aux else "--no-aux"]
    flags += ["--rand-depth" if rand_depth else "--no-rand-depth", "--ckpt-every", "5", "--steps", "20"]
    base = tmp_path_factory.mktemp("knobs")
    ok(base / "straight", *flags)
    _kill_after_first_checkpoint(base / "killed", *flags, at=at, every=5, steps=20)
    ok(base / "killed", *flags, "--resume")
    (resume,) = [r for r in history(base / "killed") if r["kind"] == "resume"]
    assert _same_checkpoints_after(base / "straight", base / "killed", resume["step"])[-1] == 20
    assert compared_rows(history(base / "straight")) == compared_rows(history(base / "killed"))


@pytest.mark.slow
def test_a_resume_at_world_size_1_is_refused_and_continues_with_reshard(
    straight: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = straight("ddp")
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    # One process, in this one: `ckptkit train` with the thread count the job recorded (torchrun: 1).
    one = ["train", "--run-dir", str(run_dir), *FLAGS, "--steps", str(STEPS + 2), "--threads", "1", "--resume"]
    assert main(one) == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith("ckptkit train: ") and "world size" in line, err
    assert "torchrun --nproc_per_node 2" in line and "--reshard" in line
    # What --reshard loads at world size 1 is what the 2 ranks saved, bit for bit.
    run = build(tiny(**{"train.ckpt_every": EVERY}))
    with deterministic_torch(), intra_op_threads(1):  # the environment the job recorded (torchrun: 1 thread)
        info = run_state(run, run_dir, data_fingerprint(load_bytes(""))).resume(reshard=True)
    assert info.step == STEPS and info.resharded
    (saved,) = [r["tensors"] for r in history(reference) if r["kind"] == "digests" and r["step"] == STEPS]
    assert param_digests(run.model) == saved
    assert run.stream.offset == expected_offset(run.cfg, STEPS)
    assert run.ngram is not None and run.ngram.table_step == STEPS
    assert main([*one, "--reshard"]) == 0
    rows = history(run_dir)
    (resume,) = [r for r in rows if r["kind"] == "resume"]
    assert resume["resharded"] is True and any("bit-comparable" in n for n in resume["notes"])
    assert [r["step"] for r in rows if r["kind"] == "step"][-3:] == [STEPS - 1, STEPS, STEPS + 1]


@pytest.mark.slow
def test_auto_rollback_on_two_ranks_rolls_back_on_both_and_records_one_decision(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    spike = ["--spike-at", "7", "--auto-rollback", "on", "--rollback-k", "2", "--ckpt-every", "2", "--keep", "3"]
    spike += ["--spike-window", "8", "--spike-min-history", "4"]  # a detector that judges from step 4
    ok(run_dir, "--steps", "10", *spike)
    rows = history(run_dir)
    rollbacks = [r for r in rows if r["kind"] == "rollback"]
    assert [(r["step"], r["to"]) for r in rollbacks] == [(7, 5)]
    assert [r["action"] for r in rows if r["kind"] == "spike"] == ["rerun", "rollback"]
    # Both ranks rolled back, dropped the LR and skipped the window: the replicated rollback
    # record and every rank's data position agreed when the final checkpoint was saved
    # (RunState refuses a save whose replicated state differs between ranks).
    assert (run_dir / _name(10) / "metadata.ckdcp").exists()


@pytest.mark.slow
def test_a_rank_killed_mid_save_keeps_the_previous_step_and_the_resume_is_exact(
    straight: Callable[[str], Path], tmp_path: Path
) -> None:
    reference = straight("ddp")
    run_dir = tmp_path / "run"
    _rank_1_dies_saving(run_dir, 2 * EVERY)
    assert (run_dir / _name(EVERY) / "metadata.ckdcp").exists()
    ok(run_dir, "--steps", str(STEPS), "--resume")
    assert_same_run(reference, run_dir, STEPS)
    (resume,) = [r for r in history(run_dir) if r["kind"] == "resume"]
    assert resume["step"] == EVERY


def _die_env(**env: str) -> dict[str, str]:
    """The environment of a job whose rank dies as ``tests/die_in_save`` says (``env``)."""
    hooks = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "die_in_save"), os.environ.get("PYTHONPATH", "")]
    )
    return {"PYTHONPATH": hooks, **env}


def _rank_1_dies_saving(run_dir: Path, step: int) -> None:
    """A job whose rank 1 SIGKILLs itself half way through its save of ``step``: it fails, uncommitted."""
    env = _die_env(CKPTKIT_TEST_DIE_IN_SAVE=f"1:{step}")
    assert job(run_dir, "--steps", str(STEPS), "--dist-timeout", "20", env=env).returncode != 0
    assert not (run_dir / _name(step) / "metadata.ckdcp").exists()


def _verify_warns(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """``ckptkit verify RUN`` passes; its WARN lines."""
    capsys.readouterr()
    assert main(["verify", str(run_dir)]) == 0, capsys.readouterr().out
    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")], lines
    return [line for line in lines if line.startswith("WARN")]


@pytest.mark.slow
def test_a_job_killed_in_its_first_save_is_started_and_resumed_over_what_it_left(
    straight: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = straight("ddp")
    run_dir = tmp_path / "run"
    _rank_1_dies_saving(run_dir, EVERY)
    assert (run_dir / _name(EVERY)).is_dir()
    warns = _verify_warns(run_dir, capsys)
    assert f"WARN  {run_dir / _name(EVERY)}: incomplete, not a checkpoint: an uncommitted checkpoint" in warns[0]
    again = tmp_path / "again"
    shutil.copytree(run_dir, again)
    ok(run_dir, "--steps", str(STEPS))  # a fresh start is not refused by what the save left
    ok(again, "--steps", str(STEPS), "--resume")  # nor is a resume: it is the run's start (no checkpoint yet)
    for done in (run_dir, again):
        assert_same_run(reference, done, STEPS)
        assert _verify_warns(done, capsys) == []


@pytest.mark.slow
def test_a_job_killed_in_retention_leaves_no_damage_and_resumes(
    straight: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    died = job(run_dir, "--steps", str(STEPS), "--keep", "1", env=_die_env(CKPTKIT_TEST_DIE_IN_DELETE=str(EVERY)))
    assert died.returncode != 0
    assert (run_dir / _name(2 * EVERY) / "metadata.ckdcp").exists()  # rank 0 died deleting step 10 after 20 committed
    warns = _verify_warns(run_dir, capsys)
    assert [w.split(":")[0] for w in warns] == [
        f"WARN  {run_dir / name}" for name in (_name(EVERY), f"{_name(EVERY)}.config.json", f"{_name(EVERY)}.ngram")
    ]
    ok(run_dir, "--steps", str(STEPS), "--keep", "1", "--resume")
    (resume,) = [r for r in history(run_dir) if r["kind"] == "resume"]
    assert resume["step"] == 2 * EVERY and not any("skipped" in n for n in resume["notes"])
    assert any(n.startswith("removed what interrupted saves left (none of it a checkpoint): ") for n in resume["notes"])
    assert compared_rows(history(run_dir)) == compared_rows(history(straight("ddp")))
    assert _verify_warns(run_dir, capsys) == []


@pytest.mark.slow
def test_ranks_whose_launcher_was_killed_stop_before_their_next_save_and_meanwhile_hold_the_directory(
    tmp_path: Path,
) -> None:
    # SIGKILL of torchrun's agent alone leaves the ranks running (each in its own session);
    # their next save (step 100) is far enough away for a second job to try the directory.
    run_dir, far = tmp_path / "run", ["--steps", "200", "--ckpt-every", "100"]
    proc = _launch(run_dir, *far)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not ((run_dir / "lease.json").exists() and _steps_done(run_dir) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "the job ended before its third step"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()  # not communicate(): the orphans hold the pipes open
        assert _stray(run_dir), "the ranks died with their launcher: nothing to test"
        holder = json.loads((run_dir / "lease.json").read_text())["pid"]
        with pytest.raises(RunDirInUse, match=f"in use by another job, pid {holder} on "):
            lease_for(run_dir).acquire(this_job(2))  # what a relaunch's rank 0 does first (R-LS03)
        while _stray(run_dir):  # the orphans stop at their next save, on their own
            assert time.monotonic() < deadline, f"the orphaned ranks did not stop: {_stray(run_dir)}"
            time.sleep(0.05)
    finally:
        for line in _stray(run_dir):
            os.kill(int(line.partition(":")[0]), signal.SIGKILL)
        _kill(proc)
    assert not (run_dir / _name(100)).exists(), "an orphaned rank wrote its next save"
    assert not (run_dir / "lease.json").exists()  # their rank 0 gave the lease up as it stopped


@pytest.mark.slow
def test_replay_of_a_two_rank_run_launches_two_ranks_and_names_a_recorded_step_that_differs(
    straight: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = straight("ddp")
    assert main(["replay", str(reference), "--from", str(STEPS - 5), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"replay: from the checkpoint at step {STEPS - EVERY} to step {STEPS}" in out
    assert "IDENTICAL:" in out and "and 1 checkpoint(s) bit for bit" in out
    # A recorded loss edited after the fact: the replay names that step and field.
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    lines = (run_dir / "history.jsonl").read_text().splitlines(keepends=True)
    rows = [json.loads(line) for line in lines]
    i = next(i for i, r in enumerate(rows) if r["kind"] == "step" and r["step"] == STEPS - 3)
    row = rows[i]
    row["loss_bits"] = f"0x{int(row['loss_bits'], 16) ^ 1:08x}"
    lines[i] = json.dumps(row, sort_keys=True, separators=(",", ":")) + "\n"
    (run_dir / "history.jsonl").write_text("".join(lines))
    assert main(["replay", str(run_dir), "--from", str(STEPS - 5), "--quiet", "--json"]) == 1
    difference = json.loads(capsys.readouterr().out)["divergence"]
    fields = [f["field"] for f in difference["fields"]]
    assert (difference["step"], difference["kind"], fields) == (STEPS - 3, "step", ["loss_bits"])


def test_replay_of_a_two_rank_run_refuses_flags_it_cannot_honour(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "environment.json").write_text(json.dumps({"world_size": 2}))
    assert main(["replay", str(tmp_path), "--from", "3", "--lr", "0.1"]) == 2
    assert capsys.readouterr().err == (
        f"ckptkit replay: {tmp_path} was trained by 2 ranks: it is replayed by as many ranks with its own config "
        "and environment, so trainer flags, --threads, --allow-env-change and --no-perturb do not apply\n"
    )


@pytest.mark.slow
def test_audit_with_two_ranks_per_run_finds_the_runs_identical(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--nproc-per-node", "2", "--steps", "3", "--quiet", *TINY_FLAGS]) == 0
    out = capsys.readouterr().out
    assert "world_size 2" in out
    assert "IDENTICAL: 3 steps, every history fingerprint and 3 checkpoint(s) bit for bit" in out
