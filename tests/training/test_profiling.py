"""--profile / --use-pytorch-profiler (training/profiling.py): the window covers iterations
[--profile-step-start, --profile-step-end) on --profile-ranks, and bad flags stop before training."""

import argparse

import pytest
import torch

from megatron_spindle.runtime.schedule import slice_range
from megatron_spindle.training.profiling import StepProfiler, add_profiling_args, check_profiling_args


def _args(*flags: str, tensorboard_dir=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_profiling_args(parser)
    args = parser.parse_args(list(flags))
    args.tensorboard_dir = tensorboard_dir
    return args


def _train(profiler: StepProfiler, iterations: int) -> None:
    a = torch.ones(8, 8)
    for it in range(iterations):
        profiler.before_iteration(it)
        with torch.profiler.record_function(f"iteration_{it}"):
            a = a @ a / 8
        profiler.after_iteration(it + 1)
    profiler.stop()


def test_the_pytorch_profiler_records_exactly_the_window_and_writes_its_trace(tmp_path):
    printed = []
    args = _args("--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3",
                 tensorboard_dir=str(tmp_path))
    _train(StepProfiler(args, rank=0, print_fn=printed.append), 5)
    assert len(printed) == 1
    table = printed[0]
    assert "[profile] rank 0, iterations 1 to 2, by host time:" in table
    assert "iteration_1" in table and "iteration_2" in table
    assert "iteration_0" not in table and "iteration_3" not in table
    assert [p.name for p in tmp_path.iterdir()][0].startswith("rank0.") and \
        all(p.name.endswith(".pt.trace.json") for p in tmp_path.iterdir())


def test_inside_the_window_the_slices_ranges_are_tabulated_by_host_time():
    printed, active = [], []
    profiler = StepProfiler(_args("--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                                  "--profile-step-end", "2"), rank=0, print_fn=printed.append)
    a = torch.ones(64, 64)
    for it in range(3):
        profiler.before_iteration(it)
        active.append(profiler.active)  # what the trainer gives the engine's slice_ranges
        for phase, work in (("forward", 1), ("backward", 40)):
            with slice_range(phase, f"w{it}:t/m", torch.device("cpu")):
                for _ in range(work):
                    a = a @ a / 64
        profiler.after_iteration(it + 1)
    profiler.stop()
    assert active == [False, True, False]
    table = printed[0].split("by slice")[1].splitlines()
    assert table[1].split() == ["range", "calls", "host", "ms", "device", "ms"]
    assert [row.split()[:3] for row in table[2:]] == [["backward", "w1:t/m", "1"], ["forward", "w1:t/m", "1"]]


def test_a_rank_not_named_and_a_run_without_profile_record_nothing(tmp_path):
    printed = []
    _train(StepProfiler(_args("--profile", "--use-pytorch-profiler", "--profile-step-start", "0",
                              "--profile-step-end", "1", "--profile-ranks", "1", "2"), 0, printed.append), 3)
    _train(StepProfiler(_args(), 0, printed.append), 3)
    assert printed == []


def test_a_window_cut_short_by_the_end_of_training_is_still_reported():
    printed = []
    _train(StepProfiler(_args("--profile", "--use-pytorch-profiler", "--profile-step-start", "2"), 0,
                        printed.append), 3)  # --profile-step-end defaults to 12, training stops after 3
    assert len(printed) == 1 and "iteration_2" in printed[0]


@pytest.mark.parametrize("flags, message", [
    (("--profile", "--use-pytorch-profiler", "--profile-step-start", "4", "--profile-step-end", "4"),
     "--profile-step-start (4) must be >= 0 and below --profile-step-end (4)"),
    (("--profile", "--use-pytorch-profiler", "--profile-step-start", "-1"), "must be >= 0"),
])
def test_bad_profiling_flags_name_the_problem(flags, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_profiling_args(_args(*flags))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the nsys bracket is refused only without CUDA")
def test_the_nsys_bracket_without_cuda_says_to_use_the_pytorch_profiler():
    with pytest.raises(ValueError, match="add --use-pytorch-profiler"):
        check_profiling_args(_args("--profile"))
    check_profiling_args(_args())  # no --profile: nothing to check


def test_a_torch_without_nvtx_markers_still_profiles_its_slices(monkeypatch):
    """A build whose NVTX calls raise (CPU builds do): a CUDA slice's range is the profiler's alone, nothing
    raises."""
    from megatron_spindle.runtime import schedule

    def missing(*_):
        raise RuntimeError("NVTX functions not installed")

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", missing)
    schedule.nvtx_available.cache_clear()
    try:
        assert not schedule.nvtx_available()
        with torch.profiler.profile() as prof:
            with slice_range("forward", "w0:t/m", torch.device("cuda")):
                torch.ones(2).sum()
    finally:
        schedule.nvtx_available.cache_clear()
    assert "spindle forward w0:t/m" in {e.key for e in prof.key_averages()}
