"""Shared fixtures: a fixed seed, and a guard that no test leaves jacmem state behind."""

from __future__ import annotations

import pytest
import torch
from torch.nn.modules import module as module_hooks

# fixtures shared by several folders: `path`, both ways to a clipped sum
pytest_plugins = ["tests.support.clipping"]

# The tests use small tensors on a shared 2-core machine: one thread avoids
# oversubscription, which slows them down many times over.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_leftovers():
    """After every test: no active block, no global module hook left behind."""
    import jacmem.context

    before = (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks))
    yield
    assert jacmem.context._ACTIVE is None, "a jacmem.extend block is still active after the test"
    after = (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks))
    assert after == before, f"global forward (pre-)hooks went from {before} to {after}"


@pytest.fixture
def float64_default():
    """float64 as the default dtype for the test; restored after it. A file takes it for
    every test with ``pytestmark = pytest.mark.usefixtures("float64_default")``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
