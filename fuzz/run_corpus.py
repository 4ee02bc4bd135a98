"""Run a hostile corpus through every reader under an address-space cap.

    python fuzz/run_corpus.py                                  # fixtures/hostile, 512 MiB cap, table
    python fuzz/run_corpus.py --json out.json --mem-mib 512    # what tests/format/test_hostile.py reads
    python fuzz/run_corpus.py --dir /tmp/corpus                # a corpus written with generate.py --out

The cap is this process's address space after the imports plus ``--mem-mib``: a
reader that allocates past it (a zstd bomb, a length trusted before it was
checked) gets MemoryError, which is a finding, not a pass. Each case's readers
are timed too. Exit status: 0 when every outcome matches MANIFEST.json, 1 if not.
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
from targets import cap_memory, exercise, finding, quiet_threads

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


def run(directory: str, mem_mib: int) -> dict:
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
    scratch.cleanup()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=DEFAULT_DIR, help="corpus directory with MANIFEST.json")
    ap.add_argument("--mem-mib", type=int, default=512, help="address space allowed beyond the imports")
    ap.add_argument("--json", metavar="FILE", help="write the full results here")
    args = ap.parse_args(argv)
    out = run(args.dir, args.mem_mib)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, sort_keys=True)
    bad = [c for c in out["cases"] if c["wrong"]]
    for c in bad:
        print(f"{c['file']}: {json.dumps(c['wrong'], sort_keys=True)}")
    if out["marker_exists"]:
        print(f"PICKLE PAYLOAD RAN: {out['marker']} exists")
    print(
        f"{len(out['cases'])} cases, {len(bad)} with unexpected outcomes, "
        f"slowest {max(c['seconds'] for c in out['cases']):.2f} s",
        file=sys.stderr,
    )
    return 1 if bad or out["marker_exists"] else 0


if __name__ == "__main__":
    sys.exit(main())
