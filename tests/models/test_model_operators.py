"""Single-process checks of the operators, the mock data and the reference model (TP=1, CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_spindle.data.mock import IGNORE_INDEX, mock_batch
from megatron_spindle.graph.workload import load_workload, workload_from_dict
from megatron_spindle.models import build_operator, metaop_infos
from megatron_spindle.models.losses import contrastive_loss, vocab_parallel_token_losses
from megatron_spindle.models.reference import ReferenceModel


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.fixture(scope="module")
def clip():
    return load_workload("tiny-clip")


@pytest.fixture(scope="module")
def vlm():
    return load_workload("tiny-vlm")


@pytest.fixture(scope="module")
def imu_workload():
    """An IMU tower and a text tower (not covered by the built-in workloads)."""
    return workload_from_dict({
        "name": "imu-text",
        "modules": {
            "imu": {"kind": "encoder", "num_layers": 2, "hidden_size": 32, "num_heads": 2, "ffn_hidden_size": 64,
                    "embed_dim": 16, "frontend": {"type": "imu", "patch_size": 5, "in_channels": 6}},
            "text": {"kind": "encoder", "num_layers": 1, "hidden_size": 32, "num_heads": 2, "ffn_hidden_size": 64,
                     "embed_dim": 16, "frontend": {"type": "text", "vocab_size": 50}},
        },
        "tasks": [{"name": "imu_text", "batch_size": 4, "tokens": {"imu": 10, "text": 6},
                   "loss": {"kind": "contrastive", "modules": ["imu", "text"], "temperature": 0.1}}],
    })


def run_chain(workload, infos, task, batch, ops=None):
    """Outputs of every MetaOp of ``task`` (full layer ranges), in the metagraph's level order."""
    outputs = {}
    ordered = sorted((i for i in infos.values() if i.task == task), key=lambda i: i.level)
    for info in ordered:
        op = (ops or {}).get(info.id) or build_operator(workload, info, 0, info.num_layers)
        outputs[info.id] = op([outputs[p] for p in info.preds], batch)
    return outputs


# ------------------------------------------------------------------------------------------------- mock data


def test_mock_batch_is_deterministic_and_shards_rows(vlm):
    a, b = mock_batch(vlm, "caption", 3, seed=1), mock_batch(vlm, "caption", 3, seed=1)
    c = mock_batch(vlm, "caption", 4, seed=1)
    assert torch.equal(a.inputs["vision"], b.inputs["vision"]) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.inputs["vision"], c.inputs["vision"])
    assert a.inputs["vision"].shape == (4, 3, 16, 16) and a.inputs["llm"].shape == (4, 8)
    # labels are the next text token
    assert torch.equal(a.labels[:, :-1], a.inputs["llm"][:, 1:])
    assert a.num_label_tokens == 4 * 8
    s = a.shard(1, 2)
    assert torch.equal(s.inputs["vision"], a.inputs["vision"][2:4]) and torch.equal(s.labels, a.labels[2:4])
    assert s.num_label_tokens == a.num_label_tokens and s.batch_size == 2
    with pytest.raises(ValueError):
        a.shard(0, 3)


# ------------------------------------------------------------------------------------------------- operators


def test_every_kind_runs_forward_backward(clip, vlm, imu_workload):
    """Every MetaOp kind (patch/audio/imu/text front ends, encoder and LLM layers, projector with pooling, pooled
    head, LM head, contrastive loss) runs forward and backward and gives every parameter a finite, nonzero grad."""
    seen = set()
    for w in (clip, vlm, imu_workload):
        infos = metaop_infos(w)
        for task in w.tasks:
            ops = {i.id: build_operator(w, i, 0, i.num_layers) for i in infos.values() if i.task == task.name}
            batch = mock_batch(w, task.name, 0)
            outs = run_chain(w, infos, task.name, batch, ops)
            loss = next(outs[i] for i in ops if infos[i].kind in ("loss", "lm_head"))
            assert loss.dim() == 0 and torch.isfinite(loss)
            loss.backward()
            for mid, op in ops.items():
                seen.add((infos[mid].kind, w.modules[infos[mid].module].frontend.type
                          if infos[mid].kind == "frontend" else ""))
                for name, p in op.full_named_parameters():
                    assert p.grad is not None and torch.isfinite(p.grad).all(), name
                    assert p.grad.abs().sum() > 0, name
    assert {k for k, _ in seen} == {"frontend", "layer", "projector", "head", "lm_head", "loss"}
    assert {f for k, f in seen if k == "frontend"} == {"patch", "audio", "imu", "text"}


def test_output_shapes_and_units(vlm):
    infos = metaop_infos(vlm)
    outs = run_chain(vlm, infos, "asr", mock_batch(vlm, "asr", 0))
    assert outs["asr/audio.frontend"].shape == (4, 16, 32)
    assert outs["asr/aud_proj"].shape == (4, 8, 64)  # pool 2: 16 -> 8 tokens
    assert outs["asr/llm"].shape == (4, 16, 64)  # 8 projected + 8 text tokens
    op = build_operator(vlm, infos["asr/llm"], 1, 3)
    assert op.units() == ["llm.layers.1", "llm.layers.2"]
    assert build_operator(vlm, infos["asr/llm.lm_head"], 0, 1).units() == ["llm.lm_head"]


@pytest.mark.parametrize("workload_name,metaop,split", [("tiny-clip", "vision_text/vision", 1),
                                                          ("tiny-clip", "vision_text/vision", 3),
                                                          ("tiny-vlm", "caption/llm", 2)])
def test_split_layer_ranges_equal_whole(workload_name, metaop, split):
    """Layers [0,k) then [k,L) chained give the same output and the same full gradients as [0,L)."""
    w = load_workload(workload_name)
    infos = metaop_infos(w)
    info = infos[metaop]
    task = info.task
    batch = mock_batch(w, task, 0)
    upstream = run_chain(w, infos, task, batch)
    inputs = [upstream[p].detach().requires_grad_() for p in info.preds]
    whole = build_operator(w, info, 0, info.num_layers)
    first, second = build_operator(w, info, 0, split), build_operator(w, info, split, info.num_layers)
    assert set(first.units()) | set(second.units()) == set(whole.units())
    probe = torch.randn(upstream[metaop].shape, generator=torch.Generator().manual_seed(0))
    out_whole = whole(inputs, batch)
    (out_whole * probe).sum().backward()
    grads_in_whole = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    out_split = second([first(inputs, batch)], batch)
    (out_split * probe).sum().backward()
    assert rel_err(out_split, out_whole) < 1e-6
    for gs, gw in zip([x.grad for x in inputs], grads_in_whole):
        assert rel_err(gs, gw) < 1e-5
    g_whole, g_split = whole.export_full_grads(), {**first.export_full_grads(), **second.export_full_grads()}
    assert g_whole.keys() == g_split.keys()
    for k in g_whole:
        assert rel_err(g_split[k], g_whole[k]) < 1e-5, k


def test_grad_contributions_at_tp1_are_the_gradients_themselves(vlm):
    """At TP 1 a rank's part of a gradient is all of it: the runtime adds the parameters' own ``.grad`` to its
    buffers, with no copy per tensor (host time in every backward wave on a GPU); a parameter without a gradient
    contributes zeros."""
    infos = metaop_infos(vlm)
    info = infos["caption/llm"]
    upstream = run_chain(vlm, infos, info.task, mock_batch(vlm, info.task, 0))
    op = build_operator(vlm, info, 0, info.num_layers)
    op([upstream[p].detach() for p in info.preds], mock_batch(vlm, info.task, 0)).float().sum().backward()
    params = dict(op.full_named_parameters())
    unused = next(iter(params))
    params[unused].grad = None
    parts = op.export_grad_contributions()
    assert parts.keys() == params.keys()
    assert all(parts[k] is p.grad for k, p in params.items() if k != unused)
    assert parts[unused].shape == params[unused].shape and not parts[unused].any()
    full = op.export_full_grads()
    assert all(torch.equal(parts[k], full[k]) for k in parts)


@pytest.mark.parametrize("metaop,modules", [("caption/llm", ("layernorm", "mlp")),
                                            ("caption/vision", ("core_attn", "layernorm"))])
def test_full_recomputation_of_some_layers_and_selective_of_the_others_is_two_blocks_and_exact(vlm, metaop, modules):
    """Full recomputation of the first layer, the others' modules rerun: megatron-core's own recomputation in
    two TransformerBlocks (one granularity each), same units, output and gradients as without recomputation."""
    from megatron_spindle.models import ModelConfig
    from megatron_spindle.plan.schema import Recompute

    infos = metaop_infos(vlm)
    info = infos[metaop]
    batch = mock_batch(vlm, info.task, 0)
    upstream = run_chain(vlm, infos, info.task, batch)
    rc = Recompute("full", 1, modules=modules)
    plain = build_operator(vlm, info, 0, info.num_layers)
    both = build_operator(vlm, info, 0, info.num_layers, config=ModelConfig(recompute=rc))
    flags = [(b.config.recompute_granularity, b.config.recompute_method, b.config.recompute_num_layers,
              tuple(b.config.recompute_modules) if b.config.recompute_granularity == "selective" else None,
              len(b.layers)) for b in both.blocks]
    assert flags == [("full", "block", 1, None, 1), ("selective", None, None, modules, info.num_layers - 1)]
    assert both.units() == plain.units()
    probe = torch.randn(upstream[metaop].shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for op in (plain, both):
        inputs = [upstream[p].detach().requires_grad_() for p in info.preds]
        out = op(inputs, batch)
        (out * probe).sum().backward()
        grads.append((out.detach(), [x.grad for x in inputs], op.export_full_grads()))
    (out_p, in_p, g_p), (out_b, in_b, g_b) = grads
    assert rel_err(out_b, out_p) < 1e-6
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(in_b, in_p))
    assert g_b.keys() == g_p.keys() and all(rel_err(g_b[k], g_p[k]) < 1e-5 for k in g_p)


def test_llm_first_layer_concatenates_flows_then_own_text(vlm):
    """inputs come in metaop.preds order (front end first here); the sequence is projector tokens then text."""
    infos = metaop_infos(vlm)
    info = infos["caption/llm"]
    assert info.preds == ["caption/llm.frontend", "caption/vis_proj"]
    batch = mock_batch(vlm, "caption", 0)
    up = run_chain(vlm, infos, "caption", batch)
    op = build_operator(vlm, info, 0, 1)
    fe, proj = up["caption/llm.frontend"], up["caption/vis_proj"]
    by_preds = op([fe, proj], batch)
    explicit = op([torch.cat([proj, fe], dim=1)], batch)
    wrong = op([torch.cat([fe, proj], dim=1)], batch)
    assert torch.equal(by_preds, explicit)
    assert rel_err(wrong, explicit) > 1e-2


def test_weights_are_deterministic_and_round_trip(vlm):
    infos = metaop_infos(vlm)
    a = build_operator(vlm, infos["caption/llm"], 0, 3)
    b = build_operator(vlm, infos["asr/llm"], 1, 3)  # another task, another range: same unit weights
    sa, sb = a.export_full_state(), b.export_full_state()
    assert set(sb) < set(sa)
    for k in sb:
        assert torch.equal(sa[k], sb[k]), k
    norms = [k for k in sa if k.endswith("layernorm.weight")]
    assert norms and all(torch.equal(sa[k], torch.ones_like(sa[k])) for k in norms)
    # round trip: load a perturbed state, export it back, and the operator computes with it
    perturbed = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in sa.items()}
    batch = mock_batch(vlm, "caption", 0)
    x = [torch.randn(4, 8, 64), torch.randn(4, 17, 64)]
    before = a(x, batch)
    a.load_full_state(perturbed)
    exported = a.export_full_state()
    assert exported.keys() == perturbed.keys()
    assert all(torch.equal(exported[k], perturbed[k]) for k in perturbed)
    assert not torch.allclose(a(x, batch), before)
    c = build_operator(vlm, infos["caption/llm"], 0, 3)
    c.load_full_state(exported)
    assert torch.equal(c(x, batch), a(x, batch))
    with pytest.raises(KeyError):
        c.load_full_state({k: v for k, v in exported.items() if "layers.0" not in k})


def test_lm_loss_matches_torch_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 11, generator=gen)
    target = torch.randint(0, 11, (5, 3), generator=gen)
    target[0, 1] = IGNORE_INDEX
    ours = vocab_parallel_token_losses(logits, target, None)
    ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), reduction="none",
                          ignore_index=IGNORE_INDEX).reshape(5, 3)
    assert rel_err(ours, ref) < 1e-6 and ours[0, 1] == 0


def test_contrastive_loss_is_symmetric_infonce():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    loss = contrastive_loss(a, b, 0.1)
    an, bn = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    logits = an @ bn.t() / 0.1
    by_hand = -0.5 * (torch.log_softmax(logits, 1).diagonal().mean() + torch.log_softmax(logits, 0).diagonal().mean())
    assert abs(float(loss - by_hand)) < 1e-5
    assert abs(float(loss - contrastive_loss(b, a, 0.1))) < 1e-6


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-vlm"])
def test_reference_model_losses_and_backward(name):
    w = load_workload(name)
    model = ReferenceModel(w)
    batches = {t.name: mock_batch(w, t.name, 0) for t in w.tasks}
    losses = model(batches)
    assert set(losses) == {t.name for t in w.tasks}
    assert all(torch.isfinite(v) and v > 0 for v in losses.values())
    if name == "tiny-vlm":  # untrained LM: close to log(vocab)
        assert all(abs(float(v) - torch.log(torch.tensor(256.0))) < 0.2 for v in losses.values())
    total = model.total_loss(losses)
    total.backward()
    grads = model.export_full_grads()
    state = model.export_full_state()
    assert grads.keys() == state.keys()
    assert sum(v.numel() for v in state.values()) == sum(p.numel() for p in model.parameters())
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    # shared units: the reference holds one tensor, whose gradient sums over the tasks that use it
    infos = metaop_infos(w)
    shared = next(u for u in model.units() if sum(u in i.params for i in infos.values()) > 1)
    assert any(k.startswith(shared + ".") for k in grads)
    # the reference starts from the same weights as any operator
    any_op = build_operator(w, next(i for i in infos.values() if shared in i.params), 0, 1)
    for k, v in any_op.export_full_state().items():
        assert torch.equal(v, state[k]), k
