"""Run a hostile corpus through every reader under an address-space cap.

    python fuzz/run_corpus.py                                  # fixtures/hostile, 512 MiB cap, table
    python fuzz/run_corpus.py --json out.json --mem-mib 512    # what tests/format/test_hostile.py reads
    python fuzz/run_corpus.py --dir /tmp/corpus                # a corpus written with generate.py --out
    python fuzz/run_corpus.py --records 2000 --seed 5          # more mutated commit records and leases

The cap is this process's address space after the imports plus ``--mem-mib``: a
reader that allocates past it (a zstd bomb, a length trusted before it was
checked) gets MemoryError, which is a finding, not a pass. Each case's readers
are timed too. Beside the corpus, ``--records N`` mutated commit records and N mutated
leases (seeded from ``fixtures/objectstore/`` and a lease ckptkit writes; ``--seed``) go
through their decoders, which must raise only ckptkit errors. Exit status: 0 when every
outcome matches MANIFEST.json and no record or lease is a finding, 1 if not.
Pickle payloads in the corpus would create ``$CKPTKIT_PWNED_MARKER`` if anything
unpickled them; this runner checks that it never appears.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targets import cap_memory, exercise, exercise_lease, exercise_record, finding, mutate_json, quiet_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIR = os.path.join(ROOT, "fixtures", "hostile")


def expected_outcomes(case: dict) -> dict[str, str]:
    """What each reader must report for a manifest case."""
    err = case["error"]
    if case["kind"] == "sidecar":
        return {"read_sidecar": err, "verify_sidecar": err}
    insp = case.get("inspect", err)
    cli_rc = "rc0" if insp == "ok" else "rc1"
    return {
        "load": err,
        "verify": err,
        "cli-verify": "rc0" if err == "ok" else "rc1",
        "cli-inspect": cli_rc,
        "cli-inspect-json": cli_rc,
    }


def run(directory: str, mem_mib: int, records: int = 200, seed: int = 0) -> dict:
    with open(os.path.join(directory, "MANIFEST.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    # Import everything before measuring the baseline.
    import zstandard  # noqa: F401

    import ckptkit.cli._inspect_cmd
    import ckptkit.cli._verify
    import ckptkit.format._checkpoint
    import ckptkit.format._codec  # noqa: F401

    quiet_threads()
    scratch = tempfile.TemporaryDirectory(prefix="ckptkit-corpus-")
    marker = os.environ.setdefault(manifest["marker_env"], os.path.join(scratch.name, "pwned"))
    cap = cap_memory(mem_mib << 20)
    results = []
    for case in manifest["cases"]:
        path = os.path.join(directory, case["file"])
        # a file declaring more tensor bytes than the cap (zstd-tensor-bomb: a legitimate 1 GiB
        # tensor) is verified but not loaded: a loader must allocate what the file holds
        got = exercise(
            path, kind=case["kind"], expect_step=case.get("expect_step"), max_load_bytes=(mem_mib << 20) // 2
        )
        want = expected_outcomes(case)
        wrong = {r: {"expected": want[r], "got": got[r]} for r in want if r in got and got[r] != want[r]}
        results.append(
            {
                "file": case["file"],
                "outcomes": got,
                "wrong": wrong,
                "findings": sorted(r for r in want if r in got and finding(got[r])),
                "seconds": max(float(v) for k, v in got.items() if k.endswith(":seconds")),
            }
        )
    out = {"cap_bytes": cap, "marker": marker, "marker_exists": os.path.exists(marker), "cases": results}
    out["records"] = run_records(records, seed, scratch.name)
    scratch.cleanup()
    return out


def record_seeds() -> tuple[list[bytes], list[bytes]]:
    """``(commit records, leases)`` to mutate: the golden records, valid and broken, and leases
    naming this process, a pid that is gone, and another host's expired job."""
    import glob
    import socket

    from ckptkit.run._lease import Holder, _encode

    found = sorted(glob.glob(os.path.join(ROOT, "fixtures", "objectstore", "*", "*.commit.json")))
    commit = []
    for path in found:
        with open(path, "rb") as f:
            commit.append(f.read())
    me = socket.gethostname()
    leases = [
        _encode(Holder(me, os.getpid(), 1.7e9, 1, None, 1.7e9, "a" * 32)),
        _encode(Holder(me, 2**31 - 1, 1.7e9, 2, 7, 1.7e9, "b" * 32)),
        _encode(Holder("elsewhere", 4242, 1.0e9, 8, None, 1.0e9, "c" * 32)),
    ]
    return commit, leases


def run_records(count: int, seed: int, scratch: str) -> dict:
    """``count`` mutated commit records and ``count`` mutated leases through their decoders: the
    outcome of each finding (a reader that raised anything but a ckptkit error), and the slowest."""
    import random

    rng = random.Random(seed)
    commit, leases = record_seeds()
    run_dir = os.path.join(scratch, "lease-run")
    os.makedirs(run_dir, exist_ok=True)
    findings, slowest = [], 0.0
    for pool, run_one in ((commit, exercise_record), (leases, lambda d: exercise_lease(d, run_dir))):
        for data in [*pool, *(mutate_json(rng.choice(pool), rng, pool) for _ in range(count))]:
            got = run_one(data)
            slowest = max([slowest, *(float(v) for k, v in got.items() if k.endswith(":seconds"))])
            findings += [
                {"reader": r, "outcome": o, "input": data[:300].decode("latin-1")} for r, o in got.items() if finding(o)
            ]
    return {"inputs": 2 * count + len(commit) + len(leases), "findings": findings, "seconds": slowest}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=DEFAULT_DIR, help="corpus directory with MANIFEST.json")
    ap.add_argument("--mem-mib", type=int, default=512, help="address space allowed beyond the imports")
    ap.add_argument("--json", metavar="FILE", help="write the full results here")
    ap.add_argument("--records", type=int, default=200, help="mutated commit records, and leases, to decode")
    ap.add_argument("--seed", type=int, default=0, help="the mutations' seed")
    args = ap.parse_args(argv)
    out = run(args.dir, args.mem_mib, args.records, args.seed)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, sort_keys=True)
    bad = [c for c in out["cases"] if c["wrong"]]
    for c in bad:
        print(f"{c['file']}: {json.dumps(c['wrong'], sort_keys=True)}")
    if out["marker_exists"]:
        print(f"PICKLE PAYLOAD RAN: {out['marker']} exists")
    for f in out["records"]["findings"]:
        print(f"FINDING {f['reader']}: {f['outcome']}  input {f['input'][:120]!r}")
    print(
        f"{len(out['cases'])} cases, {len(bad)} with unexpected outcomes, "
        f"slowest {max(c['seconds'] for c in out['cases']):.2f} s",
        file=sys.stderr,
    )
    return 1 if bad or out["marker_exists"] or out["records"]["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
