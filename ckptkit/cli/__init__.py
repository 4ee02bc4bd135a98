"""The ``ckptkit`` command line: one subcommand per module in this package.

    ckptkit verify run/                      # every checkpoint in a run directory
    ckptkit inspect run/step-00000100.ckpt   # header, sections, flags, what is missing
    ckptkit diff runA/ runB/                 # config drift between two runs
    ckptkit train --run-dir run --steps 200  # the reference trainer
    ckptkit replay run --from 100            # re-run and name the first divergence
    ckptkit plot run -o run.png              # loss, grad norm, spikes, rollbacks, LR, resumes

Exit codes (like GNU diff): 0 clean, 1 problems found (invalid file, drift,
divergence), 2 trouble (usage, unreadable path, internal error), 3 training
unstable (spike rollbacks hit their bound). Results go to stdout, diagnostics to
stderr; a ckptkit error prints one line, never a traceback (``--debug`` re-raises).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence

from ..errors import (
    EXIT_UNSTABLE,
    CheckpointError,
    FormatError,
    NoConsistentCheckpoint,
    ReplayDivergence,
    ResumeRefused,
    TrainingUnstable,
)
from ._paths import copy_urls, refuse_urls

__all__ = ["main"]  # the entry point; cli/ is no import surface

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_TROUBLE = 2

# Subcommand name -> module in this package. Modules are imported on demand so
# `ckptkit verify` never pays for torch.
_COMMANDS = {
    "verify": "_verify",
    "inspect": "_inspect_cmd",
    "diff": "_diff",
    "train": "_train",
    "replay": "_replay",
    "audit": "_audit",
    "plot": "_plot",
}


def _build_parser(only: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptkit",
        description="Trustworthy PyTorch checkpoints: a resume is the same run, or it is a hard error.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 clean, 1 problems found, 2 trouble (usage, unreadable path), 3 training unstable",
    )
    parser.add_argument("--debug", action="store_true", help="re-raise errors with a traceback")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in _COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, add_help=False)  # listed, parsed only when chosen
            continue
        try:
            module = importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{mod}":
                raise
            continue
        module.add_parser(sub)
        sub.choices[name].add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="re-raise errors with a traceback"
        )
    return parser


def _exit_code(e: CheckpointError) -> int:
    if isinstance(e, TrainingUnstable):
        return EXIT_UNSTABLE
    if isinstance(e, (FormatError, ResumeRefused, ReplayDivergence, NoConsistentCheckpoint)):
        return EXIT_PROBLEMS
    return EXIT_TROUBLE


def _reader_left() -> int:
    """The reader of our output went away (``ckptkit inspect DIR | head``): stop quietly, as a
    Unix tool killed by SIGPIPE does, with its exit status (128 + SIGPIPE)."""
    # the interpreter flushes stdout at exit, into the closed pipe: point it at /dev/null
    # (no file descriptor to point: a test's captured stdout)
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + 13  # SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckptkit`` command line; returns the exit code."""
    try:
        return _main(argv)
    except BrokenPipeError:
        return _reader_left()


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # `audit` and `replay` take the user's command after `--` (ckptkit audit -- python train.py ...):
    # split it off before argparse, which would read its flags as ours.
    given_command = "--" in args_list
    split = args_list.index("--") if given_command else len(args_list)
    args_list, trailing = args_list[:split], args_list[split + 1 :]
    chosen = next((a for a in args_list if a in _COMMANDS), None)
    parser = _build_parser(chosen)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_TROUBLE
    if given_command and args.command not in ("audit", "replay"):
        print(f"ckptkit {args.command}: takes no command after --", file=sys.stderr)
        return EXIT_TROUBLE
    args.cmd = trailing
    module = importlib.import_module(f"{__name__}.{_COMMANDS[args.command]}")
    try:
        copies = getattr(module, "URL_COPIES", {})
        refuse_urls(args, served=(*getattr(module, "URL_ARGS", ()), *copies))
        with contextlib.ExitStack() as stack:
            copy_urls(args, copies, stack)
            return int(module.run(args))
    except CheckpointError as e:
        if args.debug:
            raise
        print(f"ckptkit {args.command}: {e}", file=sys.stderr)
        return _exit_code(e)
    except KeyboardInterrupt:
        print(f"ckptkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise  # not an error of ours: main() stops quietly
    except Exception as e:
        if args.debug:
            raise
        print(f"ckptkit {args.command}: internal error: {type(e).__name__}: {e} (re-run with --debug)", file=sys.stderr)
        return EXIT_TROUBLE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
