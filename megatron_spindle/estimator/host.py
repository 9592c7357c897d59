"""The host's launch floor: eager PyTorch spends host time on every op whatever its size (megatron-core's module
logic, Python, the dispatcher, the launch), so a layer whose kernels finish sooner waits for the host."""

from __future__ import annotations

from megatron_spindle.estimator.op_kernels import LayerTime
from megatron_spindle.graph.cluster import GPUSpec

# Host time per kernel the model counts. Measured on the runtime's own
# megatron-core layers at tiny shapes (benchmarks/host_floor.py) on shared Xeon VMs: 31-69 us per counted kernel
# over the seventh session's runs, 29.5-30.5 us over four quiet runs of the eighth; we keep 36 us (an encoder layer
# 1.0 ms forward + 0.7 ms backward), inside that range, as the VM is no GPU server's host. On CUDA
# benchmarks/gpu_validate.sh measures it again: on GPU hosts 39 / 60 us (two H200 runs) and 45 us (an H100) on the
# encoder layer, 64-65 us on the LLM layer, about 17-20 us per ATen operation on both. Kept at 36 us for now: one
# constant per counted kernel cannot fit both layer kinds, and real steps' layers take more than either
# (benchmarks/results/README.md, "Fortieth session").
HOST_SECONDS_PER_KERNEL = 36e-6
# The CPU device type (tests, planning for the gloo runtime) keeps the floor its placeholder numbers were set with,
# so that the tiny workloads' plans keep the shape of GPU plans (graph/cluster.py "CPU").
CPU_PLACEHOLDER_HOST_SECONDS_PER_KERNEL = 6e-6
# Host time of a counted forward kernel over that of a backward one. Megatron-core's Python runs in the forward,
# autograd's C++ engine runs the backward: the seventh session's snapshot measured the encoder layer 1.460 ms
# forward / 1.102 ms backward over the model's 17 / 39 kernels and the LLM layer 2.159 / 1.591 ms over 24 / 38,
# (3.619 ms / 41) / (2.693 ms / 77) = 2.52; four runs of the eighth session 2.66-2.70 (host_floor.txt). We take
# 2.6: the forward is then 53-62 % of a layer's host time, measured 57-59 %.
HOST_FORWARD_KERNEL_WEIGHT = 2.6


def host_seconds_per_kernel(gpu: GPUSpec) -> float:
    """The launch floor per counted kernel on ``gpu``: measured (GPU types) or the CPU type's placeholder."""
    return CPU_PLACEHOLDER_HOST_SECONDS_PER_KERNEL if gpu.arch == "cpu" else HOST_SECONDS_PER_KERNEL


def host_forward_kernel_weight(gpu: GPUSpec) -> float | None:
    """HOST_FORWARD_KERNEL_WEIGHT on GPU types; None on the CPU type, whose placeholder floor keeps the rule it was
    set with (``phase_times``): on a CPU the host and the kernels are one thread, there is no running ahead."""
    return None if gpu.arch == "cpu" else HOST_FORWARD_KERNEL_WEIGHT


def host_seconds(kernels: LayerTime, tp_allreduces: int, launch_seconds: float) -> float:
    """The host's time to issue one operator's kernels and TP all-reduces (per phase), forward + backward."""
    return (kernels.forward_kernels + kernels.backward_kernels + 2 * tp_allreduces) * launch_seconds


def host_phase_seconds(kernels: LayerTime, tp_allreduces: int, launch_seconds: float,
                       forward_weight: float) -> tuple[float, float]:
    """``host_seconds`` split into the forward's and the backward's (a forward kernel weighs ``forward_weight``
    backward ones)."""
    host = host_seconds(kernels, tp_allreduces, launch_seconds)
    forward = forward_weight * (kernels.forward_kernels + tp_allreduces)
    backward = kernels.backward_kernels + tp_allreduces
    share = forward / (forward + backward) if forward + backward > 0 else 0.0
    return host * share, host * (1.0 - share)


def phase_times(kernels: LayerTime, tp_allreduces: int, tp_allreduce_seconds: float, launch_seconds: float,
                forward_weight: float | None = HOST_FORWARD_KERNEL_WEIGHT) -> tuple[float, float]:
    """(forward, backward) seconds of one operator on one device: its kernels plus ``tp_allreduces`` TP
    all-reduces per phase on the stream, or the host's time to launch them where that is longer (the launch
    floor). The host issues the forward, then the backward, running ahead of the GPU where it can: the forward
    ends when both have done theirs, the backward when the GPU has run it and the host has issued all of it.
    ``forward_weight`` None (the CPU type): the larger of the two totals, split like the kernels' time."""
    tp = tp_allreduces * tp_allreduce_seconds
    gpu_forward, gpu_backward = kernels.forward + tp, kernels.backward + tp
    if forward_weight is None:
        host, gpu = host_seconds(kernels, tp_allreduces, launch_seconds), gpu_forward + gpu_backward
        if host <= gpu:
            return gpu_forward, gpu_backward
        return (gpu_forward * host / gpu, gpu_backward * host / gpu) if gpu > 0 else (host / 3, 2 * host / 3)
    host_forward, host_backward = host_phase_seconds(kernels, tp_allreduces, launch_seconds, forward_weight)
    forward = max(gpu_forward, host_forward)
    return forward, max(gpu_backward, host_forward + host_backward - forward)
