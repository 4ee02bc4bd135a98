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
from ckptkit.format.container import MAGIC
from ckptkit.integrations.lightning import LAYOUT, CheckpointIO

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
        "OmegaConf.to_container(cfg, resolve=True))"
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
    with pytest.raises(UnsupportedOption, match=r"^s3://b/x\.ckpt: the Lightning plug-in .* does not serve s3:// URLs"):
        io.save_checkpoint({"global_step": 0}, "s3://b/x.ckpt")
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
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['lightning'] = None\n"
        "try:\n    import ckptkit.integrations.lightning\n"
        "except ModuleNotFoundError as e:\n    print(e)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == "ckptkit.integrations.lightning needs Lightning: pip install 'ckptkit[lightning]'\n"
