"""Low-bit model tests: one intra-op thread (see the ``one_thread`` fixture in tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _single_threaded(one_thread):
    yield
