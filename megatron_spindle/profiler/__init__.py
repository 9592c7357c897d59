"""Profiler: measure the per-operator time of every MetaOp at its (tp, dp) configs on the real devices.

The torch side of profiling; tools/profile_metaops.py drives it. What it measures is written in the format of
``estimator/profile.py`` (the pure-Python side that reads profiles: ``load_profile``, ``ProfiledCostModel``).

What one profiled point means (the same as the analytic model's ``LayerCost.total``): seconds of ONE operator of
the MetaOp, forward + backward, on n = tp * dp devices =

- **compute**: the median over repeats of forward + backward of ``min(L, layers)`` operators built with
  ``models.build_operator`` on a real TP group of tp ranks (TP all-reduces included), run on the per-rank
  shard B/dp of the batch (data parallelism is emulated: every DP rank does the same work), divided by the
  number of operators; device-synchronised on GPU;
- **+ dp_comm**: the DP all-reduce of one operator's fp32 gradients (this TP rank's shard) over dp ranks, and
  for a contrastive loss the all-gather of the embeddings. The all-reduce is timed on real dp groups when tp*dp
  ranks exist on links of the right kind (inside a node or across nodes, as the n devices would be on the
  cluster): source "measured"; otherwise the ring model with the all-reduce bandwidth measured here
  ("bandwidth"), or with the cluster's nominal links when there is one rank only ("nominal").

The optimizer step is measured too (``measure_optimizer``): torch.optim.AdamW, as the runtime engine runs it,
over one large fp32 tensor and over many tiny ones, on every rank at once, giving seconds per element and per
stepped tensor (the "optimizer" section of the profile).

MetaOps with the same (module, kind, input shape) are timed once and share the points. Configs the local world
cannot run (tp larger than the ranks of a node, or ``max_n``) are left out: the estimator fills them from the
analytic model (scaled to the measured level) and ``ProfileResult.unmeasured`` lists them.

Every rank walks the same MetaOps and configs in the same order (process groups are created collectively);
each measurement is max-reduced over the ranks so that all ranks agree on the numbers.

Modules: ``settings`` (how to measure), ``world`` (the ranks taking part), ``fingerprint`` (hardware, versions,
cache key), ``comm`` (links and DP communication), ``operators`` (operator and optimizer timing), ``run``
(``run_profile``: all of it, in order).
"""

from megatron_spindle.profiler.fingerprint import (
    cache_path,
    default_cache_dir,
    describe_hardware,
    profile_key,
    software_versions,
)
from megatron_spindle.profiler.run import (
    ProfileResult,
    group_metaops,
    profile_configs,
    run_profile,
)
from megatron_spindle.profiler.settings import ProfilerSettings, gpu_bandwidth_sizes
from megatron_spindle.profiler.world import ProfileWorld

__all__ = [
    "ProfileResult",
    "ProfileWorld",
    "ProfilerSettings",
    "cache_path",
    "default_cache_dir",
    "describe_hardware",
    "gpu_bandwidth_sizes",
    "group_metaops",
    "profile_configs",
    "profile_key",
    "run_profile",
    "software_versions",
]
