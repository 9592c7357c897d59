"""The order in which a plan's slices run forward and backward, from ``ExecutionSettings``:

- by default the whole plan is one segment: the forward of every wave in wave order, then the backward of
  every wave in reverse wave order (or in ``backward_order``);
- with ``segments``, each segment runs the forward of its waves, then their backward, before the next starts
  (temporal decoupling: the baselines run a task per segment);
- ``order`` lists the steps explicitly: ``(wave, phase, task)`` runs the forward or backward of the wave's
  slices of that task (None: all of them), e.g. early backward (``early_backward_order``).

Within a step the forward runs the wave's slices in wave order and the backward in reverse. Every rank, the
simulator and the memory accounting walk the same order (``slice_order``); the plan is valid only if every
slice runs forward then backward once and data flows forward before it is read (``check_order``).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_spindle.plan.schema import PHASES, ExecutionSettings, PlanError, Step

FWD, BWD = PHASES
SliceStep = tuple[int, int, str]  # (wave index, slice index in the wave, phase)


def segments_of(num_waves: int, settings: ExecutionSettings) -> list[list[int]]:
    """The wave indices of each segment, each in wave order; every wave in exactly one."""
    if settings.segments is None:
        return [list(range(num_waves))]
    listed = [i for seg in settings.segments for i in seg]
    if sorted(listed) != list(range(num_waves)) or any(not seg for seg in settings.segments):
        raise PlanError(f"settings.segments {[list(s) for s in settings.segments]} must list every wave index "
                        f"0..{num_waves - 1} exactly once, in non-empty segments")
    return [sorted(seg) for seg in settings.segments]


def segment_tasks(plan) -> list[list[str]]:
    """The tasks each of a plan's ``settings.segments`` runs, in the order they first run; [] without segments."""
    return [list(dict.fromkeys(s.task for i in seg for s in plan.waves[i].slices))
            for seg in plan.settings.segments or []]


def execution_steps(num_waves: int, settings: ExecutionSettings) -> list[Step]:
    """The plan's steps ``(wave, phase, task)`` in execution order."""
    if settings.order is not None:
        bad = [list(st) for st in settings.order if st[0] >= num_waves]
        if bad:
            raise PlanError(f"settings.order: steps {bad[:3]} name waves the plan does not have (it has "
                            f"{num_waves})")
        return list(settings.order)
    position = None
    if settings.backward_order is not None:
        if sorted(settings.backward_order) != list(range(num_waves)):
            raise PlanError(f"settings.backward_order {list(settings.backward_order)} must list every wave index "
                            f"0..{num_waves - 1} exactly once")
        position = {w: i for i, w in enumerate(settings.backward_order)}
    steps: list[Step] = []
    for seg in segments_of(num_waves, settings):
        backward = sorted(seg, key=position.__getitem__) if position else list(reversed(seg))
        steps += [(w, FWD, None) for w in seg] + [(w, BWD, None) for w in backward]
    return steps


def slice_order(tasks: Sequence[Sequence[str]], settings: ExecutionSettings) -> list[SliceStep]:
    """(wave, slice, phase) of every slice in execution order; ``tasks[w][s]`` is the task of slice s of
    wave w. Raises PlanError unless every slice runs its forward and its backward exactly once, forward first."""
    out: list[SliceStep] = []
    seen: set[SliceStep] = set()
    for wave, phase, task in execution_steps(len(tasks), settings):
        picked = [si for si, t in enumerate(tasks[wave]) if task is None or t == task]
        if task is not None and not picked:
            raise PlanError(f"settings.order: step [{wave}, {phase}, {task}]: wave {wave} has no slice of task "
                            f"'{task}'")
        for si in (picked if phase == FWD else reversed(picked)):
            step = (wave, si, phase)
            if step in seen:
                raise PlanError(f"settings.order runs the {phase} of slice {si} of wave {wave} twice")
            if phase == BWD and (wave, si, FWD) not in seen:
                raise PlanError(f"settings.order runs the backward of slice {si} of wave {wave} before its forward")
            seen.add(step)
            out.append(step)
    missing = [(w, si, p) for w, ts in enumerate(tasks) for si in range(len(ts)) for p in PHASES
               if (w, si, p) not in seen]
    if missing:
        w, si, p = missing[0]
        raise PlanError(f"the execution order never runs the {p} of slice {si} of wave {w} "
                        f"({len(missing)} slice phases missing)")
    return out


def check_dataflow(order: Sequence[SliceStep], pairs) -> None:
    """Every (producer, consumer) slice pair ((wave, slice) positions): the producer's forward runs before the
    consumer's, the consumer's backward before the producer's (it sends the gradient of its input)."""
    at = {(w, s, p): i for i, (w, s, p) in enumerate(order)}
    for (pw, ps), (cw, cs) in pairs:
        if at[(pw, ps, FWD)] > at[(cw, cs, FWD)]:
            raise PlanError(f"the execution order runs slice {cs} of wave {cw} forward before slice {ps} of "
                            f"wave {pw}, whose output it reads")
        if at[(cw, cs, BWD)] > at[(pw, ps, BWD)]:
            raise PlanError(f"the execution order runs the backward of slice {ps} of wave {pw} before that of "
                            f"slice {cs} of wave {cw}, which reads its output")


def early_backward_order(tasks: Sequence[Sequence[str]]) -> tuple[Step, ...]:
    """Forward wave by wave; once a task's last slice has run forward, that task's backward starts, one of its
    waves (backwards) after each later forward wave, so its activations are freed while the other tasks'
    forward goes on, and the devices holding its earlier waves do that backward between their forwards
    rather than all of it at once (which would stall the forward behind the backward's chain). What is left
    after the last forward runs backwards wave by wave, every task together. ``tasks[w][s]`` is the task of
    slice s of wave w."""
    last = {t: w for w, ts in enumerate(tasks) for t in ts}
    pending: dict[str, list[int]] = {}  # task -> its waves still to run backwards, latest first
    started: set[str] = set()
    steps: list[Step] = []
    for w, ts in enumerate(tasks):
        steps.append((w, FWD, None))
        if w == len(tasks) - 1:
            break
        for t in dict.fromkeys(ts):
            if last[t] == w:
                pending[t] = [v for v in range(w, -1, -1) if t in tasks[v]]
                started.add(t)
        for t in list(pending):
            steps.append((pending[t].pop(0), BWD, t))
            if not pending[t]:
                del pending[t]
    for v in range(len(tasks) - 1, -1, -1):  # the rest: every task's remaining backward, wave by wave
        for t in dict.fromkeys(tasks[v]):
            if t not in started or v in pending.get(t, ()):
                steps.append((v, BWD, t))
    return tuple(steps)


def default_order(num_waves: int) -> tuple[Step, ...]:
    """The one-segment order written out: every forward, then every backward in reverse."""
    return tuple([(w, FWD, None) for w in range(num_waves)] + [(w, BWD, None) for w in reversed(range(num_waves))])
