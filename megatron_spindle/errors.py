"""User-facing errors: every entry point turns them into one clear line on stderr and exit status 2.

The one mechanism for tools/*.py, pretrain_multitask.py and ``python -m megatron_spindle.runtime``:

- ``@cli_main(prog)`` on an entry point's ``main(argv=None)`` (or ``with exit_on_user_error(prog):`` around a
  block) prints ``<prog>: error: <message>`` and raises ``SystemExit(2)`` for a user error; anything else (a bug)
  keeps its traceback.
- ``CliArgumentParser`` (used by ``arguments.build_parser``) prints a flag error the same way: one line, no
  usage block, status 2.
- ``SPINDLE_DEBUG=1`` in the environment shows the traceback of a user error too.
- An error every rank of a torchrun job raises alike (a flag's, one agreed over the ranks: ``on_every_rank``) is
  printed by the first worker of each node only, so each node's log has it once rather than once per GPU; the
  other workers exit with the same status.

A user error is one whose message is written for the user: a ValueError (WorkloadError, ClusterError,
PlanError, CheckpointError, the estimator's and placement's errors all derive from it), or an OSError that
names a file (missing, a folder where a file was expected, permission denied, disk full).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Callable

DEBUG_ENV = "SPINDLE_DEBUG"
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


def debug_requested() -> bool:
    """True when ``SPINDLE_DEBUG`` asks for tracebacks of user errors."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def user_message(e: BaseException) -> str | None:
    """The one-line message of a user error; None when ``e`` is not one (a bug: keep its traceback)."""
    if isinstance(e, OSError) and not isinstance(e, ValueError):
        if e.filename is None:
            if e.errno is None:  # raised by our code with a message: FileNotFoundError("--plan x: no such file")
                return one_line(e)
            return None  # a socket or pipe error deep inside a library: not about the user's input
        where = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")
        return f"{where}: {e.strerror or one_line(e)}"
    if isinstance(e, ValueError):
        return one_line(e) or type(e).__name__
    return None


def program_name(prog: str | None = None) -> str:
    return prog or os.path.basename(sys.argv[0] or "python")


def stderr_line(line: str) -> None:
    """One line on stderr in one write. Ranks share the launcher's stream, and ``print`` writes the text and
    its newline separately, so two ranks' lines printed at once could run together."""
    sys.stderr.write(line + "\n")  # one write(2) on the line-buffered, write-through stderr
    sys.stderr.flush()


_ON_EVERY_RANK = "spindle_on_every_rank"  # the attribute ``on_every_rank`` sets on an exception


def on_every_rank(e: BaseException) -> BaseException:
    """``e``, marked as an error every rank raises alike (so that ``exit_on_user_error`` prints it once per
    node)."""
    setattr(e, _ON_EVERY_RANK, True)
    return e


@contextlib.contextmanager
def alike_on_every_rank():
    """User errors raised in the block are ``on_every_rank``: checks that every rank makes alike (of the flags and
    the inputs they name, before the ranks' work differs)."""
    try:
        yield
    except USER_ERRORS as e:
        on_every_rank(e)
        raise


def prints_errors_of_every_rank() -> bool:
    """Whether this process prints the errors every rank raises alike: any process but torchrun's workers after
    the first of their node (``LOCAL_RANK`` > 0)."""
    return os.environ.get("LOCAL_RANK", "0").strip() in ("", "0")


def fail(prog: str | None, message: str, status: int = 2, alike: bool = False):
    """Print ``<prog>: error: <message>`` on stderr and exit with ``status``. ``alike``: every rank fails with
    this message, and only ``prints_errors_of_every_rank`` processes print it."""
    if not alike or prints_errors_of_every_rank():
        stderr_line(f"{program_name(prog)}: error: {one_line(message)}")
    raise SystemExit(status)


@contextlib.contextmanager
def exit_on_user_error(prog: str | None = None):
    """Turn a user error raised inside the block into one line on stderr and ``SystemExit(2)``."""
    try:
        yield
    except (ValueError, OSError) as e:
        msg = user_message(e)
        if msg is None or debug_requested():
            raise
        fail(prog, msg, alike=getattr(e, _ON_EVERY_RANK, False))


def cli_main(prog: str | None = None) -> Callable:
    """Decorator for an entry point's ``main``: user errors end in one line and exit status 2."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def main(*args, **kwargs):
            with exit_on_user_error(prog):
                return fn(*args, **kwargs)

        return main

    return wrap


class CliArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: <message> (see --help)`` and status 2. With
    ``megatron_flags`` (the Megatron-style entry points), a Megatron-LM flag they do not take is named with what
    to give instead (megatron_spindle/megatron_flags.py)."""

    def __init__(self, *args, megatron_flags: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.megatron_flags = megatron_flags

    def error(self, message: str):
        if debug_requested():
            self.print_usage(sys.stderr)
        if self.megatron_flags:
            from megatron_spindle.megatron_flags import unrecognized_message

            message = unrecognized_message(message, {s for a in self._actions for s in a.option_strings})
        fail(self.prog, f"{message} (see --help)", alike=True)  # every rank parses the same flags
