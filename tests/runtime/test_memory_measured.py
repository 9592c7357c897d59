"""Memory prediction = what the runtime allocates: the peak of the tensors autograd saves during a real
megatron-core step (runtime/activation_meter.py) against plan/memory.py's activation peak for the same plan,
under every memory option, in-process on one rank.

The memory model is built as the runtime runs on CPU: fp32 activations, megatron-core's unfused attention
(local spec). Target (issue 14): within 20 %; the model follows the saved tensors closely, so a larger
miss is a change in what megatron-core or our operators save."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import runtime_memory_model
from plans import early_backward, module_kinds, random_plan, recomputing, sequential_plan, with_settings

from megatron_spindle.compat.groups import ensure_torch_distributed
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import load_workload
from megatron_spindle.plan.memory import plan_breakdown
from megatron_spindle.plan.schema import Recompute, fitted_recompute
from megatron_spindle.runtime.activation_meter import SavedTensorMeter
from megatron_spindle.runtime.engine import EngineConfig, RuntimeEngine

TOLERANCE = 0.05  # the issue asks for 20 %


def options(plan, workload):
    """The plan under each memory option."""
    kinds = module_kinds(plan, workload)
    every = lambda rc: recomputing(plan, lambda i, s: rc)  # noqa: E731
    turns = (Recompute("selective"), Recompute("full", 1), Recompute("full"), Recompute(),
             Recompute("selective", modules=("layernorm",)))
    # MLP recomputation only where the layers' MLPs are bias-free (plan/schema.py fitted_recompute)
    modules = {f"selective-{'+'.join(m)}": recomputing(
        plan, lambda i, s, m=m: fitted_recompute(Recompute("selective", modules=m), kinds[s.metaop]))
        for m in (("layernorm",), ("mlp",), ("core_attn", "layernorm", "mlp"))}
    return {"none": plan, "selective": every(Recompute("selective")), **modules, "full": every(Recompute("full")),
            "block-1": every(Recompute("full", 1)), "uniform-2": every(Recompute("full", 2, "uniform")),
            "block-1+layernorm": every(Recompute("full", 1, modules=("layernorm",))),
            "mix": recomputing(plan, lambda i, s: turns[i % len(turns)]), "early": early_backward(plan)}


# (workload, modules frozen, plan): the frozen case is LLaVA's first stage (the vision tower saves nothing, the LLM
# between trainable projectors and its loss saves what its input gradients need, not its linears' inputs)
CASES = [("tiny-vlm", [], lambda w: sequential_plan(w, 1)), ("tiny-clip", [], lambda w: random_plan(w, 1, 3)),
         ("tiny-vlm", [], lambda w: random_plan(w, 1, 1, micro_batches=2)),
         ("tiny-vlm", ["vision", "llm"], lambda w: random_plan(w, 1, 2)),
         ("tiny-vlm", ["vis_proj", "aud_proj", "llm"], lambda w: sequential_plan(w, 1)),  # frozen projectors too
         # dropout keeps its masks (and unfused attention the dropped probabilities)
         ("tiny-vlm", [], lambda w: with_settings(sequential_plan(w, 1), hidden_dropout=0.1, attention_dropout=0.1)),
         ("tiny-clip", [], lambda w: with_settings(random_plan(w, 1, 3), attention_dropout=0.1)),
         ("tiny-vlm", ["vision", "llm"], lambda w: with_settings(random_plan(w, 1, 2), hidden_dropout=0.1))]


@pytest.mark.parametrize("wname,frozen,make", CASES,
                         ids=["tiny-vlm-sequential", "tiny-clip-spindle", "tiny-vlm-micro2", "tiny-vlm-frozen",
                              "tiny-vlm-frozen-projectors", "tiny-vlm-dropout", "tiny-clip-attention-dropout",
                              "tiny-vlm-frozen-hidden-dropout"])
def test_predicted_activation_peak_is_what_the_runtime_saves(wname, frozen, make):
    torch.set_num_threads(1)
    ensure_torch_distributed()
    w = load_workload(wname).frozen(frozen) if frozen else load_workload(wname)
    metaops = build_metagraph(w).metaops
    ratios = {}
    for label, plan in options(make(w), w).items():
        engine = RuntimeEngine(plan, w, 0, 1, EngineConfig(measure_activations=True))
        engine.forward_backward(0)
        measured = engine.activation_peak
        predicted = plan_breakdown(plan, metaops, runtime_memory_model(plan, w))[0][1]
        ratios[label] = predicted / measured
    print(f"{wname}: predicted / measured activation peak", {k: round(v, 4) for k, v in ratios.items()})
    for label, r in ratios.items():
        assert abs(r - 1) <= TOLERANCE, (wname, label, ratios)
    assert ratios  # every option ran


def test_the_meter_counts_a_storage_once_and_releases_it_with_the_graph():
    ensure_torch_distributed()
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorMeter([weight]) as meter:
        y = x @ weight  # saves x (and the weight: excluded)
        z = (y * y).sum()  # saves y (twice: one storage)
        assert meter.live == (4 * 8 + 4 * 8) * 4
        z.backward()
        assert meter.live == 0 and meter.peak == (4 * 8 + 4 * 8) * 4


def test_micro_batches_divide_the_measured_peak():
    """Two micro-batches hold half the activations at once (the prediction's micro_batch_metaop rule)."""
    torch.set_num_threads(1)
    ensure_torch_distributed()
    w = load_workload("tiny-clip")
    plan = sequential_plan(w, 1)
    peaks = {}
    for m in (1, 2):
        p = with_settings(plan, micro_batches=m) if m > 1 else dataclasses.replace(plan)
        engine = RuntimeEngine(p, w, 0, 1, EngineConfig(measure_activations=True))
        engine.forward_backward(0)
        peaks[m] = engine.activation_peak
    assert peaks[2] == pytest.approx(peaks[1] / 2, rel=0.02)
