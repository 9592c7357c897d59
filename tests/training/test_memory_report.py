"""Megatron-LM's memory report on CUDA (training/memory.py): a line per rank after the first logged interval, which
benchmarks/train_log_summary.py reads back. Tested on the CPU with torch.cuda's statistics stood in for."""

import torch

from megatron_spindle.training import memory


def test_one_process_reports_its_cuda_statistics_in_megatrons_format(monkeypatch):
    stats = {"allocated_bytes.all.current": 3 * memory.MB, "allocated_bytes.all.peak": 10.5 * memory.MB,
             "reserved_bytes.all.current": 12 * memory.MB, "reserved_bytes.all.peak": 16 * memory.MB}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: stats)
    assert memory.memory_report(10) == ["[Rank 0] (after 10 iterations) memory (MB) | allocated: 3.0 | "
                                        "max allocated: 10.5 | reserved: 12.0 | max reserved: 16.0"]


def test_report_lines_read_back_as_each_ranks_peak():
    lines = memory.report_lines(4, [[0, 2 * memory.MB, 0, 0], [0, 7.5 * memory.MB, 0, 0]])
    assert [memory.parse_report_line(line) for line in lines] == [(0, 2 * memory.MB), (1, 7.5 * memory.MB)]
    assert memory.parse_report_line(" [2026-12-05] iteration 2/ 8 | memory (MB)") is None


def test_ranks_report_each_their_own_line_in_rank_order(monkeypatch):
    from megatron_spindle.training import multinode

    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: {"allocated_bytes.all.peak": 4 * memory.MB})
    monkeypatch.setattr(memory.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(memory.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(multinode, "all_gather_objects", lambda local: [local, [0.0, 9 * memory.MB, 0.0, 0.0]])
    lines = memory.memory_report(2)
    assert [memory.parse_report_line(line) for line in lines] == [(0, 4 * memory.MB), (1, 9 * memory.MB)]


def test_scalars_are_the_largest_over_the_ranks(monkeypatch):
    # the other rank's numbers stood in for by the shared reducer (training/engine_state.py over_ranks)
    local = {"mem-rss-bytes": 5.0, "mem-max-rss-bytes": 9.0}
    monkeypatch.setattr(memory, "_local", lambda: dict(local))
    monkeypatch.setattr(memory, "over_ranks", lambda v, op="max": torch.maximum(v, torch.tensor([7.0, 8.0],
                                                                                                 dtype=v.dtype)))
    assert memory.memory_scalars() == {"mem-rss-bytes": 7.0, "mem-max-rss-bytes": 9.0}
