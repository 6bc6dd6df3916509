"""The measurements ``autopar calibrate`` fits: run on every rank at once, on the real backend.

Every rank measures at the same time, so the figures include what the ranks of a training run
share (on a CPU machine: its cores and memory bandwidth; on a node: its PCIe and NICs). What is
measured, per rank (``measure_rank``):

* fp32 matmuls (``torch.mm``, and ``F.linear`` with its weight stored [n, k]) over a grid of
  (m, k, n) shapes (``gemm_grid``), and a few square
  ones per dtype for each dtype's rate: (flops, seconds);
* attention (``scaled_dot_product_attention``, causal) over a few shapes, forward and forward +
  backward: (batch x heads, flops, seconds, seconds);
* a streaming op (``torch.add(a, b, out=c)``) over sizes: (bytes read + written, seconds);
* fp32 convolutions (``F.conv2d``, 3x3) over a grid of their implicit GEMM's shapes (output
  pixels, input channels x kernel, output channels: ``conv_grid``), forward and forward +
  backward: a CPU convolution's speed is not a matmul's of its FLOPs (``DeviceSpec.conv_table``);
* the common non-matmul ops of training graphs (``MEASURED_OPS``), forward and forward +
  backward, at two sizes: their cost per element;
* a training probe (small linears, GELUs and views, forward + backward with autograd, then
  AdamW's update), SGD's and AdamW's update of one large parameter, and a gradient buffer's
  zeroing and accumulation: what a training step's op costs beyond its arithmetic, and the update
  and the gradient buffer per element (``calibration.training_probe``);
* each collective the runtime issues (through ``runtime.comm.MeshComm``, as the program does) over
  message sizes, on the whole world and, with 4 or more ranks, on pairs: (group size, bytes in
  nccl-tests' convention, seconds); and on pairs (the world, with 2 ranks), one message from one
  rank to the other (``send_recv``: a pipeline stage's send); these, the overlap, the skew and
  the pipeline below in ``calibration.comm_probes``;
* overlap: a collective alone, a block of matmuls alone, then both with the collective in flight;
  and the same of a small (latency-bound) all-reduce beside small layers: whether its waiting hides;
* skew: a block of matmuls, then a tiny blocking collective of each kind: what it waits beyond
  its own time;
* on CPU processes, the host's own time per collective: the runtime's reshards with the network
  left out (``calibration.host_probe``);
* a two-stage 1F1B pipeline of small stages (a model stage's work per microbatch) on every pair at two
  microbatch counts, in passes with the stage's compute: what the schedule costs per microbatch
  beyond compute and messages.

Times are per call on the slowest rank: back-to-back calls between two barriers for at least
20 ms, less what the barriers alone take (``timing.per_op``); each measurement is the median of
``repeats`` such windows (for a table of points, taken in passes over all of them:
``timing.per_op_spread``).
"""
from __future__ import annotations

import torch

from autopar.calibration.timing import MicrobenchSpec, SpreadProbe, agreed_barrier, per_op, per_op_spread, progress

__all__ = ["MicrobenchSpec", "measure_rank", "MATMUL_SHAPES"]

_agreed_barrier = agreed_barrier  # (tests/test_calibrate.py imports it from here)

# (m, k, n): from dispatch-bound to compute-bound on one CPU core
MATMUL_SHAPES = ((16, 64, 64), (64, 64, 256), (128, 256, 256), (256, 256, 1024), (256, 1024, 1024),
                 (512, 1024, 2048))
# (batch, heads, seq, head dim): few pairs and FLOPs, many pairs and few FLOPs, then FLOPs (what
# ``fit_attention`` tells apart: a CPU kernel's cost per (batch, head) pair, and per FLOP)
_ATTENTION_SHAPES = ((2, 4, 32, 16), (16, 8, 32, 16), (4, 4, 128, 32), (4, 8, 128, 64))
# on a GPU, in bf16 (its flash kernel, what mixed-precision training runs): the same three regimes
# at sizes that fill it (the CPU's shapes are launch-bound there: one H100 read 2 TFLOP/s from them)
_ATTENTION_SHAPES_GPU = ((4, 8, 256, 64), (64, 16, 256, 64), (4, 8, 1024, 64), (8, 16, 2048, 64))
ATTENTION_REPEATS = 3  # windows per attention shape and direction (``autopar calibrate`` stays within a minute)
_STREAM_NUMELS = (256, 4096, 65536, 1 << 20, 1 << 22)


GEMM_DIMS = (8, 64, 512, 2048)  # m, k and n of the shape grid (fp32); larger corners are not timed
_GEMM_MAX_MKN = 1 << 30


def gemm_grid(quick: bool = False) -> list[tuple[int, int, int]]:
    """The (m, k, n) shapes timed for ``DeviceSpec.matmul_table``: every combination of
    ``GEMM_DIMS`` up to ``_GEMM_MAX_MKN`` multiply-adds (a matmul's cost depends on its shape, not
    only its FLOPs: a weight gradient with a small inner dimension runs far below peak)."""
    dims = GEMM_DIMS[1:3] if quick else GEMM_DIMS
    return [(m, k, n) for m in dims for k in dims for n in dims if m * k * n <= _GEMM_MAX_MKN]


# windows per shape and layout: a matmul's time moves 7-12% between calibrations, a collective's
# ~30%; the grid's 60 shapes at 5 windows each took a third of `autopar calibrate`'s minute on 4
# processes, its 120 (both layouts) at 3 windows 16 s, at 2 windows 12 s
GEMM_REPEATS = 2
COLD_BYTES = 64 * 2**20  # operands cycled through per shape: more than a CPU's last-level cache


def _gemm_table(spec: MicrobenchSpec, device: torch.device, barrier) -> dict[str, list]:
    """{"gemm": [(m, k, n, seconds)] of fp32 ``torch.mm`` over ``gemm_grid``, "gemm_linear": the
    same of ``F.linear`` (no bias) with its [n, k] weight: nn.Linear's forward, ``x @ W.T``; on a
    CPU a few rows against a 4 MiB weight ran at half the speed of ``torch.mm``}, with cold operands: each call
    takes the next of as many (a, b) pairs as fill ``COLD_BYTES`` (views into one random pool), as
    a training step meets each weight once per pass, long evicted from cache. With the same
    operands every call, a skinny matmul (a microbatch's few rows against a 4 MiB weight) reads
    its weight from cache and runs at twice the speed it has in training."""
    progress(f"{len(gemm_grid(spec.quick))} matmul shapes, as torch.mm and as nn.Linear's forward")
    pool = torch.randn(COLD_BYTES // 4 + (2048 * 2048 * 2), device=device)
    keys, calls = [], []  # ((table, m, k, n), closure): timed in passes over all of them
    for m, k, n in gemm_grid(spec.quick):
        pair = m * k + k * n
        copies = max(1, min(64, COLD_BYTES // 4 // pair))
        operands = [(pool[i * pair: i * pair + m * k].view(m, k), pool[i * pair + m * k: (i + 1) * pair])
                    for i in range(copies)]
        for key, op in (("gemm", lambda a, b, k=k, n=n: torch.mm(a, b.view(k, n))),
                        ("gemm_linear", lambda a, w, k=k, n=n: torch.nn.functional.linear(a, w.view(n, k)))):
            turn = [0]

            def call(op=op, turn=turn, operands=operands):
                a, b = operands[turn[0] % len(operands)]
                turn[0] += 1
                return op(a, b)

            keys.append((key, m, k, n))
            calls.append(call)
    rows: dict[str, list] = {"gemm": [], "gemm_linear": []}
    for (key, m, k, n), t in zip(keys, per_op_spread(calls, device, min(spec.repeats, GEMM_REPEATS), barrier)):
        rows[key].append((m, k, n, t))
    return rows


# the convolution grid: 3x3 kernels (padding 1, stride 1) on CONV_IMAGE x CONV_IMAGE images; batch,
# input and output channels per axis: the implicit GEMM's m (batch x pixels), k (input channels x
# 9) and n (output channels) from a few channels, where a CPU convolution runs at a small share of
# a matmul's rate, to many
CONV_IMAGE = 16
CONV_BATCHES, CONV_CHANNELS = (1, 4, 16), (4, 16, 64)
CONV_KERNEL = 3
_CONV_MAX_MKN = 1 << 27  # multiply-adds of the largest convolution timed (a corner not timed takes the best)
CONV_REPEATS = 3


def conv_grid(quick: bool = False) -> list[tuple[int, int, int]]:
    """(batch, input channels, output channels) of the convolutions timed for
    ``DeviceSpec.conv_table``: every combination of ``CONV_BATCHES`` and ``CONV_CHANNELS`` (quick:
    the first two of each) up to ``_CONV_MAX_MKN`` multiply-adds."""
    batches, channels = (CONV_BATCHES[:2], CONV_CHANNELS[:2]) if quick else (CONV_BATCHES, CONV_CHANNELS)
    return [(b, ci, co) for b in batches for ci in channels for co in channels
            if b * CONV_IMAGE**2 * ci * CONV_KERNEL**2 * co <= _CONV_MAX_MKN]


def _conv_table(spec: MicrobenchSpec, device: torch.device, barrier) -> list[tuple]:
    """[(m, k, n, forward seconds, forward + backward seconds)] of fp32 ``F.conv2d`` over
    ``conv_grid``, m = batch x output pixels, k = input channels x kernel elements, n = output
    channels (its implicit GEMM's shape, as ``planner.costing`` reads a convolution node); the
    backward computes the input's and the weight's gradients, as a convolution inside a network does."""
    grid = conv_grid(spec.quick)
    progress(f"{len(grid)} convolution shapes, forward and backward")
    conv = torch.nn.functional.conv2d
    keys, fns = [], []
    for b, ci, co in grid:
        x = torch.randn(b, ci, CONV_IMAGE, CONV_IMAGE, device=device, requires_grad=True)
        w = torch.randn(co, ci, CONV_KERNEL, CONV_KERNEL, device=device, requires_grad=True)
        grad = torch.randn(b, co, CONV_IMAGE, CONV_IMAGE, device=device)

        def fwd(x=x, w=w):
            with torch.no_grad():
                return conv(x, w, padding=CONV_KERNEL // 2)

        def both(x=x, w=w, grad=grad):  # autograd.grad: no accumulation into leaves' .grad
            return torch.autograd.grad(conv(x, w, padding=CONV_KERNEL // 2), (x, w), grad)

        keys.append((b * CONV_IMAGE**2, ci * CONV_KERNEL**2, co))
        fns += [fwd, both]
    times = per_op_spread(fns, device, min(spec.repeats, CONV_REPEATS), barrier)
    return [(m, k, n, times[2 * i], times[2 * i + 1]) for i, (m, k, n) in enumerate(keys)]


def _compute(spec: MicrobenchSpec, device: torch.device, barrier) -> dict:
    progress("matmuls, attention and streaming ops")
    shapes = MATMUL_SHAPES[:4] if spec.quick else MATMUL_SHAPES
    out: dict = {"matmul": {}, "attention": [], "attention_grad": [], "stream": [], **_gemm_table(spec, device, barrier)}
    for dtype_name in ("float32",) + tuple(spec.dtypes):
        dtype = getattr(torch, dtype_name)
        rows = []
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            rows.append((2.0 * m * k * n, per_op(lambda: torch.mm(a, b), device, spec.repeats, barrier=barrier)))
        out["matmul"][dtype_name] = rows
    sdpa = torch.nn.functional.scaled_dot_product_attention
    shapes, att_dtype = (_ATTENTION_SHAPES, torch.float32) if device.type == "cpu" else (_ATTENTION_SHAPES_GPU,
                                                                                        torch.bfloat16)
    for b, h, s, d in shapes[:3] if spec.quick else shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=att_dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device=device, dtype=att_dtype)
        flops = 4.0 * b * h * s * s * d * 0.5  # causal: as planner.costing counts it
        with torch.no_grad():
            fwd = per_op(lambda: sdpa(q, k, v, is_causal=True), device, min(spec.repeats, ATTENTION_REPEATS),
                          barrier=barrier)
        # autograd.grad: the backward kernel without accumulating into leaves' .grad
        both = per_op(lambda: torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad), device,
                       min(spec.repeats, ATTENTION_REPEATS), barrier=barrier)
        out["attention"].append((flops, fwd))
        out["attention_grad"].append((float(b * h), flops, fwd, both))
    if device.type == "cpu":  # a GPU's convolutions: priced by their FLOPs (cuDNN's implicit GEMMs)
        out["conv"] = _conv_table(spec, device, barrier)
    for numel in _STREAM_NUMELS[:4] if spec.quick else _STREAM_NUMELS:
        x, y, z = (torch.randn(numel, device=device) for _ in range(3))
        out["stream"].append((3.0 * numel * 4, per_op(lambda: torch.add(x, y, out=z), device, spec.repeats,
                                                       barrier=barrier)))
    return out


# Ops whose cost per element is measured (forward, and forward + backward, at two sizes: the
# slope is the per-element cost, the fixed cost is op_overhead's): the traced graph's op names
# (``node_view.op_name``) of the common non-matmul ops of training graphs.
OP_SIZES = ((16, 1024), (256, 1024))  # (rows, width): 16 Ki and 256 Ki elements
OP_SIZES_GPU = ((1024, 1024), (8192, 1024))  # 1 Mi and 8 Mi: a GPU's kernels launch-bound below that
OP_REPEATS = 3  # windows per op and size (a slope over two sizes; ``autopar calibrate`` stays within a minute)


def _op_probe(name: str, rows: int, width: int, device: torch.device, pool: torch.Tensor):
    """(forward callable returning the output, elements) of op ``name`` on a [rows, width] input;
    elements: the largest of its input and output numels (as ``planner.costing`` counts them).
    Cold operands, as for the matmuls (``COLD_BYTES``): each call takes the next of as many
    operand sets as fill ``pool`` (views into it; one process here, 256 Ki
    elements, forward + backward: GELU 2.01 ns per element cold vs 1.66 warm, an add 0.81 vs 0.46)."""
    per = 2 * rows * width
    copies = max(1, min(64, pool.numel() // per))
    turns = [_op_operands(name, pool[i * per: (i + 1) * per].view(2, rows, width), device) for i in range(copies)]
    turn = [0]

    def call():
        op = turns[turn[0] % copies]
        turn[0] += 1
        return op()

    return call, rows * width


def _op_operands(name: str, xy: torch.Tensor, device: torch.device):
    """Op ``name`` as a closure over its own operands: ``xy[0]`` and ``xy[1]`` ([rows, width])."""
    F = torch.nn.functional
    rows, width = xy.shape[1:]
    x, y = xy[0].requires_grad_(), xy[1].requires_grad_()
    w = torch.ones(width, device=device, requires_grad=True)
    b = torch.zeros(width, device=device, requires_grad=True)
    table = torch.randn(512, width, device=device, requires_grad=True) if name == "embedding" else None
    idx = torch.randint(0, 512, (rows,), device=device)
    target = torch.randint(0, width, (rows,), device=device)
    stats = (torch.zeros(BN_CHANNELS, device=device), torch.ones(BN_CHANNELS, device=device))  # running mean, var
    ops = {
        "gelu": lambda: F.gelu(x), "relu": lambda: F.relu(x), "silu": lambda: F.silu(x),
        "tanh": lambda: torch.tanh(x), "sigmoid": lambda: torch.sigmoid(x),
        "add": lambda: x + y, "mul": lambda: x * y,
        "layer_norm": lambda: F.layer_norm(x, (width,), w, b), "rms_norm": lambda: F.rms_norm(x, (width,), w),
        "softmax": lambda: F.softmax(x, -1), "log_softmax": lambda: F.log_softmax(x, -1),
        "cross_entropy_loss": lambda: F.cross_entropy(x, target),
        "embedding": lambda: F.embedding(idx, table),
        "dropout": lambda: F.dropout(x, 0.1, training=True),
        # a convolution network's: [rows, 16 channels, 8, width / 128], statistics over all but the channels
        "batch_norm": lambda: F.batch_norm(x.view(rows, BN_CHANNELS, 8, -1), stats[0], stats[1], w[:BN_CHANNELS],
                                           b[:BN_CHANNELS], training=True),
    }
    return ops[name]


MEASURED_OPS = ("gelu", "relu", "silu", "tanh", "sigmoid", "add", "mul", "layer_norm", "rms_norm", "softmax",
                "log_softmax", "cross_entropy_loss", "embedding", "dropout", "batch_norm")
BN_CHANNELS = 16  # batch_norm's probe: channels of its [rows, channels, 8, width / 128] input


def _op_costs(spec: MicrobenchSpec, device: torch.device, barrier) -> dict:
    """Per op of ``MEASURED_OPS``: [(elements, forward seconds, forward + backward seconds)] at
    each of ``OP_SIZES`` (a GPU: ``OP_SIZES_GPU``)."""
    names = MEASURED_OPS[:3] if spec.quick else MEASURED_OPS
    progress(f"{len(names)} common ops, forward and backward")
    out = {}
    sizes_here = OP_SIZES if device.type == "cpu" else OP_SIZES_GPU
    # at least one operand set of the largest size (a GPU's: 64 MiB, what COLD_BYTES holds)
    pool = torch.randn(max(COLD_BYTES // 4, 2 * max(r * w for r, w in sizes_here)), device=device)
    for name in names:
        fns, sizes = [], []
        for r, w in sizes_here:
            fwd, elements = _op_probe(name, r, w, device, pool)
            grad = torch.ones_like(fwd())

            def both(fwd=fwd, grad=grad):
                fwd().backward(grad)

            fns += [fwd, both]
            sizes.append(elements)
        # an op's four timings in passes: one set of idle windows per pass, not per timing (on 4
        # processes a barrier takes milliseconds)
        times = per_op_spread(fns, device, min(spec.repeats, OP_REPEATS), barrier)
        out[name] = [(e, times[2 * i], times[2 * i + 1]) for i, e in enumerate(sizes)]
    return out


def measure_rank(spec: MicrobenchSpec) -> dict:
    """This rank's measurements (run under ``autopar.launch`` or torchrun on every rank at once;
    initialises the process group on ``spec.backend`` unless one exists)."""
    import os

    import torch.distributed as dist

    from autopar.calibration.comm_probes import (probe_collectives, probe_meshes, probe_overlap, probe_pipeline, probe_skew,
                                                 probe_waiting)
    from autopar.calibration.cpu_cache import last_level_cache_bytes
    from autopar.calibration.host_probe import collective_host_s
    from autopar.calibration.training_probe import training_ops
    from autopar.runtime.cpu_affinity import node_cores
    from autopar.runtime.comm import runs_nccl
    from autopar.runtime.launch import init_distributed

    if spec.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_distributed(spec.backend, int(os.environ.get("WORLD_SIZE", "1")))
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if runs_nccl() else torch.device("cpu")
    barrier = agreed_barrier(world)
    cores = node_cores()  # the node's, before init_distributed pinned this rank to its share
    spread = SpreadProbe(device, barrier)  # sampled again after each later part
    a, b = torch.randn(SPEED_SHAPE[:2], device=device), torch.randn(SPEED_SHAPE[1:], device=device)
    spread.add(SPEED_PROBE, lambda: torch.mm(a, b), SPEED_REPEATS, SPEED_WINDOW_S)  # the machine's speed, throughout
    compute = _compute(spec, device, barrier)
    spread.sample()
    out = {"world": world, "device_type": device.type, "compute": compute,
           # the CPU cores this node's ranks share, and the processes on the node
           "cores": cores, "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
           "shared_cache_bytes": last_level_cache_bytes() if device.type == "cpu" else None,
           "training": training_ops(spec, device, barrier, spread), "ops": _op_costs(spec, device, barrier)}
    spread.sample()
    if world > 1:
        meshes = probe_meshes(world, device)  # built once: each mesh of pairs is a new set of process groups
        out["collectives"] = probe_collectives(spec, device, barrier, meshes)
        spread.sample()
        out["overlap"] = probe_overlap(spec, device, barrier, world)
        spread.sample()
        out["waiting"] = probe_waiting(spec, device, barrier, world)
        spread.sample()
        out["skew"] = probe_skew(spec, device, barrier, meshes)
        spread.sample()
        # a GPU's host runs ahead of its streams: its time per collective is hidden, not priced
        if device.type == "cpu":
            out.update(collective_host_s(spec, device, barrier, world))
            spread.sample()
        if world % 2 == 0:
            out["pipeline"] = probe_pipeline(spec, device, barrier, meshes)
            spread.sample()
    out["training"].update(spread.medians())
    out["speed"] = spread.windows(SPEED_PROBE)
    return out


# the speed probe: one fp32 matmul timed at the start and again after every part of the
# calibration (``SpreadProbe``): how much the machine's speed moved while it was measured
SPEED_PROBE = "speed_matmul_s"
SPEED_SHAPE = (256, 256, 512)  # (m, k, n): compute-bound on a CPU core, ~1-4 ms
SPEED_REPEATS = 3
SPEED_WINDOW_S = 0.05  # long enough for 4 processes on 2 cores to take several turns inside it
