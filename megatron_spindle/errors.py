"""User-facing errors: entry points turn them into one clear line and a non-zero exit, not a traceback.

Every error whose message is written for the user derives from ValueError (WorkloadError, ClusterError,
PlanError, the estimator's and placement's errors, checkpoint errors) or is a missing file.
"""

from __future__ import annotations

import contextlib
import sys

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError)


@contextlib.contextmanager
def exit_on_user_error(prog: str | None = None):
    try:
        yield
    except USER_ERRORS as e:
        name = prog or sys.argv[0].rsplit("/", 1)[-1]
        print(f"{name}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
