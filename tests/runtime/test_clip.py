"""The step's gradient norm, clipping and the NaN check between the gradient sync and AdamW (runtime/clip.py), on
one process (no world: the norm needs no all-reduce)."""

import math

import pytest
import torch

from megatron_spindle.errors import USER_ERRORS
from megatron_spindle.runtime.clip import (
    GradClipper,
    NonFiniteStepError,
    StepStats,
    check_finite,
    prepare_step,
)


def _clipper(*grads):
    storage = [torch.tensor(g, dtype=torch.float32) for g in grads]
    return GradClipper(storage, storage, torch.device("cpu")), storage


def test_the_norm_is_measured_for_the_check_without_clipping():
    clipper, storage = _clipper([3.0, 4.0])
    assert prepare_step(clipper, 0.0, 1.0, None) == StepStats(None, 1.0, False)  # nothing asked for it
    assert prepare_step(clipper, 0.0, 1.0, None, measure=True) == StepStats(5.0, 1.0, False)
    assert storage[0].tolist() == [3.0, 4.0]  # measured, not clipped
    assert prepare_step(clipper, 1.0, 1.0, None).grad_norm == 5.0
    assert storage[0].tolist() == pytest.approx([0.6, 0.8], rel=1e-5)


def test_a_non_finite_loss_or_gradient_norm_stops_the_step():
    check_finite({"a": 1.0, "b": 2.0}, StepStats(3.0), 4, scaled=False)
    check_finite({"a": 1.0}, StepStats(None), 4, scaled=False)  # no norm measured: the losses alone
    with pytest.raises(NonFiniteStepError, match=r"^iteration 5: the loss of task\(s\) b is not finite; stopped "
                                                 r"before the optimizer step, the weights are those of iteration 4"):
        check_finite({"a": 1.0, "b": math.nan}, StepStats(3.0), 4, scaled=False)
    with pytest.raises(NonFiniteStepError, match=r"the loss of task\(s\) a, b and the gradient norm \(inf\) are not"):
        check_finite({"b": math.inf, "a": -math.inf}, StepStats(math.inf), 0, scaled=False)
    with pytest.raises(NonFiniteStepError, match=r"iteration 1: the gradient norm \(nan\) is not finite"):
        check_finite({"a": 1.0}, StepStats(math.nan), 0, scaled=False)
    # fp16: an overflowing gradient is the scaler's to skip
    check_finite({"a": 1.0}, StepStats(math.inf, 65536.0, True), 0, scaled=True)
    with pytest.raises(NonFiniteStepError) as e:
        check_finite({"a": math.nan}, StepStats(math.inf, 65536.0, True), 0, scaled=True)
    assert isinstance(e.value, USER_ERRORS) and e.value.spindle_on_every_rank  # one line, once per node


def test_zeros_are_counted_without_the_shards_padding():
    """--log-num-zeros-in-grad: a unit of 5 elements sharded over 2 members is 3 + 3 elements, the last one
    padding; the count leaves it out (``UnitShard.valid``), as it leaves out the units another rank counts."""
    from megatron_spindle.plan.schema import ParamGroup
    from megatron_spindle.runtime.clip import norm_tensors
    from megatron_spindle.runtime.shards import UnitShard

    shards = [UnitShard("u", ["u.w"], [torch.Size([5])], 2, i) for i in (0, 1)]
    assert [sh.size for sh in shards] == [3, 3] and [sh.valid for sh in shards] == [3, 2]
    second = torch.tensor([0.0, 7.0, 0.0])  # member 1's shard: elements 3 and 4, then the padding
    counted = norm_tensors({"u": second}, [ParamGroup([0, 1], ["u"])], 1, True, {"u": shards[1].valid})
    assert GradClipper([second], counted, torch.device("cpu")).zeros() == 1
    replicated = norm_tensors({"u": torch.zeros(5), "v": torch.zeros(2)}, [ParamGroup([0, 1], ["u"]),
                              ParamGroup([1], ["v"])], 1, False, {"u": 5, "v": 2})
    assert GradClipper([], replicated, torch.device("cpu")).zeros() == 2  # rank 1 owns v alone
