"""ckptkit's torchtitan CheckpointManager with the real package (spec/torchtitan.md).

The end-to-end test runs torchtitan's llama3 debug model (smaller, through its config) on 2 gloo
ranks with FSDP2 in real processes (tests/_torchtitan_worker.py): trained uninterrupted, trained
again and SIGKILLed, resumed under a pickle trip-wire (the ranks are forked from a forkserver
that imported torchtitan once); the resumed run's state equals the
uninterrupted run's bit for bit. The rest are the manager's refusals, in this process.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import pickle
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from helpers import import_error_without, same
from torchtitan.components.dataloader import ParallelAwareDataloader  # the test extra installs torchtitan

import ckptkit.distributed as ckd
from ckptkit.cli import main
from ckptkit.distributed._format import METADATA_NAME
from ckptkit.errors import ConfigDrift, MalformedIndex, ResumeRefused, SaveFailed, UnsupportedOption, UnsupportedValue
from ckptkit.integrations._torchtitan_config import check_job, job_table
from ckptkit.integrations.torchtitan import CheckpointManager, DataLoaderState, find_load_step

# torchdata's StatefulDataLoader calls torch.set_vital, which torch 2.13 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

#: What the ranks' forkserver imports before it forks them.
PRELOAD = [
    "torchtitan.models.llama3.config_registry",
    "ckptkit.integrations.torchtitan",
    "torchdata.stateful_dataloader",
]


def ranks(phase: str, out: Path, world: int = 2, timeout: float = 240) -> list[int | None]:
    """Run ``phase`` of the worker on ``world`` ranks; their exit codes. The ranks are forked from a
    forkserver that imported torchtitan once (an import costs seconds of CPU per process)."""
    import multiprocessing

    import _torchtitan_worker

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["_torchtitan_worker", *PRELOAD])
    init = str(out / f"init-{phase}")
    procs = [ctx.Process(target=_torchtitan_worker.run, args=(phase, r, world, init, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    return [p.exitcode for p in procs]


@pytest.mark.slow
def test_killed_and_resumed_is_the_uninterrupted_run_bitwise_and_nothing_unpickles(tmp_path: Path) -> None:
    assert ranks("first", tmp_path) == [-signal.SIGKILL, -signal.SIGKILL]
    folder = tmp_path / "run" / "checkpoint"
    assert sorted(os.listdir(folder)) == ["environment.json", "history.jsonl", "step-2", "step-4"]  # R-TT11
    (folder / "step-6").mkdir()  # a save killed before it committed: never a resume point
    (folder / "step-6" / "__0_0.distcp").write_bytes(b"half a rank file")
    assert ranks("resume", tmp_path) == [0, 0]
    assert main(["verify", str(folder / "step-8")]) == 0  # a ckptkit.distributed checkpoint, every chunk verified
    for rank in range(2):
        report = json.loads((tmp_path / f"report-{rank}.json").read_text())
        assert (report["resumed"], report["resumed_at"]) == (True, 4)
        assert report["counts"] == {}  # not one call into pickle's or torch's unpickling, the whole resume
        assert report["control"] == {"pickle.loads": 1}  # the trip-wire sees torchtitan's own pickle.loads
        ref = torch.load(tmp_path / f"ref-{rank}.pt", weights_only=True)
        got = torch.load(tmp_path / f"resumed-{rank}.pt", weights_only=True)
        assert got["train"] == {"step": 8, "ntokens_seen": 8 * 2 * 16}
        assert got["data"]["dataset_state"] == {"sample_idx": 8 * 2}
        assert same(ref, got)
        said = report["said"]
        assert said["lr"].startswith("ConfigDrift: ") and said["lr"].endswith(
            "config drift: 1 strict difference from the run's snapshot:\n"
            "  optimizer.param_groups.0.optimizer_kwargs.lr 0.0008 -> 0.001\n"
            "resuming would continue a different run; restore these values, or start a new run in a new directory"
        )
        assert "checkpoint/step-8: " in said["lr"]
        assert said["steps"].endswith(
            "  lr_scheduler.total_steps 8 -> 12\n"
            "resuming would continue a different run; restore these values, or start a new run in a new directory\n"
            "(lr_scheduler.total_steps is unset, so the LR schedule spans training.steps; to extend the run with the "
            "schedule it trained on, pass --lr_scheduler.total_steps 8)"
        )
        assert said["exempt"] == "loaded: True"


def test_finding_the_load_step(tmp_path: Path) -> None:
    assert find_load_step(str(tmp_path / "none")) == -1
    for name, marker in (("step-2", METADATA_NAME), ("step-10", METADATA_NAME), ("step-12", None), ("x-14", None)):
        (tmp_path / name).mkdir()
        if marker:
            (tmp_path / name / marker).write_bytes(b"")
    said: list[str] = []
    assert find_load_step(str(tmp_path), said.append) == 10
    assert said == [f"ckptkit: {tmp_path / 'step-12'} did not commit (no {METADATA_NAME}); not a resume point (R-TT04)"]
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / ".metadata").write_bytes(b"")
    assert find_load_step(str(tmp_path), said.append) == 10  # an older pickled one is no resume point either
    (tmp_path / "step-20").mkdir()
    (tmp_path / "step-20" / ".metadata").write_bytes(b"")
    with pytest.raises(ResumeRefused, match=r"step-20: a checkpoint in DCP's default \(pickled\) format, newer than"):
        find_load_step(str(tmp_path))


def test_pinned_memory_async_is_refused_when_the_config_is_made() -> None:
    with pytest.raises(UnsupportedOption, match=r"async_mode='async_with_pinned_mem': DCP runs that save in another"):
        CheckpointManager.Config(enable=True, async_mode="async_with_pinned_mem")


def test_the_job_config_is_required() -> None:
    with pytest.raises(UnsupportedOption, match=r"needs the job config, to store it with every checkpoint"):
        _build(CheckpointManager.Config(enable=True))


def _build(config: CheckpointManager.Config, **extra: Any) -> Any:
    """``config.build`` as torchtitan's Trainer calls it, for a manager that refuses to start."""
    return config.build(
        dataloader=None,
        model_parts=[torch.nn.Linear(2, 2)],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder="unused",
        **extra,
    )


@pytest.mark.parametrize("folder", ["memory://ckpt", "s3://bucket/run/checkpoint"])
def test_a_checkpoint_folder_on_a_url_is_refused_when_the_manager_starts(folder: str) -> None:
    # torchtitan reads such a folder through fsspec; ckptkit's manager lists local folders, so it would
    # find no step there and start again at step 0, failing only at its first save.
    said = (
        f"checkpoint.folder {folder}: ckptkit's torchtitan CheckpointManager does not serve "
        f"{folder.partition('://')[0]}:// URLs yet (it writes and reads local files only): it finds the step to "
        "resume by listing a local folder, so this "
        "one would read as empty and the run would start again at step 0 (R-TT10); use a local (or mounted) "
        "directory, or torchtitan's own CheckpointManager for fsspec storage"
    )
    with pytest.raises(UnsupportedOption) as info:
        _build(CheckpointManager.Config(enable=True, folder=folder), job_config=Job())
    assert str(info.value) == said
    with pytest.raises(UnsupportedOption, match=r"^checkpoint\.folder .*: ckptkit's torchtitan CheckpointManager"):
        find_load_step(folder)


class PickledState:
    """A dataloader of a user's own that keeps its state as pickle bytes, as torchtitan's does."""

    def state_dict(self) -> dict[str, Any]:
        return {"dp_rank_0": pickle.dumps({"i": 3}), "world_size": 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise AssertionError("never reached")


class PlainState:
    """A dataloader of a user's own whose state is plain data."""

    def __init__(self) -> None:
        self.position = {"epoch": 1, "seen": [3, 4]}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.position)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = state_dict


def test_another_dataloader_s_plain_state_is_stored_under_its_rank_and_given_back() -> None:
    state = DataLoaderState(PlainState()).state_dict()
    assert state == {"rank_0": ({"epoch": 1, "seen": [3, 4]},)}
    fresh = PlainState()
    fresh.position = {}
    DataLoaderState(fresh).load_state_dict(state)
    assert fresh.position == {"epoch": 1, "seen": [3, 4]}


def test_a_dataloader_state_holding_pickle_is_refused_by_key() -> None:
    with pytest.raises(
        UnsupportedValue, match=r"^dataloader\['rank_0'\]\[0\]\['dp_rank_0'\]: pickle bytes \(\d+ bytes\); restoring"
    ):
        DataLoaderState(PickledState()).state_dict()


def test_torchtitan_s_dataloader_state_is_its_tree_and_loads_without_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    data = [({"input": torch.tensor([i])}, torch.tensor([i])) for i in range(6)]
    dl = ParallelAwareDataloader(data, dp_rank=1, dp_world_size=2, batch_size=None)
    it = iter(dl)
    next(it), next(it)
    state = DataLoaderState(dl).state_dict()
    assert set(state) == {"dp_rank_1", "world_size"} and state["world_size"] == 2
    assert isinstance(state["dp_rank_1"], tuple) and state["dp_rank_1"][0]["_num_yielded"] == 2
    fresh = ParallelAwareDataloader(data, dp_rank=1, dp_world_size=2, batch_size=None)
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    DataLoaderState(fresh).load_state_dict(state)
    assert int(next(iter(fresh))[1]) == 2
    with pytest.raises(ResumeRefused, match=r"^dataloader: saved at data-parallel degree 4, resumed at 2; torchtitan"):
        DataLoaderState(fresh).load_state_dict({**state, "world_size": 4})


def test_without_torchtitan_the_import_names_the_extra() -> None:
    said = import_error_without("torchtitan", "ckptkit.integrations.torchtitan")
    assert said == "ckptkit.integrations.torchtitan needs torchtitan: pip install 'ckptkit[torchtitan]'\n"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_failed_async_save_is_the_ckptkit_error_where_torchtitan_waits(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    manager = cast(CheckpointManager, SimpleNamespace(pg=None))  # what _async_save reads: its async process group
    pending = CheckpointManager._async_save(manager, {"w": torch.ones(2)}, str(tmp_path / "a-file" / "step-2"))
    with pytest.raises(SaveFailed, match=r"a-file/step-2: cannot create the checkpoint directory \(Not a directory\)"):
        pending.result()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_checkpoint_in_the_run_folder_without_the_job_config_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "step-2")
    ckd.save({"w": torch.ones(2)}, path)  # a plain ckptkit.distributed save, not the manager's
    with pytest.raises(MalformedIndex, match=r"step-2: ckptkit_job_config: no job config snapshot; not saved by"):
        CheckpointManager._check_job(cast(CheckpointManager, SimpleNamespace(job_table={})), path)


@dataclasses.dataclass
class Inner:
    init: Any = dataclasses.field(default_factory=lambda: functools.partial(round, 0.5, ndigits=1))
    kinds: dict[Any, Any] = dataclasses.field(default_factory=lambda: {Mode.DP: 1})
    dtype: Any = torch.bfloat16


class Mode(str, enum.Enum):
    DP = "dp"


@dataclasses.dataclass
class Job:
    layers: list[Inner] = dataclasses.field(default_factory=lambda: [Inner(), Inner()])
    act: Any = torch.nn.init.zeros_
    exclude_from_loading: list[str] = dataclasses.field(default_factory=list)


def test_the_job_config_table_names_callables_without_addresses_and_lists_of_tables_by_index() -> None:
    assert job_table(Job(layers=[Inner()])) == {
        "layers": {
            "0": {
                "init": "functools.partial(builtins.round, 0.5, ndigits=1)",
                "kinds": {"dp": 1},
                "dtype": "torch.bfloat16",
            }
        },
        "act": "torch.nn.init.zeros_",
        "exclude_from_loading": [],
    }
    with pytest.raises(
        UnsupportedValue, match=r"^config field layers\.0\.kinds: cannot snapshot the key 'a\.b'; table"
    ):
        job_table(Job(layers=[Inner(kinds={"a.b": 1})]))
    with pytest.raises(UnsupportedValue, match=r"^config field act: cannot snapshot a object <object object at"):
        job_table(Job(act=object()))


def test_the_checkpoint_table_is_exempt_but_what_a_resume_restores() -> None:
    old: dict[str, Any] = {"checkpoint": {"interval": 10, "exclude_from_loading": []}, "training": {"steps": 10}}
    new: dict[str, Any] = {
        "checkpoint": {"interval": 5, "exclude_from_loading": ["optimizer"]},
        "training": {"steps": 20},
    }
    with pytest.raises(ConfigDrift) as info:
        check_job(old, new, "ck/step-10")
    assert [d.key for d in info.value.differences] == ["checkpoint.exclude_from_loading"]
    assert str(info.value).startswith("ck/step-10: config drift: 1 strict difference from the run's snapshot:\n")
    new["checkpoint"]["exclude_from_loading"] = []
    assert [d.describe() for d in check_job(old, new, "ck/step-10")] == [
        "checkpoint.interval 10 -> 5: exempt (decides when we look, not what the model computes)",
        "training.steps 10 -> 20: extending the run",
    ]
