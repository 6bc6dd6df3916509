"""Process groups and launching: torchrun for scripts, ``launch`` for tests and notebooks."""
from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.errors import AutoparError, WorkerFailedError
from autopar.runtime.cpu_affinity import pin_local_rank
from autopar.runtime.cpu_malloc import tune_cpu_malloc

__all__ = ["init_distributed", "device_mesh", "time_out_as_default", "process_group_backend", "launch", "free_port", "run_script", "collective_timeout_s",
           "DEFAULT_COLLECTIVE_TIMEOUT_S", "software_versions"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
"""How long a collective waits for the other ranks before it fails (gloo's own default is 30
minutes: a rank that skipped a step would hang the others that long)."""
COLLECTIVE_TIMEOUT_ENV = "AUTOPAR_COLLECTIVE_TIMEOUT_S"

# the timeout of the default process group when autopar made it: (id of that group, seconds)
_GROUP_TIMEOUT: dict[str, Any] = {"group": None, "timeout_s": None}


def collective_timeout_s(timeout_s: float | None = None) -> float:
    """The collective timeout to use: ``timeout_s`` if given, else ``$AUTOPAR_COLLECTIVE_TIMEOUT_S``,
    else ``DEFAULT_COLLECTIVE_TIMEOUT_S`` (300 s)."""
    source = "collective_timeout_s"
    if timeout_s is None:
        text = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_COLLECTIVE_TIMEOUT_S
        source = f"${COLLECTIVE_TIMEOUT_ENV}"
        try:
            timeout_s = float(text)
        except ValueError:
            raise AutoparError(f"{source}={text!r} is not a number of seconds; e.g. {COLLECTIVE_TIMEOUT_ENV}=300") from None
    if not timeout_s > 0:
        raise AutoparError(f"{source} must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def group_timeout_s() -> float | None:
    """The collective timeout of the current default process group if autopar initialised it
    (None for a group the user made: its timeout is the user's)."""
    if dist.is_initialized() and _GROUP_TIMEOUT["group"] == id(dist.group.WORLD):
        return _GROUP_TIMEOUT["timeout_s"]
    return None


def process_group_backend(backend: str) -> str:
    """What ``init_process_group`` is given for a cluster's ``backend``: NCCL with a gloo backend
    beside it for host tensors (an NCCL-only group rejects a CPU tensor: a loss, a count, a flag
    some code creates on the host), gloo as it is."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def init_distributed(backend: str, world_size: int, timeout_s: float | None = None) -> None:
    """Initialise the default process group from torchrun's environment (or a 1-process world).

    The cluster's world size must match the launch; a mismatch is a clear error, not a hang.
    Collectives time out after ``timeout_s`` (default: ``$AUTOPAR_COLLECTIVE_TIMEOUT_S``, else
    ``DEFAULT_COLLECTIVE_TIMEOUT_S`` = 300 s). A group that is already initialised keeps its own.
    On gloo (CPU processes), glibc's malloc is first set for training (``runtime.cpu_malloc``) and
    each local rank pinned to its own cores (``runtime.cpu_affinity``). NCCL is initialised as
    ``process_group_backend("nccl")`` = "cpu:gloo,cuda:nccl": CUDA tensors on NCCL, host tensors
    and object collectives on gloo, in the default group and in every group derived from it.
    """
    if backend == "gloo":
        tune_cpu_malloc()
        pin_local_rank()
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise AutoparError(
                f"the cluster spec has {world_size} devices but this launch has {dist.get_world_size()} "
                "processes; use Cluster.local() (it reads WORLD_SIZE) or launch that many processes"
            )
        return
    seconds = collective_timeout_s(timeout_s)
    kwargs = {"timeout": datetime.timedelta(seconds=seconds)}
    if backend == "nccl":
        enable_flight_recorder()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if world_size != 1:
            raise AutoparError(
                f"the cluster has {world_size} devices but this is a single process: launch with "
                f"`torchrun --nproc-per-node {world_size} script.py` or autopar.launch(fn, {world_size})"
            )
        dist.init_process_group(process_group_backend(backend), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, **kwargs)
    else:
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise AutoparError(
                f"the cluster spec has {world_size} devices but WORLD_SIZE={os.environ['WORLD_SIZE']}; "
                "use Cluster.local() or launch that many processes"
            )
        dist.init_process_group(process_group_backend(backend), **_restart_safe_store(world_size, seconds), **kwargs)
    _GROUP_TIMEOUT.update(group=id(dist.group.WORLD), timeout_s=seconds)



def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """``init_device_mesh`` whose axis groups time out as the default group autopar initialised:
    torch makes a mesh's axis groups with its default timeout (30 minutes on gloo), not the default
    group's, so a rank waiting on an axis for a peer that never comes hung for half an hour past
    ``collective_timeout_s`` instead of failing with a ``CollectiveError``. A default group the user
    initialised keeps its own groups' timeouts."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    for name in names:
        time_out_as_default(mesh.get_group(name))
    return mesh


def time_out_as_default(group) -> None:
    """Give ``group`` (a mesh's axis group, a flattened group of several axes) the timeout of the
    default group autopar initialised: torch gives a new group its own default timeout. Nothing for
    the default group itself, one process, or a default group the user initialised."""
    seconds = group_timeout_s()
    if seconds is not None and dist.get_world_size() > 1 and group is not dist.group.WORLD:
        # private in torch 2.11-2.13 (public replacement: none); read here only
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=seconds), group)

# torch's NCCL flight recorder: the last collectives of every rank, dumped when one times out
# (read with ``python -m torch.distributed.flight_recorder.fr_trace DIR -p PREFIX``). torch 2.11
# reads the TORCH_NCCL_* names, later releases also the TORCH_FR_* ones; a user's settings win.
FLIGHT_RECORDER_ENTRIES = 2000
FLIGHT_RECORDER_PREFIX = "autopar_fr_rank_"


def flight_recorder_dir() -> str:
    """Where the flight recorder dumps (one file per rank): ``$AUTOPAR_FLIGHT_RECORDER_DIR`` or
    the temporary folder's ``autopar_flight_recorder``."""
    import tempfile

    return os.environ.get("AUTOPAR_FLIGHT_RECORDER_DIR", os.path.join(tempfile.gettempdir(), "autopar_flight_recorder"))


def enable_flight_recorder() -> dict[str, str]:
    """Turn NCCL's flight recorder and its dump on timeout on, unless the user set them; returns
    the variables set. Call before the NCCL process group is created."""
    folder = flight_recorder_dir()
    os.makedirs(folder, exist_ok=True)
    prefix = os.path.join(folder, FLIGHT_RECORDER_PREFIX)
    wanted = {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
              "TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix, "TORCH_FR_DUMP_TEMP_FILE": prefix}
    set_now = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now


def software_versions() -> dict[str, str]:
    """The versions every rank of a run must share (checked at compile, recorded in checkpoints)."""
    import platform

    try:
        from importlib.metadata import version

        autopar_version = version("autopar")
    except Exception:  # noqa: BLE001 - an uninstalled checkout
        autopar_version = "unknown"
    return {"torch": str(torch.__version__), "autopar": autopar_version, "python": platform.python_version()}


def _restart_safe_store(world_size: int, timeout_s: float) -> dict:
    """The rendezvous of a torchrun worker, keyed by torchrun's restart count.

    Why by hand: under torchrun the workers' default group lives in the agent's TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE``), which torch (2.11-2.13) assumes is new for every restart;
    with ``--standalone`` it is not, so the restarted workers read the dead attempt's gloo
    addresses and fail with "connectFullMesh ... Connection refused". A prefix per attempt keeps
    each attempt's keys apart. Empty (torch's own env:// rendezvous) outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return {"store": dist.PrefixStore(f"autopar/attempt_{attempt}/", store), "rank": int(os.environ["RANK"]),
            "world_size": world_size}


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, conn, release, timeout_s: float,
            env: dict[str, str] | None = None) -> None:
    """One rank: run ``fn``, send (rank, ok, pickled result or traceback) to the parent, then tear
    the process group down. The closing barrier runs only once the parent says every rank has
    returned (``release``): a barrier entered while a peer is still inside ``fn`` could pair with
    that peer's collective, and after a failure the peers may never arrive. ``env``: the caller's
    environment, which a rank forked from the forkserver takes in place of the server's."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if isinstance(args, bytes):  # pickled by value (forkserver): see launch
        args = pickle.loads(args)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    ok = False
    try:
        try:
            # pickled here, by value: torch's queue would share tensors through file descriptors that
            # die with this process
            message = (rank, True, pickle.dumps(fn(*args)))
            ok = True
        except BaseException:  # noqa: BLE001 - sent back to the parent with its traceback
            message = (rank, False, traceback.format_exc())
        conn.send(message)
        conn.close()
    finally:
        if dist.is_initialized():
            try:
                if ok and release.wait(timeout_s):
                    dist.barrier()  # no rank tears gloo down while another still talks to it
            finally:
                dist.destroy_process_group()


def _exit_description(code: int | None) -> str:
    if code is None:
        return "an unknown exit code"
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code} (signal {-code})"
    return f"exit code {code}"


def _collect(procs: list, readers: list, timeout_s: float) -> dict[int, Any]:
    """Every rank's result, waiting on the result pipes and the process sentinels together (no
    polling loop). Raises ``WorkerFailedError`` as soon as a rank fails or dies without a result,
    or when ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    pending = dict(enumerate(readers))
    results: dict[int, Any] = {}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            done = sorted(results)
            raise WorkerFailedError(
                f"ranks {sorted(pending)} did not finish within {timeout_s:g} s"
                + (f" (ranks {done} returned)" if done else "")
                + "; a rank waiting in a collective for a peer that never arrives fails after the collective "
                f"timeout (${COLLECTIVE_TIMEOUT_ENV}); pass a larger timeout_s= to launch if the work needs it"
            )
        ready = set(wait(list(pending.values()) + [procs[r].sentinel for r in pending], timeout=left))
        deaths, failures = [], []
        for r in sorted(pending):
            conn = pending[r]
            if conn not in ready and procs[r].sentinel not in ready:
                continue
            message = None
            if conn.poll():
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # its end closed mid-message: it died
                    message = None
            if message is None:
                procs[r].join(timeout=1)
                deaths.append(f"rank {r} died with {_exit_description(procs[r].exitcode)} before returning a result")
            elif message[1]:
                results[r] = pickle.loads(message[2])
            else:
                failures.append(f"rank {r} failed:\n{message[2]}")
            del pending[r]
        if deaths or failures:
            raise WorkerFailedError("\n".join(deaths + failures))
    return results


START_METHOD_ENV = "AUTOPAR_LAUNCH_START_METHOD"


def launch(fn: Callable, nproc: int, *args: Any, timeout_s: float = 600.0, start_method: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` local processes (ranks 0..nproc-1); return their results.

    ``fn`` must be importable (a module-level function). Never hangs: a rank that raises, or dies
    without a result (killed, crashed, ``os._exit``), or ranks still running after ``timeout_s``
    seconds stop every rank and raise ``WorkerFailedError`` (a ``RuntimeError``) naming the
    ranks, with the failing rank's traceback or its exit code and signal.

    ``start_method``: "spawn" (each rank a fresh interpreter that imports ``fn``'s module), or
    "forkserver": ranks forked from one server process that imported autopar and ``fn``'s module
    once, where start-up time matters (``autopar calibrate``, the test suite: 4 ranks importing
    autopar took 5.3-5.5 s on 2 cores, forked 1.9 s). The server is started once per process;
    either way each rank sees the environment of this call (a forked rank takes it in place of
    the server's; only what a module read from the environment when the server imported it is
    the server's). None: ``$AUTOPAR_LAUNCH_START_METHOD``, else "spawn".

    >>> # autopar.launch(worker, 2, timeout_s=120)  # [worker() on rank 0, worker() on rank 1]
    """
    if start_method is None:
        start_method = os.environ.get(START_METHOD_ENV, "").strip() or "spawn"
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"launch: start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["autopar", fn.__module__])
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    env = dict(os.environ) if start_method == "forkserver" else None
    # forkserver: the arguments go by value, as the results come back (torch's pickler would send a
    # file descriptor per tensor through the server, which takes at most 256 per process)
    sent = pickle.dumps(args) if start_method == "forkserver" else args
    release = ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in range(nproc)]
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, fn, sent, pipes[r][1], release, timeout_s, env))
             for r in range(nproc)]
    ok = False
    try:
        for p in procs:
            p.start()
        for _, writer in pipes:
            writer.close()  # the workers hold theirs: a worker's end closing means it is gone
        results = _collect(procs, [reader for reader, _ in pipes], timeout_s)
        ok = True
    finally:
        if ok:
            release.set()  # every rank returned: their closing barriers can all meet
        grace = time.monotonic() + (max(30.0, min(timeout_s, 120.0)) if ok else 0.0)
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=max(0.0, grace - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for reader, writer in pipes:
            reader.close()
            writer.close()
    return [results[r] for r in range(nproc)]


def run_script(script: str, nproc: int, script_args: list[str], module: bool = False, max_restarts: int = 0) -> int:
    """``autopar run script.py --nproc N``: torchrun (standalone rendezvous) with local defaults;
    ``max_restarts``: how many times torchrun restarts every worker after one fails (a script
    compiled with ``checkpoint=autopar.Checkpointing(root)`` then resumes from its newest checkpoint).

    Restarts are for process failures (a rank killed, crashed, or cut off from a peer that was).
    An autopar error a rank's script leaves uncaught, other than a lost peer (``CollectiveError``)
    or a failed ``launch`` worker, is deterministic (a constraint, a plan, an input): the worker
    reports it (``runtime.run_errors``) and waits; this stops torchrun before it restarts anyone,
    prints the error once (with the ranks that raised it) and returns ``run_errors.DETERMINISTIC_EXIT``."""
    from autopar.runtime.run_errors import RUN_STATE_ENV, TorchrunWatch

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           "--max-restarts", str(max_restarts)]
    cmd += ["-m", script] if module else [script]
    cmd += list(script_args)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="autopar-run-") as state:
        env[RUN_STATE_ENV] = state
        return TorchrunWatch(cmd, env, state, nproc).run()


def _report_deterministic_errors_under_autopar_run() -> None:
    """A worker of ``autopar run`` reports a deterministic error instead of being restarted for it."""
    from autopar.runtime.run_errors import report_deterministic_errors

    report_deterministic_errors()


_report_deterministic_errors_under_autopar_run()
