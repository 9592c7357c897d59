"""Fixtures shared by the test packages."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Single-threaded torch for the test: on a shared 2-core machine oversubscribed threads make runs very slow,
    and one thread gives in-process runs the reduction order of the launch scripts' OMP_NUM_THREADS=1 ranks."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
