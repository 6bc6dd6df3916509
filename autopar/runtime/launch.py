"""Process groups and launching: torchrun for scripts, ``launch`` for tests and notebooks."""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import subprocess
import sys
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.errors import AutoparError

__all__ = ["init_distributed", "launch", "free_port", "run_script"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str, world_size: int, timeout_s: float | None = None) -> None:
    """Initialise the default process group from torchrun's environment (or a 1-process world).

    The cluster's world size must match the launch; a mismatch is a clear error, not a hang.
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise AutoparError(
                f"the cluster spec has {world_size} devices but this launch has {dist.get_world_size()} "
                "processes; use Cluster.local() (it reads WORLD_SIZE) or launch that many processes"
            )
        return
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    kwargs = {"timeout": timeout} if timeout else {}
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if world_size != 1:
            raise AutoparError(
                f"the cluster has {world_size} devices but this is a single process: launch with "
                f"`torchrun --nproc-per-node {world_size} script.py` or autopar.launch(fn, {world_size})"
            )
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **kwargs)
        return
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise AutoparError(
            f"the cluster spec has {world_size} devices but WORLD_SIZE={os.environ['WORLD_SIZE']}; "
            "use Cluster.local() or launch that many processes"
        )
    dist.init_process_group(backend, **kwargs)


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        # pickled here, by value: torch's queue would share tensors through file descriptors that
        # die with this process
        result = pickle.dumps(fn(*args))
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - sent back to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.barrier()  # no rank tears gloo down while another still talks to it
            finally:
                dist.destroy_process_group()


def launch(fn: Callable, nproc: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` local processes (ranks 0..nproc-1); return their results.

    ``fn`` must be importable (a module-level function). A failure in any rank raises with that
    rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, fn, args, queue)) for r in range(nproc)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in range(nproc):
        rank, ok, value = queue.get()
        if ok:
            results[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank} failed:\n{value}")
            break
    for p in procs:
        p.join(timeout=5 if errors else timeout_s)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(nproc)]


def run_script(script: str, nproc: int, script_args: list[str], module: bool = False) -> int:
    """``autopar run script.py --nproc N``: torchrun (standalone rendezvous) with local defaults."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"]
    cmd += ["-m", script] if module else [script]
    cmd += list(script_args)
    return subprocess.call(cmd, env=env)
