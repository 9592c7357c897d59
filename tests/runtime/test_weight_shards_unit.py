"""ZeRO-3's gather unit (runtime/weight_shards.py ``GatherUnit``) in one process: its parameters' weights released
and gathered back exactly, by a fixed number of operations whatever its parameter count (a copy per parameter was
host time in every layer's forward and backward on a GPU)."""

import torch
import torch.distributed as dist
from script_loader import load_script

from megatron_spindle.compat.groups import ensure_torch_distributed
from megatron_spindle.runtime.weight_shards import GatherUnit

bench = load_script("benchmarks/host_ops.py")


def test_a_gather_restores_every_parameter_with_a_fixed_number_of_operations():
    ensure_torch_distributed()
    torch.manual_seed(0)
    counts = {}
    for n in (3, 30):
        params = [torch.nn.Parameter(torch.randn(5, 7 + i % 3, dtype=torch.bfloat16)) for i in range(n)]
        before = [p.detach().clone() for p in params]
        unit = GatherUnit(f"u{n}", params, dist.group.WORLD, members=1, index=0)
        unit.reshard()  # keeps this member's shard (the whole unit here) and releases the parameters' storage
        assert all(p.untyped_storage().nbytes() == 0 for p in params)
        counter = bench.OperationCounter()
        with counter:
            unit.gather()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        counts[n] = sum(v for k, v in counter.totals().items() if not k.endswith("views"))
    assert counts[30] == counts[3], counts
