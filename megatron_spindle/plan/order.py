"""The order in which a plan's waves run forward and backward (``ExecutionSettings.segments`` and
``backward_order``): each segment runs the forward of its waves in wave order, then their backward in reverse
wave order (or in ``backward_order``), before the next segment starts. Without segments the whole plan is one
segment."""

from __future__ import annotations

from megatron_spindle.plan.schema import ExecutionSettings, PlanError

FWD, BWD = "fwd", "bwd"


def segments_of(num_waves: int, settings: ExecutionSettings) -> list[list[int]]:
    """The wave indices of each segment, each in wave order; every wave in exactly one."""
    if settings.segments is None:
        return [list(range(num_waves))]
    listed = [i for seg in settings.segments for i in seg]
    if sorted(listed) != list(range(num_waves)) or any(not seg for seg in settings.segments):
        raise PlanError(f"settings.segments {[list(s) for s in settings.segments]} must list every wave index "
                        f"0..{num_waves - 1} exactly once, in non-empty segments")
    return [sorted(seg) for seg in settings.segments]


def execution_order(num_waves: int, settings: ExecutionSettings) -> list[tuple[int, str]]:
    """(wave index, FWD | BWD) in execution order."""
    order = []
    position = None
    if settings.backward_order is not None:
        if sorted(settings.backward_order) != list(range(num_waves)):
            raise PlanError(f"settings.backward_order {list(settings.backward_order)} must list every wave index "
                            f"0..{num_waves - 1} exactly once")
        position = {w: i for i, w in enumerate(settings.backward_order)}
    for seg in segments_of(num_waves, settings):
        backward = sorted(seg, key=position.__getitem__) if position else list(reversed(seg))
        order += [(w, FWD) for w in seg] + [(w, BWD) for w in backward]
    return order
