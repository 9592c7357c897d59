"""The simulator's event engine: compute tasks, point-to-point flows and collectives on a cluster's devices.

- **Tasks** (a slice's forward or backward) run in one global order: each device runs its tasks in that order,
  one at a time; a task starts when every one of its devices is free and has reached it, and every flow into
  it has arrived. A task has ``work`` seconds of compute at full speed.
- **Flows** (one direction of an inter-wave transfer) start when their source task ends and every device
  whose links they use is free of other flows (first come, first served), and take fixed ``seconds``.
- **Collectives** (gradient buckets) run on each member's communication channel, one at a time per device,
  in one plan-wide launch order. A member *issues* a collective once its ``ready`` milestone is reached (a
  fraction of one of its tasks' work: the last accumulation of the bucket's gradients) and it has issued
  every collective before it; the collective starts when every member has issued it and is free. Its length
  depends on how many cross-node collectives share the network of its nodes at the moment (``seconds(k)``,
  the comm model's), so it progresses as a fluid: a fraction ``1 / seconds(k)`` per second.
  A collective ``at_start`` is issued by every member at time 0; a task may wait for collectives to end before
  it starts (``after``) or pause at a fraction of its work until one has (``gates``): the weights' all-gather
  of the previous step, overlapped with the forward, each layer waiting for its own bucket.
- **Overlap.** While a device computes and communicates at the same time, both progress ``slowdown`` times
  slower (C10): a task whose devices run a collective, and a collective whose members run a task. A collective
  beside compute also takes ``latency`` more (a CPU rank's transport thread waiting for the scheduler; 0 on
  GPUs): its rate there is 1 / (slowdown * seconds + latency).

Rates change only at events (a start, an end, a milestone, an arrival), so the run is exact for this model.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

EPS = 1e-12


@dataclass
class Task:
    devices: tuple[int, ...]
    work: float
    inputs: list[int] = field(default_factory=list)  # flow indices that must arrive first
    milestones: list[tuple[float, int, int]] = field(default_factory=list)  # (fraction, collective, device)
    after: list[int] = field(default_factory=list)  # collectives that must have ended before it starts
    gates: list[tuple[float, int]] = field(default_factory=list)  # (fraction, collective): pause there until it ends


@dataclass
class Flow:
    src: int  # task index
    dst: int  # task index
    links: tuple[int, ...]  # devices whose links it occupies (empty: local copies only)
    seconds: float


@dataclass
class Collective:
    devices: tuple[int, ...]
    seconds: Callable[[int], float]  # duration when k cross-node collectives share its busiest node
    nodes: tuple[int, ...] = ()  # nodes whose network it uses (empty: inside one node)
    rings: int = 1  # concurrent rings it runs (one per TP rank): its weight in the nodes' sharing
    at_start: bool = False  # issued by every member at time 0 (no milestone)


@dataclass
class TimelineResult:
    task_start: list[float]
    task_end: list[float]
    coll_start: list[float]
    coll_end: list[float]
    coll_issued: list[float]  # when the last member issued it
    device_end: list[float]  # per device: end of its last task
    flow_end: list[float]

    @property
    def makespan(self) -> float:
        return max(self.device_end + self.coll_end, default=0.0)


class _Run:
    def __init__(self, num_devices: int, tasks: Sequence[Task], flows: Sequence[Flow],
                 collectives: Sequence[Collective], slowdown: float, latency: float = 0.0):
        self.tasks, self.flows, self.colls, self.slowdown = tasks, flows, collectives, slowdown
        self.latency = latency
        n = num_devices
        self.t = 0.0
        # per device: its tasks in order, and its collectives in launch order
        self.queue: list[list[int]] = [[] for _ in range(n)]
        for k, task in enumerate(tasks):
            for d in task.devices:
                self.queue[d].append(k)
        self.cqueue: list[list[int]] = [[] for _ in range(n)]
        for c, coll in enumerate(collectives):
            for d in coll.devices:
                self.cqueue[d].append(c)
        self.head = [0] * n  # next task position per device
        self.at_head = [0] * len(tasks)
        self.inputs_left = [len(t.inputs) for t in tasks]
        self.colls_left = [len(t.after) for t in tasks]
        self.waiting: list[list[int]] = [[] for _ in collectives]  # collective -> tasks waiting for its end
        self.gated: list[list[int]] = [[] for _ in collectives]  # collective -> tasks with a gate on it
        for k, t in enumerate(tasks):
            for c in t.after:
                self.waiting[c].append(k)
            t.gates.sort()
            for _, c in t.gates:
                self.gated[c].append(k)
        self.gate_next = [0] * len(tasks)
        self.paused: set[int] = set()  # running tasks stopped at a gate
        self.remaining = [t.work for t in tasks]
        self.mile_next = [0] * len(tasks)
        for t in tasks:
            t.milestones.sort()
        self.task_start = [0.0] * len(tasks)
        self.task_end = [0.0] * len(tasks)
        self.running: set[int] = set()
        self.dev_task = [-1] * n
        self.dev_comm = [-1] * n
        self.comm_devices = [0] * len(tasks)  # devices of a running task that run a collective
        self.flows_out: list[list[int]] = [[] for _ in tasks]
        for f, flow in enumerate(flows):
            self.flows_out[flow.src].append(f)
        self.flow_end = [0.0] * len(flows)
        self.link_free = [0.0] * n
        self.arrivals: list[tuple[float, int]] = []  # heap of (time, flow)
        self.device_end = [0.0] * n
        # collectives
        self.accumulated = [dict.fromkeys(c.devices, False) for c in collectives]
        self.issue_head = [0] * n
        self.issued = [0] * len(collectives)
        self.run_head = [0] * n
        self.chan_at_head = [0] * len(collectives)
        self.crunning: set[int] = set()
        self.cdone: set[int] = set()
        self.cleft = [1.0] * len(collectives)
        self.compute_devices = [0] * len(collectives)  # members of a running collective that compute
        self.node_users: dict[int, int] = {}
        self.coll_start = [0.0] * len(collectives)
        self.coll_end = [0.0] * len(collectives)
        self.coll_issued = [0.0] * len(collectives)
        self._rate_cache: dict[int, float] = {}

    # ------------------------------------------------------------------------------------ starting things
    def start_tasks(self, candidates: list[int]) -> None:
        for k in candidates:
            task = self.tasks[k]
            if (k in self.running or self.at_head[k] != len(task.devices) or self.inputs_left[k] > 0
                    or self.colls_left[k] > 0):
                continue
            if any(self.dev_task[d] >= 0 for d in task.devices):
                continue
            self.running.add(k)
            self.task_start[k] = self.t
            for d in task.devices:
                self.dev_task[d] = k
                c = self.dev_comm[d]
                if c >= 0:
                    self.comm_devices[k] += 1
                    self.compute_devices[c] += 1
            self._fire_milestones(k)
            self._pass_gates(k)
            if self.remaining[k] <= EPS and k not in self.paused:
                self._finish_task(k)

    def _pass_gates(self, k: int) -> None:
        """Go through the gates the task has reached whose collective has ended; pause at the first that has not
        (its devices stay the task's, and a collective on them no longer counts as overlapping compute)."""
        task = self.tasks[k]
        done = 1.0 - self.remaining[k] / task.work if task.work > 0 else 1.0
        gates = task.gates
        while self.gate_next[k] < len(gates) and gates[self.gate_next[k]][0] <= done + 1e-9:
            if gates[self.gate_next[k]][1] not in self.cdone:
                if k not in self.paused:
                    self.paused.add(k)
                    self._count_compute(k, -1)
                return
            self.gate_next[k] += 1
        if k in self.paused:
            self.paused.discard(k)
            self._count_compute(k, +1)

    def _count_compute(self, k: int, delta: int) -> None:
        for d in self.tasks[k].devices:
            c = self.dev_comm[d]
            if c >= 0:
                self.compute_devices[c] += delta
        self._rate_cache.clear()

    def _advance_queue(self, d: int) -> list[int]:
        self.head[d] += 1
        if self.head[d] < len(self.queue[d]):
            k = self.queue[d][self.head[d]]
            self.at_head[k] += 1
            return [k]
        return []

    def _finish_task(self, k: int) -> None:
        task = self.tasks[k]
        self.running.discard(k)
        self.at_head[k] = 0  # it left every device's head: a copy still among the candidates must not rerun it
        self.task_end[k] = self.t
        self.remaining[k] = 0.0
        self._fire_milestones(k, everything=True)
        nxt = []
        for d in task.devices:
            self.dev_task[d] = -1
            c = self.dev_comm[d]
            if c >= 0:
                self.compute_devices[c] -= 1
            self.device_end[d] = self.t
            nxt += self._advance_queue(d)
        self.comm_devices[k] = 0
        for f in self.flows_out[k]:
            flow = self.flows[f]
            if not flow.links:
                heapq.heappush(self.arrivals, (self.t + flow.seconds, f))
                continue
            begin = max([self.t] + [self.link_free[d] for d in flow.links])
            end = begin + flow.seconds
            for d in flow.links:
                self.link_free[d] = end
            heapq.heappush(self.arrivals, (end, f))
        self.pending_tasks += nxt

    def _fire_milestones(self, k: int, everything: bool = False) -> None:
        task = self.tasks[k]
        done = 1.0 - self.remaining[k] / task.work if task.work > 0 else 1.0
        ms = task.milestones
        while self.mile_next[k] < len(ms) and (everything or ms[self.mile_next[k]][0] <= done + 1e-9):
            _, c, d = ms[self.mile_next[k]]
            self.mile_next[k] += 1
            self.accumulated[c][d] = True
            self._issue(d)

    def _issue(self, d: int) -> None:
        q = self.cqueue[d]
        while self.issue_head[d] < len(q) and self.accumulated[q[self.issue_head[d]]][d]:
            c = q[self.issue_head[d]]
            self.issue_head[d] += 1
            self.issued[c] += 1
            if self.issued[c] == len(self.colls[c].devices):
                self.coll_issued[c] = self.t
                self.pending_colls.append(c)

    def start_collectives(self, candidates: list[int]) -> None:
        for c in candidates:
            coll = self.colls[c]
            if (c in self.crunning or c in self.cdone or self.issued[c] != len(coll.devices)
                    or self.chan_at_head[c] != len(coll.devices)):
                continue
            self.crunning.add(c)
            self.coll_start[c] = self.t
            for d in coll.devices:
                self.dev_comm[d] = c
                k = self.dev_task[d]
                if k >= 0:
                    self.comm_devices[k] += 1
                    if k not in self.paused:
                        self.compute_devices[c] += 1
            for node in coll.nodes:
                self.node_users[node] = self.node_users.get(node, 0) + coll.rings
            self._rate_cache.clear()

    def _finish_collective(self, c: int) -> None:
        coll = self.colls[c]
        self.crunning.discard(c)
        self.cdone.add(c)
        self.coll_end[c] = self.t
        self.cleft[c] = 0.0
        for d in coll.devices:
            self.dev_comm[d] = -1
            k = self.dev_task[d]
            if k >= 0:
                self.comm_devices[k] -= 1
            self.run_head[d] += 1
            q = self.cqueue[d]
            if self.run_head[d] < len(q):
                nxt = q[self.run_head[d]]
                self.chan_at_head[nxt] += 1
                self.pending_colls.append(nxt)
        self.compute_devices[c] = 0
        for node in coll.nodes:
            self.node_users[node] -= coll.rings
        self._rate_cache.clear()
        for k in self.waiting[c]:
            self.colls_left[k] -= 1
            self.pending_tasks.append(k)
        for k in self.gated[c]:
            if k in self.paused:
                self._pass_gates(k)
                if self.remaining[k] <= EPS and k not in self.paused:
                    self._finish_task(k)

    # ------------------------------------------------------------------------------------------- rates
    def task_rate(self, k: int) -> float:
        if k in self.paused:
            return 0.0
        return 1.0 / self.slowdown if self.comm_devices[k] > 0 else 1.0

    def coll_rate(self, c: int) -> float:
        base = self._rate_cache.get(c)
        if base is None:
            coll = self.colls[c]
            sharing = max((self.node_users[node] for node in coll.nodes), default=1)
            seconds = coll.seconds(max(1, sharing))
            base = self._rate_cache[c] = 1.0 / seconds if seconds > 0 else float("inf")
        if self.compute_devices[c] == 0:
            return base
        return base / (self.slowdown + self.latency * base) if base != float("inf") else base

    # --------------------------------------------------------------------------------------------- loop
    def run(self) -> TimelineResult:
        n = len(self.queue)
        self.pending_tasks: list[int] = []
        self.pending_colls: list[int] = []
        for d in range(n):
            if self.queue[d]:
                self.at_head[self.queue[d][0]] += 1
                self.pending_tasks.append(self.queue[d][0])
            if self.cqueue[d]:
                self.chan_at_head[self.cqueue[d][0]] += 1
        for c, coll in enumerate(self.colls):
            if coll.at_start:
                for d in coll.devices:
                    self.accumulated[c][d] = True
        for d in range(n):  # milestones of tasks without work are fired at their start; nothing issued yet
            self._issue(d)
        while True:
            while self.pending_tasks or self.pending_colls:
                tasks, self.pending_tasks = self.pending_tasks, []
                self.start_tasks(tasks)
                colls, self.pending_colls = self.pending_colls, []
                self.start_collectives(colls)
            dt, events = self._next_events()
            if dt is None:
                break
            self._advance(dt)
            for kind, x in events:
                if kind == "task" and x in self.running:
                    self._finish_task(x)
                elif kind == "mile" and x in self.running:
                    self._fire_milestones(x)
                elif kind == "gate" and x in self.running:
                    self._pass_gates(x)
                elif kind == "coll" and x in self.crunning:
                    self._finish_collective(x)
            while self.arrivals and self.arrivals[0][0] <= self.t + EPS:
                _, f = heapq.heappop(self.arrivals)
                self.flow_end[f] = self.t
                dst = self.flows[f].dst
                self.inputs_left[dst] -= 1
                self.pending_tasks.append(dst)
        return TimelineResult(self.task_start, self.task_end, self.coll_start, self.coll_end, self.coll_issued,
                              self.device_end, self.flow_end)

    def _next_events(self) -> tuple[float | None, list[tuple[str, int]]]:
        best = None
        candidates: list[tuple[float, str, int]] = []
        for k in self.running:
            rate = self.task_rate(k)
            if rate <= 0:  # paused at a gate: its collective's end moves it on
                continue
            candidates.append((self.remaining[k] / rate, "task", k))
            work = self.tasks[k].work
            ms = self.tasks[k].milestones
            if self.mile_next[k] < len(ms):
                target = (1.0 - ms[self.mile_next[k]][0]) * work
                candidates.append((max(0.0, self.remaining[k] - target) / rate, "mile", k))
            gates = self.tasks[k].gates
            if self.gate_next[k] < len(gates):
                target = (1.0 - gates[self.gate_next[k]][0]) * work
                candidates.append((max(0.0, self.remaining[k] - target) / rate, "gate", k))
        for c in self.crunning:
            candidates.append((self.cleft[c] / self.coll_rate(c), "coll", c))
        if self.arrivals:
            candidates.append((max(0.0, self.arrivals[0][0] - self.t), "arrival", -1))
        if not candidates:
            return None, []
        best = min(x[0] for x in candidates)
        tol = max(EPS, 1e-9 * (self.t + best))
        return best, [(kind, x) for dt, kind, x in candidates if dt <= best + tol and kind != "arrival"]

    def _advance(self, dt: float) -> None:
        if dt <= 0:
            return
        for k in self.running:
            self.remaining[k] = max(0.0, self.remaining[k] - dt * self.task_rate(k))
        for c in self.crunning:
            self.cleft[c] = max(0.0, self.cleft[c] - dt * self.coll_rate(c))
        self.t += dt


def run_timeline(num_devices: int, tasks: Sequence[Task], flows: Sequence[Flow] = (),
                 collectives: Sequence[Collective] = (), slowdown: float = 1.0,
                 latency: float = 0.0) -> TimelineResult:
    """Run ``tasks`` (in their global order), ``flows`` and ``collectives`` (in launch order); see the module
    docstring. Milestones of a task are (fraction of its work, collective index, member device)."""
    if slowdown < 1:
        raise ValueError(f"overlap slowdown must be >= 1, got {slowdown}")
    if latency < 0:
        raise ValueError(f"overlap latency must be >= 0, got {latency}")
    return _Run(num_devices, tasks, flows, collectives, slowdown, latency).run()
