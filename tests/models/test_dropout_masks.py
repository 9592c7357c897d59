"""models/dropout.py: a layer's dropout masks are a function of the draw position (seed, iteration, micro-batch)
and the layer's key (task, unit, data-parallel rank), and drawing them leaves the process's generator as it was."""

import pytest
import torch

from megatron_spindle.data.mock import mock_batch
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.models import ModelConfig, build_operator, metaop_infos
from megatron_spindle.models.dropout import draw_position, key_seed, set_micro_batch

DROPOUT = ModelConfig(hidden_dropout=0.3, attention_dropout=0.3)


class RankOnly:
    """A data-parallel group as the operator reads it: its rank."""

    def __init__(self, rank: int):
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2


@pytest.fixture(scope="module")
def vision():
    w = load_workload("tiny-clip")
    info = metaop_infos(w)["vision_text/vision"]
    x = torch.randn(2, 17, 64, generator=torch.Generator().manual_seed(0))
    return w, info, [x], mock_batch(w, "vision_text", 0)


def run(op, inputs, batch, seed=1, iteration=0, micro=0):
    with draw_position(seed, iteration):
        set_micro_batch(micro)
        return op(inputs, batch)


def test_masks_follow_the_position_and_the_layer_key(vision):
    w, info, x, batch = vision
    op = build_operator(w, info, 0, 2, config=DROPOUT)
    base = run(op, x, batch)
    assert torch.equal(base, run(op, x, batch)), "the same position draws the same masks"
    for other in (dict(seed=2), dict(iteration=1), dict(micro=1)):
        assert not torch.equal(base, run(op, x, batch, **other)), other
    shard = build_operator(w, info, 0, 2, dp_group=RankOnly(1), config=DROPOUT)
    assert not torch.equal(base, run(shard, x, batch)), "data-parallel ranks draw their own masks"
    # the second layer alone, fed the first's output, draws what it drew inside the two-layer operator
    first, second = (build_operator(w, info, a, a + 1, config=DROPOUT) for a in (0, 1))
    assert torch.equal(base, run(second, [run(first, x, batch)], batch))


def test_drawing_leaves_the_generator_alone(vision):
    w, info, x, batch = vision
    op = build_operator(w, info, 0, 2, config=DROPOUT)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    run(op, x, batch)
    assert torch.equal(before, torch.get_rng_state())


def test_eval_mode_runs_without_dropout(vision):
    w, info, x, batch = vision
    op = build_operator(w, info, 0, 2, config=DROPOUT)
    plain = build_operator(w, info, 0, 2)
    assert not torch.equal(run(op, x, batch), run(plain, x, batch))
    op.eval()
    assert torch.equal(run(op, x, batch), run(plain, x, batch))


def test_masks_have_the_probability(vision):
    """About p of the attention probabilities are dropped (the mask the attention's dropout module applies)."""
    w, info, x, batch = vision
    op = build_operator(w, info, 0, 1, config=ModelConfig(attention_dropout=0.25))
    dropped = []
    for m in op.modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_hook(lambda mod, inp, out: dropped.append(float((out == 0).float().mean())))
    run(op, x, batch)
    assert len(dropped) == 1 and abs(dropped[0] - 0.25) < 0.03, dropped


def test_key_seed_is_stable():
    assert key_seed(1, 0, 0, "t", "u.layers.0", 0) == key_seed(1, 0, 0, "t", "u.layers.0", 0)
    assert key_seed(1, 0, 0, "t", "u.layers.0", 0) != key_seed(1, 0, 0, "t", "u.layers.1", 0)
    assert 0 <= key_seed("x") < 2**63


def test_dropout_probability_is_checked():
    for bad in (1.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="hidden-dropout must be a probability in"):
            ModelConfig(hidden_dropout=bad)


def test_text_embeddings_drop_as_megatron_cores_do():
    """A text front end drops its embeddings' output with --hidden-dropout (LanguageModelEmbedding's dropout), its
    masks keyed as a layer's; image patches are not dropped."""
    w = load_workload("tiny-vlm")
    infos = metaop_infos(w)
    batch = mock_batch(w, "caption", 0)
    text = build_operator(w, infos["caption/llm.frontend"], 0, 1, config=ModelConfig(hidden_dropout=0.5))
    plain = build_operator(w, infos["caption/llm.frontend"], 0, 1)
    kept = run(plain, [], batch)
    dropped = run(text, [], batch)
    assert torch.equal(dropped, run(text, [], batch)) and not torch.equal(dropped, run(text, [], batch, iteration=1))
    zero = dropped == 0
    assert 0.4 < float(zero.float().mean()) < 0.6 and torch.allclose(dropped[~zero], 2 * kept[~zero])
    assert torch.equal(text.eval()(([]), batch), kept)
    patches = build_operator(w, infos["caption/vision.frontend"], 0, 1, config=ModelConfig(hidden_dropout=0.5))
    assert torch.equal(run(patches, [], batch), run(build_operator(w, infos["caption/vision.frontend"], 0, 1), [],
                                                     batch))
