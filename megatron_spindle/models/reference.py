"""Single-process reference: every MetaOp of every task at TP=1 on one process, with shared weights tied.

The runtime's equivalence tests compare against it: per-task losses, every parameter's gradient (full tensors,
``export_full_grads``) and parameters after optimizer steps (``export_full_state``). It is built from the same
operators as the runtime, so names, initial weights and numerics match by construction.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_spindle.data.mock import TaskBatch
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import Workload
from megatron_spindle.models.config import ModelConfig
from megatron_spindle.models.dropout import set_micro_batch
from megatron_spindle.models.operator import SliceOperator, build_operator, metaop_infos

LOSS_KINDS = ("loss", "lm_head")


def _module_key(metaop_id: str) -> str:
    return metaop_id.replace(".", "__")  # ModuleDict keys cannot contain "."


class ReferenceModel(nn.Module):
    def __init__(self, workload: Workload, config: ModelConfig | None = None):
        super().__init__()
        self.workload = workload
        self.infos = metaop_infos(workload)
        graph = build_metagraph(workload)
        self.order = [mid for level in graph.levels for mid in level]
        self.operators = nn.ModuleDict({
            _module_key(mid): build_operator(workload, self.infos[mid], 0, self.infos[mid].num_layers, config=config)
            for mid in self.order
        })
        self._tie_shared_parameters()

    def operator(self, metaop_id: str) -> SliceOperator:
        return self.operators[_module_key(metaop_id)]

    def _tie_shared_parameters(self) -> None:
        """MetaOps that share a parameter unit use one Parameter object (gradients of all tasks accumulate)."""
        canonical: dict[str, nn.Parameter] = {}
        for mid in self.order:
            for unit, module in self.operator(mid).unit_modules().items():
                for path, param in list(module.named_parameters()):
                    name = f"{unit}.{path}"
                    if name not in canonical:
                        canonical[name] = param
                        continue
                    owner_path, _, leaf = path.rpartition(".")
                    owner = module.get_submodule(owner_path) if owner_path else module
                    setattr(owner, leaf, canonical[name])

    def units(self) -> list[str]:
        return sorted({u for mid in self.order for u in self.operator(mid).units()})

    def full_named_parameters(self) -> dict[str, nn.Parameter]:
        out: dict[str, nn.Parameter] = {}
        for mid in self.order:
            for name, p in self.operator(mid).full_named_parameters():
                out.setdefault(name, p)
        return out

    def export_full_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.full_named_parameters().items()}

    def export_full_grads(self) -> dict[str, torch.Tensor]:
        return {
            name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for name, p in self.full_named_parameters().items()
        }

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, p in self.full_named_parameters().items():
            p.copy_(state[name].to(p.dtype))

    def forward_task(self, batch: TaskBatch) -> torch.Tensor:
        """Run every MetaOp of ``batch.task`` in dependency order; return the task loss."""
        outputs: dict[str, torch.Tensor] = {}
        loss = None
        for mid in self.order:
            info = self.infos[mid]
            if info.task != batch.task:
                continue
            outputs[mid] = self.operator(mid)([outputs[p] for p in info.preds], batch)
            if info.kind in LOSS_KINDS:
                loss = outputs[mid]
        if loss is None:
            raise ValueError(f"task '{batch.task}' has no loss")
        return loss

    def forward(self, batches: dict[str, TaskBatch], micro_batches: int = 1) -> dict[str, torch.Tensor]:
        """Per-task losses (each the mean over that task's global batch) for the tasks in ``batches``; with
        ``micro_batches`` m, the sum of the m micro-batches' shares (``TaskBatch.micro``), as a plan with m
        micro-batches trains."""
        if micro_batches == 1:
            set_micro_batch(0)
            return {task: self.forward_task(batch) for task, batch in batches.items()}
        return {task: sum(self._micro_forward(batch, j, micro_batches) for j in range(micro_batches))
                for task, batch in batches.items()}

    def _micro_forward(self, batch: TaskBatch, index: int, micro_batches: int) -> torch.Tensor:
        set_micro_batch(index)  # its dropout masks (models/dropout.py), as the runtime draws them
        return self.forward_task(batch.micro(index, micro_batches))

    def total_loss(self, losses: dict[str, torch.Tensor]) -> torch.Tensor:
        """sum over tasks of ``loss.weight * task loss``: what one training iteration backpropagates."""
        return sum(self.workload.task(t).loss.weight * loss for t, loss in losses.items())
