"""Test-wide set-up.

The Triton interpreter must be chosen before ``triton`` is imported anywhere, so on machines
without CUDA we switch it on here, first thing. Ops still run their PyTorch reference on CPU
tensors unless a test forces Triton (``notebookkit.kernels.runtime.use_triton(True)``).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        # one xdist worker runs the tests that hold tens of GiB, one after another (`--dist loadgroup`, the
        # Makefile's GPU halves): at -n 8 on an 80 GiB H100, several at once ran the card out of memory and took
        # the tests beside them down (session 38: 24 failures, all passing when run again at -n 3)
        for item in items:
            if "large_memory" in item.keywords:
                item.add_marker(pytest.mark.xdist_group("large_memory"))
        # the tests of a minute or more first (xdist hands tests out in this order), so that none is a half's tail
        # (session 47: 738 of half 1's 740 tests were done when its 215 s were up; its two vision memory rows, 60 s
        # each, were collected near the end)
        items.sort(key=lambda item: item.get_closest_marker("long") is None)
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _give_back_cached_gpu_memory(request):
    """After a GPU test, hand its cached blocks back to the driver. The suite's xdist workers share one card, and
    PyTorch's allocator otherwise keeps a test's peak reserved for the rest of the worker's life: at -n 8 on an
    80 GiB H100, workers holding 22 and 29 GiB of cache ran the tests beside them out of memory (session 46: 52
    failures)."""
    yield
    if _HAS_CUDA and "gpu" in request.keywords:
        torch.cuda.empty_cache()


@pytest.fixture
def one_thread():
    """Run a test with one intra-op thread: the tiny models' matmuls are small, and on a shared 2-core CI
    machine two threads mostly wait on each other (measured 7x slower under load)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
