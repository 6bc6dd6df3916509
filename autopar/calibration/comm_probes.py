"""The communication half of ``autopar calibrate``'s measurements (``microbench.measure_rank``
runs them after the compute half): each collective the runtime issues over message sizes and
group shapes, a stage-to-stage message, a collective overlapped with compute, a collective after
compute (the ranks' skew), and a two-stage pipeline schedule's work per microbatch. Every rank
runs each at once, through ``runtime.comm.MeshComm`` as the program does; times are per call on
the slowest rank (``timing.per_op``).
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch

from autopar.calibration.fit import exposed_share
from autopar.calibration.timing import MicrobenchSpec, per_op, per_op_spread, progress, spread_runs

# the sizes each collective is timed at (nccl-tests bytes): a scalar-sized message (gloo and NCCL
# switch protocols for small ones) up to a large gradient bucket; quick mode times _QUICK_BYTES
_COMM_BYTES = (64, 4 << 10, 32 << 10, 256 << 10, 1 << 21, 1 << 23)
_QUICK_BYTES = (64, 256 << 10, 1 << 23)
_COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# calls per timed window of a collective, at least: a 20 ms window held two 8 MiB all-gathers on 2
# ranks, and one calibration read 10.6 ms for them against 6.3 for an 8 MiB all-reduce
COLLECTIVE_MIN_CALLS = 4
# windows per collective and size: what moves a collective's time (~30%) is the machine between
# calibrations, not a fifth window; at 5 windows the 54 collectives took 22 s of the minute on 4
# processes, at 4 windows 18 s (the minute then ran 62-64 s with the update probed at two sizes)
COLLECTIVE_REPEATS = 3


def _collective_call(comm, kind: str, nbytes: int, axis: int, device: torch.device) -> Callable[[], object]:
    """One ``kind`` of ``nbytes`` (nccl-tests' size) on ``comm``'s ``axis``, as a closure."""
    p = comm.sizes[axis]
    numel = max(p, nbytes // 4 // p * p)
    full = torch.randn(numel, device=device)
    part = torch.empty(numel // p, device=device)
    if kind == "all_reduce":
        return lambda: comm.all_reduce(full, axis)
    if kind == "all_gather":
        return lambda: comm.all_gather(full, part, axis)
    if kind == "reduce_scatter":
        return lambda: comm.reduce_scatter(part, full, axis)
    out = torch.empty_like(full)
    return lambda: comm.all_to_all(out, full, axis)


def _send_recv_call(comm, nbytes: int, axis: int, device: torch.device) -> Callable[[], object]:
    """One message of ``nbytes`` from coordinate 0 to coordinate 1 of ``comm``'s ``axis`` (a pair),
    sent as ``torch.distributed.pipelining`` sends a stage's activations (``batch_isend_irecv``)."""
    import torch.distributed as dist

    group = comm._group(axis)
    peer = dist.get_process_group_ranks(group)[1 - comm.coords[axis]]
    buf = torch.zeros(max(1, nbytes // 4), device=device)
    op = dist.isend if comm.coords[axis] == 0 else dist.irecv

    def call():
        for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer, group)]):
            work.wait()
    return call


def probe_meshes(world: int, device: torch.device):
    """(group size, MeshComm, axis): the whole world and, with 4 or more ranks (an even count),
    pairs of rank r and r + world / 2: the pairs a two-stage pipeline's stages form (the
    outermost mesh axis), and, where ranks outnumber cores, ranks on different cores
    (``runtime.cpu_affinity`` puts consecutive ranks on one core). Pairs on one core differ: on 4
    processes pinned 2 per core, a 4 KiB all-reduce took 0.17 ms on one core against 1.4 across
    cores, one stage's 4 KiB message 3.1 ms against 0.29."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.comm import MeshComm

    meshes = [(world, MeshComm.from_device_mesh(init_device_mesh(device.type, (world,), mesh_dim_names=("w",))), 0)]
    if world >= 4 and world % 2 == 0:
        pairs = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("pair", "inner"))
        meshes.append((2, MeshComm.from_device_mesh(pairs), 0))
    return meshes


def probe_collectives(spec: MicrobenchSpec, device: torch.device, barrier, meshes: list) -> dict:
    # quick: the smallest, a middle and the largest size: the largest is what resolves bandwidth
    # from latency (with small sizes only, the noise can outweigh the bandwidth term)
    sizes = _QUICK_BYTES if spec.quick else _COMM_BYTES
    progress(f"collectives ({', '.join(_COMM_KINDS)}) over {meshes[0][0]} ranks" + (" and pairs" if len(meshes) > 1 else ""))
    points, calls = [], []  # (kind, group size, nccl-tests bytes), its closure: timed in passes over all
    for p, comm, axis in meshes:
        for kind in _COMM_KINDS:
            for nbytes in sizes:
                points.append((kind, p, float(max(p, nbytes // 4 // p * p) * 4)))
                calls.append(_collective_call(comm, kind, nbytes, axis, device))
        if p == 2:  # a pipeline's stage-to-stage message, every pair sending at once as stages do
            for nbytes in sizes:
                points.append(("send_recv", 2, float(max(1, nbytes // 4) * 4)))
                calls.append(_send_recv_call(comm, nbytes, axis, device))
    seconds = per_op_spread(calls, device, min(spec.repeats, COLLECTIVE_REPEATS), barrier,
                             min_calls=COLLECTIVE_MIN_CALLS)
    out: dict = {k: [] for k in _COMM_KINDS + ("send_recv",)}
    for (kind, p, nbytes), t in zip(points, seconds):
        out[kind].append((p, nbytes, t))
    return {k: v for k, v in out.items() if v}


def probe_overlap(spec: MicrobenchSpec, device: torch.device, barrier, world: int) -> dict:
    """Seconds of a block of matmuls, of an all-reduce, and of both with the all-reduce in flight
    (issued asynchronously, waited after the matmuls), as the runtime overlaps gradient sync and
    waits for it (``runtime.comm.wait_for``)."""
    import torch.distributed as dist

    from autopar.runtime.comm import polls, wait_for

    progress("overlap of an all-reduce with compute")
    buf = torch.randn((1 << 21) // 4, device=device)  # 2 MiB
    a = torch.randn(256, 256, device=device)
    poll = polls("all_reduce", buf)

    def comm():
        wait_for(dist.all_reduce(buf, async_op=True), poll)

    t_comm = per_op(comm, device, spec.repeats, barrier=barrier)
    t_mm = per_op(lambda: torch.mm(a, a), device, 3, barrier=barrier, min_s=0.005)
    n_mm = max(1, int(t_comm / t_mm))

    def compute():
        for _ in range(n_mm):
            torch.mm(a, a)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        wait_for(work, poll)

    # processes sharing cores overlap by chance: one round's share has read 0.2 and 1.0 on the same
    # machine; the round with the median share of OVERLAP_ROUNDS, each timing all three anew
    rounds, repeats = [], min(spec.repeats, 3)  # (the rounds' median is the estimate: fewer runs each)
    for r in range(OVERLAP_ROUNDS):
        alone = t_comm if r == 0 else per_op(comm, device, repeats, barrier=barrier)
        rounds.append({"comm_s": alone, "compute_s": per_op(compute, device, repeats, barrier=barrier),
                       "together_s": per_op(both, device, repeats, barrier=barrier)})
    shares = [exposed_share(x["compute_s"], x["comm_s"], x["together_s"]) for x in rounds]
    middle = sorted(range(len(rounds)), key=shares.__getitem__)[len(rounds) // 2]
    return {**rounds[middle], "shares": shares}


OVERLAP_ROUNDS = 5  # the overlap probe's rounds (its median share is kept)
# the waiting probe: a latency-bound all-reduce (a small gradient bucket, a ZeRO shard) in flight
# beside a training step's kind of compute, lasting WAIT_COMPUTE_RATIO times the collective alone
WAIT_BYTES = 4 << 10
WAIT_COMPUTE_RATIO = 3.0
WAIT_REPEATS = 7  # passes over its three timings (a per-pass share; their median is kept)


def probe_waiting(spec: MicrobenchSpec, device: torch.device, barrier, world: int) -> dict:
    """Does a collective's waiting hide behind compute here? Seconds of a ``WAIT_BYTES``
    all-reduce alone, of small layers forward and backward (the skew probe's block, repeated to
    ``WAIT_COMPUTE_RATIO`` times the collective's time), and of both with the all-reduce issued
    first and waited after the block (``runtime.comm.wait_for``, as gradient sync waits), in
    passes: each pass's exposed share ``(both - block) / alone`` (``fit.exposed_share``).

    The planner's overlap model hides a collective's latency behind compute
    (``planner.overlap``); whether it does depends on what progresses the collective while the
    ranks compute: on 2 gloo processes of 2 cores an asynchronous gradient sync saved 17-20 ms
    of a step, while on 4 processes of 2 cores a 2 MiB all-reduce beside compute hid nothing,
    latency included (``probe_overlap``). This probe measures the latency's share alone
    (``Cluster.exposed_latency_share``): on that machine 1.0 in the median pass on 2 processes
    and on 4 (single passes 0.49-1.0), 1.00 in three calibrations of 4 processes."""
    import torch.distributed as dist

    from autopar.runtime.comm import polls, wait_for

    progress("whether a small collective's waiting hides behind compute")
    buf = torch.randn(WAIT_BYTES // 4, device=device)
    poll = polls("all_reduce", buf)
    block = small_layers_step(device)

    def comm():
        wait_for(dist.all_reduce(buf, async_op=True), poll)

    t_comm = per_op(comm, device, 3, barrier=barrier, min_s=0.01)
    t_block = per_op(block, device, 3, barrier=barrier, min_s=0.01)
    n_blocks = barrier(max(1, round(WAIT_COMPUTE_RATIO * t_comm / max(t_block, 1e-9))))

    def compute():
        for _ in range(n_blocks):
            block()

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        wait_for(work, poll)

    _, runs = spread_runs([comm, compute, both], device, spec.repeats if spec.quick else WAIT_REPEATS, barrier,
                          min_calls=COLLECTIVE_MIN_CALLS)
    shares = [exposed_share(c, a, b) for a, c, b in zip(*runs)]
    return {"comm_s": statistics.median(runs[0]), "compute_s": statistics.median(runs[1]),
            "together_s": statistics.median(runs[2]), "shares": shares, "share": statistics.median(shares)}


# the skew probe's compute before each collective: small layers forward and backward, as a training
# step runs between its blocking collectives (a tensor-parallel step of the example GPT: 0.2-0.3
# ms of small ops)
SKEW_LAYERS, SKEW_ROWS, SKEW_WIDTH = 2, 512, 64
SKEW_BYTES = 128 << 10  # each collective's size: a small model's activation
# passes of the skew probe over its nine timings (a paired excess per kind and pass; one kind's
# excess read -850 to 670 us over a handful of passes on 4 processes)
SKEW_REPEATS = 5


def small_layers_step(device: torch.device):
    """A step of ``SKEW_LAYERS`` small layers forward and backward (about 0.2-0.4 ms on this
    VM's cores): the compute a training step runs between two blocking collectives, as the
    waiting and skew probes place it."""
    layer = torch.nn.Linear(SKEW_WIDTH, SKEW_WIDTH).to(device)
    h0 = torch.randn(SKEW_ROWS, SKEW_WIDTH, device=device, requires_grad=True)

    def step():
        h = h0
        for _ in range(SKEW_LAYERS):
            h = torch.nn.functional.gelu(layer(h))
        h.sum().backward()
    return step


def probe_skew(spec: MicrobenchSpec, device: torch.device, barrier, meshes: list) -> dict:
    """Seconds of a block of small layers forward and backward (``SKEW_LAYERS``), and per
    collective kind the runtime issues, of one ``SKEW_BYTES`` call alone (back to back) and after
    the block, each waited for as the runtime waits (``runtime.comm.wait_for``): what a
    collective costs a step beyond its back-to-back time. Ranks that arrive from compute arrive
    apart (processes that share cores take turns), the collective waits for the last one, and
    back-to-back calls overlap one call's tail with the next one's start, which a call after
    compute cannot.

    A block of small layers with autograd, not of matmuls: on 2 gloo processes of a 2-core VM,
    polled 128 KiB collectives after 2 such layers (0.38 ms) cost 186-236 us more than back to
    back (on 4 processes 396-481 us), after 20 matmuls (0.37 ms) 64 us; a block of ~1 ms of
    matmuls (this probe's earlier form) read 0-84 us in every calibration, while the GPT's
    ``tp=2`` step ran its 22 blocking collectives 5.8 ms over their back-to-back times. Priced
    offline over two calibrations and their 23 measured plans, a skew of 250 us on 2 processes
    and 400 on 4 gave a median error of 6.6% and 5.1%; the skews those calibrations had read
    (0 and 48 us on 2, 0 and 202 on 4) 9.9% and 10.8%."""
    progress("what a collective waits for ranks arriving from compute")
    compute = small_layers_step(device)

    world, comm, axis = meshes[0]
    fns = [compute]
    for kind in _COMM_KINDS:
        call = _collective_call(comm, kind, SKEW_BYTES, axis, device)

        def both(call=call):
            compute()
            call()
        fns += [call, both]
    # in passes over all of them, each pass's excess (after the block, less the block and the call
    # alone) taken from its own windows: a median over kinds of each kind's medians read 0, 82 and
    # 179 us in three calibrations of a 2-process machine back to back (a collective's time there
    # is 80 us or 4 ms, by chance)
    _, runs = spread_runs(fns, device, min(spec.repeats, SKEW_REPEATS), barrier)
    excess = [both - compute_s - alone for i in range(len(_COMM_KINDS))
              for compute_s, alone, both in zip(runs[0], runs[1 + 2 * i], runs[2 + 2 * i])]
    t = [statistics.median(r) for r in runs]
    return {"compute_s": t[0], "kinds": {kind: t[1 + 2 * i: 3 + 2 * i] for i, kind in enumerate(_COMM_KINDS)},
            "excess": excess}


PIPELINE_MICROBATCHES = (2, 8)  # the two microbatch counts of the pipeline probe
PIPELINE_STAGE_LAYERS = 16  # residual Linear + GELU layers per probe stage: about 1 ms of forward + backward here


class _ProbeStage(torch.nn.Module):
    """A pipeline probe's stage: ``layers`` residual blocks ``h + gelu(linear(h))``, many small ops
    as a transformer stage has (the residual keeps the gradients' scale, so no denormal floats slow
    the first stage's backward)."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for linear in self.blocks:
            h = h + torch.nn.functional.gelu(linear(h))
        return h


def probe_pipeline(spec: MicrobenchSpec, device: torch.device, barrier, meshes: list) -> dict:
    """A two-stage ``torch.distributed.pipelining`` 1F1B step on every pair of ranks at once, at
    ``PIPELINE_MICROBATCHES``; and one stage's forward + backward of one microbatch alone. The
    slope over the microbatch count, less that compute and the two messages a microbatch sends
    (``send_recv``), is what the schedule's actions cost (``Cluster.pipeline_microbatch_s``).

    The stages do a model stage's work per microbatch (``PIPELINE_STAGE_LAYERS`` small layers),
    not one tiny op: a stage that waits longer than the host's idle polling sleeps, and its
    messages then take longer to land. On 2 processes of 2 cores, stages of one ``Linear`` +
    GELU (0.2 ms a microbatch) cost 90-120 us per message beyond the schedule's compute, stages of
    1-4 ms 140-450 us; the example GPT's two stages at 4 microbatches ran 8.3-8.9 ms a step where a
    probe of one ``Linear(16, 16)`` per stage priced 5.8."""
    from torch.distributed import pipelining

    progress("a two-stage pipeline schedule's work per microbatch")
    _, comm, axis = meshes[-1]
    group, stage = comm._group(axis), comm.coords[axis]
    width, rows = 64, 16
    mod = _ProbeStage(width, PIPELINE_STAGE_LAYERS).to(device)
    x1 = torch.randn(rows, width, device=device, requires_grad=True)
    steps = []
    for m in PIPELINE_MICROBATCHES:
        meta_in = torch.empty(rows, width, device="meta", requires_grad=stage == 1)
        meta_out = torch.empty(rows, width, device="meta", requires_grad=True)
        pipe = pipelining.PipelineStage(mod, stage, 2, device, input_args=(meta_in,), output_args=(meta_out,), group=group)
        schedule = pipelining.Schedule1F1B(pipe, m, loss_fn=lambda y, _t: y.sum())
        batch = torch.randn(m * rows, width, device=device)

        def step(schedule=schedule, batch=batch, m=m):
            if stage == 0:
                schedule.step(batch)
            else:
                schedule.step(target=torch.zeros(m, device=device), losses=[])
        steps.append(step)
    # the stage's compute and both schedules in passes, each pass's slope less its own compute:
    # measured apart, the two ~1 ms figures' drift swamped their ~0.5 ms difference (0 and 634 us
    # in two calibrations back to back)
    _, runs = spread_runs([lambda: mod(x1).sum().backward(), *steps], device, spec.repeats, barrier)
    lo, hi = PIPELINE_MICROBATCHES[0], PIPELINE_MICROBATCHES[-1]
    out = {"m": list(PIPELINE_MICROBATCHES), "compute_s": statistics.median(runs[0]),
           "step_s": [statistics.median(r) for r in runs[1:]],
           "excess": [(s_hi - s_lo) / (hi - lo) - c for c, s_lo, s_hi in zip(runs[0], runs[1], runs[-1])]}
    return out
