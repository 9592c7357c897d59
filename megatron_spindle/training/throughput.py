"""--log-throughput: samples per second and model TFLOP/s per GPU, from the cost model's FLOP count.

Model FLOPs, as Megatron counts them: forward + backward (3x the forward's matmul FLOPs, ``FWD_BWD_FACTOR``) of
every operator of every task that takes part in the iteration, with no recomputation counted (the FLOPs the
model needs, not the ones the plan spends), divided by the measured time per iteration and the number of ranks.
A frozen module needs less (``AnalyticCostModel.flops``): 2x its forward where it passes input gradients on, 1x
where it runs no backward.
The per-operator forward FLOPs are the analytic cost model's (``AnalyticCostModel.forward_flops``: dense
GEMMs and attention of the layers, front ends, projectors, heads, contrastive similarities); validation
passes are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_spindle.estimator.cost_model import AnalyticCostModel
from megatron_spindle.graph.cluster import make_cluster
from megatron_spindle.graph.opgraph import build_metagraph
from megatron_spindle.graph.workload import Workload


def task_model_flops(workload: Workload) -> dict[str, float]:
    """task -> model FLOPs (forward + backward) of one iteration's batch of that task."""
    model = AnalyticCostModel(workload, make_cluster(1, gpu_type_name="CPU"))  # FLOPs do not depend on the GPU
    out = {t.name: 0.0 for t in workload.tasks}
    for m in build_metagraph(workload).metaops.values():
        out[m.task] += model.flops(m) * m.num_layers  # the model's config: no recomputation
    return out


@dataclass(frozen=True)
class Throughput:
    samples_per_second: float
    tflops_per_gpu: float  # model TFLOP/s per rank


class ThroughputMeter:
    """Sums the samples and model FLOPs of the iterations of a log interval (only the tasks that took part)."""

    def __init__(self, workload: Workload, world_size: int):
        self.flops = task_model_flops(workload)
        self.batch = {t.name: t.batch_size for t in workload.tasks}
        self.world_size = world_size
        self.reset()

    def reset(self) -> None:
        self.samples, self.total_flops = 0, 0.0

    def add(self, active: dict[str, bool]) -> None:
        for t, on in active.items():
            if on:
                self.samples += self.batch[t]
                self.total_flops += self.flops[t]

    def rate(self, seconds: float) -> Throughput:
        """Over the iterations added since ``reset`` that took ``seconds`` of training steps in all."""
        if seconds <= 0:
            return Throughput(0.0, 0.0)
        return Throughput(self.samples / seconds, self.total_flops / (seconds * self.world_size * 1e12))
