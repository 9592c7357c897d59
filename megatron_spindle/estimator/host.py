"""The host's launch floor: eager PyTorch spends host time on every op whatever its size (megatron-core's module
logic, Python, the dispatcher, the launch), so a layer whose kernels finish sooner waits for the host."""

from __future__ import annotations

from megatron_spindle.estimator.op_kernels import LayerTime
from megatron_spindle.graph.cluster import GPUSpec

# Host time per kernel the model counts. Measured on the runtime's own
# megatron-core layers at tiny shapes (benchmarks/host_floor.py) on a shared 2.8 GHz Xeon VM: 31-69 us per counted
# kernel over runs (benchmarks/results/host_floor.txt: 53 us); we take the fastest runs' 36 us (an encoder layer
# 1.0 ms forward + 0.7 ms backward), as a shared machine's contention only adds. On CUDA benchmarks/gpu_validate.sh
# measures it again.
HOST_SECONDS_PER_KERNEL = 36e-6
# The CPU device type (tests, planning for the gloo runtime) keeps the floor its placeholder numbers were set with,
# so that the tiny workloads' plans keep the shape of GPU plans (graph/cluster.py "CPU").
CPU_PLACEHOLDER_HOST_SECONDS_PER_KERNEL = 6e-6


def host_seconds_per_kernel(gpu: GPUSpec) -> float:
    """The launch floor per counted kernel on ``gpu``: measured (GPU types) or the CPU type's placeholder."""
    return CPU_PLACEHOLDER_HOST_SECONDS_PER_KERNEL if gpu.arch == "cpu" else HOST_SECONDS_PER_KERNEL


def host_seconds(kernels: LayerTime, tp_allreduces: int, launch_seconds: float) -> float:
    """The host's time to issue one operator's kernels and TP all-reduces (per phase), forward + backward."""
    return (kernels.forward_kernels + kernels.backward_kernels + 2 * tp_allreduces) * launch_seconds


def phase_times(kernels: LayerTime, tp_allreduces: int, tp_allreduce_seconds: float,
                launch_seconds: float) -> tuple[float, float]:
    """(forward, backward) seconds of one operator on one device: its kernels plus ``tp_allreduces`` TP
    all-reduces per phase on the stream, or, when the host takes longer to launch them all (the launch floor),
    the host's time, split between the phases like the GPU work (the host runs ahead across the phases)."""
    tp = tp_allreduces * tp_allreduce_seconds
    forward, backward = kernels.forward + tp, kernels.backward + tp
    host = host_seconds(kernels, tp_allreduces, launch_seconds)
    gpu = forward + backward
    if host <= gpu:
        return forward, backward
    if gpu <= 0:
        return host / 3, 2 * host / 3
    return forward * host / gpu, backward * host / gpu
