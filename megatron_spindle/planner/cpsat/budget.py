"""The one clock of a CP-SAT planning call: a deadline, and shares of what is left before it.

Every stage, level and model of the search gets a child budget (``share`` or ``part``), which never ends after
its parent, so no solve can overrun the call's limit however the shares are chosen; time a child does not use
stays with the parent for what comes after it.

The clock is the wall clock, or (``--spindle-solver-deterministic``) the work clock: CP-SAT's deterministic
time summed over the call's solves, which advances only by what the solver reports. On the work clock where the
search stops, and so the plan, depends on the inputs alone, not on the machine's speed or load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# The least a solve advances the work clock: a loop bounded only by its budget still ends when its solves
# return at once.
MIN_SOLVE_WORK = 1e-3


class WallClock:
    """Seconds of ``time.perf_counter()``."""

    deterministic = False

    def now(self) -> float:
        return time.perf_counter()

    def spend(self, work: float) -> None:
        """Nothing to do: the wall clock runs by itself."""


class WorkClock:
    """CP-SAT's deterministic time (its unit is meant to be about a second) summed over one call's solves."""

    deterministic = True

    def __init__(self) -> None:
        self.spent = 0.0

    def now(self) -> float:
        return self.spent

    def spend(self, work: float) -> None:
        self.spent += max(work, MIN_SOLVE_WORK)


WALL_CLOCK = WallClock()


@dataclass(frozen=True)
class TimeBudget:
    """A deadline on ``clock`` and the seconds it had when it was made."""

    deadline: float
    seconds: float
    clock: WallClock | WorkClock = field(default=WALL_CLOCK, compare=False)

    @classmethod
    def of(cls, seconds: float, deterministic: bool = False) -> TimeBudget:
        """``seconds`` of the wall clock, or of a new work clock (``deterministic``)."""
        clock = WorkClock() if deterministic else WALL_CLOCK
        seconds = max(0.0, seconds)
        return cls(clock.now() + seconds, seconds, clock)

    def left(self) -> float:
        return max(0.0, self.deadline - self.clock.now())

    def expired(self) -> bool:
        return self.clock.now() > self.deadline

    def part(self, seconds: float) -> TimeBudget:
        """A child of at most ``seconds`` (less if this budget ends sooner)."""
        now = self.clock.now()
        seconds = min(max(0.0, seconds), max(0.0, self.deadline - now))
        return TimeBudget(now + seconds, seconds, self.clock)

    def share(self, fraction: float, floor: float = 0.0) -> TimeBudget:
        """A child of ``fraction`` of the time left, at least ``floor`` seconds (if there is that much)."""
        left = self.left()
        return self.part(max(left * fraction, min(left, floor)))

    def spent_fraction(self) -> float:
        """How much of its time is gone (1.0 for a budget made empty)."""
        return 1.0 - self.left() / self.seconds if self.seconds > 0 else 1.0
