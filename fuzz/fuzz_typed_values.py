"""Fuzz typed values (spec/container.md §5.4): mutated payloads in a sealed container, every reader.

    python fuzz/fuzz_typed_values.py --seconds 60               # hypothesis, seed 0
    python fuzz/fuzz_typed_values.py --seconds 600 --seed 3 --keep-going
    python fuzz/fuzz_typed_values.py --replay fuzz/artifacts/typed-1a2b3c  # re-run one saved input

Each input is a typed value -- ``[ext 4 <name>, field, ...]`` with a name from the table or
not, fields drawn around the bounds of R-018 and R-030..R-034 (dtype and device names,
shapes whose product overflows, dimensions of 2**63, sets of equal elements of two types,
nested typed values) -- put in the monitor tree of a valid container whose index is
re-packed and whose digests are resealed, so that only the typed-value checks can refuse
it. The property: every reader succeeds or raises a ckptkit error (``targets.exercise``),
and they agree (spec/validation.md): ``load`` and ``verify`` give the same verdict, and
``ckptkit verify`` exits 0 exactly when ``verify`` accepts. ``fuzz_load.py`` fuzzes the
file bytes around it; this target reaches the values behind the digests every time.

Exit status: 0 no finding, 1 a finding (printed, and saved to --artifacts), 2 usage.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msgpack
from targets import cap_memory, exercise, finding, index_sites, quiet_threads, replace_index, reseal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def template() -> bytes:
    """A valid container whose monitor tree is ``{"v": 0}``: the value's place."""
    import ckptkit

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.ckpt")
        ckptkit.save(path, ckptkit.Checkpoint(step=1, monitor={"v": 0}))
        with open(path, "rb") as f:
            return f.read()


def with_value(base: bytes, value: Any) -> bytes:
    """``base`` with its monitor tree's ``v`` replaced by the raw msgpack ``value``, digests resealed."""
    (start, ilen) = index_sites(base)[-1]
    index = msgpack.unpackb(base[start + 8 : start + 8 + ilen], raw=False, strict_map_key=False)
    index["tree"]["v"] = value
    return reseal(replace_index(base, start, ilen, msgpack.packb(index, use_bin_type=True)))


def disagreement(got: dict[str, str]) -> str | None:
    """How the readers' verdicts on one file differ, or None when they agree (spec/validation.md)."""
    if "load" in got and got["load"] != got["verify"]:
        return f"load {got['load']} but verify {got['verify']}"
    if "cli-verify" in got and (got["cli-verify"] == "rc0") != (got["verify"] == "ok"):
        return f"ckptkit verify {got['cli-verify']} but verify {got['verify']}"
    return None


def check(path: str, data: bytes, cli: bool) -> str | None:
    """The finding for one container, or None."""
    with open(path, "wb") as f:
        f.write(data)
    skip = () if cli else ("cli-verify", "cli-inspect", "cli-inspect-json")
    got = exercise(path, skip=skip)
    bad = {k: o for k, o in got.items() if not k.endswith(":seconds") and finding(o)}
    return f"readers: {bad}" if bad else disagreement(got)


# ------------------------------------------------------------------ payloads


def payloads() -> Any:
    """Typed values as msgpack trees, drawn around the bounds of R-018 and R-030..R-034: each type
    with fields near its bounds, and any name with any fields, nested."""
    from hypothesis import strategies as st

    from ckptkit.format._values import DEVICE_TYPES, NUMPY_DTYPES, TORCH_DTYPES, TYPE_NAMES

    big = [0, 1, 2, 3, 127, 128, 2**31, 2**32, 2**61, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
    ints = st.sampled_from(big) | st.integers(-(2**63), 2**64 - 1)
    words = [*NUMPY_DTYPES, *TORCH_DTYPES, "float", "double", "__class__", "save", "torch.float32", "", "Tensor"]
    devices = [*DEVICE_TYPES, "cpu:0", "cuda:127", "cuda:128", "cpu:-5", "cuda:007", "cpu\0", "cuda:" + "9" * 20]
    text = st.sampled_from(words + devices) | st.text(max_size=8)
    names = st.sampled_from([n.encode() for n in TYPE_NAMES]) | st.binary(max_size=12)
    tuple_mark = msgpack.ExtType(2, b"")

    def marked(name: bytes, *fields: Any) -> Any:
        return st.tuples(*fields).map(lambda f: [msgpack.ExtType(4, name), *f])

    shapes = st.lists(ints, max_size=4)
    ndarray = marked(
        b"numpy.ndarray",
        st.sampled_from(NUMPY_DTYPES) | text,
        shapes,
        st.just(b"") | st.binary(max_size=32),
        st.booleans(),
    )
    size = shapes.map(lambda dims: [msgpack.ExtType(4, b"torch.Size"), *dims])
    known = st.one_of(
        ndarray,
        size,
        marked(b"torch.dtype", text),
        marked(b"torch.device", text),
        marked(b"numpy.scalar", st.sampled_from(NUMPY_DTYPES) | text, st.binary(max_size=16)),
        size.map(lambda a: [msgpack.ExtType(4, b"set"), a, [tuple_mark, *a[1:]]]),  # equal once loaded
    )
    leaves = st.one_of(st.none(), st.booleans(), ints, st.floats(), text, st.binary(max_size=16), known)
    return st.recursive(
        leaves,
        lambda inner: (
            st.tuples(names, st.lists(inner, max_size=5)).map(lambda t: [msgpack.ExtType(4, t[0]), *t[1]])
            | st.lists(inner, max_size=3).map(lambda xs: [tuple_mark, *xs])
        ),
        max_leaves=8,
    )


def run(seconds: float, seed: int, artifacts: str, *, cli: bool = True, keep_going: bool = False) -> int:
    """Draw payloads for ``seconds``; print and save each distinct finding. Returns the exit status."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    base = template()
    work = tempfile.mkdtemp(prefix="ckptkit-fuzz-typed-")
    path = os.path.join(work, "input.ckpt")
    failure: list[tuple[str, bytes]] = []
    runs = [0]

    @settings(
        max_examples=100,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(payloads())
    def prop(value: Any) -> None:
        runs[0] += 1
        try:
            data = with_value(base, value)
        except Exception as e:  # noqa: BLE001 - sealing reads the layout: a non-ckptkit error there is a finding
            data, found = msgpack.packb(value, use_bin_type=True), f"!{type(e).__name__} reading the layout: {e}"
        else:
            found = check(path, data, cli)
        if found is not None:
            failure[:] = [(found, data)]
            raise AssertionError(found)

    end, rounds, found_any = time.monotonic() + seconds, 0, 0
    while time.monotonic() < end:
        try:
            hseed(seed * 1_000_003 + rounds)(prop)()
        except AssertionError:
            msg, data = failure[0]
            os.makedirs(artifacts, exist_ok=True)
            out = os.path.join(artifacts, f"typed-{hashlib.sha1(data).hexdigest()}")
            with open(out, "wb") as f:
                f.write(data)
            print(f"FINDING after {runs[0]} inputs: {msg}\n  saved to {out}", file=sys.stderr)
            found_any += 1
            if not keep_going:
                return 1
        rounds += 1
    print(f"typed values: {runs[0]} inputs in {rounds} rounds, seed {seed}, {found_any} finding(s)", file=sys.stderr)
    return 1 if found_any else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--seconds", type=float, default=60, help="time budget (default 60)")
    ap.add_argument("--seed", type=int, default=0, help="base seed")
    ap.add_argument("--mem-mib", type=int, default=1024, help="address space allowed beyond the imports")
    ap.add_argument("--no-cli", action="store_true", help="skip the in-process CLI readers (faster)")
    ap.add_argument("--artifacts", default=os.path.join(ROOT, "fuzz", "artifacts"), help="where findings go")
    ap.add_argument("--replay", metavar="FILE", help="run the readers on one saved container and exit")
    ap.add_argument("--keep-going", action="store_true", help="record each finding and go on until the time is up")
    args = ap.parse_args(argv)
    import ckptkit.cli._inspect_cmd
    import ckptkit.format._codec  # noqa: F401 - imported before the memory cap is measured

    quiet_threads()
    cap_memory(args.mem_mib << 20)
    if args.replay:
        with open(args.replay, "rb") as f:
            data = f.read()
        with tempfile.TemporaryDirectory() as d:
            found = check(os.path.join(d, "input.ckpt"), data, not args.no_cli)
        print(f"FINDING: {found}" if found else "no finding")
        return 1 if found else 0
    return run(args.seconds, args.seed, args.artifacts, cli=not args.no_cli, keep_going=args.keep_going)


if __name__ == "__main__":
    sys.exit(main())
