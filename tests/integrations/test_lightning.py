"""The Lightning plug-in with the real ``lightning.pytorch.Trainer`` on CPU.

A deterministic module (fixed init, no dropout, AdamW with a per-step StepLR
schedule, hyper-parameters, the default ModelCheckpoint) trained 40 steps straight
equals one trained 20 steps, checkpointed through the plug-in, and resumed with
``fit(ckpt_path=...)`` to 40: parameters, optimizer and scheduler state, bit for bit.

The batch of optimizer step ``k`` is a function of ``k`` (``global_step``), not of the
DataLoader's position: where a plain DataLoader resumes is Lightning's business, not
the checkpoint's (Lightning 2.6 resumes a run stopped by ``max_steps`` at an epoch's
last batch with one extra batch in the next epoch, with its own TorchCheckpointIO too).
"""

from __future__ import annotations

import argparse
import enum
import os
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import ChecksumMismatch, FormatError, UnsupportedOption, UnsupportedValue
from ckptkit.format._container import MAGIC
from ckptkit.integrations.lightning import LAYOUT, CheckpointIO, LoadsContainers, load_from_checkpoint

pytestmark = [
    pytest.mark.slow,
    # Lightning's own advice for real jobs (more dataloader workers, a logger): not ours to act on here.
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    # A resume in the run's own directory, as intended.
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning"),
]


class Net(L.LightningModule):
    """A tiny deterministic regression module."""

    def __init__(self, lr: float = 0.05, hidden: int = 16, act: Any = "tanh") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.fc1 = torch.nn.Linear(8, hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def training_step(self, _batch: Any, _i: int) -> torch.Tensor:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(self.global_step))  # step k's batch
        y = x.sum(dim=1, keepdim=True).sin()
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(40)), batch_size=4)  # 10 batches an epoch; only their count matters


def trainer(root: Path, steps: int, **kw: Any) -> Any:
    return L.Trainer(
        max_steps=steps,
        plugins=kw.pop("plugins", [CheckpointIO()]),
        default_root_dir=str(root),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def fit(root: Path, steps: int, ckpt_path: str | None = None, **kw: Any) -> tuple[Net, Any]:
    model, t = Net(), trainer(root, steps, **kw)
    t.fit(model, data(), ckpt_path=ckpt_path)
    return model, t


def assert_bitwise(a: Any, b: Any, at: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, at
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), at
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), at
        for k in a:
            assert_bitwise(a[k], b[k], f"{at}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), at
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{at}[{i}]")
    else:
        assert a == b or (a != a and b != b), at


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lightning")
    straight, t40 = fit(root / "straight", 40)
    _half, _t20 = fit(root / "half", 20)
    ckpt = root / "half" / "checkpoints" / "epoch=1-step=20.ckpt"  # by ModelCheckpoint, through the plug-in
    resumed, t_res = fit(root / "half", 40, ckpt_path=str(ckpt))
    return {"root": root, "straight": (straight, t40), "resumed": (resumed, t_res), "ckpt": ckpt}


def test_twenty_steps_resumed_to_forty_equal_forty_straight_bit_for_bit(runs: dict[str, Any]) -> None:
    (straight, t40), (resumed, t_res) = runs["straight"], runs["resumed"]
    assert t40.global_step == t_res.global_step == 40
    assert_bitwise(straight.state_dict(), resumed.state_dict(), "state_dict")
    assert_bitwise(t40.optimizers[0].state_dict(), t_res.optimizers[0].state_dict(), "optimizer")
    assert_bitwise(
        t40.lr_scheduler_configs[0].scheduler.state_dict(),
        t_res.lr_scheduler_configs[0].scheduler.state_dict(),
        "lr_scheduler",
    )
    assert t40.optimizers[0].state_dict()["state"][0]["step"].item() == 40


def test_every_lightning_checkpoint_is_a_verified_ckptkit_container(runs: dict[str, Any]) -> None:
    files = sorted((runs["root"] / "straight" / "checkpoints").iterdir())
    assert [f.name for f in files] == ["epoch=3-step=40.ckpt"]  # top-1 retention removed the older ones
    files += sorted((runs["root"] / "half" / "checkpoints").iterdir())
    assert [f.name for f in files] == ["epoch=3-step=40.ckpt", "epoch=1-step=20.ckpt", "epoch=3-step=40.ckpt"]
    for f in [*files, runs["ckpt"]]:
        assert f.read_bytes()[: len(MAGIC)] == MAGIC  # no pickle: torch.save files start with a zip header
        assert ckptkit.verify(f).ok
    ck = ckptkit.load(runs["ckpt"])
    assert ck.step == 20 and ck.monitor["layout"] == LAYOUT
    assert set(ck.model) == {"state_dict"} and set(ck.optim) == {"optimizer_states", "lr_schedulers"}
    assert ck.monitor["checkpoint"]["hyper_parameters"] == {"lr": 0.05, "hidden": 16, "act": "tanh"}


def test_the_plugin_returns_the_dict_lightning_saved(tmp_path: Path) -> None:
    _model, t = fit(tmp_path, 6, enable_checkpointing=False)
    saved = t._checkpoint_connector.dump_checkpoint(weights_only=False)
    t.save_checkpoint(tmp_path / "x.ckpt")
    assert_bitwise(saved, CheckpointIO().load_checkpoint(tmp_path / "x.ckpt"), "checkpoint")


def test_ckptkit_verify_and_inspect_read_lightning_checkpoints(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(runs["ckpt"])]) == 0
    assert capsys.readouterr().out.startswith(f"OK    {runs['ckpt']}  v2 step 20")
    assert main(["inspect", str(runs["ckpt"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{runs['ckpt']}: container v2, step 20")


def test_a_damaged_checkpoint_is_refused_before_lightning_restores_anything(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.ckpt"
    shutil.copyfile(runs["ckpt"], bad)
    report = ckptkit.verify(bad)
    model_section = next(s for s in report.sections if s.name == "model")
    data = bytearray(bad.read_bytes())
    data[model_section.offset + model_section.length - 8] ^= 0x01  # a bit of the last weight's bytes
    bad.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match=r"bad\.ckpt"):
        fit(tmp_path / "r", 40, ckpt_path=str(bad))


class Activation(Net):
    def __init__(self) -> None:
        super().__init__(act=torch.nn.ReLU())


def test_an_object_in_hyper_parameters_is_refused_by_key_path_and_the_old_file_stays(tmp_path: Path) -> None:
    _model, t = fit(tmp_path, 2, enable_checkpointing=False)
    path = tmp_path / "last.ckpt"
    t.save_checkpoint(path)
    good = path.read_bytes()
    bad = trainer(tmp_path, 2, enable_checkpointing=False)
    with pytest.warns(UserWarning, match="is an instance of `nn.Module`"):  # Lightning's own hint
        model = Activation()
    bad.fit(model, data())
    with pytest.raises(UnsupportedValue) as e:
        bad.save_checkpoint(path)
    assert str(e.value) == (
        "checkpoint['hyper_parameters']['act']: a torch.nn.modules.activation.ReLU cannot be stored (only tensors, "
        "None, bool, int, float, str, bytes, lists, tuples, dicts, sets, ordered dicts, numpy arrays and scalars, "
        "torch dtypes, devices and sizes); convert it to one of those; exclude that argument with "
        "self.save_hyperparameters(ignore=[...]) and rebuild it in __init__, or pass a plain value (for omegaconf, "
        "OmegaConf.to_container(cfg, resolve=True)) (to have this refused when fit starts, before step 1, pass the "
        "plug-in in callbacks too: io = CheckpointIO(); Trainer(plugins=[io], callbacks=[io]))"
    )
    assert path.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # no temporary file left behind


class Mode(enum.Enum):
    FAST = 1


class Keeps(L.Callback):
    def state_dict(self) -> dict[str, Any]:
        return {"mode": Mode.FAST}


def test_callback_state_that_is_not_plain_is_refused_with_advice(tmp_path: Path) -> None:
    _model, t = fit(tmp_path, 2, enable_checkpointing=False, callbacks=[Keeps()])
    with pytest.raises(
        UnsupportedValue,
        match=r"^checkpoint\['callbacks'\]\['Keeps'\]\['mode'\]: a test_lightning\.Mode cannot be stored: an Enum "
        r"member; store its \.value .*; a callback's state_dict\(\) must return plain",
    ):
        t.save_checkpoint(tmp_path / "x.ckpt")


class Counted(Net):
    """Counts its training steps; its ``mode`` hyper-parameter may be an Enum member."""

    def __init__(self, mode: Any = "fast") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.steps_run = 0

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        self.steps_run += 1
        return super().training_step(batch, i)


@pytest.mark.parametrize("where", ["hyper_parameters", "callbacks"])
def test_the_plugin_as_a_callback_refuses_unstorable_state_when_fit_starts(where: str, tmp_path: Path) -> None:
    io_ = CheckpointIO()
    extra = [Keeps()] if where == "callbacks" else []
    t = trainer(tmp_path, 2, plugins=[io_], callbacks=[io_, *extra])
    model = Counted(mode=Mode.FAST if where == "hyper_parameters" else "fast")
    with pytest.raises(UnsupportedValue, match=r"an Enum member; store its \.value") as e:
        t.fit(model, data())
    at = "['hyper_parameters']['mode']" if where == "hyper_parameters" else "['callbacks']['Keeps']['mode']"
    assert str(e.value).startswith(f"checkpoint{at}: a test_lightning.Mode cannot be stored")
    assert model.steps_run == 0 and not (tmp_path / "checkpoints").exists()  # before step 1, nothing written


class RandomState(L.Callback):
    """Saves the numpy RNG state, as a trainer does for an exact resume."""

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint["numpy_rng"] = np.random.RandomState(5).get_state()
        checkpoint["extras"] = {"seen": {1, 2}, "scale": np.float32(0.5), "dtype": torch.bfloat16}


def test_typed_values_in_a_lightning_checkpoint_come_back_equal_and_of_the_same_type(tmp_path: Path) -> None:
    io_ = CheckpointIO()
    _model, t = fit(tmp_path, 2, enable_checkpointing=False, plugins=[io_], callbacks=[io_, RandomState()])
    t.save_checkpoint(tmp_path / "r.ckpt")
    back = io_.load_checkpoint(tmp_path / "r.ckpt")
    want: Any = np.random.RandomState(5).get_state()
    assert type(back["numpy_rng"]) is tuple and back["numpy_rng"][0] == "MT19937"
    assert back["numpy_rng"][1].dtype == want[1].dtype and (back["numpy_rng"][1] == want[1]).all()
    assert back["numpy_rng"][2:] == want[2:]
    assert back["extras"] == {"seen": {1, 2}, "scale": np.float32(0.5), "dtype": torch.bfloat16}
    assert type(back["extras"]["scale"]) is np.float32
    np.random.RandomState().set_state(back["numpy_rng"])


def test_a_container_not_written_by_the_plugin_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "step-00000001.ckpt"
    ckptkit.save(other, ckptkit.Checkpoint(step=1, model={"net": {"w": torch.zeros(2)}}))
    with pytest.raises(FormatError) as e:
        CheckpointIO().load_checkpoint(other)
    assert str(e.value) == (
        f"{other}: monitor.layout: not a Lightning checkpoint written by ckptkit.integrations.lightning.CheckpointIO "
        f"(expected {LAYOUT}, got none); load it with ckptkit.load(); a torch.save file is imported once with "
        "ckptkit.import_torch_checkpoint"
    )


def test_a_plugin_container_without_its_lightning_keys_is_refused(tmp_path: Path) -> None:
    altered = tmp_path / "x.ckpt"
    ckptkit.save(altered, ckptkit.Checkpoint(step=1, monitor={"layout": LAYOUT, "checkpoint": [1]}))
    with pytest.raises(FormatError) as e:
        CheckpointIO().load_checkpoint(altered)
    assert str(e.value) == (
        f"{altered}: monitor.checkpoint: the Lightning keys are missing or not a map; "
        "the file was altered after it was written"
    )


def test_missing_files_remote_paths_and_storage_options(tmp_path: Path) -> None:
    io = CheckpointIO()
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "nope.ckpt")
    with pytest.raises(
        UnsupportedOption, match=r"^gs://b/x\.ckpt: the gs:// scheme is not supported; ckptkit serves s3://"
    ):
        io.save_checkpoint({"global_step": 0}, "gs://b/x.ckpt")
    with pytest.raises(UnsupportedValue, match="storage_options are not supported"):
        io.save_checkpoint({"global_step": 0}, tmp_path / "x.ckpt", storage_options={"a": 1})
    io.remove_checkpoint(tmp_path / "nope.ckpt")  # Lightning may remove what is already gone
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, tmp_path / "sub" / "x.ckpt")
    assert ckptkit.load(tmp_path / "sub" / "x.ckpt").step == 3
    io.remove_checkpoint(tmp_path / "sub" / "x.ckpt")
    assert not (tmp_path / "sub" / "x.ckpt").exists()


def test_fabric_saves_and_loads_through_the_plugin(tmp_path: Path) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[CheckpointIO()])
    net, opt = _stepped()
    net, opt = fabric.setup(net, opt)
    fabric.save(tmp_path / "f.ckpt", {"model": net, "optimizer": opt, "step": 3})
    assert ckptkit.verify(tmp_path / "f.ckpt").ok
    net2, opt2 = fabric.setup(*_stepped(steps=0))
    state = {"model": net2, "optimizer": opt2, "step": 0}
    fabric.load(tmp_path / "f.ckpt", state)
    assert state["step"] == 3
    assert_bitwise(net.state_dict(), net2.state_dict(), "model")
    assert_bitwise(opt.state_dict(), opt2.state_dict(), "optimizer")


def _stepped(steps: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = torch.nn.Linear(3, 2)
    with torch.no_grad():
        net.weight.copy_(torch.arange(6.0).reshape(2, 3) if steps else torch.zeros(2, 3))
    opt = torch.optim.AdamW(net.parameters())
    for _ in range(steps):
        net(torch.ones(1, 3)).sum().backward()
        opt.step()
    return net, opt


def test_without_lightning_the_import_names_the_extra() -> None:
    """A real process in which lightning cannot be imported."""
    from helpers import import_error_without

    said = import_error_without("lightning", "ckptkit.integrations.lightning")
    assert said == "ckptkit.integrations.lightning needs Lightning: pip install 'ckptkit[lightning]'\n"


# --- load_from_checkpoint, hyper-parameters at fit start, diff (issue 26) ------------------------


class Loadable(LoadsContainers, Net):
    """The user's module with the mix-in: ``Loadable.load_from_checkpoint(path)`` reads plug-in files."""


def _no_unpickling(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A trip-wire: every way to unpickle raises (and is counted)."""
    import pickle

    calls: list[str] = []

    def tripped(name: str) -> Any:
        def fail(*_a: Any, **_k: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} was called")

        return fail

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, tripped(f"pickle.{name}"))
    monkeypatch.setattr(torch, "load", tripped("torch.load"))
    return calls


def test_load_from_checkpoint_builds_the_module_from_a_plugin_file_and_never_unpickles(
    runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    straight, _t = runs["straight"]
    last = runs["root"] / "straight" / "checkpoints" / "epoch=3-step=40.ckpt"
    calls = _no_unpickling(monkeypatch)
    net = Loadable.load_from_checkpoint(last)
    assert isinstance(net, Loadable) and dict(net.hparams) == {"lr": 0.05, "hidden": 16, "act": "tanh"}
    assert_bitwise(straight.state_dict(), net.state_dict(), "state_dict")
    wider = load_from_checkpoint(Net, str(runs["ckpt"]), map_location="cpu", lr=0.5)  # the function, any class
    assert type(wider) is Net and wider.hparams["lr"] == 0.5
    assert calls == []


def test_lightnings_own_load_from_checkpoint_unpickles_and_the_mix_in_refuses_what_it_cannot_verify(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    import pickle

    with pytest.raises(pickle.UnpicklingError):  # why the mix-in exists: Lightning reads with torch.load
        Net.load_from_checkpoint(runs["ckpt"])
    with pytest.raises(UnsupportedValue) as e:
        Loadable.load_from_checkpoint(runs["ckpt"], hparams_file="h.yaml")
    assert str(e.value) == (
        "hparams_file='h.yaml': not read by Loadable.load_from_checkpoint (a YAML file is not verified with the "
        "checkpoint); pass the hyper-parameters to override as keyword arguments"
    )
    torch_file = tmp_path / "torch.ckpt"
    torch.save({"state_dict": Net().state_dict()}, torch_file)
    with pytest.raises(
        FormatError, match=r"torch\.ckpt: .*torch\.save .*import it once with ckptkit\.import_torch_checkpoint"
    ):
        Loadable.load_from_checkpoint(torch_file)


class Hparam(Net):
    """A module whose hyper-parameter ``h`` is whatever the test passes."""

    def __init__(self, h: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (Path("data/train"), "a pathlib.PosixPath cannot be stored: a path; store str(path)"),
        (argparse.Namespace(depth=2), "a argparse.Namespace cannot be stored: an argparse Namespace; store vars(ns)"),
        (Mode.FAST, "a test_lightning.Mode cannot be stored: an Enum member; store its .value"),
    ],
)
def test_an_unstorable_hparam_is_refused_when_fit_starts_naming_it_and_the_conversion(
    value: Any, said: str, tmp_path: Path
) -> None:
    io_ = CheckpointIO()
    model = Hparam(h=value)
    with pytest.raises(UnsupportedValue) as e:
        trainer(tmp_path, 2, plugins=[io_], callbacks=[io_]).fit(model, data())
    assert str(e.value).startswith(f"checkpoint['hyper_parameters']['h']: {said}")
    assert model.global_step == 0 and not (tmp_path / "checkpoints").exists()


def test_a_set_hparam_is_stored_and_comes_back_a_set(tmp_path: Path) -> None:
    io_ = CheckpointIO()
    t = trainer(tmp_path, 1, plugins=[io_], callbacks=[io_], enable_checkpointing=False)
    t.fit(Hparam(h={"a", "b"}), data())
    t.save_checkpoint(tmp_path / "s.ckpt")
    assert load_from_checkpoint(Hparam, tmp_path / "s.ckpt").hparams["h"] == {"a", "b"}


def test_diff_compares_two_lightning_files_hparams_as_the_config_and_tensors_bitwise(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    half = runs["ckpt"]
    assert main(["diff", str(half), str(half), "--tensors"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"a: {half} (Lightning hyper_parameters)"
    assert out[2:] == ["no differences", "tensors: bitwise identical"]
    t = trainer(tmp_path, 20, enable_checkpointing=False)
    t.fit(Net(lr=0.07), data())
    other = tmp_path / "lr.ckpt"
    t.save_checkpoint(other)
    assert main(["diff", str(half), str(other), "--tensors"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:5] == [
        "CLASS   KEY  OLD   NEW   NOTE",
        "strict  lr   0.05  0.07",
        "1 difference: 1 strict, 0 exempt",
    ]
    assert lines[5].startswith("tensors: ") and "model:state_dict.fc1.weight" in "\n".join(lines[6:])


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # botocore's pooled sockets
def test_a_trainer_saves_through_the_plugin_to_s3_and_resumes_from_there_bit_for_bit(
    runs: dict[str, Any], s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spec/objectstore.md R-O44, G-82: the Trainer's checkpoint on s3:// is the same container, committed
    by its record and checked on every read; written once; removed record first."""
    url = f"{s3}/lit/epoch=1-step=20.ckpt"
    _half, t20 = fit(tmp_path / "half", 20, enable_checkpointing=False)
    t20.save_checkpoint(url)  # Lightning's own save, through the plug-in
    resumed, t_res = fit(tmp_path / "resumed", 40, ckpt_path=url, enable_checkpointing=False)
    straight, t40 = runs["straight"]
    assert t_res.global_step == 40
    assert_bitwise(straight.state_dict(), resumed.state_dict(), "state_dict")
    assert_bitwise(t40.optimizers[0].state_dict(), t_res.optimizers[0].state_dict(), "optimizer")
    calls = _no_unpickling(monkeypatch)
    net = Loadable.load_from_checkpoint(url)
    assert calls == [] and dict(net.hparams) == {"lr": 0.05, "hidden": 16, "act": "tanh"}
    assert main(["verify", url]) == 0
    with pytest.raises(ckptkit.CommitConflict, match=r"step already committed; .*: use a filename with \{step\}"):
        t20.save_checkpoint(url)
    io = CheckpointIO()
    io.remove_checkpoint(url)
    io.remove_checkpoint(url)  # Lightning may remove what is already gone
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        io.load_checkpoint(url)
