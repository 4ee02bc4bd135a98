"""ckptkit on S3 against DCP's fsspec backend (s3fs), on a local S3 server, in one process.

    python bench/bench_storage.py                              # ~128 MB of fp32 tensors, 5 rounds
    python bench/bench_storage.py --size-mb 8 --rounds 1       # a smoke run in seconds
    python bench/bench_storage.py --json > bench-storage.json  # one JSON object (schema_version 1)

The server is moto's ``ThreadedMotoServer`` on 127.0.0.1 (the tests' server; no network),
so absolute numbers measure a loopback HTTP server in this process, not S3; the ratios
compare what the two clients do per byte. The state is ``--tensors`` fp32 tensors of
``--size-mb`` in all. Each round, the two backends are interleaved (who goes first
alternates); the first round is a warm-up; the median of the rest is reported.

- save: ``ckptkit.save("s3://...")`` (the container spooled, each part uploaded as soon as
  it is written, parallel multipart above 64 MiB, else one conditional put, then its commit
  record: every byte hashed) vs
  ``dcp.save`` with ``FsspecWriter`` (one file per rank, its ``.metadata`` committed by a
  rename, which on S3 is a copy and a delete);
- load: ``ckptkit.load`` (the record, then the object, its size and xxh3-64 checked before
  parsing, then every tensor's digest) vs ``dcp.load`` with ``FsspecReader`` (no digest);
- commit cost: one ``commit`` of ``k`` small objects (``--objects``: 1, 10, 100) and the size
  of its record; listing the prefix those checkpoints are in.

Ratios are ckptkit / DCP-fsspec: below 1.0 ckptkit is faster. Nothing here is a test.

``--peers`` (issue 38): ckptkit against DCP's ``FsspecWriter``/``FsspecReader`` on a current
s3fs and against s3torchconnector's DCP ``S3StorageWriter``/``S3StorageReader``, at one
process and at 2 gloo ranks, with peak memory::

    python bench/bench_storage.py --peers --size-mb 1024 --rounds 3   # ~40 min on 2 busy cores
    python bench/bench_storage.py --peers --size-mb 32 --rounds 1     # a smoke run, ~2 min

The peers live in one virtual environment the bench builds once under ``--peer-venvs``
(default: a folder in the system temp dir; torch through ``constraints.txt``, so the CPU
build), since a current s3fs pins a botocore that fights ckptkit's boto3. moto's server runs
in its own process on 127.0.0.1; every save and every load is a fresh process per rank
(ckptkit's in this interpreter, the peers' in theirs) that rebuilds the state from a seed:
``--tensors`` fp32 tensors of ``--size-mb`` in all, rank r holding tensors i with
i % world == r (each rank its own shard, as under FSDP). A round runs every client's save,
then its load, then deletes its objects; the first client rotates each round; medians over
``--rounds``. Save is ``ckptkit.save`` (1 process) or ``ckptkit.distributed.save`` (2 ranks)
against ``dcp.save``; load is into existing tensors: ``ckptkit.load(into=...)`` or
``ckptkit.distributed.load`` (every byte's digest checked) against ``dcp.load`` (in place, no
digest). Seconds: the slowest rank, between barriers. Peak: the largest rank's ``VmHWM``
after ``clear_refs`` minus its ``VmRSS`` before the call (the state itself excluded). After
each load every rank compares every byte with the state rebuilt from its seed, outside the
timing, for every client. Ratios are ckptkit / the best peer per measure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _server() -> Any:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    return server


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _state(size_mb: float, tensors: int) -> dict[str, Any]:
    import torch

    per = max(1, int(size_mb * 1e6 / 4 / tensors))
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}


#: The peer needs s3fs, which ckptkit's extras do not pull (its aiobotocore pins botocore below boto3's).
PEER_MISSING = "dcp-fsspec not measured: s3fs is not installed (pip install -c constraints.txt s3fs)"


def _peer_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("s3fs") is not None


def _round(bucket: str, state: dict[str, Any], first_ckptkit: bool, peer: bool) -> dict[str, float]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import ckptkit

    tag = uuid.uuid4().hex[:8]
    ck_url, dcp_url = f"s3://{bucket}/ck-{tag}/model.ckpt", f"s3://{bucket}/dcp-{tag}"
    out: dict[str, float] = {}

    def ck_save() -> None:
        out["ckptkit_save"] = _timed(lambda: ckptkit.save(ck_url, ckptkit.Checkpoint(step=1, model=state)))

    def dcp_save() -> None:
        out["dcp_save"] = _timed(lambda: dcp.save(state, storage_writer=FsspecWriter(dcp_url), no_dist=True))

    def ck_load() -> None:
        out["ckptkit_load"] = _timed(lambda: ckptkit.load(ck_url))

    def dcp_load() -> None:
        into = {k: torch.empty_like(v) for k, v in state.items()}
        out["dcp_load"] = _timed(lambda: dcp.load(into, storage_reader=FsspecReader(dcp_url), no_dist=True))

    for pair in ((ck_save, dcp_save), (ck_load, dcp_load)):
        for fn in pair if first_ckptkit else reversed(pair):
            if peer or fn in (ck_save, ck_load):
                fn()
    return out


def _commit_costs(bucket: str, counts: list[int]) -> dict[str, Any]:
    from ckptkit.format._commit import RECORD_SUFFIX, commit, listing
    from ckptkit.format._objectstore import store_for
    from ckptkit.format._urls import parse

    base = parse(f"s3://{bucket}/commits-{uuid.uuid4().hex[:8]}")
    store = store_for(base)
    costs: dict[str, Any] = {}
    container = lambda f: f.write(b"x" * 1024)  # noqa: E731 - one KiB, as each companion
    for k in counts:
        name = f"step-{k:08d}.ckpt"
        companions = [(f"{name}.part{i:03d}", b"y" * 1024) for i in range(k - 1)]
        seconds = _timed(lambda name=name, companions=companions: commit(store, base, name, container, companions))
        record = store.head(base.child(name + RECORD_SUFFIX).key)
        costs[f"commit_{k}_objects_s"] = round(seconds, 4)
        costs[f"record_{k}_objects_bytes"] = record
    costs[f"list_{len(counts)}_checkpoints_s"] = round(_timed(lambda: listing(store, base, ".ckpt")), 4)
    return costs


# ---------------------------------------------------------------------------------------------
# --peers: issue 38 item 8. Every save and load runs in a fresh process (ckptkit's in this
# interpreter, the peers' in their own virtual environment), against one moto server process.

#: The peers' virtual environment: torch through constraints.txt (the CPU build), numpy (DCP's
#: multi-rank save asks for it), s3fs (for DCP's fsspec backend) and s3torchconnector's DCP extra.
PEER_PACKAGES = ("torch", "numpy", "s3fs", "s3torchconnector[dcp]")
CLIENTS = ("ckptkit", "dcp-fsspec", "s3torchconnector")
REGION = "us-east-1"
MARK = "BENCH-RESULT "


def _peer_venv(root: Path) -> Path:
    """The peers' interpreter: a virtual environment under ``root``, built once and then reused."""
    import subprocess

    venv, python = root / "peers", root / "peers" / "bin" / "python"
    stamp = venv / "bench-packages.txt"
    if stamp.exists() and stamp.read_text() == " ".join(PEER_PACKAGES):
        return python
    print(f"building the peers' virtual environment in {venv} (once) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = Path(__file__).resolve().parents[1] / "constraints.txt"
    pip = [str(python), "-m", "pip", "install", "-q", "-c", str(constraints), *PEER_PACKAGES]
    subprocess.run(pip, check=True, capture_output=True, text=True)
    stamp.write_text(" ".join(PEER_PACKAGES))
    return python


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_process() -> tuple[Any, str]:
    """moto's server in its own process on 127.0.0.1, so no client shares its interpreter."""
    import subprocess
    import urllib.request

    port = _free_port()
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"moto's server did not answer on {url}")


def _layout(size_mb: float, tensors: int) -> tuple[int, list[str]]:
    return max(1, int(size_mb * 1e6 / 4 / tensors)), [f"layer{i}.weight" for i in range(tensors)]


def _tensor(i: int, per: int) -> Any:
    """Tensor ``i`` of the state: rebuilt from its own seed by every process that needs it."""
    import torch

    return torch.randn(per, generator=torch.Generator().manual_seed(1000 + i))


def _status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"/proc/self/status has no {field}")


def _s3tc(kind: str, url: str, endpoint: str) -> Any:
    """s3torchconnector's DCP writer or reader, its client pointed at the local server.

    Its ``S3FileSystem`` builds a client without an endpoint (it would go to AWS), so the
    bench gives it one built with ``endpoint=`` and path-style addressing.
    """
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    config = S3ClientConfig(force_path_style=True)
    client = S3Client(REGION, endpoint=endpoint, s3client_config=config)
    if kind == "writer":
        io: Any = S3StorageWriter(REGION, url, s3client_config=config)
        io.fs = S3FileSystem(REGION, s3_client=client)
    else:
        io = S3StorageReader(REGION, url, s3client_config=config)
        io.fs = S3FileSystem(REGION, s3_client=client, reader_constructor=io._reader_constructor)
    io.path = io.fs.init_path(url)
    return io


def _operation(job: dict[str, Any], state: dict[str, Any]) -> Callable[[], Any]:
    """The timed call: ``job["op"]`` of ``job["client"]`` on ``state`` (the source or the destination)."""
    client, op, url, solo = job["client"], job["op"], job["url"], job["world"] == 1
    if client == "ckptkit":
        import ckptkit

        if solo:
            if op == "save":
                return lambda: ckptkit.save(url + "/model.ckpt", ckptkit.Checkpoint(step=1, model=state))
            return lambda: ckptkit.load(url + "/model.ckpt", into={"model": state})
        import ckptkit.distributed as ckd

        return lambda: ckd.save(state, url) if op == "save" else ckd.load(state, url)
    import torch.distributed.checkpoint as dcp

    if client == "dcp-fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        io: Any = FsspecWriter(url) if op == "save" else FsspecReader(url)
    else:
        io = _s3tc("writer" if op == "save" else "reader", url, job["endpoint"])
    if op == "save":
        return lambda: dcp.save(state, storage_writer=io, no_dist=solo)
    return lambda: dcp.load(state, storage_reader=io, no_dist=solo)


def _worker(job: dict[str, Any]) -> None:
    """One rank of one save or load; prints its seconds, peak extra memory and bytes checked."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = job["rank"], job["world"]
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    per, names = _layout(job["size_mb"], job["tensors"])
    mine = [i for i in range(len(names)) if i % world == rank]
    saving = job["op"] == "save"  # a load goes into zeroed (resident) tensors, as DCP loads in place
    state = {names[i]: _tensor(i, per) if saving else torch.zeros(per) for i in mine}
    run = _operation(job, state)
    if world > 1:
        dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    before, t = _status("VmRSS"), time.perf_counter()
    run()
    if world > 1:
        dist.barrier()
    seconds, peak = time.perf_counter() - t, _status("VmHWM") - before
    checked = 0
    if job["op"] == "load":  # every byte each rank got back, against the state rebuilt from its seed
        for i in mine:
            if not torch.equal(state[names[i]], _tensor(i, per)):
                raise SystemExit(f"{job['client']} rank {rank}: {names[i]} came back different")
            checked += per * 4
    if world > 1:
        dist.destroy_process_group()
    print(MARK + json.dumps({"seconds": seconds, "peak": peak, "checked": checked}), flush=True)


def _launch(python: Path, job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Every rank of ``job`` as a process; the slowest rank's seconds, the largest peak, bytes checked."""
    import subprocess

    port = str(_free_port())
    procs = []
    for rank in range(job["world"]):
        e = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        cmd = [str(python), str(Path(__file__).resolve()), "--worker", json.dumps(dict(job, rank=rank))]
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith(MARK)]
        if proc.returncode or not lines:
            tail = (err or out).strip().splitlines()[-3:]
            raise RuntimeError(
                f"{job['client']} {job['op']} x{job['world']}: exit {proc.returncode}: {' | '.join(tail)}"
            )
        results.append(json.loads(lines[-1][len(MARK) :]))
    return {
        "seconds": max(r["seconds"] for r in results),
        "peak": max(r["peak"] for r in results),
        "checked": sum(r["checked"] for r in results),
    }


def _empty(bucket: str, prefix: str) -> None:
    """Delete what one save put under ``prefix``, so the server holds one checkpoint at a time."""
    import boto3

    s3 = boto3.client("s3")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def _pair(python: Path, job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """A save then a load of the same checkpoint, then the checkpoint deleted."""
    tag = f"{job['client']}-x{job['world']}-{uuid.uuid4().hex[:8]}"
    job = dict(job, url=f"s3://{job['bucket']}/{tag}")
    try:
        return {op: _launch(python, dict(job, op=op), env) for op in ("save", "load")}
    finally:
        _empty(job["bucket"], tag)


def _peer_rounds(args: argparse.Namespace, peers: Path | None, endpoint: str, bucket: str) -> dict[str, Any]:
    """``--rounds`` rounds of every client at 1 and 2 ranks; who goes first rotates each round."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    clients = [c for c in CLIENTS if c == "ckptkit" or peers is not None]
    runs: dict[str, list[dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    for r in range(args.rounds):
        for world in (1, 2):
            for client in clients[r % len(clients) :] + clients[: r % len(clients)]:
                key = f"{client} x{world}"
                if key in failed:
                    continue
                python = Path(sys.executable) if client == "ckptkit" else peers
                job = {"client": client, "world": world, "bucket": bucket, "endpoint": endpoint}
                job.update(size_mb=args.size_mb, tensors=args.tensors)
                print(f"round {r + 1}/{args.rounds}: {key}", file=sys.stderr)
                try:
                    result = _pair(python, job, env)  # type: ignore[arg-type]
                except RuntimeError as e:
                    failed[key] = str(e)
                    continue
                runs.setdefault(key, []).append(result)
    return {"runs": runs, "failed": failed}


def _peer_summary(rounds: dict[str, Any], size_mb: float) -> dict[str, Any]:
    """Medians per client and world size, and ckptkit / the faster peer for each."""
    med: dict[str, dict[str, float]] = {}
    for key, runs in rounds["runs"].items():
        med[key] = {f"{op}_s": statistics.median(r[op]["seconds"] for r in runs) for op in ("save", "load")} | {
            f"{op}_peak_mib": statistics.median(r[op]["peak"] for r in runs) / 2**20 for op in ("save", "load")
        }
        med[key]["load_checked_mb"] = min(r["load"]["checked"] for r in runs) / 1e6
    ratios: dict[str, dict[str, float]] = {}
    for world in (1, 2):
        ours, peers = (
            med.get(f"ckptkit x{world}"),
            [v for k, v in med.items() if k.endswith(f"x{world}") and not k.startswith("ckptkit")],
        )
        if ours and peers:
            ratios[f"x{world}"] = {
                m: ours[m] / min(p[m] for p in peers) for m in ("save_s", "load_s", "save_peak_mib", "load_peak_mib")
            }
    return {"median": med, "vs_faster_peer": ratios, "failed": rounds["failed"], "size_mb": size_mb}


def _peer_main(args: argparse.Namespace) -> dict[str, Any]:
    """``--peers``: build the peers' environment, start the server, run the rounds, summarise."""
    import subprocess

    import boto3

    peers: Path | None = None
    try:
        peers = _peer_venv(Path(args.peer_venvs))
        note = None
    except (subprocess.CalledProcessError, OSError) as e:
        said = (getattr(e, "stderr", None) or "").strip().splitlines()[-1:]
        note = f"peers not measured: their virtual environment could not be built ({e}; {' '.join(said)})"
    proc, endpoint = _server_process()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION=REGION
    )
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        summary = _peer_summary(_peer_rounds(args, peers, endpoint, bucket), args.size_mb)
    finally:
        proc.terminate()
        proc.wait()
    return dict(summary, schema_version=1, mode="peers", tensors=args.tensors, rounds=args.rounds, note=note)


def _print_peers(doc: dict[str, Any]) -> None:
    print(
        f"{doc['size_mb']:.0f} MB in {doc['tensors']} fp32 tensors, median of {doc['rounds']} round(s), "
        "moto's server on 127.0.0.1 in its own process; every save and load a fresh process"
    )
    print(f"{'client':<22}{'save s':>9}{'load s':>9}{'save peak MiB':>15}{'load peak MiB':>15}{'checked MB':>12}")
    for key, m in doc["median"].items():
        print(
            f"{key:<22}{m['save_s']:>9.2f}{m['load_s']:>9.2f}{m['save_peak_mib']:>15.0f}"
            f"{m['load_peak_mib']:>15.0f}{m['load_checked_mb']:>12.0f}"
        )
    for world, r in doc["vs_faster_peer"].items():
        print(
            f"ckptkit {world} / the best peer: save {r['save_s']:.2f}x  load {r['load_s']:.2f}x  "
            f"save peak {r['save_peak_mib']:.2f}x  load peak {r['load_peak_mib']:.2f}x"
        )
    for key, why in doc["failed"].items():
        print(f"{key}: not measured: {why}")
    if doc["note"]:
        print(doc["note"])


def _in_process(args: argparse.Namespace) -> dict[str, Any]:
    """The default run: ckptkit and DCP-fsspec in this process, and the commit costs."""
    warnings.filterwarnings("ignore")  # s3fs 0.4's own warning about its age; DCP's about no_dist
    server = _server()
    try:
        import boto3

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        state = _state(args.size_mb, args.tensors)
        peer = _peer_available()
        rounds = [_round(bucket, state, i % 2 == 0, peer) for i in range(args.rounds + 1)][1:]
        median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        ratios = {op: median[f"ckptkit_{op}"] / median[f"dcp_{op}"] for op in ("save", "load")} if peer else {}
        return {
            "schema_version": 1,
            "size_mb": args.size_mb,
            "tensors": args.tensors,
            "rounds": args.rounds,
            "seconds": {k: round(v, 4) for k, v in median.items()},
            "ratio": {k: round(v, 3) for k, v in ratios.items()},
            "commit": _commit_costs(bucket, [int(k) for k in args.objects.split(",")]),
            "peer": None if peer else PEER_MISSING,
        }
    finally:
        server.stop()


def _print_in_process(doc: dict[str, Any], args: argparse.Namespace) -> None:
    s, peer = doc["seconds"], doc["peer"] is None
    print(f"{args.size_mb:.0f} MB in {args.tensors} tensors, median of {args.rounds} round(s), local S3 server")
    for op in ("save", "load"):
        peer_s = f"dcp-fsspec {s[f'dcp_{op}']:.3f} s   ratio {doc['ratio'][op]:.2f}x" if peer else "-"
        print(f"{op:<5} ckptkit {s[f'ckptkit_{op}']:.3f} s   {peer_s}")
    if not peer:
        print(PEER_MISSING)
    for k, v in doc["commit"].items():
        print(f"{k:<28} {v}")


def main(argv: list[str] | None = None) -> int:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=128.0, help="fp32 tensors, all together (MB)")
    p.add_argument("--tensors", type=int, default=16, help="how many tensors")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (in-process: after one warm-up round)")
    p.add_argument("--objects", default="1,10,100", help="commit costs: objects per checkpoint, comma-separated")
    p.add_argument("--peers", action="store_true", help="every save and load in its own process, against the peers")
    default_venvs = Path(tempfile.gettempdir()) / "ckptkit-bench-peers"
    p.add_argument("--peer-venvs", default=str(default_venvs), help="where the peers' virtual environment is built")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    doc = _peer_main(args) if args.peers else _in_process(args)
    if args.json:
        print(json.dumps(doc, sort_keys=True))
    elif args.peers:
        _print_peers(doc)
    else:
        _print_in_process(doc, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
