"""The start-of-training line on the busiest rank's decoding (training/data_rate.py): which rows and fields a rank
decodes, the data threads it has, and when the line says the data will hold the steps back."""

import pytest
from recording_dataset import RecordingDataset

from megatron_spindle.data.datasets import MockTaskDataset
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.training import data_rate
from megatron_spindle.training.data_rate import FieldLoad, busiest_rank, decode_report, rank_decode_load


def test_a_rank_is_charged_the_rows_and_fields_its_slices_read():
    w = load_workload("tiny-clip")  # text_audio: 8 rows, vision_text: 4
    datasets = {t.name: RecordingDataset(MockTaskDataset(w, t.name, 16)) for t in w.tasks}
    needs = {"text_audio": {"audio": [(0, 2), (4, 6)], "text": None}, "vision_text": None}
    loads = rank_decode_load(w, datasets, needs)
    assert sorted((x.task, x.field, x.rows) for x in loads) == [
        ("text_audio", "audio", 4), ("text_audio", "text", 8), ("vision_text", "text", 4),
        ("vision_text", "vision", 4)]
    assert all(x.seconds_per_sample > 0 for x in loads)
    # each field timed alone on the first samples; tasks the rank reads nothing of are not touched
    probed = datasets["text_audio"].reads
    assert sorted(probed) == sorted([(i, ("audio",)) for i in range(data_rate.PROBE_SAMPLES)]
                                    + [(i, ("text",)) for i in range(data_rate.PROBE_SAMPLES)])
    assert datasets["vision_depth"].reads == [] and datasets["audio_depth"].reads == []


def test_data_threads_are_the_workers_up_to_the_ranks_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(data_rate.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert [data_rate.data_threads(n) for n in (0, 1, 2, 4)] == [0, 1, 2, 2]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert data_rate.data_threads(4) == 4


@pytest.mark.parametrize("workers, predicted, behind", [(2, 0.5, True), (2, 10.0, False), (0, 1.5, True),
                                                        (0, 10.0, False)])
def test_the_line_says_when_the_data_holds_the_steps_back(monkeypatch, workers, predicted, behind):
    monkeypatch.setattr(data_rate, "data_threads", lambda n: n)
    loads = [FieldLoad("clip_audio", "audio", 100, 0.01), FieldLoad("clip_audio", "text", 100, 0.0001)]
    line = decode_report(3, loads, workers, predicted)  # 1.01 CPU-s
    assert line.startswith("data: decoding takes the busiest rank (3) 1.01 CPU-s per iteration "
                           "(clip_audio/audio 100 x 10.00 ms, clip_audio/text 100 x 0.10 ms)")
    assert ("about 0.51 s on its 2 data thread(s)" in line) == (workers == 2)
    assert ("inside the step (--num-workers 0)" in line) == (workers == 0)
    assert ("--store-decoded audio" in line) == behind, line


def test_one_process_is_its_own_busiest_rank():
    loads = [FieldLoad("t", "audio", 1, 0.5)]
    assert busiest_rank(loads) == (0, loads)
