"""RunState in a process group: real gloo ranks (tests/_dist_workers.py, tests/_runstate_workers.py).

Every test here drives whole ranks; models are tiny, every wait bounded, every rank reaped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import torch
from _dist_workers import RankPool, assert_same
from _runstate_workers import LoopConfig, resume_at_this_world_size

import ckptkit
from ckptkit.cli import main
from ckptkit.distributed._format import read_metadata

pytestmark = pytest.mark.slow

W = "_runstate_workers:"


def resume_in_fresh_ranks(run: str, want: list[dict[str, Any]]) -> None:
    """Resume the DDP loop of ``run`` in 2 new processes to step 6: each rank ends where ``want`` did."""
    fresh = RankPool(2)
    try:
        got = fresh.run(W + "train", run, "ddp", 6)
    finally:
        fresh.close()
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)


@contextlib.contextmanager
def as_the_ranks_ran() -> Iterator[None]:
    """This process with the environment the ranks recorded (one intra-op thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tree_bytes(root: str) -> dict[str, bytes]:
    """Every file under ``root`` by relative path (the run directory, byte for byte)."""
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


@pytest.fixture(scope="module")
def ddp_run(pool, tmp_path_factory):
    """A 2-rank DDP run trained straight to step 6 (saves at 2, 4, 6; keeps 2), and each rank's final state."""
    run = str(tmp_path_factory.mktemp("ddp") / "run")
    return run, pool.run(W + "train", run, "ddp", 6)


def test_ddp_interrupted_and_resumed_in_fresh_processes_equals_uninterrupted(pool, ddp_run, tmp_path):
    straight, want = ddp_run
    split = str(tmp_path / "split")
    pool.run(W + "train", split, "ddp", 4)
    resume_in_fresh_ranks(split, want)
    assert want[0]["pos"] == 12 and want[1]["pos"] == 13  # each rank kept its own position
    files = tree_bytes(straight)
    assert sorted(files) == sorted(tree_bytes(split))
    assert files == tree_bytes(split)
    assert sorted(n for n in os.listdir(straight) if n.startswith("step-")) == [
        "step-00000004.dcp",
        "step-00000004.dcp.config.json",
        "step-00000006.dcp",
        "step-00000006.dcp.config.json",
    ]


def test_one_process_resumes_a_distributed_run_only_with_a_reshard(ddp_run, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(ddp_run[0], run)
    said = (
        f"{run}: saved at world size 2 (model: ddp, teacher: plain), resumed at world size 1 (model: plain, teacher: "
        "plain); a checkpoint continues the same run bit for bit only at the world size and layout it was saved at: "
        "run it with torchrun --nproc_per_node 2 and the same parallelism, or resume with reshard=True (--reshard, "
        "under torchrun): DCP reshards the model and optimizer, the data positions are re-derived from their offset "
        "rule, and the run is no longer bit-comparable to its past"
    )
    with as_the_ranks_ran():
        assert resume_at_this_world_size(run, "plain", False) == {"error": f"WorldSizeChanged: {said}"}
        got = resume_at_this_world_size(run, "plain", True)  # this process: no torch.distributed at all
    assert got["step"] == 6 and got["resharded"] is True
    for key in ("model", "optim", "teacher", "updates"):
        assert_same(got["state"][key], ddp_run[1][0][key])
    assert got["state"]["pos"] == 6
    with pytest.raises(ckptkit.ResumeRefused, match="already holds 2 checkpoint"):
        ckptkit.RunState(run, config=LoopConfig()).start()


@pytest.fixture(scope="module")
def fsdp2_run(pool, tmp_path_factory):
    """A 2-rank FSDP2 run trained straight to step 6, and each rank's final state."""
    run = str(tmp_path_factory.mktemp("fsdp2") / "run")
    return run, pool.run(W + "train", run, "fsdp2", 6)


@pytest.fixture(scope="module")
def pool1():
    p = RankPool(1)
    try:
        yield p
    finally:
        p.close()


def test_fsdp2_saves_shards_and_interrupted_and_resumed_equals_uninterrupted(pool, fsdp2_run, tmp_path):
    straight, want = fsdp2_run
    split = str(tmp_path / "split")
    pool.run(W + "train", split, "fsdp2", 4)
    got = pool.run(W + "train", split, "fsdp2", 6)
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)
    assert tree_bytes(straight) == tree_bytes(split)
    md = read_metadata(os.path.join(straight, "step-00000006.dcp"))
    weight = md.tensors["model.model.0.weight"]
    assert weight.size == (10, 6) and [c.rank for c in weight.chunks] == [0, 1]  # each rank wrote its own shard
    assert [c.rank for c in md.tensors["optim.adamw.state.0.weight.exp_avg"].chunks] == [0, 1]


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_an_in_memory_copy_restores_every_rank_exactly(pool, layout):
    assert pool.run(W + "restore_in_memory", layout) == [[], []]


def test_a_spike_rollback_happens_on_both_ranks_identically(pool, tmp_path):
    # DDP: the testing aid GradSpike hooks parameter gradients, which FSDP2's sharded parameters never
    # receive through autograd (the restore itself is tested for FSDP2 in the in-memory copy test).
    run = str(tmp_path / "run")
    r0, r1 = pool.run(W + "guarded", run, "ddp", 10, 6)
    (e0,), (e1,) = r0["record"].pop("rollbacks"), r1["record"].pop("rollbacks")
    assert r0["record"] == r1["record"] and r0["record"]["count"] == 1
    # One decision (from the all-reduced grad norm), the same on both ranks; each skipped its own positions.
    assert e0.pop("skipped") == {"start": 8, "end": 14, "batches": 3}
    assert e1.pop("skipped") == {"start": 9, "end": 15, "batches": 3}
    assert e0 == e1 and (e0["step"], e0["to"]) == (6, 4)
    for key in ("model", "optim", "teacher", "updates"):
        assert_same(r0[key], r1[key])
    assert r0["ckpts"] == r1["ckpts"] == [8, 10]
    assert (r0["pos"], r1["pos"]) == (0 + (10 + 3) * 2, 1 + (10 + 3) * 2)  # each rank skipped the window's 3 batches
    with open(os.path.join(run, "history.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows if r["kind"] == "rollback"] == [6]


def test_a_resume_at_world_size_1_is_refused_naming_both_sizes(pool1, ddp_run):
    run, _ = ddp_run
    (got,) = pool1.run(W + "resume_at_this_world_size", run, "ddp", False)
    said = (
        f"{run}: saved at world size 2 (model: ddp, teacher: plain), resumed at world size 1 (model: ddp, teacher: "
        "plain); a checkpoint continues the same run bit for bit only at the world size and layout it was saved at: "
        "run it with torchrun --nproc_per_node 2 and the same parallelism, or resume with reshard=True (--reshard, "
        "under torchrun): DCP reshards the model and optimizer, the data positions are re-derived from their offset "
        "rule, and the run is no longer bit-comparable to its past"
    )
    assert got == {"error": f"WorldSizeChanged: {said}"}


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_a_reshard_to_world_size_1_loads_the_saved_state_bitwise_and_says_so(pool1, ddp_run, fsdp2_run, layout):
    run, saved = ddp_run if layout == "ddp" else fsdp2_run
    (got,) = pool1.run(W + "resume_at_this_world_size", run, layout, True)
    assert got["step"] == 6 and got["resharded"] is True
    for key in ("model", "optim", "teacher", "updates"):
        assert_same(got["state"][key], saved[0][key])
    assert got["state"]["pos"] == 0 + 6 * 1  # re-derived from the offset rule for rank 0 of 1
    assert got["state"]["seen"] == saved[0]["seen"]  # a per-rank value: rank 0 keeps saved rank 0's
    note = (
        f"resharded at step 6 from world size 2 (model: {saved_layout(layout)}, teacher: plain) to world size 1 "
        f"(model: {saved_layout(layout, 1)}, teacher: plain): the run is no longer bit-comparable to its past "
        "(the steps before it ran at another world size or layout)"
    )
    assert got["notes"] == [note]


def saved_layout(layout: str, world: int = 2) -> str:
    return "ddp" if layout == "ddp" else f"fsdp2 mesh {world}"


def test_async_save_writes_the_same_run_directory_as_a_synchronous_one(pool, ddp_run, tmp_path):
    straight, want = ddp_run
    run = str(tmp_path / "async")
    got = pool.run(W + "train", run, "ddp", 6, True)
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)
    assert tree_bytes(run) == tree_bytes(straight)


def test_replicated_state_that_differs_between_ranks_is_refused_naming_it_and_the_ranks(pool, tmp_path):
    run = str(tmp_path / "run")
    said = pool.run(W + "save_diverged_replica", run)
    assert (
        said[0]
        == said[1]
        == (
            f"ReplicaDivergence: {run}/step-00000000.dcp: not saved: replicated state differs between ranks: "
            "values.local_loss (ranks 0 | ranks 1); every rank must hold the same copy of replicated state "
            "(rank 0's is saved); state that is per-rank by nature must be registered per rank "
            "(add_value(..., per_rank=True); data positions always are)"
        )
    )
    assert sorted(os.listdir(run)) == ["environment.json", "lease.json"]  # nothing saved; the job holds its directory


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank_and_the_run_resumes_exactly(pool, ddp_run, tmp_path):
    straight, want = ddp_run
    run = str(tmp_path / "run")
    said = pool.run(W + "train_then_fail_a_save", run, 1, "enospc")
    assert said[0] == said[1]
    assert said[0].startswith("SaveFailed: ") and "No space left on device" in said[0]
    assert not os.path.exists(os.path.join(run, "step-00000004.dcp", "metadata.ckdcp"))
    assert pool.run(W + "committed_steps", run) == [[2], [2]]  # the torn step 4 is no checkpoint
    got = pool.run(W + "train", run, "ddp", 6)  # resumes from step 2, the last committed
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)
    assert tree_bytes(run) == tree_bytes(straight)


def test_a_rank_killed_mid_save_ends_the_job_and_the_run_resumes_exactly(ddp_run, tmp_path):
    straight, want = ddp_run
    run = str(tmp_path / "run")
    doomed = RankPool(2, timeout_s=10)
    try:
        for box in doomed.inboxes:
            box.put((W + "train_then_fail_a_save", (run, 1, "kill")))
        status, survivor = doomed.outboxes[0].get(timeout=90)  # the survivor fails within its group timeout
        doomed.procs[1].join(timeout=30)
        assert doomed.procs[1].exitcode == -9
        assert status == "ok" and survivor.startswith("DistributedFailure: ")
    finally:
        doomed.close()
    assert not any(p.is_alive() for p in doomed.procs)
    assert not os.path.exists(os.path.join(run, "step-00000004.dcp", "metadata.ckdcp"))
    resume_in_fresh_ranks(run, want)
    assert tree_bytes(run) == tree_bytes(straight)


def test_verify_checks_a_distributed_run_directory_with_its_companions(ddp_run, tmp_path, capsys):
    run = str(tmp_path / "run")
    shutil.copytree(ddp_run[0], run)
    assert main(["verify", run]) == 0
    out = capsys.readouterr().out.splitlines()
    for step in ("00000004", "00000006"):
        assert any(line.startswith(f"OK    {run}/step-{step}.dcp  distributed world size 2") for line in out)
        assert f"OK    {run}/step-{step}.dcp.config.json  snapshot, bound to step-{step}.dcp" in out
    assert f"OK    {run}/environment.json  environment, bound to 2 checkpoints" in out
    snapshot = os.path.join(run, "step-00000006.dcp.config.json")
    with open(snapshot, "r+b") as f:
        f.seek(5)
        f.write(b"#")
    assert main(["verify", run]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  {snapshot}: damaged: its xxh3-64 does not match the digest step-00000006.dcp records" in out


def test_diff_tensors_compares_two_distributed_run_directories(ddp_run, tmp_path, capsys):
    """`ckptkit diff runs/d_ref runs/d --tensors`: each run's newest step-N.dcp/, its snapshot and its tensors."""
    ref, run = str(tmp_path / "d_ref"), str(tmp_path / "d")
    shutil.copytree(ddp_run[0], ref)
    shutil.copytree(ddp_run[0], run)
    assert main(["diff", ref, run, "--tensors"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"a: {ref}/step-00000006.dcp.config.json",
        f"b: {run}/step-00000006.dcp.config.json",
        "no differences",
        "tensors: bitwise identical",
    ]
    for name in ("step-00000006.dcp", "step-00000006.dcp.config.json"):  # d's newest is now step 4
        path = os.path.join(run, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    assert main(["diff", ref, run, "--tensors"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"b: {run}/step-00000004.dcp.config.json" and out[2] == "no differences"
    assert out[3].startswith("tensors: ") and any(line.startswith("changed  model.") for line in out[4:])
    assert main(["diff", ref, os.path.join(run, "step-00000004.dcp")]) == 0  # a step directory with its snapshot
    capsys.readouterr()


def test_a_guarded_run_interrupted_after_its_rollback_resumes_to_the_same_state(pool, tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    want = pool.run(W + "guarded", straight, "ddp", 10, 6)
    pool.run(W + "guarded", split, "ddp", 8, 6)
    got = pool.run(W + "guarded", split, "ddp", 10, 6)  # rebuilds the ring by replaying on both ranks
    rebuilt = "rollback ring rebuilt: replayed steps 6..8 from step-00000006.dcp; it reproduced step-00000008.dcp"
    assert all(rebuilt in r["log"] for r in got)  # loaded into copies from the newest checkpoint at or before 8-K
    for a, b in zip(want, got, strict=True):
        assert a["record"] == b["record"]
        for key in ("model", "optim", "teacher", "pos", "updates"):
            assert_same(a[key], b[key])
    checkpoints = [{k: v for k, v in tree_bytes(run).items() if k != "history.jsonl"} for run in (straight, split)]
    assert checkpoints[0] == checkpoints[1]


def test_a_distributed_run_state_refuses_what_it_cannot_save_and_a_one_process_run(pool, tmp_path):
    run = str(tmp_path / "run")
    one = ckptkit.RunState(run, config=LoopConfig())
    one.start()
    one.save(2)  # a one-process run: step-00000002.ckpt
    one.close()  # ... that ended (a live one would hold the directory: RunDirInUse, spec/lease.md)
    scheduler = (
        "UnsupportedValue: scheduler 'tensorful'['scale']: a torch.Tensor cannot be stored here: this is a plain "
        "value (None, bool, int, float, str, bytes, lists, tuples, dicts, sets, numpy arrays and scalars), which "
        "holds no tensors; store value.tolist(); a distributed run saves schedulers, scalers and statefuls as "
        "plain values"
    )
    one_process = (
        f"WorldSizeChanged: {run}: saved at one process (no process group), resumed at world size 2; a "
        "checkpoint continues the same run bit for bit only at the world size and layout it was saved at: "
        "resume it in one process (python, not torchrun), the way it was saved"
    )
    for said in pool.run(W + "refusals", run):
        assert said == [
            "ValueError: compression must be 'raw' in a distributed run (got 'zstd')",
            "ValueError: optimizer 'adamw': name its model (model=...): 2 are registered",
            scheduler,
            scheduler.replace("scheduler 'tensorful'", "stateful 'loader'"),
            one_process,
        ]


def test_a_reshard_refuses_a_data_position_without_an_offset_rule(ddp_run):
    run = ddp_run[0]
    rs = ckptkit.RunState(run, config=LoopConfig())  # one process: world size 1
    rs.add_data_position("train", get=lambda: 0, set=lambda _p: None)
    with as_the_ranks_ran(), pytest.raises(ckptkit.ResumeRefused) as e:
        rs.resume(reshard=True)
    assert str(e.value) == (
        f"{run}/step-00000006.dcp: data position 'train' has no offset rule, so a reshard cannot re-derive it for "
        "rank 0 of 1; register it with add_data_position(..., expected=...)"
    )


def _rank_objects(url: str, step: int) -> dict[str, int]:
    """The sizes of the rank files of ``step`` under the ``s3://`` prefix ``url``, by key."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step-{step:08d}.dcp.rank-")
    return {o["Key"]: o["Size"] for o in listed.get("Contents", [])}


def test_each_rank_of_a_resume_on_s3_fetches_its_share_and_the_run_equals_uninterrupted(pool, s3):
    """R-O36, G-60: a 2-rank FSDP2 run of 3 MiB stopped at step 2 and resumed on an s3:// prefix: each
    rank fetches the metadata and companions whole and, of the rank files, the chunks its shards
    need (about half), never a copy of every rank file; rank 0 alone lists the steps; it ends where
    an uninterrupted run does."""
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    straight = pool.run(W + "wide_on_s3", f"{s3}/straight", env, 4)
    pool.run(W + "wide_on_s3", f"{s3}/split", env, 2)
    sizes = _rank_objects(f"{s3}/split", 2)
    data = sum(sizes.values())
    assert len(sizes) == 2 and data > 3 << 20
    got = pool.run(W + "wide_on_s3", f"{s3}/split", env, 4)
    for (want, *_), (state, fetched, _, _) in zip(straight, got, strict=True):
        assert_same(want, state)
        ranks = sum(n for key, n in fetched.items() if key in sizes)
        assert 0.4 * data < ranks <= 0.6 * data, (fetched, data)
    assert got[0][2] > 0 and got[1][2] == 0  # rank 0's listing reaches rank 1 through the run's group


def test_a_damaged_chunk_one_rank_reads_on_s3_makes_every_rank_fall_back_to_the_previous_step(pool, s3):
    """R-O36, R-026: rank 0's check reads no rank file; rank 1's load finds its chunk damaged, every
    rank passes the step over, and the run resumes from the step before, to an uninterrupted run's state."""
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    straight = pool.run(W + "wide_on_s3", f"{s3}/straight", env, 6)
    pool.run(W + "wide_on_s3", f"{s3}/split", env, 4)
    bucket, _, prefix = s3.removeprefix("s3://").partition("/")
    key = f"{prefix}/split/step-00000004.dcp.rank-00001.ckdcp".lstrip("/")
    client = boto3.client("s3")
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 1
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    got = pool.run(W + "wide_on_s3", f"{s3}/split", env, 6)
    for (want, *_), (state, *_) in zip(straight, got, strict=True):
        assert_same(want, state)
    for rank, (*_, notes) in enumerate(got):
        skipped = [n for n in notes if n.startswith("skipped ")]
        assert skipped == [n for n in notes if "step-00000004.dcp: " in n and "rank-00001.ckdcp" in n], (rank, notes)
        assert len(skipped) == 1 and "falling back to step-00000002.dcp (step 2)" in notes, (rank, notes)


def test_a_store_that_throttles_one_rank_s_ranged_reads_stops_the_resume_and_passes_no_step_over(pool, s3):
    """R-O50 and R-O36: a rank whose ranged reads of the rank files keep failing (503 SlowDown past
    every retry) learned nothing about the step: the resume stops on every rank with the store named,
    and no step is passed over as damaged."""
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    pool.run(W + "wide_on_s3", f"{s3}/run", env, 4)
    got = pool.run(W + "wide_on_s3_throttled", f"{s3}/run", env, 6)
    for raised, notes in got:  # rank 0 too: the ranks agree on the error (R-D25)
        assert raised.startswith("StoreUnavailable: s3://") and ".dcp.rank-00001.ckdcp: range " in raised, raised
        assert raised.endswith("the store is throttling (503 SlowDown) or failing (R-O50): try again once it answers")
        assert not [n for n in notes if n.startswith("skipped ") or "falling back" in n], notes
