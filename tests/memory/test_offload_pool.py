"""The host buffer pool: reuse across steps, no growth, clear errors before host RAM runs out."""

import pytest
import torch

from notebookkit.memory import HostMemoryError, PinnedBufferPool

MiB = 2**20


def _step(pool, layers, tokens, hidden=256, dtype=torch.float16):
    views = []
    for i in range(layers):
        v = pool.acquire((tokens, hidden), dtype)
        v.fill_(i)
        views.append(v)
    for i, v in enumerate(views):
        assert torch.all(v == i)  # buffers in use never alias each other
    for v in reversed(views):
        pool.release(v)


def test_buffers_are_reused_across_steps_without_growth():
    pool = PinnedBufferPool(pin=False, granularity=MiB)
    _step(pool, layers=4, tokens=1024)
    held, allocs = pool.held_bytes, pool.allocations
    for _ in range(5):
        _step(pool, layers=4, tokens=1024)
    assert pool.held_bytes == held and pool.allocations == allocs == 4
    # shorter sequences fit in the same buffers
    _step(pool, layers=4, tokens=700)
    assert pool.allocations == 4 and pool.in_use_bytes == 0


def test_longer_sequences_replace_small_buffers_instead_of_piling_up():
    pool = PinnedBufferPool(pin=False, granularity=MiB)
    for tokens in (1024, 4096, 2048, 8192, 1024, 8192):
        _step(pool, layers=3, tokens=tokens)
    # never more than the layers in flight times the largest request (rounded to the granularity)
    assert pool.held_bytes <= 3 * 8192 * 256 * 2
    assert len(pool) == 3


def test_typed_views_and_release_errors():
    pool = PinnedBufferPool(pin=False, granularity=4096)
    v = pool.acquire((3, 5), torch.float32)
    assert v.shape == (3, 5) and v.dtype == torch.float32 and v.is_contiguous()
    pool.release(v)
    with pytest.raises(ValueError, match="did not come from"):
        pool.release(v)


def test_cap_and_available_ram_are_checked_before_allocating():
    pool = PinnedBufferPool(pin=False, max_bytes=3 * MiB, granularity=MiB)
    a = pool.acquire((MiB,), torch.uint8)
    b = pool.acquire((MiB,), torch.uint8)
    with pytest.raises(HostMemoryError, match="allowed"):
        pool.acquire((2 * MiB,), torch.uint8)
    pool.release(a), pool.release(b)
    greedy = PinnedBufferPool(pin=False, reserve_bytes=2**60)
    with pytest.raises(HostMemoryError, match="host memory"):
        greedy.acquire((16,), torch.uint8)


class _Event:
    """Stands in for a CUDA event: counts host waits."""

    def __init__(self):
        self.host_waits = 0

    def synchronize(self):
        self.host_waits += 1


class _Stream:
    """Stands in for a CUDA stream: logs the events it is told to wait for."""

    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_reused_buffer_waits_for_the_copy_it_was_released_after_on_the_gpu():
    pool = PinnedBufferPool(pin=False, granularity=MiB)
    v = pool.acquire((1024,), torch.float16)
    copy_back = _Event()
    pool.release(v, after=copy_back)
    stream = _Stream()
    again = pool.acquire((1024,), torch.float16, stream=stream)
    assert again.data_ptr() == v.data_ptr() and pool.allocations == 1
    assert stream.waited == [copy_back] and copy_back.host_waits == 0  # ordered on the GPU, host free
    # The wait is owed once: the next user of the buffer owes nothing more.
    pool.release(again)
    later = _Stream()
    pool.acquire((1024,), torch.float16, stream=later)
    assert later.waited == [] and copy_back.host_waits == 0


def test_reused_buffer_without_a_stream_waits_on_the_host():
    pool = PinnedBufferPool(pin=False, granularity=MiB)
    v = pool.acquire((256,), torch.float32)
    copy_back = _Event()
    pool.release(v, after=copy_back)
    w = pool.acquire((256,), torch.float32)
    assert w.data_ptr() == v.data_ptr() and copy_back.host_waits == 1
    pool.release(w)  # no event: nothing to wait for next time
    stream = _Stream()
    pool.acquire((256,), torch.float32, stream=stream)
    assert stream.waited == [] and copy_back.host_waits == 1
