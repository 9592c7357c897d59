"""When a plan's slices run: its device components and each component's own wave clock.

A wave is a barrier only among slices that meet: on a device, or through a hand-off of activations. Slices
joined that way form a device component; components run their waves side by side without waiting for each
other (the runtime has no barrier, the simulator times dataflow). A node-group plan (planner/node_groups.py)
has one component per group: its waves are merged level by level for the record, so a wave's ``start`` and
``duration`` are those of the slowest group, not when another group's slices run. The planner's estimate, the
plan summary and the Gantt chart take each component's timeline from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_spindle.plan.derive import plan_slice_pairs
from megatron_spindle.plan.schema import Plan


def device_components(plan: Plan) -> dict[str, int]:
    """slice id -> its component (a device of it): slices are joined by sharing a device or by a hand-off of
    activations. Node-group plans have one per group; their groups only meet in the gradient sync."""
    parent = list(range(plan.num_devices))

    def find(d: int) -> int:
        while parent[d] != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    slices = {s.id: s for s in plan.slices()}
    links = [s.devices for s in slices.values()]
    links += [[slices[p].devices[0], slices[c].devices[0]] for p, c in plan_slice_pairs(plan)]
    for devices in links:
        for d in devices[1:]:
            parent[find(d)] = find(devices[0])
    return {sid: find(s.devices[0]) for sid, s in slices.items()}


@dataclass(frozen=True)
class PlanTimeline:
    """Each slice's start on its component's clock, and each component's end."""

    starts: dict[str, float]  # slice id -> start
    ends: dict[int, float]  # component -> its end

    @property
    def components(self) -> int:
        return len(self.ends)

    @property
    def makespan(self) -> float:
        """The waves' span: the longest component's; the last wave's end for one component."""
        return max(self.ends.values(), default=0.0)


def plan_timeline(plan: Plan) -> PlanTimeline:
    """Each component takes the waves it has slices in, in order; its part of a wave is the wave's duration less
    what a longer slice of another component adds (so a plan of one component keeps its waves' times to the bit),
    and a gap before a wave stays a gap."""
    component = device_components(plan)
    if len(set(component.values())) <= 1:
        end = max((w.end for w in plan.waves), default=0.0)
        return PlanTimeline({s.id: w.start for w in plan.waves for s in w.slices},
                            {c: end for c in set(component.values())})
    ends: dict[int, float] = {}
    starts: dict[str, float] = {}
    previous_end = 0.0
    for w in plan.waves:
        gap = max(0.0, w.start - previous_end)
        previous_end = w.end
        longest = max((s.predicted_time for s in w.slices), default=0.0)
        own: dict[int, float] = {}
        for s in w.slices:
            own[component[s.id]] = max(own.get(component[s.id], 0.0), s.predicted_time)
        begins = {c: ends.get(c, 0.0) + gap for c in own}
        for c, mine in own.items():
            ends[c] = begins[c] + max(mine, w.duration - (longest - mine))
        starts.update((s.id, begins[component[s.id]]) for s in w.slices)
    return PlanTimeline(starts, ends)


def slice_starts(plan: Plan) -> dict[str, float]:
    """slice id -> when it starts on its component's clock (``plan_timeline``)."""
    return plan_timeline(plan).starts


def makespan(plan: Plan) -> float:
    """The waves' span: the longest component's (``plan_timeline``)."""
    return plan_timeline(plan).makespan
