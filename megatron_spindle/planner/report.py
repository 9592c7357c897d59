"""Human-readable views of a plan: the summary table and the Gantt chart of waves per device."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_spindle.plan.buckets import overlaps_param_gather
from megatron_spindle.plan.layout import batch_coupled_tasks
from megatron_spindle.plan.memory import memory_options
from megatron_spindle.plan.order import segment_tasks
from megatron_spindle.plan.schema import Plan
from megatron_spindle.plan.timeline import plan_timeline


def _fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.2f} us"
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.2f} s"


BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


def _fmt_bytes(b: float) -> str:
    for unit, scale in BYTE_UNITS:
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


MEMORY_LINE = re.compile(r"memory per device: max ([0-9.]+) (GB|MB|KB|B)\b")


def parse_memory_per_device(line: str) -> float | None:
    """The largest predicted memory per device, in bytes, from the summary's "memory per device" line (None for any
    other line): what a training log holds of the plan's memory."""
    m = MEMORY_LINE.search(line)
    if not m:
        return None
    return float(m.group(1)) * dict(BYTE_UNITS).get(m.group(2), 1.0)


CANDIDATES_SHOWN = 12  # plan selection's candidates named in the log and the summary (1024 GPUs make 96)


def shown_candidates(candidates: list[tuple[str, float]], selected: str,
                     most: int = CANDIDATES_SHOWN) -> tuple[list[tuple[str, float]], int]:
    """(name, simulated seconds) of the candidates to name and how many are left out: all of them, in their
    order, up to ``most``; else the ``most`` fastest, fastest first, the selected one always among them."""
    if len(candidates) <= most:
        return list(candidates), 0
    fastest = sorted(candidates, key=lambda c: c[1])[:most]
    if selected not in {name for name, _ in fastest}:
        fastest[-1] = next(c for c in candidates if c[0] == selected)
    return fastest, len(candidates) - most


# what a MetaOp's backward computes (graph/workload.py BACKWARDS), in the plan summary's column
BACKWARD_LABELS = {"full": "full", "input": "dgrad", "none": "none"}


def plan_summary(plan: Plan) -> str:
    """The table tools/plan.py and pretrain_multitask.py print at start."""
    p = plan.predicted
    lines = [
        f"plan for workload '{plan.workload_name}' on {plan.num_devices} devices "
        f"({plan.cluster['num_nodes']} x {plan.cluster['gpus_per_node']} {plan.cluster['gpu']['name']}), "
        f"planner={plan.planner.get('planner')}",
        f"  predicted iteration time {_fmt_time(p['iteration_time'])}"
        + ("" if "simulated_compute" not in p else
           f" (simulated: compute {_fmt_time(p['simulated_compute'])}, transfers {_fmt_time(p['simulated_transfer'])},"
           f" gradient sync {_fmt_time(p['simulated_grad_sync'])}, optimizer "
           f"{_fmt_time(p['simulated_optimizer'] + p.get('simulated_param_gather', 0.0))})"),
        f"  waves {_fmt_time(p.get('makespan', p['iteration_time']))}"
        + (f"   C* {_fmt_time(p['c_star'])}   gap {100 * p['gap']:.1f}%" if p.get("c_star") else "")
        + f"   mean utilisation {100 * p.get('utilisation', 0.0):.1f}%"
        + (f"   planner's estimate {_fmt_time(p['planner_estimate'])}" if "planner_estimate" in p else ""),
        f"  waves {len(plan.waves)}   levels {len(plan.levels)}   inter-island {_fmt_bytes(p.get('inter_island_bytes', 0))}"
        f"   intra-island {_fmt_bytes(p.get('intra_island_bytes', 0))}   local {_fmt_bytes(p.get('local_bytes', 0))}",
        f"  execution: memory options {memory_options(plan)}"
        f"   attention backend {plan.settings.attention_backend}"
        f"   gradient all-reduce in {plan.settings.grad_reduce_dtype}"
        + ("" if plan.settings.tp_sharded_grads else " in whole units")
        + (f" in buckets of {plan.settings.ddp_bucket_size:,} parameters" if plan.settings.ddp_bucket_size else "")
        + ("" if plan.settings.overlap_grad_reduce else " after the backward (--no-overlap-grad-reduce)")
        + ("" if plan.settings.grad_norm else "   no gradient norm (--clip-grad 0)")
        + (f"   dropout hidden {plan.settings.hidden_dropout:g} attention {plan.settings.attention_dropout:g}"
           if plan.settings.hidden_dropout or plan.settings.attention_dropout else "")
        + ("   weight all-gather overlapped with the next forward"
           if overlaps_param_gather(plan.settings) else ""),
    ]
    if plan.settings.segments:
        tasks = [" + ".join(seg) for seg in segment_tasks(plan)]
        lines.append(f"  {len(tasks)} segments, one after another (each its forward then its backward, so a device "
                     f"holds one segment's activations at a time): {' | '.join(tasks)}")
    coupled = batch_coupled_tasks(plan.metaops) if plan.settings.micro_batches > 1 else []
    if coupled:
        m = plan.settings.micro_batches
        lines.append(f"  note: {m} micro-batches split the batches of contrastive losses (tasks {', '.join(coupled)}): "
                     f"each loss takes its negatives from its micro-batch, 1/{m} of the task's batch, not the whole")
    if plan.memory_per_device:
        mem = plan.memory_per_device
        lines.append(f"  memory per device: max {_fmt_bytes(max(mem))}  min {_fmt_bytes(min(mem))}  "
                     f"capacity {_fmt_bytes(plan.cluster['gpu']['memory_bytes'])}")
    selection = plan.planner.get("selection") or {}
    candidates = selection.get("candidates", [])
    if len(candidates) > 1:
        shown, hidden = shown_candidates([(c["name"], c["simulated"]) for c in candidates], selection["selected"])
        lines.append("  selected by simulation: " + ", ".join(
            f"{name} {_fmt_time(t)}{' *' if name == selection['selected'] else ''}" for name, t in shown)
            + (f" (the fastest {len(shown)} of {len(candidates)})" if hidden else ""))
    solver = plan.planner.get("solver")
    if solver:
        lines += _solver_lines(solver)
    if "planning_seconds" in plan.planner:
        lines.append(f"  planning took {plan.planner['planning_seconds']:.3f} s" + (
            f" (this plan; choosing it among {len(candidates)} candidates took "
            f"{plan.planner['selection_seconds']:.3f} s)"
            if len(candidates) > 1 and "selection_seconds" in plan.planner else ""))
    lines.append("")
    frozen = any(m.backward != "full" for m in plan.metaops)  # a column only where some module is frozen
    lines.append(f"  {'MetaOp':<34}{'lvl':>4}{'L':>4}  {'n*':>6}  {'allocation (n x layers)':<26}{'curve':<18}"
                 + (f"{'backward':<10}" if frozen else ""))
    for m in plan.metaops:
        alloc = " + ".join(f"{int(n)}x{int(layers)}" for n, layers in m.allocation) or "-"
        curve = f"{m.curve_source} ({100 * m.curve_fit_error:.1f}%)"
        lines.append(f"  {m.id:<34}{m.level:>4}{m.num_layers:>4}  {m.n_star:>6.2f}  {alloc:<26}{curve:<18}"
                     + (f"{BACKWARD_LABELS[m.backward]:<10}" if frozen else ""))
    lines.append("")
    components = plan_timeline(plan).components
    if components > 1:
        lines.append(f"  {components} device groups share no device and no hand-off: each runs its waves on its own "
                     "clock (start and duration below are a wave's slowest group's)")
    lines.append(f"  {'wave':>4} {'lvl':>4} {'start':>11} {'duration':>11}  slices (MetaOp[layers] tp x dp @ devices)")
    for w in plan.waves:
        parts = [f"{s.metaop}[{s.layer_start}:{s.layer_end}] {s.tp}x{s.dp}@{_fmt_devices(s.devices)}"
                 for s in w.slices]
        lines.append(f"  {w.index:>4} {w.level:>4} {_fmt_time(w.start):>11} {_fmt_time(w.duration):>11}  "
                     + "; ".join(parts))
    return "\n".join(lines)


def _solver_lines(solver: dict) -> list[str]:
    """CP-SAT status, its best bound, C*, and the returned plan's gap to both (issue 4's summary)."""
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    def ms(x):
        return "-" if x is None else _fmt_time(x)

    head = (f"  cp-sat: {solver.get('status')}"
            + (" (no better plan than the greedy hint)" if solver.get("used_hint_only") else "")
            + f" in {solver.get('solve_seconds', 0):.1f} s"
            + (f" ({solver['solve_work']:.2f} deterministic units)" if solver.get("solve_work") is not None else "")
            + f"; makespan {ms(solver.get('makespan'))} vs greedy "
              f"{ms(solver.get('greedy_makespan'))} ({pct(solver.get('improvement'))} better); best bound "
              f"{ms(solver.get('best_bound'))} (gap {pct(solver.get('gap_to_bound'))}); C* {ms(solver.get('c_star'))} "
              f"(gap {pct(solver.get('gap_to_c_star'))}); time rounding <= {ms(solver.get('rounding_error_bound'))}")
    lines = [head]
    if solver.get("cross_level_overlap"):
        lines.append(f"  cross-level overlap: barrier makespan {ms(solver.get('barrier_makespan'))}, gain "
                     f"{pct(solver.get('overlap_gain'))}")
    if solver.get("notes"):
        lines.append(f"  cp-sat notes: {solver['notes']}")
    return lines


def _fmt_devices(devs: list[int]) -> str:
    """"0-71,192-247": runs of consecutive devices as ranges (a slice on 128 devices was 128 numbers)."""
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in _device_runs(devs))


GANTT_PALETTES = ("tab20", "tab20b", "tab20c")  # 60 colours, indexed by a hash of the module name


def module_colors(modules) -> dict[str, tuple]:
    """module -> RGBA colour, from a hash of its name (crc32, not Python's salted hash), so a module keeps its
    colour from one chart to the next whatever else the chart shows. Names that hash to a colour already taken
    in this chart take the next free one (in name order)."""
    import zlib

    import matplotlib

    colours = [c for name in GANTT_PALETTES for c in matplotlib.colormaps[name].colors]
    taken: dict[int, str] = {}
    out = {}
    for m in sorted(set(modules)):
        i = zlib.crc32(m.encode()) % len(colours)
        while i in taken and len(taken) < len(colours):
            i = (i + 1) % len(colours)
        taken[i] = m
        out[m] = (*colours[i], 1.0)
    return out


def _device_runs(devices: list[int]) -> list[list[int]]:
    """Sorted devices (or chart rows) split into runs of consecutive ones (the blocks a slice occupies)."""
    runs: list[list[int]] = []
    for d in sorted(devices):
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs


# above this many devices the chart draws one row per set of devices that run the same slices (a row per device
# made a 1024-GPU chart 39537 px tall and a 2048-GPU one 78859 px; QWen-VAL-70B's 256 devices need 32 rows)
GANTT_DEVICE_ROWS_MAX = 64


def gantt_rows(plan: Plan) -> tuple[list[int], list[str]]:
    """(row of each device, label of each row): one row per device up to GANTT_DEVICE_ROWS_MAX devices, else one
    per set of devices that take part in exactly the same slices, in the order of their first device, labelled
    with the devices (shortened) and how many there are."""
    n_dev, per_node = plan.num_devices, int(plan.cluster["gpus_per_node"])
    if n_dev <= GANTT_DEVICE_ROWS_MAX:
        return list(range(n_dev)), [f"{d} (n{d // per_node})" for d in range(n_dev)]
    slices_of: list[list[str]] = [[] for _ in range(n_dev)]
    for s in plan.slices():
        for d in s.devices:
            slices_of[d].append(s.id)
    rows: dict[tuple[str, ...], list[int]] = {}
    for d in range(n_dev):
        rows.setdefault(tuple(slices_of[d]), []).append(d)
    row_of = [0] * n_dev
    for r, devices in enumerate(rows.values()):
        for d in devices:
            row_of[d] = r
    return row_of, [_row_label(devices) for devices in rows.values()]


def _row_label(devices: list[int], width: int = 24) -> str:
    """"64-127 (64)", "0-7,16-23 (16)", or "64,69,192,... (16)" when the ranges are long."""
    if len(devices) == 1:
        return str(devices[0])
    text = _fmt_devices(devices)
    if len(text) > width:
        text = text[:width].rsplit(",", 1)[0] + ",..."
    return f"{text} ({len(devices)})"


FROZEN_HATCH = "///"  # the Gantt chart's bars of slices of frozen modules


def gantt_figure(plan: Plan, title: str | None = None):
    """(figure, axes) of the Gantt chart (``draw_gantt`` saves it): waves per device over time, one row per
    device (``gantt_rows``: on a large cluster one per set of devices that run the same slices), one bar per
    slice coloured by module (``module_colors``); every block of consecutive rows of a slice wide enough for it
    carries the slice's label; waves are numbered along the top as in the training log (w0, w1, ...); thin lines
    at wave boundaries, thick ones at MetaLevel boundaries, shading per island (rows of single devices); slices of
    frozen modules hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n_dev = plan.num_devices
    row_of, row_labels = gantt_rows(plan)
    n_rows = len(row_labels)
    timeline = plan_timeline(plan)  # each slice at its device component's time (node groups keep their own)
    own_clocks = timeline.components > 1
    scale, unit = (1e3, "ms") if timeline.makespan < 10 else (1.0, "s")
    modules = sorted({s.module or s.kind for s in plan.slices()})
    color = module_colors(modules)
    fig, ax = plt.subplots(figsize=(14, max(3.0, 0.32 * n_rows + 1.8)))
    per_node = int(plan.cluster["gpus_per_node"])
    per_device = n_dev <= GANTT_DEVICE_ROWS_MAX  # else a row holds every device that runs the same slices
    if per_device:
        for isl in range(0, n_dev, per_node):
            if (isl // per_node) % 2:
                ax.axhspan(isl - 0.5, isl + per_node - 0.5, color="0.94", zorder=0)
    labels = []  # (text artist, left, right): bars' extents in data coordinates
    frozen = {m.id for m in plan.metaops if m.backward != "full"}  # frozen weights (graph/workload.py BACKWARDS)
    for w in plan.waves:
        for s in w.slices:
            label = s.task if s.kind == "layer" else f"{s.task}:{s.kind}"
            left, width = timeline.starts[s.id] * scale, s.predicted_time * scale
            rows = sorted({row_of[d] for d in s.devices})
            for r in rows:
                ax.barh(r, width, left=left, height=0.8, color=color[s.module or s.kind], edgecolor="black",
                        linewidth=0.3, zorder=2, hatch=FROZEN_HATCH if s.metaop in frozen else None)
            for run in _device_runs(rows):  # a label per block: scattered slices are labelled on each
                text = ax.text(left + width / 2, run[(len(run) - 1) // 2], label, ha="center", va="center",
                               fontsize=6, zorder=3, clip_on=True)
                labels.append((text, left, left + width))
        if not own_clocks:
            ax.axvline(w.start * scale, color="0.6", linewidth=0.4, zorder=1)
    for lv in plan.levels if not own_clocks else []:
        ax.axvline(lv.end * scale, color="black", linewidth=1.2, zorder=1)
    ax.set_ylim(n_rows - 0.5, -0.5)
    ax.set_xlim(0, max(plan.predicted.get("iteration_time", 0.0), timeline.makespan) * scale)
    _draw_step_tail(ax, plan, timeline.makespan, scale)
    ax.set_yticks(range(n_rows))
    ax.set_yticklabels(row_labels, fontsize=6 if n_rows > 32 else 8)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("device (node)" if per_device else "devices that run the same slices (how many)")
    if not own_clocks:  # wave numbers, as the log's "measured wave time (ms): w0=..."
        top = ax.secondary_xaxis("top")
        top.set_xticks([(w.start + w.duration / 2) * scale for w in plan.waves])
        top.set_xticklabels([f"w{i}" for i in range(len(plan.waves))], fontsize=6,
                            rotation=90 if len(plan.waves) > 12 else 0)
        top.tick_params(length=0)
    p = plan.predicted
    ax.set_title(title or f"{plan.workload_name}: {len(plan.waves)} waves, predicted "
                 f"{p['iteration_time'] * scale:.1f} {unit}"
                 + (f" (C* {p['c_star'] * scale:.1f})" if p.get("c_star") else "")
                 + f", utilisation {100 * p.get('utilisation', 0.0):.0f}%"
                 + (", device groups on their own wave clocks" if own_clocks else ""))
    handles = [Patch(color=color[m], label=m) for m in modules]
    if frozen:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch=FROZEN_HATCH, label="frozen"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="module")
    fig.tight_layout()
    _drop_labels_that_do_not_fit(fig, ax, labels)
    return fig, ax


def _draw_step_tail(ax, plan: Plan, waves_end: float, scale: float) -> None:
    """The predicted iteration past the waves' end, shaded and named: the gradient sync the backward did not
    hide and the optimizer step (with its weight all-gather), as simulated; the chart ends there."""
    p = plan.predicted
    end = p.get("iteration_time", 0.0)
    if end <= waves_end * (1 + 1e-9):
        return
    ax.axvspan(waves_end * scale, end * scale, color="0.85", hatch="//", fill=False, linewidth=0, zorder=1)
    if end - waves_end >= 0.02 * end:  # room for two lines of small text
        ax.text((waves_end + end) / 2 * scale, -0.5, f"after the waves: {_fmt_time(end - waves_end)}\n"
                "(exposed gradient sync, optimizer step)", ha="center", va="top", fontsize=6, rotation=90, zorder=3,
                clip_on=True)


def _drop_labels_that_do_not_fit(fig, ax, labels) -> None:
    """Remove every label wider than its bar or taller than a bar (measured after layout)."""
    renderer = fig.canvas.get_renderer()
    bar_px = 0.8 * abs(ax.transData.transform((0, 1))[1] - ax.transData.transform((0, 0))[1])
    for text, left, right in labels:
        box = text.get_window_extent(renderer)
        width_px = ax.transData.transform((right, 0))[0] - ax.transData.transform((left, 0))[0]
        if box.width > 0.95 * width_px or box.height > bar_px:
            text.remove()


def draw_gantt(plan: Plan, path: str | Path, title: str | None = None) -> Path:
    """The Gantt chart of ``gantt_figure``, written to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, _ = gantt_figure(plan, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
