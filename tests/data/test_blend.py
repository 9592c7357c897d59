"""Blends of a task's datasets (--data-path TASK=WEIGHT:PATH): the sampler draws each batch from the parts in
their proportions, each part in its own epochs, and resumes exactly; --split splits part by part; validation
and test batches interleave the parts."""

import threading

import pytest
import torch

from megatron_spindle.data.datasets import ConcatTaskDataset, InterleavedTaskDataset, MockTaskDataset
from megatron_spindle.data.sampler import Blend, MultiTaskSampler
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.training.evaluate import split_dataset

SIZES, WEIGHTS = (30, 7, 100), (5.0, 3.0, 2.0)


def _sampler(weights=WEIGHTS, sizes=SIZES, seed=4):
    return MultiTaskSampler({"t": sum(sizes), "u": 9}, {"t": 10, "u": 3}, seed,
                            blends={"t": Blend.of(sizes, weights)})


def _part(i: int, sizes=SIZES) -> int:
    return next(k for k in range(len(sizes)) if i < sum(sizes[:k + 1]))


def test_every_prefix_holds_each_part_within_one_sample_of_its_share_and_parts_walk_their_epochs():
    sampler = _sampler()
    drawn = [i for _ in range(60) for i in sampler.next().indices["t"]]
    assert all(0 <= i < sum(SIZES) for i in drawn)
    share = [w / sum(WEIGHTS) for w in WEIGHTS]
    taken = [0, 0, 0]
    for s, i in enumerate(drawn, 1):
        taken[_part(i)] += 1
        assert all(abs(taken[k] - share[k] * s) < 1 for k in range(3)), (s, taken)
    for k, n in enumerate(SIZES):  # each epoch of a part visits its samples once, in an order of its own
        mine = [i for i in drawn if _part(i) == k]
        epochs = [sorted(mine[e * n:(e + 1) * n]) for e in range(len(mine) // n)]
        assert epochs and all(e == list(range(sum(SIZES[:k]), sum(SIZES[:k + 1]))) for e in epochs), k
    assert len({tuple(mine[:5]) for mine in [[i for i in drawn if _part(i) == 1][e * 7:e * 7 + 5]
                                            for e in range(4)]}) > 1  # reshuffled per epoch


def test_a_blend_resumes_exactly_and_its_position_names_its_parts():
    a = _sampler()
    for _ in range(7):
        a.next()
    state = a.state_dict()
    parts = state["tasks"]["t"]["parts"]
    assert [p["size"] for p in parts] == list(SIZES) and sum(p["epoch"] * p["size"] + p["offset"] for p in parts) == 70
    assert [p["weight"] for p in parts] == pytest.approx([0.5, 0.3, 0.2])
    b = _sampler()
    b.load_state_dict(state)
    assert [a.next().indices for _ in range(5)] == [b.next().indices for _ in range(5)]
    c = _sampler(weights=(1.0, 1.0, 1.0))  # new weights from the same parts' places
    c.load_state_dict(state)
    assert c.state_dict()["tasks"]["t"]["parts"][0]["offset"] == parts[0]["offset"]
    with pytest.raises(ValueError, match=r"for a blend of parts of \[30, 7, 100\] samples, this run reads a blend "
                                         r"of parts of \[30, 8, 99\] samples"):
        _sampler(sizes=(30, 8, 99)).load_state_dict(state)
    d = _sampler()  # a converted checkpoint's position (tools/checkpoint): every task at its beginning
    d.load_state_dict({"iteration": 0, "tasks": {"t": {"epoch": 0, "offset": 0}, "u": {"epoch": 0, "offset": 0}}})
    assert d.next().indices == _sampler().next().indices
    with pytest.raises(ValueError, match="this run reads one dataset"):
        MultiTaskSampler({"t": 137, "u": 9}, {"t": 10, "u": 3}, 4).load_state_dict(state)


def test_blend_checks():
    with pytest.raises(ValueError, match="at least two parts"):
        Blend.of([5], [1.0])
    with pytest.raises(ValueError, match="must be > 0"):
        Blend.of([5, 6], [1.0, 0.0])
    with pytest.raises(ValueError, match="its blend's parts hold 11 samples, its dataset 12"):
        MultiTaskSampler({"t": 12}, {"t": 2}, blends={"t": Blend.of([5, 6], [1, 1])})


def _blend(w, task="vision_text"):
    parts = [MockTaskDataset(w, task, n, seed) for n, seed in ((12, 1), (8, 2))]
    return ConcatTaskDataset(parts, [3.0, 1.0])


def test_split_keeps_a_blend_and_evaluation_interleaves_its_parts():
    w = load_workload("tiny-clip")
    blend = _blend(w)
    train, valid, test = split_dataset(blend, (2.0, 1.0, 1.0), "2,1,1", "vision_text")
    assert [len(p) for p in train.parts] == [6, 4] and train.blend.weights == pytest.approx((0.75, 0.25))
    assert [len(p) for p in valid.parts] == [3, 2] and [len(p) for p in test.parts] == [3, 2]
    assert valid.parts[1].lo == 4 and valid.parts[1].dataset is blend.parts[1]  # each part's own range
    assert split_dataset(blend, (9.0, 1.0, 0.0), "9,1", "vision_text")[2] is None  # no test share
    # an evaluation batch holds the mix: parts 3:1, each part's samples in order
    inter = InterleavedTaskDataset(blend)
    order = [inter._index(i) for i in range(8)]
    assert order == [0, 1, 12, 2, 3, 4, 13, 5]
    threads = [threading.Thread(target=lambda: [inter.get(i) for i in range(20)]) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert inter._order[:8] == order and len(inter._order) == 20
    assert torch.equal(inter.get(2)["vision"], blend.parts[1].get(0)["vision"])
