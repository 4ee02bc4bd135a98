"""ckptkit as DCP's storage backend, with real gloo ranks (tests/_dist_workers.py).

A module-wide pool of 2 ranks does the distributed saves and loads; loads at world
size 1 run in this process (a single-process DCP load), the 4-rank reshard in a
pool of its own.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
from typing import Any

import pytest
import torch
from _dist_workers import RankPool, assert_same, load_unsharded, tiny_model

import ckptkit
import ckptkit.distributed as ckd
from ckptkit.cli import main
from ckptkit.distributed._format import METADATA_NAME, data_name, read_metadata

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    """A 2-rank FSDP2 + AdamW checkpoint and the full state it was saved from."""
    path = str(tmp_path_factory.mktemp("dist") / "step-2")
    full = pool.run("fsdp_train_and_save", path)[0]
    return path, full


@pytest.fixture
def copy(saved, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], dst)
    return dst


def load_single(path: str, seed: int = 7) -> dict[str, Any]:
    """Load into an unsharded model and AdamW in this process (world size 1)."""
    return load_unsharded(tiny_model(seed), path)


def test_fsdp2_adamw_round_trip_at_world_size_2_is_bitwise(pool, saved):
    path, full = saved
    for got in pool.run("fsdp_load", path)[:1]:
        assert_same(full, got)
    assert sorted(os.listdir(path)) == [METADATA_NAME, data_name(0), data_name(1)]
    assert read_metadata(path).world_size == 2


def test_saved_at_2_loads_at_world_size_1_bitwise(saved):
    path, full = saved
    assert_same(full, load_single(path))


def test_saved_at_2_loads_at_world_size_4_bitwise(saved):
    path, full = saved
    four = RankPool(4)
    try:
        for got in four.run("fsdp_load", path, timeout=240)[:1]:
            assert_same(full, got)
    finally:
        four.close()


def test_load_never_unpickles(saved, monkeypatch):
    def tripwire(*a: Any, **kw: Any) -> Any:
        raise AssertionError("pickle used while loading")

    class TripwireUnpickler(pickle.Unpickler):  # still a class: modules that subclass it keep importing
        def __init__(self, *a: Any, **kw: Any) -> None:
            tripwire()

    path, full = saved
    load_single(path)  # imports what a first load imports, before the wire is armed
    monkeypatch.setattr(pickle, "load", tripwire)
    monkeypatch.setattr(pickle, "loads", tripwire)
    monkeypatch.setattr(pickle, "Unpickler", TripwireUnpickler)
    assert_same(full, load_single(path))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x10]))


def test_a_flipped_bit_in_a_data_file_is_a_typed_error_naming_file_tensor_offset(copy, capsys):
    md = read_metadata(copy)
    fqn, entry = next((k, t) for k, t in sorted(md.tensors.items()) if any(c.rank == 1 and c.nbytes for c in t.chunks))
    chunk = next(c for c in entry.chunks if c.rank == 1 and c.nbytes)
    _flip(os.path.join(copy, data_name(1)), chunk.offset + chunk.nbytes - 1)
    with pytest.raises(ckptkit.ChecksumMismatch) as e:
        load_single(copy)
    msg = str(e.value)
    assert msg.startswith(f"{os.path.join(copy, data_name(1))}: offset {chunk.offset} (0x{chunk.offset:x}): ")
    assert f"tensor {fqn!r} chunk at {list(chunk.offsets)}" in msg and "digest does not match" in msg
    assert main(["verify", copy]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL  {os.path.join(copy, data_name(1))}: offset ")


def test_a_flipped_bit_in_the_metadata_is_a_typed_error(copy, capsys):
    meta = os.path.join(copy, METADATA_NAME)
    _flip(meta, os.path.getsize(meta) // 2)
    with pytest.raises(ckptkit.FormatError) as e:
        load_single(copy)
    assert str(e.value).startswith(f"{meta}: ")
    assert main(["verify", copy]) == 1
    assert capsys.readouterr().out.startswith(f"FAIL  {meta}: ")


def test_a_dtype_mismatch_is_refused_and_every_problem_listed(saved):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = tiny_model(3).double()
    msd, _ = get_state_dict(model, [])
    before = {k: v.clone() for k, v in msd.items()}
    state = {"model": msd, "extra": torch.zeros(2)}
    with pytest.raises(ckptkit.StateMismatch) as e:
        ckd.load(state, saved[0])
    problems = e.value.problems
    assert "extra: missing from the checkpoint" in problems
    assert "model.0.weight: the checkpoint holds float32, the destination is float64 (never cast)" in problems
    assert len(problems) == 1 + len(msd)
    assert_same({"model": before}, {"model": msd})  # nothing was read


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_dcp_load_with_the_reader_refuses_a_dtype_mismatch_too(saved):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = {"0.bias": torch.zeros(10, dtype=torch.float64)}
    reader = ckd.Reader(saved[0])
    with pytest.raises(CheckpointException):
        dcp.load({"model": state}, storage_reader=reader)
    assert isinstance(reader.failure, ckptkit.StateMismatch)
    assert "the destination is float64 (never cast)" in str(reader.failure)


def test_a_checkpoint_directory_without_metadata_is_refused_naming_what_is_missing(copy):
    os.unlink(os.path.join(copy, METADATA_NAME))
    with pytest.raises(ckptkit.IncompleteCheckpoint) as e:
        load_single(copy)
    assert e.value.missing == (METADATA_NAME,)
    assert str(e.value) == (
        f"{copy}: incomplete distributed checkpoint: {METADATA_NAME} is missing (2 rank data "
        "files present); the save did not commit on every rank (a rank failed or was killed); "
        "load the previous checkpoint (R-DC03)"
    )


def test_a_committed_checkpoint_is_never_overwritten_unless_asked(copy):
    with pytest.raises(ckptkit.SaveFailed) as e:
        ckd.save({"w": torch.zeros(2)}, copy)
    assert str(e.value) == (
        f"{copy}: Checkpoint already exists and overwrite=False (R-DC09); save into a new directory, or pass "
        "overwrite=True to replace it atomically"
    )
    assert load_single(copy)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_and_a_refused_torn_one(tmp_path, capsys):
    prev, torn = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    pool = RankPool(2, timeout_s=10)
    try:
        pool.run("save_plain", prev, 1.0)
        for box in pool.inboxes:
            box.put(("save_and_die", (torn, 1)))
        deadline = time.monotonic() + 60
        while pool.procs[1].is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.procs[1].exitcode == -9
        status, survivor = pool.outboxes[0].get(timeout=60)  # the survivor fails, within its group timeout
        assert (status, survivor) == ("ok", "DistributedFailure")
    finally:
        pool.close()
    state = {"w": torch.zeros(64), "step": 0, "betas": None}
    ckd.load(state, prev)
    assert torch.equal(state["w"], torch.full((64,), 1.0)) and state["step"] == 1 and state["betas"] == (0.9, 0.999)
    with pytest.raises(ckptkit.IncompleteCheckpoint, match="the save did not commit on every rank"):
        ckd.load({"w": torch.zeros(64)}, torn)
    assert main(["verify", prev]) == 0
    assert main(["verify", torn]) == 1
    assert "incomplete distributed checkpoint" in capsys.readouterr().out


def test_async_save_on_its_own_group_and_a_failure_surfaces_at_the_next_call(pool, tmp_path):
    first, third = str(tmp_path / "step-3"), str(tmp_path / "step-5")
    for out in pool.run("async_saves", first, third):
        assert out[0] == "all_reduce 1048576"
        assert out[1] == (
            f"SaveFailed: {first}: Checkpoint already exists and overwrite=False (R-DC09); save into a new "
            "directory, or pass overwrite=True to replace it atomically"
        )
        assert len(out) == 2
    state = {"w": torch.zeros(64), "step": 0}
    ckd.load(state, first)
    assert torch.equal(state["w"], torch.arange(64, dtype=torch.float32)) and state["step"] == 3
    assert not os.path.exists(third)  # the call that reported the failure started nothing


# ---------------------------------------------------------------------------- the command line


def test_verify_and_inspect_a_distributed_checkpoint(saved, capsys):
    path = saved[0]
    assert main(["verify", path]) == 0
    out = capsys.readouterr().out
    md = read_metadata(path)
    n_chunks = sum(len(t.chunks) for t in md.tensors.values())
    assert out.startswith(
        f"OK    {path}  distributed world size 2  {len(md.tensors)} tensors in {n_chunks} chunks, "
        f"{len(md.values)} values  "
    )
    assert main(["inspect", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{path}: distributed checkpoint, world size 2 at save, DCP metadata 1.0.0, ")
    assert lines[2].split()[:2] == ["0", data_name(0)] and lines[3].split()[:2] == ["1", data_name(1)]
    assert any(line.split()[:3] == ["model.0.weight", "float32", "[10,"] for line in lines)


def test_diff_tensors_compares_logical_tensors_across_world_sizes(saved, tmp_path, capsys):
    path, _full = saved
    state = load_single(path)
    resaved = str(tmp_path / "one-rank")
    ckd.save(state, resaved)
    assert read_metadata(resaved).world_size == 1
    assert main(["diff", path, resaved, "--tensors"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == "tensors: bitwise identical"
    state["model"]["2.bias"][1] += 1
    changed = str(tmp_path / "changed")
    ckd.save(state, changed)
    assert main(["diff", path, changed, "--tensors"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[2:4] == ["tensors: 1 difference", "KIND     TENSOR        DETAIL"]
    assert out[4] == "changed  model.2.bias  1/3 elements differ, max |diff| 1"
    assert main(["diff", path, changed]) == 2
    assert "compare their tensors with --tensors" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_default_backend_directory_is_named_and_never_unpickled(tmp_path, capsys, monkeypatch):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "default")
    dcp.save({"w": torch.ones(3), "step": 1}, storage_writer=dcp.FileSystemWriter(path))
    monkeypatch.setattr(pickle, "load", None)  # any unpickling attempt would now fail loudly
    assert main(["verify", path]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL  {path}: .metadata: a checkpoint written by DCP's default filesystem backend")
    assert "ckptkit never unpickles" in out
    with pytest.raises(ckptkit.BadMagic):
        ckd.load({"w": torch.zeros(3)}, path)
    assert main(["inspect", path]) == 1
