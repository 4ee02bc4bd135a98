"""Fuzz every ckptkit reader: load, verify, the sidecar readers, ``ckptkit verify/inspect``.

    python fuzz/fuzz_load.py --seconds 60                      # atheris if installed, else hypothesis
    python fuzz/fuzz_load.py --seconds 600 --engine atheris    # coverage-guided (pip install atheris)
    python fuzz/fuzz_load.py --seconds 30 --engine hypothesis --seed 3
    python fuzz/fuzz_load.py --replay fuzz/artifacts/crash-1a2b3c  # re-run one saved input
    python fuzz/fuzz_load.py --target records --seconds 60     # commit records and leases instead

The property: for any input bytes, every reader either succeeds or raises a
``ckptkit.errors.CheckpointError``, within a memory cap (``--mem-mib`` above the
post-import address space) and a time limit per input; the CLI exits 0/1/2 with
a one-line diagnostic and never says "internal error". Each input is tried as
written and again *resealed* (its tensor and skeleton digests recomputed) so
that mutations reach the checks behind the integrity checks.

Engines:
    atheris     libFuzzer, coverage-guided, seeded from fixtures/hostile and
                fixtures/valid; a finding is saved by libFuzzer (crash-<sha1>).
    hypothesis  no extra dependency: mutates the same seeds (bit flips, u64 lies,
                truncation, splices, msgpack-level index edits) in batches until
                the time is up; a finding is shrunk and saved to --artifacts.

Exit status: 0 no finding, 1 a finding (printed, and saved), 2 usage.
"""

from __future__ import annotations

import argparse
import atexit
import glob
import hashlib
import os
import shutil
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targets import cap_memory, exercise, finding, quiet_threads, reseal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Finding(Exception):
    """A reader broke the rule: ``str()`` says which and how; ``data`` is the input."""

    def __init__(self, message: str, data: bytes) -> None:
        super().__init__(message)
        self.data = data


def seeds() -> list[bytes]:
    """Valid and hostile files to start from (sorted, so runs are reproducible)."""
    out = []
    for pattern in ("fixtures/hostile/*", "fixtures/valid/*", "fixtures/invalid/*"):
        for p in sorted(glob.glob(os.path.join(ROOT, pattern))):
            if p.endswith((".json", ".py", ".md")) or os.path.getsize(p) > 64 * 1024:
                continue
            with open(p, "rb") as f:
                out.append(f.read())
    return out


class Target:
    """Runs the readers on one input; counts executions; raises :class:`Finding`."""

    def __init__(self, cli: bool = True, slow_s: float = 10.0) -> None:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.dir = tempfile.mkdtemp(prefix="ckptkit-fuzz-", dir=base)
        atexit.register(shutil.rmtree, self.dir, True)
        self.path = os.path.join(self.dir, "input.ckpt")
        self.skip = () if cli else ("cli-verify", "cli-inspect", "cli-inspect-json")
        self.slow_s = slow_s
        self.runs = 0

    def __call__(self, data: bytes) -> None:
        self.runs += 1
        variants = [data]
        sealed = reseal(data)
        if sealed != data:
            variants.append(sealed)
        for v in variants:
            with open(self.path, "wb") as f:
                f.write(v)
            for kind in ("container", "sidecar"):
                got = exercise(self.path, kind=kind, expect_step=None, skip=self.skip)
                bad = {k: o for k, o in got.items() if not k.endswith(":seconds") and finding(o)}
                slow = {k: s for k, s in got.items() if k.endswith(":seconds") and float(s) > self.slow_s}
                if bad or slow:
                    raise Finding(
                        f"{kind} readers on {len(v)} bytes{' (resealed)' if v is not data else ''}: {bad or slow}", v
                    )


# ------------------------------------------------------------------ atheris


def run_atheris(target: Target, seconds: int, extra: list[str], corpus_dir: str, artifacts: str) -> int:
    import atheris

    os.makedirs(corpus_dir, exist_ok=True)
    for s in seeds():
        name = os.path.join(corpus_dir, hashlib.sha1(s).hexdigest())
        if not os.path.exists(name):
            with open(name, "wb") as f:
                f.write(s)

    def one(data: bytes) -> None:
        try:
            target(data)
        except Finding as e:
            print(f"FINDING: {e}", file=sys.stderr, flush=True)
            raise AssertionError(str(e)) from None

    os.makedirs(artifacts, exist_ok=True)
    argv = [
        sys.argv[0],
        f"-max_total_time={seconds}",
        "-timeout=20",
        "-rss_limit_mb=0",
        "-max_len=65536",
        f"-artifact_prefix={artifacts.rstrip('/')}/",
        *extra,
        corpus_dir,
    ]
    atheris.Setup(argv, one)
    atheris.Fuzz()  # exits the process; libFuzzer prints the summary
    return 0


# ------------------------------------------------------------------ hypothesis


def run_hypothesis(
    target: Target, seconds: int, seed: int, artifacts: str, batch: int = 200, keep_going: bool = False
) -> int:
    import msgpack
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st
    from targets import index_sites, replace_index

    pool = seeds()
    interesting = [0, 1, 7, 8, 63, 64, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 64, 2**64 - 1]
    values = st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**63), 2**64 - 1),
            st.floats(),
            st.text(max_size=6),
            st.binary(max_size=9),
            st.sampled_from(["raw", "zstd", "float32", "uint8", "int64"]),
            st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=5)),
            st.just(msgpack.Timestamp(1, 0)),
        ),
        lambda c: (
            st.lists(c, max_size=4) | st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 9)), c, max_size=4)
        ),
        max_leaves=10,
    )

    @st.composite
    def mutated(draw):
        data = bytearray(draw(st.sampled_from(pool)))
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "byte", "u64", "cut", "insert", "delete", "splice", "index"]))
            n = len(data)
            at = draw(st.integers(0, max(n - 1, 0)))
            if op == "flip" and n:
                data[at] ^= 1 << draw(st.integers(0, 7))
            elif op == "byte" and n:
                data[at] = draw(st.integers(0, 255))
            elif op == "u64" and n >= 8:
                at = min(at, n - 8)
                v = draw(st.sampled_from([*interesting, n, n - at, n + 8]))
                data[at : at + 8] = struct.pack("<Q", v % 2**64)
            elif op == "cut":
                del data[at:]
            elif op == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=64))
            elif op == "delete":
                del data[at : at + draw(st.integers(1, 64))]
            elif op == "splice":
                other = draw(st.sampled_from(pool))
                data[at:] = other[draw(st.integers(0, max(len(other) - 1, 0))) :]
            elif op == "index":
                sites = index_sites(bytes(data))
                if sites:
                    start, ilen = draw(st.sampled_from(sites))
                    try:
                        index = msgpack.unpackb(
                            bytes(data[start + 8 : start + 8 + ilen]), raw=False, strict_map_key=False
                        )
                    except Exception:  # noqa: BLE001 - the seed's index may itself be hostile
                        continue
                    if isinstance(index, dict) and index:
                        key = draw(st.sampled_from(sorted(index, key=str)))
                        index[key] = draw(values)
                        data = bytearray(
                            replace_index(bytes(data), start, ilen, msgpack.packb(index, use_bin_type=True))
                        )
        return bytes(data)

    inputs = st.one_of(
        mutated(),
        st.binary(max_size=2048),
        st.builds(
            lambda p, b: p + b,
            st.sampled_from([b"DMCK\x00\x02\x00\x00", b"DMSC\x00\x01\x00\x00"]),
            st.binary(max_size=1024),
        ),
    )
    failure: list[tuple[str, bytes]] = []

    @settings(
        max_examples=batch,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(inputs)
    def prop(data: bytes) -> None:
        try:
            target(data)
        except Finding as e:
            failure[:] = [(str(e), e.data)]
            raise

    end = time.monotonic() + seconds
    rounds = 0
    found: dict[str, str] = {}  # a finding's signature -> where its input was saved
    while time.monotonic() < end:
        try:
            hseed(seed * 1_000_003 + rounds)(prop)()
        except Finding:
            msg, data = failure[0]
            sig = msg.split(": ", 1)[-1][:120]
            if sig not in found:
                os.makedirs(artifacts, exist_ok=True)
                out = os.path.join(artifacts, f"crash-{hashlib.sha1(data).hexdigest()}")
                with open(out, "wb") as f:
                    f.write(data)
                found[sig] = out
                print(
                    f"FINDING after {target.runs} inputs: {msg}\n  saved to {out} "
                    f"(replay: python fuzz/fuzz_load.py --replay {out})",
                    file=sys.stderr,
                )
            if not keep_going:
                return 1
        rounds += 1
    print(
        f"hypothesis engine: {target.runs} inputs in {rounds} rounds of {batch}, seed {seed}, "
        f"{len(found)} distinct finding(s)",
        file=sys.stderr,
    )
    return 1 if found else 0


# ------------------------------------------------------------------ commit records and leases


def run_records(seconds: int, seed: int) -> int:
    """Mutated commit records and leases (``run_corpus.run_records``, 500 of each per round, the
    seed advancing) until the time is up; every finding printed."""
    from run_corpus import run_records as one_round

    end, rounds, inputs, found = time.monotonic() + seconds, 0, 0, 0
    with tempfile.TemporaryDirectory(prefix="ckptkit-fuzz-records-") as scratch:
        while time.monotonic() < end:
            got = one_round(500, seed * 1_000_003 + rounds, scratch)
            inputs, rounds, found = inputs + got["inputs"], rounds + 1, found + len(got["findings"])
            for f in got["findings"]:
                print(f"FINDING {f['reader']}: {f['outcome']}  input {f['input'][:120]!r}", file=sys.stderr)
    print(f"records engine: {inputs} inputs in {rounds} rounds, seed {seed}, {found} finding(s)", file=sys.stderr)
    return 1 if found else 0


# ------------------------------------------------------------------ main


def _import_readers() -> None:
    """Import every reader before the memory cap is measured (and, for atheris, instrumented)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--seconds", type=int, default=60, help="time budget (default 60)")
    ap.add_argument("--engine", choices=("auto", "atheris", "hypothesis"), default="auto")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis engine: base seed")
    ap.add_argument("--mem-mib", type=int, default=1024, help="address space allowed beyond the imports")
    ap.add_argument("--no-cli", action="store_true", help="skip the in-process CLI readers (faster)")
    ap.add_argument("--corpus", default=os.path.join(ROOT, "fuzz", "corpus"), help="atheris working corpus")
    ap.add_argument("--artifacts", default=os.path.join(ROOT, "fuzz", "artifacts"), help="where findings go")
    ap.add_argument("--replay", metavar="FILE", help="run the readers on one file and exit")
    ap.add_argument(
        "--target",
        choices=("checkpoints", "records"),
        default="checkpoints",
        help="records: mutated commit records and leases through their decoders (seeded mutations)",
    )
    ap.add_argument(
        "--keep-going",
        action="store_true",
        help="hypothesis engine: record each distinct finding and go on until the time is up",
    )
    args, extra = ap.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]

    if args.target == "records":
        _import_readers()
        cap_memory(args.mem_mib << 20)
        return run_records(args.seconds, args.seed)
    engine = args.engine
    if engine == "auto":
        try:
            import atheris

            engine = "atheris"
        except ImportError:
            engine = "hypothesis"
    if args.replay:
        engine = "replay"
    if engine == "atheris":
        import atheris
        import torch  # noqa: F401 - imported first, so only ckptkit's own code is instrumented

        with atheris.instrument_imports(include=["ckptkit"]):
            _import_readers()
    else:
        _import_readers()
    quiet_threads()
    target = Target(cli=not args.no_cli)
    cap_memory(args.mem_mib << 20)
    if args.replay:
        with open(args.replay, "rb") as f:
            data = f.read()
        try:
            target(data)
        except Finding as e:
            print(f"FINDING: {e}")
            return 1
        print("no finding")
        return 0
    if engine == "atheris":
        return run_atheris(target, args.seconds, extra, args.corpus, args.artifacts)
    return run_hypothesis(target, args.seconds, args.seed, args.artifacts, keep_going=args.keep_going)


if __name__ == "__main__":
    sys.exit(main())
