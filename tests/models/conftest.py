"""Model-layer tests: one intra-op thread.

The tiny models' matmuls are small; on a shared 2-core CI machine two intra-op threads mostly
wait on each other (measured 7x slower under load), so these tests run single-threaded.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
