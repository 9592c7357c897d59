"""Executes a Plan on torch.distributed (gloo on CPU, NCCL on GPU): see engine.py.

- ``RuntimeEngine(plan, workload, rank, world_size, EngineConfig(...))``: ``train_step(step) -> {task: loss}``,
  ``forward_backward(step)``, ``grads`` (synchronised full gradients), ``full_state()`` / ``load_full_state()``;
- ``PlanGroups``: every process group of a plan, created once in the same order on all ranks (groups.py);
- ``TransferOp``: inter-wave activations / gradients by batched P2P (transfer.py);
- ``check_runnable``: the checks that run before any communication (layout.py);
- ``python -m megatron_spindle.runtime --plan plan.json --workload NAME --steps 3`` (__main__.py).
"""

from megatron_spindle.runtime.engine import EngineConfig, OptimizerConfig, RuntimeEngine
from megatron_spindle.runtime.groups import PlanGroups
from megatron_spindle.runtime.layout import check_runnable
from megatron_spindle.runtime.transfer import ActivationSpec, TransferOp, default_activation_spec

__all__ = ["ActivationSpec", "EngineConfig", "OptimizerConfig", "PlanGroups", "RuntimeEngine", "TransferOp",
           "check_runnable", "default_activation_spec"]
