"""Valid parallel configurations (tp, dp) of a MetaOp on a cluster.

Rules (the runtime builds megatron-core layers from these, so they mirror megatron-core's own asserts):

- dp divides the MetaOp's batch: DP rank k holds samples [k*B/dp, (k+1)*B/dp) and every rank gets the same
  number of samples (see plan/schema.py).
- tp divides the number of attention heads, the number of query groups (GQA) and the FFN width, so every TP
  rank holds whole heads, whole KV groups and an equal share of the MLP.
- tp stays inside a node: tp <= gpus_per_node and tp divides gpus_per_node. TP all-reduces sit on the critical
  path of every layer and need NVLink bandwidth; a divisor of the node size also lets TP groups tile a node.
- Light kinds (frontend, projector, head, lm_head, loss) and modules without layers use tp = 1 only. They are
  tiny ops (one or two matmuls, an embedding gather, a loss): splitting them over TP ranks adds all-reduces
  that cost more than the compute they save.
- n = tp * dp <= the number of devices in the cluster.
"""

from __future__ import annotations

from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.graph.cluster import ClusterSpec
from megatron_spindle.graph.opgraph import OP_KINDS, MetaOp
from megatron_spindle.graph.workload import Workload

# Operator kinds that always run with tp = 1 (see the module docstring for why).
LIGHT_KINDS = ("frontend", "projector", "head", "lm_head", "loss")


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def _check_metaop(metaop: MetaOp, workload: Workload) -> None:
    if metaop.kind not in OP_KINDS:
        raise EstimatorError(
            f"MetaOp '{metaop.id}': unknown kind '{metaop.kind}' (expected one of {OP_KINDS})"
        )
    if metaop.kind != "loss" and metaop.module not in workload.modules:
        raise EstimatorError(
            f"MetaOp '{metaop.id}': module '{metaop.module}' is not in workload '{workload.name}'"
        )
    if metaop.batch <= 0:
        raise EstimatorError(f"MetaOp '{metaop.id}': batch must be positive, got {metaop.batch}")


def valid_tp_degrees(metaop: MetaOp, workload: Workload, cluster: ClusterSpec) -> list[int]:
    """Tensor-parallel degrees the MetaOp can use, ascending."""
    _check_metaop(metaop, workload)
    if metaop.kind in LIGHT_KINDS:
        return [1]
    module = workload.modules[metaop.module]
    if not module.has_layers:
        return [1]
    return [
        tp
        for tp in _divisors(cluster.gpus_per_node)
        if module.num_heads % tp == 0 and module.query_groups % tp == 0 and module.ffn_hidden_size % tp == 0
    ]


def valid_configs(metaop: MetaOp, workload: Workload, cluster: ClusterSpec) -> list[tuple[int, int]]:
    """All (tp, dp) the MetaOp can run with, sorted by n = tp * dp, then tp."""
    tps = valid_tp_degrees(metaop, workload, cluster)  # validates the MetaOp first
    configs = [(tp, dp) for tp in tps for dp in _divisors(metaop.batch) if tp * dp <= cluster.num_devices]
    return sorted(configs, key=lambda c: (c[0] * c[1], c[0]))


def valid_ns(metaop: MetaOp, workload: Workload, cluster: ClusterSpec) -> list[int]:
    """Device counts n with at least one valid (tp, dp), ascending."""
    return sorted({tp * dp for tp, dp in valid_configs(metaop, workload, cluster)})
