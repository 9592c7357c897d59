"""The test machines have 2 cores shared with other jobs: one intra-op thread avoids oversubscription stalls
(a tiny matmul takes ~30 ms with 2 contended threads, <1 ms with one)."""

import torch

torch.set_num_threads(1)
