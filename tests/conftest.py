"""Shared fixtures."""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
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
if os.environ["AUTOPAR_LAUNCH_START_METHOD"] == "forkserver":
    # The server starts now, in the background, with what the ranks import preloaded (transformers
    # and its model families: ~10 s of wall per 4-rank launch otherwise; tests/launch_preload.py);
    # launch() finds it running (it starts once per process), so its own preload list is not used.
    # (The server imports with the sys.path its own environment gives, not this process's: the
    # tests folder and the repository go on its PYTHONPATH for the start.)
    multiprocessing.get_context("forkserver").set_forkserver_preload(["autopar", "launch_preload"])
    _tests = os.path.dirname(os.path.abspath(__file__))
    _saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([_tests, os.path.dirname(_tests)] + ([_saved] if _saved else []))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if _saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = _saved


@pytest.fixture
def world1():
    """A one-process cluster; the process group compile makes is destroyed afterwards."""
    yield autopar.Cluster.local(1)
    if dist.is_initialized():
        dist.destroy_process_group()
