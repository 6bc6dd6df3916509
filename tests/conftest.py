"""Shared fixtures."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch.distributed as dist

import autopar

# Tests plan for the uncalibrated local model whatever `autopar calibrate` wrote on this machine
# (spawned ranks inherit the variable); tests of calibration set their own folder.
os.environ["AUTOPAR_CALIBRATION_DIR"] = tempfile.mkdtemp(prefix="autopar-no-calibration-")


@pytest.fixture
def world1():
    """A one-process cluster; the process group compile makes is destroyed afterwards."""
    yield autopar.Cluster.local(1)
    if dist.is_initialized():
        dist.destroy_process_group()
