"""``ckptkit diff``, ``plot`` and ``replay`` on a run recorded on object storage (spec/objectstore.md
R-O40..R-O45), against the real S3 HTTP server: each reads ``s3://`` through one verified local
copy made by the commit engine, says so on one line, and refuses a damaged object by URL.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import boto3
import pytest
from helpers import TINY_FLAGS

from ckptkit.cli import main
from ckptkit.format._urls import parse

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

TRAIN = [*TINY_FLAGS, "--threads", "1", "--quiet", "--steps", "4", "--ckpt-every", "2"]


def _err_lines(capsys: pytest.CaptureFixture[str]) -> tuple[str, list[str]]:
    out, err = capsys.readouterr()
    return out, err.splitlines()


def test_diff_plot_and_replay_read_an_s3_run_through_a_verified_local_copy(
    s3: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """R-O40 (one copy, said, removed), R-O41 (a run's), R-O42 (an object's), R-O43 (each command's steps), G-83."""
    run, local = f"{s3}/demo", tmp_path / "local"
    assert main(["train", "--run-dir", run, *TRAIN]) == 0
    assert main(["train", "--run-dir", str(local), *TRAIN, "--lr", "0.002"]) == 0
    capsys.readouterr()

    assert main(["diff", run, str(local)]) == 1  # strict drift: the lr
    out, err = _err_lines(capsys)
    assert "strict  train.lr" in out and "0.003" in out and "0.002" in out, out
    copy = err[0].split(" read into ")[1].split(" (")[0]
    said = (
        f"ckptkit diff: {run}: read into {copy} (1 committed checkpoint(s), every object checked against its "
        "commit record; environment.json; history.jsonl)"
    )
    assert err == [said], err
    assert copy.startswith(tempfile.gettempdir()) and copy.endswith("/demo")
    assert not os.path.exists(copy)  # removed when the command ended
    assert main(["diff", f"{run}/step-00000004.ckpt", f"{run}/step-00000002.ckpt.config.json"]) == 0

    image = tmp_path / "demo.png"
    assert main(["plot", run, "-o", str(image)]) == 0
    assert image.stat().st_size > 0 and "4 step rows" in capsys.readouterr().out
    assert main(["plot", f"{run}/history.jsonl", "-o", str(image), "--json"]) == 0  # a run record named (R-O42)
    assert '"steps": 4' in capsys.readouterr().out

    assert main(["replay", run, "--from", "2", "--quiet", "--threads", "1"]) == 0  # the reference trainer's replay
    out, err = _err_lines(capsys)
    assert (
        "IDENTICAL: steps 2..3, every history fingerprint and 1 checkpoint(s)" in out
        and "2 committed checkpoint(s)" in err[0]
    ), (out, err)
    command = [sys.executable, "-m", "ckptkit", "train", "--run-dir", "{run_dir}", *TRAIN, "--resume"]
    assert main(["replay", run, "--from", "3", "--quiet", "--", *command]) == 0  # any loop: from step 2
    assert "IDENTICAL" in capsys.readouterr().out

    assert main(["replay", run, "--from", "1"]) == 2
    assert capsys.readouterr().err == (
        f"ckptkit replay: {run}: no checkpoint at or before step 1 (checkpoints: 2, 4)\n"
    )
    client, bucket = boto3.client("s3"), parse(s3).bucket
    key = "demo/step-00000004.ckpt.config.json"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[5] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    assert main(["diff", run, str(local)]) == 1
    _out, err = _err_lines(capsys)
    assert len(err) == 1 and err[0].startswith(
        f"ckptkit diff: {run}/step-00000004.ckpt.config.json: xxh3: object bytes differ from its commit record"
    ), err
    assert main(["plot", f"{s3}/nothing", "-o", str(image)]) == 2
    assert capsys.readouterr().err == f"ckptkit plot: {s3}/nothing: no such checkpoint\n"
    client.put_object(Bucket=bucket, Key="junk/step-00000002.ckpt", Body=b"an interrupted save's object")
    assert main(["plot", f"{s3}/junk", "-o", str(image)]) == 2  # objects, but nothing committed (R-O41)
    assert capsys.readouterr().err == (
        f"ckptkit plot: {s3}/junk: no committed checkpoint and none of environment.json, history.jsonl, "
        "config.json under this prefix\n"
    )
