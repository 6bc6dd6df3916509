"""CPU processes of one node pinned to their own cores, so that the scheduler stops moving them.

Several gloo ranks on one machine are scheduled by the OS onto any core, and migrate: a rank that
wakes from a collective may wait behind another rank's compute while a core sits idle. The example
GPT at dp=4 on 4 processes sharing 2 cores ran 19-22 ms per step unpinned, 14-15 ms pinned (the
8.4M-parameter MLP, compute-bound, 142-157 vs 138-153 ms); at dp=2 on 2 processes, 8.8-12.9 ms
unpinned across launches, 9.1-11.1 pinned (``benchmarks/README.md``, "calibration.py").

``pin_local_rank`` gives local rank ``r`` of ``n`` on the node a contiguous ``len(cores) // n`` of
the cores this process may use, or, with more ranks than cores, core ``r * len(cores) // n``
(consecutive ranks share a core): what Intel's ``ipexrun`` and torchrun's NUMA binding do, without
a launcher. Consecutive ranks are the ones a mesh's inner axes group (tensor parallelism), as
consecutive ranks share a node on GPUs; a plan's outer axes (pipeline stages) span cores. On 4
processes sharing 2 cores this ran the GPT's ``pp=2, dp=2`` plan at 20.5 ms against 27.6 with
rank ``r`` on core ``r % 2``, and ``dp=2, tp=2`` at 28.9 against 36.6: ranks on one core hand a
collective's bytes to each other within the core (a 4 KiB all-reduce: 0.17 ms, 1.4 across
cores), while a stage's message to a rank on its own core waits for the sender's time slice
(3.1 ms, 0.29 across). Every thread of the process
is moved (gloo's threads may exist already). Left alone where the user chose: the process is
already restricted to fewer cores than its container's cpuset (``taskset``, a launcher's per-rank
binding), ``AUTOPAR_CPU_AFFINITY=none``, one local rank, or no ``sched_setaffinity``.
"""
from __future__ import annotations

import os

__all__ = ["pin_local_rank", "rank_cores", "node_cores", "container_cpus", "parse_cpu_list"]

_state: dict = {}


def rank_cores(cores, local_rank: int, local_world: int) -> set[int]:
    """The cores local rank ``local_rank`` of ``local_world`` gets out of ``cores`` (pure).

    >>> rank_cores([0, 1, 2, 3], 1, 2), rank_cores([0, 1], 1, 4), rank_cores([0, 1], 2, 4)
    ({2, 3}, {0}, {1})
    """
    cores = sorted(cores)
    if local_world <= len(cores):
        share = len(cores) // local_world
        return set(cores[local_rank * share:(local_rank + 1) * share])
    return {cores[local_rank * len(cores) // local_world]}


_CPUSET_FILES = ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus")


def parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list (``"0-3,8,10-11"``) as a set (pure).

    >>> sorted(parse_cpu_list("0-2,8,10-11"))
    [0, 1, 2, 8, 10, 11]
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def container_cpus() -> set[int]:
    """The CPUs this container may use (its cgroup cpuset; else every CPU of the machine)."""
    for path in _CPUSET_FILES:
        try:
            with open(path) as f:
                cpus = parse_cpu_list(f.read())
            if cpus:
                return cpus
        except (OSError, ValueError):
            continue
    return set(range(os.cpu_count() or 1))


def node_cores() -> int:
    """How many cores this node's ranks share: the process's cores before ``pin_local_rank``."""
    if "node_cores" in _state:
        return _state["node_cores"]
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pin_local_rank(environ=os.environ) -> set[int] | None:
    """Pin this process (every thread) to its local rank's cores once; the cores, or None where
    left alone (see the module doc)."""
    if "pinned" in _state:
        return _state["pinned"]
    _state["pinned"] = None
    if not hasattr(os, "sched_setaffinity") or environ.get("AUTOPAR_CPU_AFFINITY", "").lower() == "none":
        return None
    allowed = os.sched_getaffinity(0)
    _state["node_cores"] = len(allowed)
    local_world = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    if local_world <= 1 or not 0 <= local_rank < local_world or not container_cpus() <= allowed:
        return None
    cores = rank_cores(allowed, local_rank, local_world)
    try:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cores)
    except (OSError, ValueError):
        os.sched_setaffinity(0, cores)
    _state["pinned"] = cores
    return cores
