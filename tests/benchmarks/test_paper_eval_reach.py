"""benchmarks/paper_eval.py's table of the Fig. 8 cells against the cost model: the time the paper's speedup needs,
C* with memory unlimited, and the verdict per cell (issue 13 asks why (d) misses, cell by cell)."""

from __future__ import annotations

from script_loader import load_script

PAPER_EVAL = load_script("benchmarks/paper_eval.py")


def _cell(workload: str, gpus: int, deepspeed: float, spindle: float, c_star: float) -> dict:
    breakdown = {"compute": spindle - 0.010, "transfer": 0.004, "grad_sync": 0.003, "optimizer": 0.002,
                 "param_gather": 0.001}
    return {"workload": workload, "gpus": gpus, "c_star_unlimited": c_star,
            "systems": {"deepspeed": {"iteration_time": deepspeed},
                        "spindle": {"iteration_time": spindle, "breakdown": breakdown}}}


def test_each_cell_is_met_within_the_model_or_beyond_it():
    # clip-7 / 16: the paper's 1.26x over DeepSpeed's 0.902 s needs 0.716 s
    met = _cell("clip-7", 16, 0.902, 0.700, 0.665)
    within = _cell("clip-7", 16, 0.902, 0.746, 0.665)
    beyond = _cell("clip-7", 16, 0.902, 0.800, 0.750)
    lines = PAPER_EVAL.reach_table([met, within, beyond]).splitlines()[2:]
    assert lines[0].endswith("  met")
    assert lines[1].endswith("within the model: 30 ms over what it needs, which leaves 51 ms above C* for the "
                             "waves' packing, transfers, sync and optimizer")
    assert lines[2].endswith("beyond the model: C* alone is 5 % over what it needs")
    assert "746 = 736 + 4 + 3 + 3" in lines[1] and " 1.36 " in lines[1]  # the breakdown; the speedup at C*
    # the (d1) target counts the cells the model allows: C* within what the paper's speedup needs
    assert PAPER_EVAL._reach_note([met, within, beyond]) == " (the paper's speedup is within C* in 2 of 3)"


def test_cells_without_c_star_or_a_paper_number_are_left_out():
    cells = [_cell("clip-7", 16, 0.902, 0.746, 0.0), _cell("clip-20", 1024, 0.9, 0.3, 0.2)]
    assert len(PAPER_EVAL.reach_table(cells).splitlines()) == 2
    assert PAPER_EVAL._reach_note(cells[:1]) == ""
