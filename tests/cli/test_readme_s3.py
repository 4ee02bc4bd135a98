"""The README's S3 section runs as written: its own local server, its credentials, its bucket,
train, resume, verify, and a replay from a step ``--keep 3`` kept (issue: three first-try failures)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def _section() -> list[str]:
    """The command lines of the README's first ``sh`` block under "Checkpoints on S3"."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Checkpoints on S3") :]
    block = section[section.index("```sh\n") + 6 : section.index("```\n", section.index("```sh\n") + 6)]
    return [line for line in block.splitlines() if line.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_readme_s3_section_works_as_written_on_a_fresh_machine(tmp_path: Path) -> None:
    lines = _section()
    assert lines[0].startswith("pip install -c constraints.txt 'ckptkit[s3]' 'moto[server]'")  # done by the set-up
    port = str(_free_port())  # the README's 9000, unless this host already uses it
    commands = [line.replace("9000", port) for line in lines[1:]]
    server = next(i for i, line in enumerate(commands) if line.startswith("moto_server "))
    # a person types the next line after the server is up; a script waits for it, and reaps it after
    up = f"python -c 'import socket, time\nwhile socket.socket().connect_ex((\"127.0.0.1\", {port})): time.sleep(0.1)'"
    commands[server + 1 : server + 1] = ["echo $! > moto.pid", up]
    script = "set -e\n" + "\n".join(commands)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # a fresh machine: no credentials
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(ROOT)
    try:
        done = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
    finally:
        pid = tmp_path / "moto.pid"
        if pid.exists():
            subprocess.run(["kill", pid.read_text().strip()], check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^OK +s3://bucket/demo/step-00000060\.ckpt ", done.stdout, re.M), done.stdout[-3000:]
    assert "IDENTICAL: steps 60..79" in done.stdout, done.stdout[-3000:]
