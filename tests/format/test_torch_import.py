"""Importing an existing torch.save checkpoint once, safely (no arbitrary pickle)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import ckptkit
from ckptkit import Checkpoint, UnsupportedValue, import_torch_checkpoint


def test_a_torch_save_state_dict_imports_and_re_saves_exactly(tmp_path):
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": 7}, tmp_path / "old.pt")
    old = import_torch_checkpoint(tmp_path / "old.pt")
    ckptkit.save(
        tmp_path / "new.ckpt",
        Checkpoint(step=old["step"], model={"net": old["model"]}, optim={"adamw": old["optimizer"]}),
    )
    back = ckptkit.load(tmp_path / "new.ckpt")
    assert torch.equal(back.model["net"]["weight"], net.weight)
    assert torch.equal(back.optim["adamw"]["state"][0]["exp_avg"], opt.state[net.weight]["exp_avg"])


class _RunsACommand:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_a_command_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"w": _RunsACommand(str(marker))}, f)
    with pytest.raises(UnsupportedValue) as e:
        import_torch_checkpoint(tmp_path / "evil.pt")
    assert str(e.value).startswith(f"{tmp_path / 'evil.pt'}: torch.load(weights_only=True) refused it (")
    assert str(e.value).endswith("only tensors and plain containers are imported, never arbitrary pickle")
    assert not marker.exists()


def test_a_missing_file_is_checkpoint_not_found(tmp_path):
    with pytest.raises(ckptkit.CheckpointNotFound, match="no such file"):
        import_torch_checkpoint(tmp_path / "nope.pt")
