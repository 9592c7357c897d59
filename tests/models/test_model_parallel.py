"""One spawned 2-process gloo run: tensor-parallel operators equal TP=1, with and without sequence parallelism,
and data-parallel losses equal the single-process loss (values and gradients)."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def assert_close(a, b, what):
    err = rel_err(a, b)
    assert err < TOL, f"{what}: relative error {err:.3g} >= {TOL}"


def _seeded(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _run(op, inputs, batch, probe_seed):
    """Forward on leaf copies of ``inputs``; backward of the output (scalar) or of <output, probe>."""
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = op(leaves, batch)
    (out if out.dim() == 0 else (out * _seeded(out.shape, probe_seed)).sum()).backward()
    return out.detach(), [x.grad for x in leaves]


def _assert_same_results(single, split, inputs, batch, what: str) -> None:
    """The TP=1 and the split operator give the same output, input gradients and full weight gradients."""
    out1, gin1 = _run(single, inputs, batch, 7)
    out2, gin2 = _run(split, inputs, batch, 7)
    assert_close(out2, out1, f"{what} output")
    for a, b in zip(gin2, gin1):
        assert_close(a, b, f"{what} input grad")
    g1, g2 = single.export_full_grads(), split.export_full_grads()
    for k in g1:
        assert_close(g2[k], g1[k], f"{what} grad {k}")
    # what the runtime adds to its gradient buffers instead, each TP rank its part: summed over TP, the full ones
    parts = split.export_grad_contributions()
    assert list(parts) == list(g2), what
    for k, part in parts.items():
        summed = part.clone()  # the parts are read-only: the gradients themselves, or zeros made once
        dist.all_reduce(summed, group=split.tp_group)
        assert torch.equal(summed, g2[k]), f"{what} grad contributions of {k}"
    # a replicated parameter's part on a TP rank other than the leader: the same zeros every step, not a new tensor
    again = split.export_grad_contributions()
    params = dict(split.full_named_parameters())
    replicated = [k for k, p in params.items() if not getattr(p, "tensor_model_parallel", False)
                  and not getattr(p, "sequence_parallel", False)]
    if split.tp_rank != 0:
        for k in replicated:
            assert again[k] is parts[k] and not again[k].any(), f"{what} zero contribution of {k}"


def _check_tensor_parallel(rank):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_spindle.data.mock import mock_batch
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.models import build_operator, metaop_infos

    pgs = ProcessGroupCollection()
    pgs.tp = dist.new_group([0, 1])
    clip, vlm = load_workload("tiny-clip"), load_workload("tiny-vlm")
    cases = [  # (workload, metaop, layer range, input shapes)
        (clip, "vision_text/vision", (1, 3), [(4, 17, 64)]),  # encoder tower range, 4 heads
        (vlm, "caption/llm", (0, 3), [(4, 8, 64), (4, 17, 64)]),  # LLM with GQA (4 heads, 2 groups), concat inputs
        (vlm, "caption/llm.lm_head", (0, 1), [(4, 25, 64)]),  # vocab-parallel output layer + LM loss
        (vlm, "caption/vis_proj", (0, 1), [(4, 17, 48)]),  # projector MLP (column + row parallel)
        (vlm, "caption/llm.frontend", (0, 1), []),  # vocab-parallel word embedding
    ]
    for i, (w, mid, (lo, hi), shapes) in enumerate(cases):
        info = metaop_infos(w)[mid]
        batch = mock_batch(w, info.task, 0)
        inputs = [_seeded(s, 100 * i + j) for j, s in enumerate(shapes)]
        single = build_operator(w, info, lo, hi)
        split = build_operator(w, info, lo, hi, pg_collection=pgs)
        assert split.tp_size == 2 and single.tp_size == 1
        full_single, full_split = single.export_full_state(), split.export_full_state()
        assert full_single.keys() == full_split.keys()
        for k in full_single:
            assert torch.equal(full_single[k], full_split[k]), f"{mid}: initial {k} differs between TP layouts"
        _assert_same_results(single, split, inputs, batch, mid)
        sharded = [n for n, p in split.full_named_parameters() if getattr(p, "tensor_model_parallel", False)]
        assert sharded, f"{mid}: no tensor-parallel parameter was exercised"
    _check_sequence_parallel(pgs)


def _check_sequence_parallel(pgs):
    """Layer slices with megatron's sequence parallelism on 2 TP ranks equal TP=1: an encoder (its LayerNorms'
    and row-parallel biases' gradients summed over the TP group), and an LLM of 25 tokens, padded to 26 at the end
    (causal), without and with megatron-core's recomputation (the pre-norms' selective one among it). A
    bidirectional module whose sequence does not divide by TP is refused with its numbers."""
    from megatron_spindle.data.mock import mock_batch
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.models import ModelConfig, build_operator, metaop_infos
    from megatron_spindle.plan.schema import Recompute

    clip, vlm = load_workload("tiny-clip"), load_workload("tiny-vlm")
    on = ModelConfig(sequence_parallel=True)
    cases = [(clip, "vision_text/vision", (1, 3), [(4, 16, 64)], on),
             (vlm, "caption/llm", (0, 3), [(4, 8, 64), (4, 17, 64)], on),
             (vlm, "caption/llm", (0, 3), [(4, 8, 64), (4, 17, 64)],
              ModelConfig(sequence_parallel=True, recompute=Recompute("full", 1, modules=("layernorm",))))]
    for i, (w, mid, (lo, hi), shapes, cfg) in enumerate(cases):
        info = metaop_infos(w)[mid]
        batch = mock_batch(w, info.task, 0)
        inputs = [_seeded(s, 50 + 10 * i + j) for j, s in enumerate(shapes)]
        single = build_operator(w, info, lo, hi, config=dataclasses.replace(cfg, sequence_parallel=False))
        split = build_operator(w, info, lo, hi, pg_collection=pgs, config=cfg)
        assert split.sequence_parallel and not single.sequence_parallel
        marked = [n for n, p in split.full_named_parameters() if getattr(p, "sequence_parallel", False)]
        assert any("layernorm" in n for n in marked), f"{mid}: no norm is marked sequence-parallel"
        _assert_same_results(single, split, inputs, batch, f"{mid} sequence-parallel")
    info = metaop_infos(clip)["vision_text/vision"]
    odd = build_operator(clip, info, 1, 3, pg_collection=pgs, config=on)
    with pytest.raises(ValueError, match="divisible by 2 in a bidirectional module, got 17 tokens"):
        odd([_seeded((4, 17, 64), 0)], mock_batch(clip, info.task, 0))


def _check_data_parallel(rank):
    from megatron_spindle.data.mock import mock_batch
    from megatron_spindle.graph.workload import load_workload
    from megatron_spindle.models import build_operator, metaop_infos

    dp_group = dist.new_group([0, 1])
    dp = 2

    def grads_summed_over_dp(op):
        out = {}
        for k, g in op.export_full_grads().items():
            dist.all_reduce(g, group=dp_group)
            out[k] = g
        return out

    # contrastive: two pooled heads on this rank's rows, InfoNCE over the DP-gathered batch
    clip = load_workload("tiny-clip")
    infos = metaop_infos(clip)
    full = mock_batch(clip, "vision_text", 0)
    shard = full.shard(rank, dp)
    hv, ht = _seeded((4, 17, 64), 1), _seeded((4, 12, 32), 2)
    rows = slice(rank * 2, rank * 2 + 2)
    head_ids, loss_id = ["vision_text/vision.head", "vision_text/text.head"], "vision_text/loss"
    assert infos[loss_id].preds == head_ids

    def contrastive(hidden, batch, group):
        heads = [build_operator(clip, infos[h], 0, 1) for h in head_ids]
        leaves = [x.clone().requires_grad_() for x in hidden]
        embs = [op([x], batch) for op, x in zip(heads, leaves)]
        loss = build_operator(clip, infos[loss_id], 0, 1, dp_group=group)(embs, batch)
        loss.backward()
        return loss.detach(), heads, [x.grad for x in leaves]

    ref_loss, ref_heads, ref_gin = contrastive([hv, ht], full, None)
    share, heads, gin = contrastive([hv[rows], ht[rows]], shard, dp_group)
    total = share.clone()
    dist.all_reduce(total, group=dp_group)
    assert_close(total, ref_loss, "DP contrastive loss (sum of shares)")
    assert_close(share * dp, ref_loss, "DP contrastive loss on each rank")
    for a, b in zip(gin, ref_gin):
        assert_close(a, b[rows], "DP contrastive input grad")
    for op, ref in zip(heads, ref_heads):
        ref_grads = ref.export_full_grads()
        for k, g in grads_summed_over_dp(op).items():
            assert_close(g, ref_grads[k], f"DP contrastive grad {k}")

    # LM loss: this shard's token sum over the global token count; shares sum to the global mean
    vlm = load_workload("tiny-vlm")
    info = metaop_infos(vlm)["caption/llm.lm_head"]
    full = mock_batch(vlm, "caption", 0)
    hidden = _seeded((4, 25, 64), 3)
    ref = build_operator(vlm, info, 0, 1)
    ref_loss, _ = _run(ref, [hidden], full, 0)
    op = build_operator(vlm, info, 0, 1)
    share, _ = _run(op, [hidden[rows]], full.shard(rank, dp), 0)
    total = share.clone()
    dist.all_reduce(total, group=dp_group)
    assert_close(total, ref_loss, "DP LM loss (sum of shares)")
    ref_grads = ref.export_full_grads()
    for k, g in grads_summed_over_dp(op).items():
        assert_close(g, ref_grads[k], f"DP LM grad {k}")


def _worker(rank, world_size, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        _check_tensor_parallel(rank)
        _check_data_parallel(rank)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiproc
def test_tensor_and_data_parallel_match_single_process():
    mp.start_processes(_worker, args=(2, _free_port()), nprocs=2, join=True, start_method="spawn")
