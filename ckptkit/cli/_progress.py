"""What a long command shows while it works: a bar on a terminal, lines elsewhere, nothing with --quiet.

The mode is chosen once, from the stream progress goes to (stderr; spec/cli.md):

* ``bar``: the stream is a terminal. A tqdm bar at the bottom (position,
  rate, ETA, the latest loss), every log line printed above it (broken at its
  ``" | "`` fields to the terminal's width, ``_width``), and the final bar left
  on screen when the work ends;
* ``lines``: a file or a pipe (CI, ``2>train.log``). The log lines only,
  ``ckptkit COMMAND: ...``, one per message: a log file gains no carriage
  returns and no escape codes;
* ``quiet`` (``--quiet``): nothing.

The bar starts at the first :meth:`Progress.at` call, so a resumed run's bar
starts where the run stands and its rate and ETA count only the work of this
call. A position may go back (a spike rollback re-trains steps).
"""

from __future__ import annotations

import sys
from typing import IO, Any

from ._width import fit, terminal_width

__all__ = ["Progress"]


class Progress:
    """Progress of one command on ``stream`` (default: stderr).

    Args:
        command: the subcommand, as the prefix of log lines says it (``train``).
        quiet: silence the bar and the lines (``--quiet``).
        unit: what the bar counts (``step``, ``file``).
        stream: where progress goes; its ``isatty()`` picks the mode.

    Example::

        with Progress("train", quiet=args.quiet) as progress:
            progress.log("warm-up probe: ...")
            for done in range(1, 201):
                progress.at(done, 200, loss=f"{loss:.4f}")
    """

    def __init__(self, command: str, *, quiet: bool = False, unit: str = "step", stream: IO[str] | None = None) -> None:
        self.command = command
        self.unit = unit
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.mode = "quiet" if quiet else ("bar" if isatty is not None and isatty() else "lines")
        self._bar: Any = None

    def log(self, msg: str, *, always: bool = False) -> None:
        """One line, ``ckptkit COMMAND: msg``: above the bar, or alone (a ``Log`` callable).

        ``always``: a diagnostic that ``--quiet`` does not silence (a file skipped, an error).
        """
        if self.mode == "quiet" and not always:
            return
        head = f"ckptkit {self.command}: "
        for line in fit(head + msg, terminal_width(self.stream), len(head)):  # unbroken in a file or pipe
            if self._bar is not None:
                self._bar.write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)

    def at(self, done: int, total: int, **postfix: str) -> None:
        """The work stands at ``done`` of ``total`` (bar mode only; lines mode logs its own lines).

        ``postfix`` values are shown after the rate (``loss=2.3456``).
        """
        if self.mode != "bar":
            return
        if self._bar is None:
            from tqdm import tqdm  # imported only when a terminal will show it

            # The bar starts one unit before the first report, so the first update
            # is a real unit of work and the rate never counts what a resume skipped.
            self._bar = tqdm(
                total=total,
                initial=max(done - 1, 0),
                unit=self.unit,
                desc=self.command,
                file=self.stream,
                ncols=self._columns(),
                leave=True,
                unit_scale=self.unit == "B",
                unit_divisor=1024,
            )  # bytes: KiB, MiB, GiB
        self._bar.total = total
        self._bar.ncols = self._columns()  # follows a resized terminal, as tqdm's dynamic_ncols would
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(done - self._bar.n)  # negative after a rollback: the bar goes back too

    def _columns(self) -> int | None:
        """The bar's width: the terminal's less 3 columns, where the terminal echoes a Ctrl-C
        (``^C``) without wrapping it onto a line of its own."""
        width = terminal_width(self.stream)
        return None if width is None else max(width - 3, 20)

    def close(self) -> None:
        """Leave the final bar on screen and move below it; safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
