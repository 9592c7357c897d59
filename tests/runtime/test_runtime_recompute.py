"""Activation recomputation: the plan's settings.recompute makes the runtime build recomputing operators,
and recomputation changes memory, never numbers."""

import dataclasses

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_spindle.compat.groups import ensure_torch_distributed
from megatron_spindle.data.mock import mock_batch
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.models import build_operator, metaop_infos
from megatron_spindle.models.config import ModelConfig
from megatron_spindle.plan.schema import Recompute
from megatron_spindle.planner.pipeline import PlannerConfig, make_plan
from megatron_spindle.runtime.engine import EngineConfig, RuntimeEngine


def recompute_flags(op) -> set:
    """recompute_granularity of every megatron-core TransformerConfig inside an operator."""
    return {m.config.recompute_granularity for m in op.modules()
            if isinstance(getattr(m, "config", None), TransformerConfig)}


def test_recomputing_operator_gives_identical_outputs_and_gradients_with_dropout():
    torch.set_num_threads(1)
    w = load_workload("tiny-vlm")
    info = metaop_infos(w)["caption/llm"]
    batch = mock_batch(w, "caption", 0)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(4, 17, 64, generator=gen), torch.randn(4, 8, 64, generator=gen)]
    results = {}
    for recompute in (False, True):
        op = build_operator(w, info, 0, 3, config=ModelConfig(recompute=recompute, hidden_dropout=0.1))
        assert recompute_flags(op) == {"full" if recompute else None}
        xs = [x.clone().requires_grad_() for x in inputs]
        torch.manual_seed(5)  # dropout draws from the CPU generator; recomputation must replay the same masks
        out = op(xs, batch)
        out.float().pow(2).mean().backward()
        results[recompute] = (out.detach(), op.export_full_grads(), xs[0].grad)
    (out_a, grads_a, xg_a), (out_b, grads_b, xg_b) = results[False], results[True]
    assert torch.equal(out_a, out_b) and torch.equal(xg_a, xg_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


def test_engine_follows_the_plans_recompute_setting():
    torch.set_num_threads(1)
    ensure_torch_distributed()  # HashStore world: no MASTER_PORT leaks into later tests (launch scripts read it)
    w = load_workload("tiny-clip")
    plan = make_plan(w, make_cluster(1, 1, "CPU"), PlannerConfig(planner="wavefront"))
    assert plan.settings.recompute == Recompute("none")
    recomputing = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, recompute=Recompute("full")))
    losses = {}
    for name, p in (("plain", plan), ("recompute", recomputing)):
        engine = RuntimeEngine(p, w, 0, 1, EngineConfig())
        flags = set().union(*(recompute_flags(ls.op) for ls in engine.local.values() if ls.slice.kind == "layer"))
        assert flags == ({"full"} if name == "recompute" else {None})
        losses[name] = [engine.train_step(step) for step in range(2)]
    assert losses["plain"][0] == losses["recompute"][0]  # the same operators on the same weights
    for plain, recomputed in zip(losses["plain"], losses["recompute"]):  # after an update: fp32 rounding only
        assert recomputed == pytest.approx(plain, rel=1e-6)
