"""CPU processes set up for training: glibc's malloc (``runtime.cpu_malloc``: large tensors stop
page-faulting) and each local rank on its own cores (``runtime.cpu_affinity``)."""
import os
import subprocess
import sys

import pytest

from autopar.runtime.cpu_malloc import why_untuned

# in a fresh process, after 3 warm-up steps: the median page faults of 11 steps that each allocate,
# touch and free a 40 MiB tensor
# (above glibc's own 32 MiB ceiling for its dynamic threshold: mmapped every time by default)
_PROBE = """
import resource, sys, torch
from autopar.runtime.cpu_malloc import tune_cpu_malloc
from autopar.runtime.launch import init_distributed
if sys.argv[1] == "tune":
    init_distributed("gloo", 1)  # what compile, bench and calibrate call first
tuned = tune_cpu_malloc() if sys.argv[1] == "tune" else False
for _ in range(3):
    torch.empty(10 << 20).fill_(1.0)
faults = []
for _ in range(11):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(10 << 20).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(tuned, sorted(faults)[5])
"""


def _faults(*probes: tuple[str, dict]) -> list[tuple[bool, int]]:
    """(tuned, median faults) of each (mode, environment) probe; the fresh processes run side by
    side (their start-up, importing torch, is most of their time; faults are counted per process)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "AUTOPAR_CPU_MALLOC"}
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**clean, **env}) for mode, env in probes]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        words = stdout.split()
        out.append((words[0] == "True", int(words[1])))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_tuned_malloc_reuses_large_blocks_instead_of_faulting_fresh_pages():
    (tuned, tuned_faults), (_, default_faults), (refused, refused_faults) = _faults(
        ("tune", {}), ("default", {}), ("tune", {"AUTOPAR_CPU_MALLOC": "system"}))
    pages = (40 << 20) // 4096
    assert default_faults > pages // 2  # glibc's default maps (and faults) every 40 MiB block
    assert tuned and tuned_faults < pages // 20  # reused from the heap (this VM reclaims some now and then)
    assert not refused and refused_faults > pages // 2


def test_user_choices_leave_malloc_alone():
    assert why_untuned({}) is None
    assert why_untuned({"AUTOPAR_CPU_MALLOC": "system"}) == "AUTOPAR_CPU_MALLOC=system"
    assert why_untuned({"MALLOC_TRIM_THRESHOLD_": "0"}) == "MALLOC_TRIM_THRESHOLD_ is set"
    assert why_untuned({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"}) == "GLIBC_TUNABLES sets malloc"
    assert why_untuned({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "jemalloc is preloaded"


def _thread_cores() -> list[set[int]]:
    """Every thread's allowed cores (this process)."""
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")]


def _affinity_worker():
    from autopar.runtime.cpu_affinity import node_cores, pin_local_rank
    from autopar.runtime.launch import init_distributed

    before = sorted(os.sched_getaffinity(0))
    init_distributed("gloo", int(os.environ["WORLD_SIZE"]))  # pins, then starts gloo's threads
    return before, pin_local_rank(), _thread_cores(), node_cores()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="sched_setaffinity: Linux only")
def test_local_ranks_are_pinned_to_their_own_cores(monkeypatch):
    from autopar.runtime.cpu_affinity import container_cpus, rank_cores
    from autopar.runtime.launch import launch

    if not container_cpus() <= os.sched_getaffinity(0):
        pytest.skip("this test process is already restricted to fewer cores than its container")
    ranks = launch(_affinity_worker, 2, timeout_s=120)
    for rank, (before, pinned, threads, cores) in enumerate(ranks):
        assert pinned == rank_cores(before, rank, 2) and cores == len(before)
        assert all(t == pinned for t in threads) and len(threads) > 1  # gloo's threads too
    if len(ranks[0][0]) >= 2:
        assert not ranks[0][1] & ranks[1][1]  # two ranks, two cores: one each
    monkeypatch.setenv("AUTOPAR_CPU_AFFINITY", "none")  # the user's choice: left alone
    for before, pinned, threads, _ in launch(_affinity_worker, 2, timeout_s=120):
        assert pinned is None and all(sorted(t) == before for t in threads)


def test_cores_per_local_rank():
    from autopar.runtime.cpu_affinity import parse_cpu_list, rank_cores

    assert [rank_cores(range(8), r, 4) for r in range(4)] == [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
    # more ranks than cores: consecutive ranks share one (a mesh's inner axes stay on a core)
    assert [rank_cores([0, 1], r, 4) for r in range(4)] == [{0}, {0}, {1}, {1}]
    assert [rank_cores([0, 1, 2], r, 4) for r in range(4)] == [{0}, {0}, {1}, {2}]
    assert parse_cpu_list("0-1,4\n") == {0, 1, 4}
