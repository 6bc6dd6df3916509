"""No hangs, and steps that check their inputs (issue 8).

* ``autopar.launch`` returns or raises in bounded time: a rank that dies without a result (signal,
  ``os._exit``), raises, or runs past ``timeout_s`` stops every rank and is named;
* collectives time out after minutes (``DEFAULT_COLLECTIVE_TIMEOUT_S``), and a rank left alone in
  ``train_step`` fails with an error that says so;
* every step checks its batch against the compiled example (count, shapes, dtypes), and the ranks
  compare their batches on the first steps (``check_inputs``);
* the plan fingerprint covers the plan's decisions, so ranks holding different plans are refused.

Every multi-process test runs under ``launch``'s ``timeout_s`` and asserts how long it took.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

import autopar
from autopar.errors import AutoparError, WorkerFailedError

# ----------------------------------------------------------------------------- launch


def _rank() -> int:
    return int(os.environ["RANK"])


def rank_worker(extra=0):
    return _rank() + extra


def killed_worker():
    if _rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # rank 0 would wait for ever on its peer; launch must stop it
    return "late"


def exiting_worker():
    if _rank() == 1:
        os._exit(3)
    time.sleep(120)
    return "late"


def raising_worker():
    if _rank() == 0:
        raise ValueError("boom on rank 0")
    time.sleep(120)
    return "late"


def sleeping_worker():
    if _rank() >= 1:
        time.sleep(120)
    return _rank()


def test_launch_returns_every_rank_result_in_order():
    assert autopar.launch(rank_worker, 3, 10, timeout_s=120) == [10, 11, 12]


@pytest.mark.parametrize("worker, message", [
    (killed_worker, r"rank 1 died with exit code -9 \(SIGKILL\) before returning a result"),
    (exiting_worker, r"rank 1 died with exit code 3 before returning a result"),
])
def test_launch_names_a_rank_that_died_without_a_result(worker, message):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match=message) as info:
        autopar.launch(worker, 2, timeout_s=100)
    assert time.monotonic() - t0 < 60  # not launch's timeout, nor the sleeping rank's 120 s
    assert isinstance(info.value, RuntimeError)  # callers catching RuntimeError keep working


def test_launch_raises_a_failing_rank_traceback_and_stops_the_others():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 0 failed:.*ValueError: boom on rank 0"):
        autopar.launch(raising_worker, 2, timeout_s=100)
    assert time.monotonic() - t0 < 60


def test_launch_names_the_ranks_still_running_at_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"ranks \[1\] did not finish within 30 s \(ranks \[0\] returned\)"):
        autopar.launch(sleeping_worker, 2, timeout_s=30)  # long enough for a process to start here
    assert time.monotonic() - t0 < 70
