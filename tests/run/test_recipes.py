"""The data and dropout recipes (docs/adopting.md): ckptkit.step_rng, and any object with a state_dict."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.testing import assert_resume_equivalent, assert_step_leaves_global_rng_alone


def _mask(seed: int, step: int) -> torch.Tensor:
    with ckptkit.step_rng(seed, step):
        return torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True)


def test_the_draws_are_a_function_of_seed_and_step_and_the_global_generator_is_left_alone() -> None:
    assert torch.equal(_mask(1, 7), _mask(1, 7))
    assert not torch.equal(_mask(1, 7), _mask(1, 8)) and not torch.equal(_mask(1, 7), _mask(2, 7))
    assert_step_leaves_global_rng_alone(lambda: _mask(1, 7))


@dataclasses.dataclass
class Cfg:
    seed: int = 3
    steps: int = 8


@dataclasses.dataclass
class Run:
    net: torch.nn.Module
    opt: torch.optim.Optimizer
    state: ckptkit.RunState
    wrap: bool


def _make(wrap: bool) -> Any:
    def make_run(cfg: Cfg, run_dir: Path) -> Run:
        net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
        g = ckptkit.torch_generator(cfg.seed, 0, stream=1)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        state = ckptkit.RunState(run_dir, config=cfg)
        state.add_model("net", net)
        state.add_optimizer("sgd", opt)
        return Run(net, opt, state, wrap)

    return make_run


def step(run: Run, i: int) -> None:
    x = torch.randn(8, 4, generator=ckptkit.torch_generator(3, i, stream=2))
    if run.wrap:
        with ckptkit.step_rng(3, i):
            loss = run.net(x).square().mean()
    else:
        loss = run.net(x).square().mean()  # nn.Dropout draws from the global generator
    run.opt.zero_grad()
    loss.backward()
    run.opt.step()


def test_plain_dropout_inside_step_rng_resumes_as_the_same_run(tmp_path: Path) -> None:
    assert_resume_equivalent(_make(True), step, Cfg(), steps=8, stops=[3, 5], workdir=tmp_path)


def test_plain_dropout_without_it_is_caught_and_the_message_names_the_recipe(tmp_path: Path) -> None:
    with pytest.raises(
        AssertionError,
        match=r"model:net\.0\.weight(.|\n)*wrap the step in `with "
        r"ckptkit\.step_rng\(seed, step\):`",
    ):
        assert_resume_equivalent(_make(False), step, Cfg(), steps=8, stops=[3], workdir=tmp_path)


class Cursor:
    """A loader-like object that carries its own state (the StatefulDataLoader shape)."""

    def __init__(self) -> None:
        self.epoch, self.batch = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.batch = sd["epoch"], sd["batch"]


def test_any_object_with_a_plain_state_dict_is_registered_and_restored(tmp_path: Path) -> None:
    cursor = Cursor()
    state = ckptkit.RunState(tmp_path, config=Cfg())
    state.add_stateful("loader", cursor)
    state.start()
    cursor.epoch, cursor.batch = 2, 7
    state.save(5)
    again = Cursor()
    fresh = ckptkit.RunState(tmp_path, config=Cfg())
    fresh.add_stateful("loader", again)
    assert fresh.resume().step == 5 and again.state_dict() == {"epoch": 2, "batch": 7}
    with pytest.raises(ckptkit.UnsupportedValue, match="stateful 'x': a int has no state_dict"):
        fresh.add_stateful("x", 3)
    with pytest.raises(ValueError, match="value 'loader' is already registered"):
        fresh.add_stateful("loader", Cursor())
