"""Tensor-by-tensor comparison (ckptkit.audit._compare) and `ckptkit diff --tensors`."""

from __future__ import annotations

import dataclasses
import json

import torch

from ckptkit.audit import compare_checkpoints, compare_states
from ckptkit.cli import main
from ckptkit.format._checkpoint import Checkpoint, save
from ckptkit.format._snapshot import snapshot_path, write_snapshot
from ckptkit.format._tree import flatten


@dataclasses.dataclass
class Cfg:
    lr: float = 0.1
    steps: int = 10


_CFG = Cfg()


def _ckpt(path, w, *, lr=0.1, extra=None, cfg=_CFG):
    model = {"net": {"w": w, **(extra or {})}}
    save(path, Checkpoint(step=10, model=model, optim={"adamw": {"param_groups": [{"lr": lr}]}}))
    write_snapshot(snapshot_path(path), cfg)
    return path


def test_identical_checkpoints_have_no_differences(tmp_path):
    a = _ckpt(tmp_path / "a.ckpt", torch.arange(6.0))
    b = _ckpt(tmp_path / "b.ckpt", torch.arange(6.0))
    assert compare_checkpoints(a, b) == []


def test_a_one_ulp_change_is_found_with_its_count_and_size(tmp_path):
    w = torch.arange(6.0)
    w2 = w.clone()
    w2[3] = torch.nextafter(w2[3], torch.tensor(10.0))
    a = _ckpt(tmp_path / "a.ckpt", w)
    b = _ckpt(tmp_path / "b.ckpt", w2, lr=0.05, extra={"b": torch.zeros(1)})
    diffs = compare_checkpoints(a, b)
    assert [(d.name, d.kind) for d in diffs] == [
        ("model:net.b", "only_new"),
        ("model:net.w", "changed"),
        ("optim:adamw.param_groups.0.lr", "changed"),
    ]
    w_diff = diffs[1]
    assert (w_diff.n_diff, w_diff.numel) == (1, 6)
    assert w_diff.max_abs_diff == 2.0**-22
    assert w_diff.detail == "1/6 elements differ, max |diff| 2.38419e-07"
    assert diffs[2].detail == "0.1 -> 0.05"


def test_bitwise_equality_tells_signed_zeros_and_nan_payloads_apart():
    a = {"x:t": torch.tensor([0.0, float("nan")])}
    b = {"x:t": torch.tensor([-0.0, float("nan")])}
    (d,) = compare_states(a, b)
    assert d.n_diff == 1 and d.max_abs_diff == 0.0
    assert compare_states(a, {"x:t": a["x:t"].clone()}) == []


def test_dtype_or_shape_changes_are_reported_not_compared():
    (d,) = compare_states({"m:w": torch.zeros(2)}, {"m:w": torch.zeros(3, dtype=torch.float16)})
    assert d.detail == "torch.float32[2] -> torch.float16[3]"


def test_flatten_names_leaves_by_section_and_dotted_path():
    assert flatten({"state": {0: {"exp_avg": 1}}, "groups": [{"lr": 2}]}, "optim") == {
        "optim:state.0.exp_avg": 1,
        "optim:groups.0.lr": 2,
    }


def test_cli_diff_tensors_shows_the_differing_tensor_and_exits_1(tmp_path, capsys):
    w2 = torch.arange(6.0)
    w2[0] = 100.0
    a = _ckpt(tmp_path / "a.ckpt", torch.arange(6.0))
    b = _ckpt(tmp_path / "b.ckpt", w2)
    assert main(["diff", str(a), str(b), "--tensors"]) == 1
    out = capsys.readouterr().out
    assert "changed  model:net.w  1/6 elements differ, max |diff| 100" in out
    assert main(["diff", str(a), str(b), "--tensors", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"] == [
        {
            "detail": "1/6 elements differ, max |diff| 100",
            "kind": "changed",
            "max_abs_diff": 100.0,
            "n_diff": 1,
            "name": "model:net.w",
            "numel": 6,
        }
    ]
    assert main(["diff", str(a), str(a), "--tensors"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "tensors: bitwise identical"
