"""ckptkit.run._environment: the environment is part of the run (spec/determinism.md R-D09..R-D12)."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
import torch

from ckptkit.errors import EnvironmentDrift, MalformedIndex, ResumeRefused
from ckptkit.run import _environment as environment
from ckptkit.run._environment import ENV_HINT, EnvDiff, capture, check_environment, diff_environment

EXPECTED_KEYS = [
    "cuda",
    "cuda_device",
    "cuda_matmul_allow_bf16_reduced_precision",
    "cuda_matmul_allow_fp16_reduced_precision",
    "cuda_matmul_allow_tf32",
    "cudnn",
    "cudnn_allow_tf32",
    "cudnn_benchmark",
    "cudnn_deterministic",
    "default_dtype",
    "deterministic_algorithms",
    "deterministic_algorithms_warn_only",
    "float32_matmul_precision",
    "inter_op_threads",
    "intra_op_threads",
    "mkldnn_enabled",
    "numpy",
    "platform_machine",
    "platform_system",
    "python",
    "python_implementation",
    "torch",
]


def test_capture_has_the_documented_sorted_keys_and_plain_values() -> None:
    facts = capture()
    assert list(facts) == EXPECTED_KEYS
    for key, value in facts.items():
        assert type(value) in (str, int, bool), key
    assert facts["torch"] == torch.__version__
    assert facts["intra_op_threads"] == torch.get_num_threads()
    assert facts["default_dtype"] == "torch.float32"
    assert msgpack.unpackb(msgpack.packb(facts)) == facts


def test_capture_is_stable_within_a_process() -> None:
    assert capture() == capture()
    assert diff_environment(capture(), capture()) == []
    assert check_environment(capture()) == []


def test_a_thread_count_change_is_detected() -> None:
    before = torch.get_num_threads()
    recorded = capture()
    try:
        torch.set_num_threads(before + 1)
        now = capture()
        assert diff_environment(recorded, now) == [EnvDiff("intra_op_threads", before, before + 1, fatal=True)]
        with pytest.raises(EnvironmentDrift) as info:
            check_environment(recorded)
    finally:
        torch.set_num_threads(before)
    assert str(info.value) == (
        "the environment differs from the run's recording in 1 fact(s):\n"
        f"  intra_op_threads: recorded {before}, now {before + 1}\n"
        "pass --allow-env-change to resume anyway (the override is recorded in the run history)"
    )
    assert capture() == recorded


def test_a_deterministic_algorithms_change_is_detected() -> None:
    recorded = capture()
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(not was)
        keys = [d.key for d in diff_environment(recorded, capture())]
    finally:
        torch.use_deterministic_algorithms(was)
    assert keys == ["deterministic_algorithms"]


def test_drift_message_names_every_differing_fact() -> None:
    recorded: dict[str, str | int | bool] = {
        "intra_op_threads": 2,
        "torch": "2.12.0+cpu",
        "old_fact": "x",
        "same": True,
    }
    current: dict[str, str | int | bool] = {"intra_op_threads": 1, "torch": "2.13.0+cpu", "new_fact": 4, "same": True}
    with pytest.raises(EnvironmentDrift) as info:
        check_environment(recorded, current)
    assert str(info.value) == (
        "the environment differs from the run's recording in 3 fact(s):\n"
        "  intra_op_threads: recorded 2, now 1\n"
        "  old_fact: recorded x, not captured now\n"
        "  torch: recorded 2.12.0+cpu, now 2.13.0+cpu\n"
        "also new since the recording (not fatal):\n"
        "  new_fact: not recorded, now 4\n"
        "pass --allow-env-change to resume anyway (the override is recorded in the run history)"
    )
    assert isinstance(info.value, ResumeRefused)
    assert [d.key for d in info.value.differences] == ["intra_op_threads", "new_fact", "old_fact", "torch"]
    assert ENV_HINT in str(info.value)


def test_allow_returns_the_differences_for_the_history() -> None:
    diffs = check_environment({"intra_op_threads": 2}, {"intra_op_threads": 1}, allow=True)
    assert diffs == [EnvDiff("intra_op_threads", 2, 1, fatal=True)]
    assert [str(d) for d in diffs] == ["intra_op_threads: recorded 2, now 1"]


def test_a_fact_missing_from_an_old_recording_is_reported_but_not_fatal() -> None:
    recorded: dict[str, str | int | bool] = {"torch": "2.13.0"}
    current: dict[str, str | int | bool] = {"torch": "2.13.0", "inter_op_threads": 4}
    diffs = check_environment(recorded, current)  # does not raise
    assert diffs == [EnvDiff("inter_op_threads", None, 4, fatal=False)]
    assert str(diffs[0]) == "inter_op_threads: not recorded, now 4"


def test_a_recorded_fact_missing_now_is_fatal() -> None:
    with pytest.raises(EnvironmentDrift) as info:
        check_environment({"torch": "2.13.0", "cuda_device": "H100"}, {"torch": "2.13.0"})
    assert info.value.differences == [EnvDiff("cuda_device", "H100", None, fatal=True)]


def test_comparison_is_type_strict() -> None:
    # True == 1 in Python, but a switch that became a count is another environment.
    assert diff_environment({"x": True}, {"x": 1}) == [EnvDiff("x", True, 1, fatal=True)]
    assert diff_environment({"x": 1}, {"x": "1"}) == [EnvDiff("x", 1, "1", fatal=True)]


@pytest.mark.parametrize(
    ("recorded", "message"),
    [
        ([1], "environment.recorded: must be a dict of facts (got list)"),
        ({1: "a"}, "environment.recorded: fact name 1 is not a string"),
        ({"a": 1.5}, "environment.recorded: fact a has a float; facts are str, int or bool"),
        ({"a": None}, "environment.recorded: fact a has a NoneType; facts are str, int or bool"),
    ],
)
def test_a_malformed_recording_raises_malformed_index(recorded: object, message: str) -> None:
    with pytest.raises(MalformedIndex) as info:
        check_environment(recorded, {})  # type: ignore[arg-type]
    assert str(info.value) == message


def test_import_does_not_import_torch() -> None:
    code = "import sys, ckptkit.run._environment; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_public_names() -> None:
    assert sorted(environment.__all__) == environment.__all__
