"""How a rank waits for its collectives (``runtime.comm.wait_for``): polled on CPU, with the CPU
yielded between checks, for at most ``POLL_WINDOW_S``; then, or for kinds whose work does not
report completion (gloo's reduce-scatter), inside torch."""
from __future__ import annotations

import time

import pytest
import torch

import autopar
from autopar.runtime import comm


class _Work:
    """A work that completes after ``checks`` calls of ``is_completed`` (never: None)."""

    def __init__(self, checks: int | None, error: Exception | None = None):
        self.checks, self.asked, self.waited, self.error = checks, 0, False, error

    def is_completed(self) -> bool:
        self.asked += 1
        return self.checks is not None and self.asked > self.checks

    def wait(self):
        self.waited = True
        if self.error is not None:
            raise self.error
        return True


def test_a_polled_wait_asks_until_the_work_completes_then_waits_on_it():
    work = _Work(checks=50)
    assert comm.wait_for(work) is True
    assert work.asked == 51 and work.waited


def test_a_work_that_never_reports_completion_is_waited_for_once_the_window_passes(monkeypatch):
    monkeypatch.setattr(comm, "POLL_WINDOW_S", 0.02)
    work = _Work(checks=None)
    t0 = time.perf_counter()
    comm.wait_for(work)
    assert 0.02 <= time.perf_counter() - t0 < 1.0 and work.waited and work.asked > 1


def test_a_failed_collective_raises_from_its_wait_as_unpolled():
    """A timeout or lost peer completes the work with an error: its ``wait`` raises it, polled or not."""
    for poll in (True, False):
        with pytest.raises(RuntimeError, match="(?i)timed out"):
            comm.wait_for(_Work(checks=3, error=RuntimeError("Timed out waiting 1000ms")), poll)


@pytest.fixture
def fresh_wait_mode():
    """``comm._wait_mode`` read anew from the environment inside the test, and after it."""
    comm._wait_mode.cache_clear()
    yield
    comm._wait_mode.cache_clear()


def test_which_collectives_are_polled(monkeypatch, fresh_wait_mode):
    cpu = torch.zeros(1)
    assert comm.polls("all_reduce", cpu) and comm.polls("all_gather", cpu) and comm.polls("all_to_all", cpu)
    assert not comm.polls("reduce_scatter", cpu)  # gloo's never reports completion before its wait
    assert not comm.polls("all_reduce", torch.zeros(1, device="meta"))  # not a CPU tensor
    for mode, polled in (("block", False), ("poll", True)):
        monkeypatch.setenv(comm.WAIT_ENV, mode)
        comm._wait_mode.cache_clear()
        assert comm.polls("all_reduce", cpu) is polled
    monkeypatch.setenv(comm.WAIT_ENV, "spin")
    comm._wait_mode.cache_clear()
    with pytest.raises(ValueError, match="AUTOPAR_COLLECTIVE_WAIT='spin'.*'poll'.*'block'"):
        comm.polls("all_reduce", cpu)


def _every_kind_worker():
    import torch.distributed as dist

    from autopar.runtime.comm import MeshComm
    from autopar.runtime.launch import init_distributed

    init_distributed("gloo", 2)
    mesh = MeshComm([dist.group.WORLD], [2], [dist.get_rank()])
    rank = dist.get_rank()
    x = torch.arange(8.0) + 10 * rank
    out = {}
    reduced = x.clone()
    mesh.all_reduce(reduced, 0)
    out["all_reduce"] = reduced
    gathered = torch.empty(16)
    mesh.all_gather(gathered, x, 0)
    out["all_gather"] = gathered
    scattered = torch.empty(4)
    mesh.reduce_scatter(scattered, x, 0)
    out["reduce_scatter"] = scattered
    swapped = torch.empty(8)
    mesh.all_to_all(swapped, x, 0)
    out["all_to_all"] = swapped
    pending = x.clone()
    mesh.all_reduce(pending, 0, async_op=True).wait()
    out["async all_reduce"] = pending
    return out, dict(mesh.stats.calls), {k: v > 0 for k, v in mesh.stats.seconds.items()}


@pytest.mark.slow
def test_every_collective_kind_gives_the_same_result_polled_or_blocked(monkeypatch):
    """Two gloo processes, each kind synchronously and an asynchronous all-reduce: the results,
    the counted calls and the counted seconds blocked do not depend on how the rank waits."""
    results = {}
    for mode in ("poll", "block"):
        monkeypatch.setenv(comm.WAIT_ENV, mode)
        results[mode] = autopar.launch(_every_kind_worker, 2)
    a = torch.arange(8.0)
    want = [{"all_reduce": 2 * a + 10, "all_gather": torch.cat([a, a + 10]), "reduce_scatter": (2 * a + 10)[4 * r: 4 * r + 4],
             "all_to_all": torch.cat([(a + 10 * k)[4 * r: 4 * r + 4] for k in range(2)]), "async all_reduce": 2 * a + 10}
            for r in range(2)]
    for mode, per_rank in results.items():
        for r, (out, calls, timed) in enumerate(per_rank):
            for k, v in want[r].items():
                assert torch.equal(out[k], v), (mode, r, k)
            assert calls == {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}
            assert all(timed.values()) and set(timed) == set(calls)
