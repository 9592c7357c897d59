"""The plan's Gantt chart: waves numbered as in the training log, module colours that do not depend on the chart,
a label on every block of every slice wide enough to hold one (scattered slices get one per block)."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from megatron_spindle.graph.cluster import make_cluster  # noqa: E402
from megatron_spindle.graph.workload import load_workload  # noqa: E402
from megatron_spindle.plan.timeline import plan_timeline  # noqa: E402
from megatron_spindle.planner.pipeline import PlannerConfig, make_plan  # noqa: E402
from megatron_spindle.planner.report import (  # noqa: E402
    _device_runs,
    _solver_lines,
    draw_gantt,
    gantt_figure,
    module_colors,
    plan_summary,
)


def test_gantt_numbers_waves_and_labels_every_wide_block(tmp_path):
    plan = make_plan(load_workload("clip-10"), make_cluster(16), PlannerConfig(planner="wavefront"))
    fig, ax = gantt_figure(plan)
    try:
        top = next(a for a in ax.child_axes if a.get_xticklabels())
        assert [t.get_text() for t in top.get_xticklabels()] == [f"w{i}" for i in range(len(plan.waves))]
        texts = {(t.get_text(), round(t.get_position()[0], 6), t.get_position()[1]) for t in ax.texts}
        scale = 1e3
        span = ax.get_xlim()[1] - ax.get_xlim()[0]
        scattered = 0
        for w in plan.waves:
            for s in w.slices:
                label = s.task if s.kind == "layer" else f"{s.task}:{s.kind}"
                x = round((w.start + s.predicted_time / 2) * scale, 6)
                runs = _device_runs(s.devices)
                have = [(label, x, run[(len(run) - 1) // 2]) in texts for run in runs]
                if s.predicted_time * scale > 0.12 * span:  # far wider than any label at 6 pt
                    assert all(have), (s.id, runs)
                    scattered += len(runs) > 1
        assert scattered, "no wide slice over several blocks of devices in this plan"
        bars = {(round(p.get_x() + p.get_width() / 2, 6), round(p.get_y() + p.get_height() / 2)): p.get_width()
                for p in ax.patches if hasattr(p, "get_width")}
        for t in ax.texts:  # every label sits on a bar of its slice
            x, y = t.get_position()
            assert (round(x, 6), round(y)) in bars, t.get_text()
    finally:
        plt.close(fig)
    assert draw_gantt(plan, tmp_path / "g.png").stat().st_size > 0


def test_module_colours_are_stable_across_charts():
    a = module_colors(["vision", "text", "audio"])
    b = module_colors(["thermal", "audio", "motion", "vision", "depth"])
    assert a["vision"] == b["vision"] and a["audio"] == b["audio"]
    assert module_colors(["b", "a", "c"]) == module_colors(["c", "a", "b"])  # not the order of appearance
    many = module_colors([f"module{i}" for i in range(40)])
    assert len(set(many.values())) == 40  # hash collisions inside a chart move to a free colour


def test_summary_names_the_solver_time_and_its_deterministic_units():
    """The CP-SAT line says how long the solves took, and on the deterministic limit how many units they used."""
    summary = {"status": "FEASIBLE", "solve_seconds": 12.34, "makespan": 0.5, "greedy_makespan": 0.52,
               "improvement": 0.04}
    assert "in 12.3 s; makespan" in _solver_lines(summary)[0]
    assert "in 12.3 s (8.50 deterministic units); makespan" in _solver_lines({**summary, "solve_work": 8.5})[0]


def test_gantt_and_summary_of_a_node_group_plan_follow_each_groups_clock():
    """A node-group plan's groups share no device: the chart draws each slice at its group's time
    (plan/timeline.py), without the merged waves' lines, over the predicted span; the summary says so."""
    from megatron_spindle.plan.timeline import makespan, slice_starts
    from megatron_spindle.planner.node_groups import node_group_partitions, plan_node_groups

    w, c = load_workload("clip-4"), make_cluster(16, gpus_per_node=8)
    plan = plan_node_groups(w, c, node_group_partitions(w, c)[0]).plan
    fig, ax = gantt_figure(plan)
    try:
        lefts = {(round(p.get_x(), 6), round(p.get_y() + p.get_height() / 2)) for p in ax.patches
                 if hasattr(p, "get_width")}
        starts = slice_starts(plan)
        for s in plan.slices():
            assert all((round(starts[s.id] * 1e3, 6), d) in lefts for d in s.devices), s.id
        assert not ax.lines and not ax.child_axes  # no merged wave boundaries or wave numbers
        assert ax.get_xlim()[1] == max(plan.predicted["iteration_time"], makespan(plan)) * 1e3
    finally:
        plt.close(fig)
    assert "device groups share no device and no hand-off" in plan_summary(plan)
    single = make_plan(load_workload("tiny-clip"), make_cluster(4), PlannerConfig(planner="wavefront"))
    assert "device groups" not in plan_summary(single)


def test_summary_says_how_long_the_selection_took_beside_the_plans_own_time():
    """autoplan plans several candidates: the summary gives the selected plan's own planning time and the
    whole selection's, which is what a user waited for."""
    from megatron_spindle.autoplan import autoplan
    from megatron_spindle.planner.report import plan_summary

    plan = autoplan(load_workload("tiny-clip"), make_cluster(4), PlannerConfig(planner="wavefront")).plan
    n = len(plan.planner["selection"]["candidates"])
    assert n > 1
    line = next(x for x in plan_summary(plan).splitlines() if "planning took" in x)
    assert line == (f"  planning took {plan.planner['planning_seconds']:.3f} s (this plan; choosing it among {n} "
                    f"candidates took {plan.planner['selection_seconds']:.3f} s)")
    single = make_plan(load_workload("tiny-clip"), make_cluster(4), PlannerConfig(planner="wavefront"))
    assert "candidates took" not in plan_summary(single)


def test_gantt_shades_and_names_the_predicted_iteration_after_the_waves():
    """A selected plan's predicted iteration (the simulator's) ends after its waves, by the gradient sync the
    backward does not hide and the optimizer step: the chart shades that tail and says what it is."""
    from matplotlib.patches import Polygon, Rectangle

    from megatron_spindle.autoplan import autoplan
    from megatron_spindle.plan.timeline import makespan

    # tiny-clip on 4 devices: its gradient sync hardly hides behind a backward this short (a 2.4 % tail, under
    # a millisecond)
    plan = autoplan(load_workload("tiny-clip"), make_cluster(4), PlannerConfig(planner="wavefront")).plan
    end, waves_end = plan.predicted["iteration_time"], makespan(plan)
    assert end > 1.02 * waves_end
    fig, ax = gantt_figure(plan)
    try:
        spans = [p for p in ax.patches if p.get_hatch() == "//"]
        assert len(spans) == 1
        xs = [x for x, _ in (spans[0].get_xy() if isinstance(spans[0], Polygon) else [])] or \
            ([spans[0].get_x(), spans[0].get_x() + spans[0].get_width()] if isinstance(spans[0], Rectangle) else [])
        assert min(xs) == pytest.approx(waves_end * 1e3) and max(xs) == pytest.approx(end * 1e3)
        texts = [t.get_text() for t in ax.texts if t.get_text().startswith("after the waves: ")]
        assert texts == [f"after the waves: {(end - waves_end) * 1e6:.2f} us\n(exposed gradient sync, optimizer step)"]
    finally:
        plt.close(fig)
    plain = make_plan(load_workload("tiny-clip"), make_cluster(4), PlannerConfig(planner="wavefront"))
    fig, ax = gantt_figure(plain)  # unsimulated: the waves are the prediction, no tail
    try:
        assert not [p for p in ax.patches if p.get_hatch() == "//"]
    finally:
        plt.close(fig)


def test_a_large_clusters_chart_has_a_row_per_set_of_devices_that_run_the_same_slices():
    """Above GANTT_DEVICE_ROWS_MAX devices a row per device made charts tens of thousands of pixels tall: the
    devices that run exactly the same slices share a row, every device is in one row, and each slice's bars lie
    on the rows of its devices."""
    from megatron_spindle.planner.report import GANTT_DEVICE_ROWS_MAX, _fmt_devices, _row_label, gantt_rows

    plan = make_plan(load_workload("clip-10"), make_cluster(128), PlannerConfig(planner="wavefront"))
    assert plan.num_devices > GANTT_DEVICE_ROWS_MAX
    row_of, labels = gantt_rows(plan)
    assert len(row_of) == plan.num_devices and sorted(set(row_of)) == list(range(len(labels)))
    assert len(labels) < plan.num_devices  # 65 rows for 128 devices here
    slices_of = [tuple(s.id for s in plan.slices() if d in s.devices) for d in range(plan.num_devices)]
    for d in range(plan.num_devices):
        for e in range(plan.num_devices):
            assert (row_of[d] == row_of[e]) == (slices_of[d] == slices_of[e])
    fig, ax = gantt_figure(plan)
    try:
        assert [t.get_text() for t in ax.get_yticklabels()] == labels
        bars = {(round(p.get_x(), 6), round(p.get_y() + p.get_height() / 2)) for p in ax.patches
                if hasattr(p, "get_width") and p.get_hatch() is None}
        starts = plan_timeline(plan).starts
        for s in plan.slices():
            assert {r for x, r in bars if x == round(starts[s.id] * 1e3, 6)} >= {row_of[d] for d in s.devices}
        assert fig.get_size_inches()[1] < 0.32 * len(labels) + 2
    finally:
        plt.close(fig)
    assert _row_label(list(range(64, 128))) == "64-127 (64)"
    assert _row_label([0, 1, 2, 3, 8, 9]) == "0-3,8-9 (6)"
    assert _row_label([64, 69, 192, 197, 200, 205, 208, 213, 217]) == "64,69,192,197,200,205,... (9)"
    assert _row_label([5]) == "5"
    # the summary's wave lines give a slice's devices as ranges too
    assert _fmt_devices([0, 1, 2, 3, 192, 193, 7]) == "0-3,7,192-193" and _fmt_devices([4]) == "4"


def test_a_long_candidate_list_names_the_fastest_with_the_selected_one():
    """1024 GPUs make 96 candidates, a line of several kilobytes: the log and the summary name the
    CANDIDATES_SHOWN fastest (the selected one always among them) and say how many there were."""
    from megatron_spindle.planner.report import CANDIDATES_SHOWN, shown_candidates

    few = [("a", 3.0), ("b", 1.0), ("c", 2.0)]
    assert shown_candidates(few, "b") == (few, 0)  # all, in their order
    many = [(f"c{i}", float(100 - i)) for i in range(40)]
    shown, hidden = shown_candidates(many, "c39")
    assert hidden == 40 - CANDIDATES_SHOWN and [n for n, _ in shown] == [f"c{i}" for i in range(39, 39 - CANDIDATES_SHOWN, -1)]
    shown, _ = shown_candidates(many, "c0")  # the selected one is slow (the faster ones did not fit memory)
    assert shown[-1] == ("c0", 100.0) and len(shown) == CANDIDATES_SHOWN


def test_frozen_modules_show_in_the_summary_and_the_chart():
    """The summary's backward column (only when something is frozen) and the chart's hatched bars."""
    cluster, config = make_cluster(4, gpu_type_name="CPU"), PlannerConfig(planner="wavefront")
    plain = plan_summary(make_plan(load_workload("tiny-vlm"), cluster, config))
    assert "backward" not in plain
    plan = make_plan(load_workload("tiny-vlm").frozen(["vision", "llm"]), cluster, config)
    rows = {line.split()[0]: line.split()[-1] for line in plan_summary(plan).splitlines()
            if line.strip().startswith(("caption/", "asr/"))}
    assert (rows["caption/vision"], rows["caption/llm"], rows["caption/vis_proj"]) == ("none", "dgrad", "full")
    fig, ax = gantt_figure(plan)
    hatched = {p.get_hatch() for p in ax.patches if p.get_hatch()}
    assert hatched == {"///"} and "frozen" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)
