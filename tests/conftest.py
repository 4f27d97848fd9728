"""Shared fixtures of the CPU tests."""

import pytest


@pytest.fixture(scope="session")
def kernels():
    """stof_trt.kernels with a loaded libstof_kernels (the host helpers need no GPU); skips when none is built.
    A stale build (other ABI) raises in load_library: that is an error to see, not a skip."""
    kernels = pytest.importorskip("stof_trt.kernels")
    if not kernels.library_available():
        pytest.skip("libstof_kernels.so not built")
    kernels.load_library()
    return kernels
