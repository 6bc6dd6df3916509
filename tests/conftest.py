"""Shared fixtures."""
from __future__ import annotations

import pytest
import torch.distributed as dist

import autopar


@pytest.fixture
def world1():
    """A one-process cluster; the process group compile makes is destroyed afterwards."""
    yield autopar.Cluster.local(1)
    if dist.is_initialized():
        dist.destroy_process_group()
