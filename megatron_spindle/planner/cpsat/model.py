"""The wave-slot model: one CP-SAT model of (part of) the plan, hinted, solved and read back as waves.

Why a *wave-indexed* model rather than free start times: the plan format (plan/schema.py) is a sequence of
waves; within a wave the allocation is fixed, slices have disjoint devices, transfers happen only at wave
boundaries, and a wave lasts as long as its longest slice. A continuous-time model (start times +
NoOverlap2D rectangles) optimises a schedule that must afterwards be cut into waves, and that cut either
splits slices at non-layer boundaries or stretches waves, so the solver's makespan is not the plan's. Here
the model has a fixed number of wave *slots* in time order and decides, per (MetaOp, slot), whether the
MetaOp runs there, with which option and how many layers. The objective ``sum_w D_w`` (D_w >= every slice
time in slot w) is then exactly the iteration time of the plan it encodes (up to the reported rounding),
and the greedy plan maps one-to-one onto a solution (the hint). A MetaOp's slices in successive slots run
its layers in order, so "slices of one MetaOp never overlap and run in order" holds by construction. The
slots bound the slices per MetaOp: per level block the hint's wave count there plus ``extra_waves``, or
``block_size``.

Linearisation: for every (MetaOp m, slot w, option c) one boolean ``y`` (m runs in w with option c) and one
integer ``l`` in [0, L_m] with ``y <= l <= L_m * y``. The slice time is ``sum_c T_c * l_c`` (only the chosen
c is non-zero), so ``D_w >= sum_c T_c * l_c`` is linear; ``sum_{w,c} l = L_m`` runs every layer once. A
redundant energy cut ``N * D_w >= sum n_c * T_c * l_c`` lifts the LP bound to about C*.

Devices: ranges (planner/cpsat/ranges.py) rather than device booleans keep the model small. When nothing in
the model depends on *which* devices (no communication objective, no per-device memory) and the tp degrees
nest, it keeps only ``sum n <= N`` per wave and packs the ranges afterwards; otherwise each slot has an
optional interval ``[o, o + n)`` with ``o`` a multiple of tp and every wave a ``NoOverlap``. Ranges may cross
islands, as the greedy plan's device sets do (else its plan would not be a valid hint).

Memory: a device of a slice holds its layers' parameter state and activations for the iteration, so per
option ``l <= capacity / per-layer bytes`` (accounting.layer_bytes). With ``exact_memory``, booleans
``a[slot, d]`` for ``d`` in the slot's range and a linear load per device (conservative: shared weights
summed, not stored once) bound every device.

Communication (``with_comm``, the second objective): each MetaOp has a home island; a slice outside it pays
the MetaOp's hand-off bytes, an edge between MetaOps with different homes the producer's, and MetaOps
sharing weights with different homes the gradient bytes of the shared weights (the co-location
preference), all from accounting.py.

Cross-level overlap (``overlap``): slots are global, a MetaOp may use the slots of its own level's block and
of the ``LEVEL_WINDOW`` neighbouring blocks, and precedence is explicit (a consumer's first slot after each
producer's last slot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ortools.sat.python import cp_model

from megatron_spindle.graph.opgraph import MetaGraph
from megatron_spindle.plan.memory import grad_bytes_of
from megatron_spindle.planner.cpsat.accounting import handoff_bytes, layer_bytes, shared_weight_bytes
from megatron_spindle.planner.cpsat.budget import TimeBudget
from megatron_spindle.planner.cpsat.problem import Problem
from megatron_spindle.planner.cpsat.ranges import pack_ranges, pack_slices, range_start, tp_degrees_nest
from megatron_spindle.planner.schedule import ScheduledSlice, ScheduledWave

LEVEL_WINDOW = 1  # cross-level overlap: neighbouring level blocks a MetaOp may move into
MEMORY_UNIT_BYTES = 2**20  # per-device memory in MiB: byte counts would overflow nothing but slow the solver
COMM_UNIT_BYTES = 2**20  # communication objective in MiB
# models with more slots skip presolve: on whole-graph models of large clusters it alone can take the whole
# limit before the hint is loaded, while on the per-level models (probing in particular) it proves optima
LIGHT_PRESOLVE_SLOTS = 150
SEED = 0  # the solver's seed: the same inputs and time give the same search


@dataclass
class Answer:
    """What one solve found: the best waves (None if no solution) and the solver's bound in time units."""

    status: str
    waves: list[ScheduledWave] | None
    bound_units: float | None


@dataclass
class _Slot:
    """Variables of one (MetaOp, wave slot) pair."""

    metaop: str
    wave: int
    y: list[Any]  # bool per option
    layers: list[Any]  # layer count per option
    present: Any
    size: Any
    offset: Any = None  # first device of the range (models with ranges only)
    end: Any = None  # offset + size (the interval's end)
    aligned: dict[int, Any] = field(default_factory=dict)  # tp -> q with offset == tp * q
    home: Any = None  # bool: the range lies in the MetaOp's home island


class SlotModel:
    """The wave-slot model of ``metagraph`` (the problem's, or a level's or a window's sub-graph), built and
    hinted by ``hint`` on construction; small methods per constraint family."""

    def __init__(self, problem: Problem, hint: list[ScheduledWave], overlap: bool = False,
                 metagraph: MetaGraph | None = None, exact_memory: bool = False, with_comm: bool = False,
                 block_size: int | None = None):
        self.problem = problem
        self.g = metagraph or problem.metagraph
        self.cluster = problem.cluster
        self.options = problem.slice_options
        self.N = problem.cluster.num_devices
        self.level_of = {m: k for k, lv in enumerate(self.g.levels) for m in lv}
        self.with_comm = with_comm and self.cluster.num_nodes > 1
        self.exact_memory = exact_memory
        # device ranges as variables only where they matter to the objective or the constraints
        self.ranges = exact_memory or self.with_comm or not tp_degrees_nest(self.options)
        self.hint = sorted(hint, key=lambda w: w.start)
        self.overlap = overlap
        self.block_size = block_size
        self.model = cp_model.CpModel()
        self.blocks = self._level_blocks()
        self.num_slots = self.blocks[-1][1] if self.blocks else 0
        self.slots: dict[tuple[str, int], _Slot] = {}
        self.durations: list[Any] = []
        self.used: list[Any] = []
        self.first: dict[str, Any] = {}  # cross-level overlap: first / last slot of each MetaOp
        self.last: dict[str, Any] = {}
        self.home_island: dict[str, Any] = {}
        self.comm_expr = None
        self.hint_units = 0  # model makespan of the hint
        self._build()
        self._add_hint()

    # ---------------------------------------------------------------- structure
    def _level_blocks(self) -> list[tuple[int, int]]:
        """[start, end) slot indices per MetaLevel: the hint's wave count there plus extra_waves."""
        counts = [0] * len(self.g.levels)
        for w in self.hint:
            counts[self._wave_level(w)] += 1
        blocks, pos = [], 0
        for k, lv in enumerate(self.g.levels):
            wanted = counts[k] + self.problem.settings.extra_waves if self.block_size is None else self.block_size
            size = max(counts[k], wanted) if lv else 0
            blocks.append((pos, pos + size))
            pos += size
        return blocks

    def _wave_level(self, w: ScheduledWave) -> int:
        return min(self.level_of[s.metaop] for s in w.slices)

    def _slot_range(self, mid: str) -> range:
        k = self.level_of[mid]
        if not self.overlap:
            return range(*self.blocks[k])
        lo = self.blocks[max(0, k - LEVEL_WINDOW)][0]
        hi = self.blocks[min(len(self.blocks) - 1, k + LEVEL_WINDOW)][1]
        return range(lo, hi)

    # ---------------------------------------------------------------- build
    def _build(self) -> None:
        horizon = sum(m.num_layers * max(o.units for o in self.options[mid]) for mid, m in self.g.metaops.items())
        self.durations = [self.model.NewIntVar(0, horizon, f"D{w}") for w in range(self.num_slots)]
        for mid in self.g.metaops:
            for w in self._slot_range(mid):
                self.slots[(mid, w)] = self._new_slot(mid, w)
        self._layers_and_durations()
        if self.ranges:
            self._devices()
        else:
            self._capacity()
        if self.overlap:
            self._precedence()
        self._symmetry()
        self._slice_memory()
        if self.exact_memory:
            self._memory()
        if self.with_comm:
            self.comm_expr = self._communication()

    def _new_slot(self, mid: str, w: int) -> _Slot:
        m, L = self.model, self.g.metaops[mid].num_layers
        opts = self.options[mid]
        y = [m.NewBoolVar(f"y[{mid},{w},{c}]") for c in range(len(opts))]
        lay = [m.NewIntVar(0, L, f"l[{mid},{w},{c}]") for c in range(len(opts))]
        present = m.NewBoolVar(f"p[{mid},{w}]")
        m.Add(sum(y) == present)
        for yc, lc in zip(y, lay):
            m.Add(lc >= yc)
            m.Add(lc <= L * yc)
        size = m.NewIntVar(0, max(o.n for o in opts), f"n[{mid},{w}]")
        m.Add(size == sum(o.n * yc for o, yc in zip(opts, y)))
        return _Slot(mid, w, y, lay, present, size)

    def _layers_and_durations(self) -> None:
        for mid, mo in self.g.metaops.items():
            slots = [s for (m, _), s in self.slots.items() if m == mid]
            self.model.Add(sum(lc for s in slots for lc in s.layers) == mo.num_layers)
        energy: dict[int, list[Any]] = {}
        for s in self.slots.values():
            opts = self.options[s.metaop]
            self.model.Add(self.durations[s.wave] >= sum(o.units * lc for o, lc in zip(opts, s.layers)))
            energy.setdefault(s.wave, []).append(sum(o.n * o.units * lc for o, lc in zip(opts, s.layers)))
        for w, terms in energy.items():
            # redundant (implied by disjoint devices) but it lifts the LP bound towards C*
            self.model.Add(self.N * self.durations[w] >= sum(terms))

    def _capacity(self) -> None:
        """Without ranges: the slices of a wave use at most N devices."""
        per_wave: dict[int, list[Any]] = {}
        for s in self.slots.values():
            per_wave.setdefault(s.wave, []).append(s.size)
        for sizes in per_wave.values():
            self.model.Add(sum(sizes) <= self.N)

    def _devices(self) -> None:
        """Ranges per slot: NoOverlap per wave, inside [0, N), start a multiple of tp (TP groups stay in a
        node)."""
        per_wave: dict[int, list[Any]] = {}
        for s in self.slots.values():
            s.offset = self.model.NewIntVar(0, self.N - 1, f"o[{s.metaop},{s.wave}]")
            s.end = self.model.NewIntVar(0, self.N, f"e[{s.metaop},{s.wave}]")
            iv = self.model.NewOptionalIntervalVar(s.offset, s.size, s.end, s.present, f"iv[{s.metaop},{s.wave}]")
            per_wave.setdefault(s.wave, []).append(iv)
            for o, yc in zip(self.options[s.metaop], s.y):
                if o.tp > 1:
                    if o.tp not in s.aligned:
                        s.aligned[o.tp] = self.model.NewIntVar(0, self.N // o.tp, f"q[{s.metaop},{s.wave},{o.tp}]")
                    self.model.Add(s.offset == o.tp * s.aligned[o.tp]).OnlyEnforceIf(yc)
        for ivs in per_wave.values():
            self.model.AddNoOverlap(ivs)

    def _precedence(self) -> None:
        """Cross-level mode: a consumer's first slot is after each producer's last slot."""
        for mid in self.g.metaops:
            rng = self._slot_range(mid)
            self.first[mid] = self.model.NewIntVar(rng.start, rng.stop - 1, f"first[{mid}]")
            self.last[mid] = self.model.NewIntVar(rng.start, rng.stop - 1, f"last[{mid}]")
            for w in rng:
                p = self.slots[(mid, w)].present
                self.model.Add(self.first[mid] <= w).OnlyEnforceIf(p)
                self.model.Add(self.last[mid] >= w).OnlyEnforceIf(p)
        for src, dst in self.g.edges:
            self.model.Add(self.first[dst] >= self.last[src] + 1)

    def _symmetry(self) -> None:
        """Empty slots go last in each level block: slot w used => slot w-1 used (removes equivalent orders).

        Also right with cross-level overlap: moving an empty slot to the end of its block only shifts later
        slots of the same block, which stay inside every window that contained them."""
        for w in range(self.num_slots):
            u = self.model.NewBoolVar(f"used[{w}]")
            ps = [s.present for s in self.slots.values() if s.wave == w]
            if ps:
                self.model.AddBoolOr(ps).OnlyEnforceIf(u)
            else:
                self.model.Add(u == 0)
            for p in ps:
                self.model.AddImplication(p, u)
            self.used.append(u)
        for lo, hi in self.blocks:
            for w in range(lo + 1, hi):
                self.model.AddImplication(self.used[w], self.used[w - 1])
                if not self.overlap:
                    # no precedence inside a level: any order of its waves is the same plan (layer ranges
                    # follow the slot order), so keep the longest first
                    self.model.Add(self.durations[w - 1] >= self.durations[w])

    # ---------------------------------------------------------------- memory
    def _slice_memory(self) -> None:
        """Each device of a slice holds all its layers: l <= capacity / per-layer bytes, per option."""
        for s in self.slots.values():
            mo = self.g.metaops[s.metaop]
            for o, lc in zip(self.options[s.metaop], s.layers):
                cap = self.problem.layer_cap(mo, o)
                if cap < mo.num_layers:
                    self.model.Add(lc <= cap)

    def _memory(self) -> None:
        """Per-device booleans a[s, d] <=> d in the slot's range; sum of the slot bytes on d <= capacity."""
        cap = int(self.cluster.gpu.memory_bytes // MEMORY_UNIT_BYTES)
        load: dict[int, list[Any]] = {d: [] for d in range(self.N)}
        for s in self.slots.values():
            mo = self.g.metaops[s.metaop]
            per_layer = [math.ceil(layer_bytes(mo, o.tp, o.dp, self.problem.memory_model) / MEMORY_UNIT_BYTES)
                         for o in self.options[s.metaop]]
            big = mo.num_layers * max(per_layer)
            slot_bytes = sum(b * lc for b, lc in zip(per_layer, s.layers))
            on = []
            for d in range(self.N):
                a = self.model.NewBoolVar(f"a[{s.metaop},{s.wave},{d}]")
                self.model.Add(s.offset <= d).OnlyEnforceIf(a)
                self.model.Add(s.offset + s.size >= d + 1).OnlyEnforceIf(a)
                z = self.model.NewIntVar(0, big, f"z[{s.metaop},{s.wave},{d}]")
                self.model.Add(z >= slot_bytes - big * (1 - a))
                load[d].append(z)
                on.append(a)
            self.model.Add(sum(on) == s.size)
        for zs in load.values():
            self.model.Add(sum(zs) <= cap)

    # ---------------------------------------------------------------- communication
    def _communication(self):
        """Home islands, slices away from home, edges and weight sharing across islands (module docstring)."""
        m, G, islands = self.model, self.cluster.gpus_per_node, self.cluster.num_nodes
        cost, ops = self.problem.cost_model, self.g.metaops
        terms = []
        for mid in ops:
            self.home_island[mid] = m.NewIntVar(0, islands - 1, f"home[{mid}]")
        for s in self.slots.values():
            h = self.home_island[s.metaop]
            s.home = m.NewBoolVar(f"athome[{s.metaop},{s.wave}]")
            m.Add(s.offset >= G * h).OnlyEnforceIf(s.home)
            m.Add(s.offset + s.size <= G * h + G).OnlyEnforceIf(s.home)
            away = m.NewBoolVar(f"away[{s.metaop},{s.wave}]")
            m.AddBoolOr([s.present.Not(), s.home, away])
            terms.append(_mib(handoff_bytes(ops[s.metaop], cost)) * away)
        for src, dst in self.g.edges:
            terms.append(_mib(handoff_bytes(ops[src], cost)) * self._differ(src, dst))
        ids = list(ops)
        grad_bytes = grad_bytes_of(self.problem.memory_model)
        for i, a in enumerate(ids):
            for b in ids[i + 1:]:
                if ops[a].trained_param_names() & ops[b].trained_param_names():
                    terms.append(_mib(shared_weight_bytes(ops[a], ops[b], cost, grad_bytes)) * self._differ(a, b))
        return sum(terms)

    def _differ(self, a: str, b: str):
        d = self.model.NewBoolVar(f"differ[{a},{b}]")
        self.model.Add(self.home_island[a] == self.home_island[b]).OnlyEnforceIf(d.Not())
        return d

    # ---------------------------------------------------------------- hint
    def _add_hint(self) -> None:
        """The hint as a complete solution: wave i of level k -> slot block_k.start + i (a partial one where
        a hint slice is not an option of this model or lies outside its slots)."""
        if not self.hint:
            return
        counters = {k: lo for k, (lo, _) in enumerate(self.blocks)}
        hinted: set[tuple[str, int]] = set()
        durations = [0] * self.num_slots
        order = self.hint if self.overlap else sorted(self.hint, key=lambda w: -self._wave_units(w))
        for w in order:
            k = self._wave_level(w)
            slot = counters[k]
            counters[k] += 1
            durations[slot] = self._hint_wave(w, slot, hinted)
        for key, s in self.slots.items():
            if key not in hinted:
                self._hint_slot(s, None, 0, 0)
        for d, v in zip(self.durations, durations):
            self.model.AddHint(d, v)
        self.hint_units = sum(durations)
        for w, u in enumerate(self.used):
            self.model.AddHint(u, any(slot == w for _, slot in hinted))
        for mid, var in self.first.items():
            self.model.AddHint(var, min(w for m, w in hinted if m == mid))
        for mid, var in self.last.items():
            self.model.AddHint(var, max(w for m, w in hinted if m == mid))

    def _option_index(self, s: ScheduledSlice) -> int | None:
        return next((i for i, o in enumerate(self.options[s.metaop]) if (o.n, o.tp, o.dp) == (s.n, s.tp, s.dp)),
                    None)

    def _wave_units(self, w: ScheduledWave) -> int:
        """The wave's duration in the model's time units (its longest slice)."""
        longest = 0
        for s in w.slices:
            c = self._option_index(s)
            units = self.options[s.metaop][c].units if c is not None else 0
            longest = max(longest, units * (s.layer_end - s.layer_start))
        return longest

    def _hint_wave(self, w: ScheduledWave, slot: int, hinted: set) -> int:
        starts = [range_start(s.devices, s.n) for s in w.slices]
        if any(st is None or st % s.tp for s, st in zip(w.slices, starts)):
            starts = pack_ranges([(s.n, s.tp) for s in w.slices], self.cluster) or [0] * len(w.slices)
        longest = 0
        for s, st in zip(w.slices, starts):
            c = self._option_index(s)
            if (s.metaop, slot) not in self.slots or c is None:  # partial hint
                continue
            layers = s.layer_end - s.layer_start
            self._hint_slot(self.slots[(s.metaop, slot)], c, layers, st)
            hinted.add((s.metaop, slot))
            longest = max(longest, self.options[s.metaop][c].units * layers)
        return longest

    def _hint_slot(self, s: _Slot, c: int | None, layers: int, start: int) -> None:
        m = self.model
        m.AddHint(s.present, c is not None)
        for i, (yc, lc) in enumerate(zip(s.y, s.layers)):
            m.AddHint(yc, i == c)
            m.AddHint(lc, layers if i == c else 0)
        n = self.options[s.metaop][c].n if c is not None else 0
        m.AddHint(s.size, n)
        if not self.ranges:
            return
        m.AddHint(s.offset, start if c is not None else 0)
        m.AddHint(s.end, start + n if c is not None else 0)
        if c is not None and self.options[s.metaop][c].tp in s.aligned:
            tp = self.options[s.metaop][c].tp
            m.AddHint(s.aligned[tp], start // tp)

    # ---------------------------------------------------------------- solve
    def solve(self, budget: TimeBudget) -> Answer:
        """Minimise the makespan within the budget."""
        self.model.Minimize(sum(self.durations))
        return self._solve(budget)

    def solve_comm(self, budget: TimeBudget) -> Answer:
        """Second objective: inter-island bytes, with the makespan capped at the hint's (lexicographic)."""
        self.model.Add(sum(self.durations) <= self.hint_units)
        self.model.Minimize(self.comm_expr)
        return self._solve(budget)

    def _solve(self, budget: TimeBudget) -> Answer:
        solver = cp_model.CpSolver()
        solver.parameters.cp_model_presolve = len(self.slots) <= LIGHT_PRESOLVE_SLOTS
        solver.parameters.random_seed = SEED
        limit = max(budget.left(), 0.001)
        if budget.clock.deterministic:
            # one worker: parallel workers race (not reproducible), and OR-Tools' deterministic interleaved
            # search took 14-43 s where this one takes 0.05 s, on a 15-slot level model of QWen-VAL / 64
            solver.parameters.num_workers = 1
            solver.parameters.max_deterministic_time = limit
        else:
            solver.parameters.num_workers = max(1, self.problem.workers)
            solver.parameters.max_time_in_seconds = limit
        status = solver.Solve(self.model)
        budget.clock.spend(solver.deterministic_time)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return Answer(solver.StatusName(status), None, None)
        return Answer(solver.StatusName(status), self._extract(solver), solver.BestObjectiveBound())

    def _extract(self, solver: cp_model.CpSolver) -> list[ScheduledWave]:
        """Slots in order -> waves with float times; layer ranges accumulate per MetaOp."""
        done = {mid: 0 for mid in self.g.metaops}
        waves: list[ScheduledWave] = []
        t = 0.0
        for w in range(self.num_slots):
            slices = []
            for (mid, slot), s in self.slots.items():
                if slot != w or not solver.Value(s.present):
                    continue
                c = next(i for i, yc in enumerate(s.y) if solver.Value(yc))
                o, layers = self.options[mid][c], solver.Value(s.layers[c])
                start = solver.Value(s.offset) if self.ranges else 0
                slices.append(ScheduledSlice(mid, o.n, o.tp, o.dp, done[mid], done[mid] + layers,
                                             o.seconds * layers, list(range(start, start + o.n))))
                done[mid] += layers
            if not slices:
                continue
            if not self.ranges and not pack_slices(slices, self.cluster):
                # cannot happen: the tp degrees nest and the wave fits N
                raise RuntimeError("cp-sat: a wave of the solver does not pack into device ranges")
            duration = max(s.time for s in slices)
            level = min(self.g.metaops[s.metaop].level for s in slices)
            waves.append(ScheduledWave(level, t, duration, slices))
            t += duration
        return waves


def _mib(nbytes: float) -> int:
    """Bytes in the communication objective's unit, at least 1 (so no transfer is free)."""
    return max(1, math.ceil(float(nbytes) / COMM_UNIT_BYTES))
