"""ckptkit on S3 against DCP's fsspec backend (s3fs), on a local S3 server, in one process.

    python bench/bench_storage.py                              # ~128 MB of fp32 tensors, 5 rounds
    python bench/bench_storage.py --size-mb 8 --rounds 1       # a smoke run in seconds
    python bench/bench_storage.py --json > bench-storage.json  # one JSON object (schema_version 1)

The server is moto's ``ThreadedMotoServer`` on 127.0.0.1 (the tests' server; no network),
so absolute numbers measure a loopback HTTP server in this process, not S3; the ratios
compare what the two clients do per byte. The state is ``--tensors`` fp32 tensors of
``--size-mb`` in all. Each round, the two backends are interleaved (who goes first
alternates); the first round is a warm-up; the median of the rest is reported.

- save: ``ckptkit.save("s3://...")`` (the container spooled, uploaded with a conditional
  put, parallel multipart above 64 MiB, then its commit record: every byte hashed) vs
  ``dcp.save`` with ``FsspecWriter`` (one file per rank, its ``.metadata`` committed by a
  rename, which on S3 is a copy and a delete);
- load: ``ckptkit.load`` (the record, then the object, its size and xxh3-64 checked before
  parsing, then every tensor's digest) vs ``dcp.load`` with ``FsspecReader`` (no digest);
- commit cost: one ``commit`` of ``k`` small objects (``--objects``: 1, 10, 100) and the size
  of its record; listing the prefix those checkpoints are in.

Ratios are ckptkit / DCP-fsspec: below 1.0 ckptkit is faster. Nothing here is a test.
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
    for k in counts:
        name = f"step-{k:08d}.ckpt"
        objects = [(name, b"x" * 1024)] + [(f"{name}.part{i:03d}", b"y" * 1024) for i in range(k - 1)]
        seconds = _timed(lambda name=name, objects=objects: commit(store, base, name, objects))
        record = store.head(base.child(name + RECORD_SUFFIX).key)
        costs[f"commit_{k}_objects_s"] = round(seconds, 4)
        costs[f"record_{k}_objects_bytes"] = record
    costs[f"list_{len(counts)}_checkpoints_s"] = round(_timed(lambda: listing(store, base, ".ckpt")), 4)
    return costs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=128.0, help="fp32 tensors, all together (MB)")
    p.add_argument("--tensors", type=int, default=16, help="how many tensors")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up round)")
    p.add_argument("--objects", default="1,10,100", help="commit costs: objects per checkpoint, comma-separated")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
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
        doc = {
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
    if args.json:
        print(json.dumps(doc, sort_keys=True))
    else:
        s = doc["seconds"]
        print(f"{args.size_mb:.0f} MB in {args.tensors} tensors, median of {args.rounds} round(s), local S3 server")
        for op in ("save", "load"):
            peer_s = f"dcp-fsspec {s[f'dcp_{op}']:.3f} s   ratio {doc['ratio'][op]:.2f}x" if peer else "-"
            print(f"{op:<5} ckptkit {s[f'ckptkit_{op}']:.3f} s   {peer_s}")
        if not peer:
            print(PEER_MISSING)
        for k, v in doc["commit"].items():
            print(f"{k:<28} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
