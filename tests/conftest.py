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
# autopar.launch forks its ranks from one server that imported torch and autopar once (about 1 s
# of start-up per rank instead of 3 to 5 on 2 cores); each rank still sees the caller's environment.
# A test that needs fresh interpreters passes start_method="spawn".
os.environ.setdefault("AUTOPAR_LAUNCH_START_METHOD", "forkserver")


@pytest.fixture
def world1():
    """A one-process cluster; the process group compile makes is destroyed afterwards."""
    yield autopar.Cluster.local(1)
    if dist.is_initialized():
        dist.destroy_process_group()
