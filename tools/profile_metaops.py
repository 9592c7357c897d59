#!/usr/bin/env python
"""Profile every MetaOp of a workload on the real devices and write a profile file for the planner.

Run under torchrun (one process per device) or as a single process:
    torchrun --nproc-per-node 8 tools/profile_metaops.py --workload clip-10 --num-gpus 16 --out clip10.profile.json
    python tools/profile_metaops.py --workload tiny-clip --num-gpus 4 --out tiny.profile.json      # CPU, one rank
    python tools/plan.py --workload clip-10 --num-gpus 16 --spindle-profile clip10.profile.json

--num-gpus/--cluster describe the TARGET cluster (which (tp, dp) configs are valid; default: this world).
Configs this world cannot run (tp above the ranks of a node) are left to the analytic model and listed.
Profiles are cached by (workload digest, hardware, versions, settings) under --profile-cache-dir and reused.
"""

import os
import sys
import time
from pathlib import Path

from megatron_spindle.arguments import (
    add_batch_args,
    add_cluster_args,
    add_workload_args,
    build_parser,
    cluster_from_args,
    workload_from_args,
)
from megatron_spindle.errors import exit_on_user_error
from megatron_spindle.fileio import check_output_file, write_bytes_atomic
from megatron_spindle.flags import add_flags, config_from_args
from megatron_spindle.profiler.settings import ProfilerSettings, gpu_bandwidth_sizes

PROFILE_PREFIX = "profile-"  # ProfilerSettings' flags: --profile-layers, --profile-repeats, ... (and --bf16)


def add_profile_args(parser):
    g = parser.add_argument_group("profiler")
    g.add_argument("--out", default=None, help="Write the profile JSON here (atomically).")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="Device to measure on (auto: CUDA when available).")
    add_flags(g, ProfilerSettings, prefix=PROFILE_PREFIX)
    g.add_argument("--profile-cache-dir", default=None,
                   help="Profile cache (default: $MEGATRON_SPINDLE_CACHE or ~/.cache/megatron-spindle).")
    g.add_argument("--no-profile-cache", action="store_true", help="Neither read nor write the cache.")
    g.add_argument("--force", action="store_true", help="Measure again even when the cache has this profile.")
    g.add_argument("--report-tflops", action="store_true",
                   help="Print achieved TFLOP/s per device of every measurement (analytic FLOPs / seconds).")
    return parser


def _device_kind(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available")
    return choice


def _default_gpu_type(device_kind: str) -> str:
    """The built-in node type of the devices here: CPU, or the CUDA device's name matched to a built-in."""
    import torch

    from megatron_spindle.graph.cluster import NODE_TYPES

    if device_kind == "cpu":
        return "CPU"
    name = torch.cuda.get_device_name().upper()
    for t in sorted(NODE_TYPES, key=len, reverse=True):
        if t.split("-")[0] in name:
            return t
    raise ValueError(f"CUDA device '{name}' matches no built-in GPU type; give --gpu-type or --cluster")


def settings_from_args(args, device_kind: str) -> ProfilerSettings:
    sizes = {"bandwidth_sizes": gpu_bandwidth_sizes()} if device_kind == "cuda" else {}
    return config_from_args(ProfilerSettings, args, prefix=PROFILE_PREFIX, **sizes)


def profile_summary(path, workload, cluster) -> str:
    """Per MetaOp: which curve the planner will use (profiled / analytic), measured and filled points, fit error."""
    from megatron_spindle.estimator import estimate_curves
    from megatron_spindle.estimator.profile import load_profile_points
    from megatron_spindle.graph.opgraph import build_metagraph

    points = load_profile_points(path, workload, cluster)
    curves = estimate_curves(build_metagraph(workload), workload, cluster, profile=points)
    lines = [f"  {'MetaOp':<34}{'curve':<10}{'measured':>9}{'analytic':>9}{'fit err':>9}  fastest (n: ms/op)"]
    for mid, c in curves.items():
        measured = sum(p.source == "profiled" for p in c.points.values())
        fastest = ", ".join(f"{n}:{p.seconds * 1e3:.3g}" for n, p in list(c.points.items())[:6])
        lines.append(f"  {mid:<34}{c.source:<10}{measured:>9}{len(c.points) - measured:>9}"
                     f"{100 * c.fit_error:>8.1f}%  {fastest}")
    return "\n".join(lines)


def tflops_table(measurements) -> str:
    lines = [f"  {'MetaOp':<34}{'tp':>3}{'dp':>4}{'ms/op (compute)':>17}{'GFLOP/op':>11}{'TFLOP/s/dev':>13}"]
    for m in measurements:
        lines.append(f"  {m.metaop:<34}{m.tp:>3}{m.dp:>4}{m.compute_seconds * 1e3:>17.3f}{m.flops / 1e9:>11.2f}"
                     f"{m.tflops_per_device:>13.3g}")
    return "\n".join(lines)


def main(argv=None, extra_args_provider=None):
    parser = build_parser(__doc__.strip().splitlines()[0],
                          [add_workload_args, add_batch_args, add_cluster_args, add_profile_args], extra_args_provider)
    parser.set_defaults(gpu_type=None)  # detected from the devices here (CPU, or the CUDA device's name)
    args = parser.parse_args(argv)
    if args.no_profile_cache and not args.out:
        parser.error("--no-profile-cache needs --out (the profile would be written nowhere)")
    with exit_on_user_error():
        if args.out:
            check_output_file(args.out, "--out")  # before anything is measured
        workload = workload_from_args(args)  # a bad one is one line, before megatron-core's import warnings
        from megatron_spindle.compat.cpu import apply_cpu_shim
        from megatron_spindle.estimator.profile import load_profile
        from megatron_spindle.profiler import (
            ProfileWorld,
            cache_path,
            default_cache_dir,
            describe_hardware,
            profile_key,
            run_profile,
            software_versions,
        )
        from megatron_spindle.profiler.run import measured_attention
        from megatron_spindle.runtime.distributed import destroy_distributed, init_distributed

        device_kind = _device_kind(args.device)
        ctx = init_distributed("nccl" if device_kind == "cuda" else "gloo")
        apply_cpu_shim()
        try:
            world = ProfileWorld.current(device_kind)
            if args.gpu_type is None:
                args.gpu_type = _default_gpu_type(device_kind)
            cluster = cluster_from_args(args, default_num_gpus=world.world_size)
            settings = measured_attention(settings_from_args(args, device_kind), world)  # the key names it
            say = (lambda msg: print(f"[profile] {msg}", flush=True)) if world.rank == 0 else (lambda msg: None)
            key = profile_key(workload, cluster, describe_hardware(world), software_versions(), settings)
            cached = None
            if not args.no_profile_cache:
                cached = cache_path(args.profile_cache_dir or default_cache_dir(), workload, key)
            hit = world.broadcast(bool(cached is not None and cached.exists() and not args.force))
            say(f"workload '{workload.name}' (digest {workload.digest()}) on a {cluster.num_devices}-device "
                f"{cluster.gpu.name} cluster; measuring on {world.world_size} {device_kind} rank(s); key {key}")
            t0 = time.perf_counter()
            if hit:
                say(f"cache hit: {cached} (not measured again; --force to re-measure)")
                source = cached
            else:
                result = run_profile(workload, cluster, settings, world, progress=say)
                source = None
                if world.rank == 0:
                    if cached is not None:
                        source = result.save(cached)
                        say(f"cached as {cached}")
                    elif args.out:
                        source = result.save(args.out)
                    say(f"measured {len(result.measurements)} configs in {result.seconds:.1f} s")
                    left = {m: c for m, c in result.unmeasured.items() if c}
                    if left:
                        say(f"{len(left)} MetaOps have configs left to the analytic model, e.g. "
                            + "; ".join(f"{m}: {c}" for m, c in list(left.items())[:3]))
            if world.rank == 0 and source is not None:
                if args.out and os.path.abspath(args.out) != os.path.abspath(source):
                    write_bytes_atomic(args.out, Path(source).read_bytes())
                print(profile_summary(source, workload, cluster))
                if args.report_tflops:
                    print(tflops_table(load_profile(source, workload, cluster).measurements))
                if args.out:
                    print(f"profile written to {args.out} ({time.perf_counter() - t0:.1f} s)")
            world.barrier()
        finally:
            destroy_distributed(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
