"""Property tests: plans for random workloads and clusters satisfy the plan invariants."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import workload_from_dict
from megatron_spindle.plan.schema import Plan
from megatron_spindle.plan.validate import validate_plan
from megatron_spindle.planner.pipeline import PlannerConfig, make_plan

HEADS = [2, 4, 8]


@st.composite
def workloads(draw):
    """Random contrastive towers and, sometimes, a generative task through a projector into a small LLM."""
    n_towers = draw(st.integers(2, 4))
    modules = {}
    for i in range(n_towers):
        heads = draw(st.sampled_from(HEADS))
        hidden = heads * draw(st.sampled_from([16, 32, 64]))
        modules[f"enc{i}"] = {"kind": "encoder", "num_layers": draw(st.integers(1, 12)), "hidden_size": hidden,
                              "num_heads": heads, "ffn_hidden_size": 4 * hidden, "embed_dim": 64,
                              # 8 x 8 patches + the class token: a task takes 65 tokens, or 17 (4 x 4, smaller images)
                              "frontend": {"type": "patch", "image_size": 64, "patch_size": 8, "in_channels": 3}}
    tasks = []
    n_tasks = draw(st.integers(1, 4))
    for t in range(n_tasks):
        a, b = draw(st.lists(st.integers(0, n_towers - 1), min_size=2, max_size=2, unique=True))
        tasks.append({"name": f"t{t}", "batch_size": draw(st.sampled_from([4, 6, 8, 16, 32])),
                      "tokens": {f"enc{a}": draw(st.sampled_from([17, 65])), f"enc{b}": 17},
                      "loss": {"kind": "contrastive", "modules": [f"enc{a}", f"enc{b}"]}})
    if draw(st.booleans()):
        src = f"enc{draw(st.integers(0, n_towers - 1))}"
        modules["proj"] = {"kind": "projector", "input_size": modules[src]["hidden_size"], "hidden_size": 256}
        modules["llm"] = {"kind": "llm", "num_layers": draw(st.integers(1, 8)), "hidden_size": 256,
                          "num_heads": 8, "num_query_groups": 4, "ffn_hidden_size": 688,
                          "frontend": {"type": "text", "vocab_size": 1000}}
        tasks.append({"name": "gen", "batch_size": draw(st.sampled_from([4, 8, 12])),
                      "tokens": {src: 17, "proj": 17, "llm": 17 + draw(st.integers(1, 32))},
                      "flows": [[src, "proj"], ["proj", "llm"]], "loss": {"kind": "lm", "module": "llm"}})
    return workload_from_dict({"name": "random", "modules": modules, "tasks": tasks})


clusters = st.builds(lambda nodes, per: make_cluster(nodes * per, per, "A800-80GB"),
                     st.integers(1, 4), st.sampled_from([1, 2, 4, 8]))


def check_invariants(plan: Plan, workload, cluster):
    # validate_plan checks: devices exist and are disjoint within a wave, every layer of every MetaOp runs exactly
    # once and in order, no slice starts before its producers end, predicted memory fits.
    validate_plan(plan, workload, cluster, build_metagraph(workload))
    for w in plan.waves:
        assert sum(len(s.devices) for s in w.slices) <= cluster.num_devices
    # C* is the relaxed optimum of the waves with a barrier between MetaLevels, solved to the bisection's relative
    # tolerance (allocator.bisect_level rel_eps): a plan of host-bound (flat) curves meets it exactly. Device
    # components that share no device and no hand-off keep their own clocks (plan/timeline.py), so the plan's span
    # may be shorter than the barrier schedule's, never longer
    assert barrier_span(plan) >= plan.predicted["c_star"] * (1 - 1e-6)
    assert plan.iteration_time <= barrier_span(plan) * (1 + 1e-12)
    assert Plan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()


def barrier_span(plan: Plan) -> float:
    """The waves' end with every wave a barrier across the cluster: what C* and CP-SAT's makespan measure."""
    return max((w.end for w in plan.waves), default=0.0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), clusters, st.sampled_from(["rate", "time"]), st.sampled_from(["spindle", "sequential"]))
def test_wavefront_plans_hold_the_invariants(workload, cluster, inverse, placement):
    plan = make_plan(workload, cluster, PlannerConfig(planner="wavefront", inverse=inverse, placement=placement))
    check_invariants(plan, workload, cluster)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), clusters)
def test_cpsat_plans_hold_the_invariants_and_never_lose_to_greedy(workload, cluster):
    greedy = make_plan(workload, cluster, PlannerConfig(planner="wavefront"))
    plan = make_plan(workload, cluster, PlannerConfig(planner="cpsat", solver_time_limit=1.0, solver_workers=1))
    check_invariants(plan, workload, cluster)
    assert barrier_span(plan) <= barrier_span(greedy) * (1 + 1e-6)
