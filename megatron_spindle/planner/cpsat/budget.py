"""The one clock of a CP-SAT planning call: a wall-clock deadline, and shares of what is left before it.

Every stage, level and model of the search gets a child budget (``share`` or ``part``), which never ends after
its parent, so no solve can overrun the call's limit however the shares are chosen; time a child does not use
stays with the parent for what comes after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class TimeBudget:
    """A deadline on ``time.perf_counter()`` and the seconds it had when it was made."""

    deadline: float
    seconds: float

    @classmethod
    def of(cls, seconds: float) -> TimeBudget:
        seconds = max(0.0, seconds)
        return cls(time.perf_counter() + seconds, seconds)

    def left(self) -> float:
        return max(0.0, self.deadline - time.perf_counter())

    def part(self, seconds: float) -> TimeBudget:
        """A child of at most ``seconds`` (less if this budget ends sooner)."""
        now = time.perf_counter()
        seconds = min(max(0.0, seconds), max(0.0, self.deadline - now))
        return TimeBudget(now + seconds, seconds)

    def share(self, fraction: float, floor: float = 0.0) -> TimeBudget:
        """A child of ``fraction`` of the time left, at least ``floor`` seconds (if there is that much)."""
        left = self.left()
        return self.part(max(left * fraction, min(left, floor)))

    def spent_fraction(self) -> float:
        """How much of its time is gone (1.0 for a budget made empty)."""
        return 1.0 - self.left() / self.seconds if self.seconds > 0 else 1.0
