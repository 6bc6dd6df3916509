"""``autopar bench``: autopar's plan beside the baselines, in one run, one table.

    autopar bench [--model gpt|mlp|MODULE:FACTORY] [--nproc 4] [--steps 60] [--memory-limited [--memory MIB]]
                  [--also dp=4,tp=1,zero=0 ...]

On ``nproc`` local gloo processes, from the same weights and the same global batch, with AdamW:
naive data parallelism (``testing.baselines.naive_dp``), torch DDP, FSDP2 ``fully_shard``,
hand-written tensor parallelism (``parallelize_module``, where the model has a hand plan) and
autopar's free plan (and, with ``--also``, autopar under forced constraints: is a gap the
plan's choice or the runtime's?). Every setup warms up, has one step measured for memory, then all are timed
in interleaved rounds (A, B, C, ..., A, B, C, ... so that they share the machine's drift), each
step after a barrier. One row per setup:

* step time: the slowest rank's median, ms;
* peak memory per rank: the worst rank's peak over one step, MiB, measured with the same
  ``MemoryTracker`` for every row (tensor storages: parameters, gradients, optimizer state and
  everything a step allocates; DTensors by their local shards, ``memory_tracker.MemoryTracker``);
* communication share: seconds blocked in collectives over step time, mean over ranks, where it
  can be measured honestly (autopar's ``CommStats``; naive DP's timed all-reduces; DDP by
  difference with ``no_sync()``), otherwise "n/a" with the reason as a footnote;
* speedup vs naive data parallelism (its step time / the row's);
* predicted vs measured: autopar's plan's predicted step time, peak and communication share, and
  the plan's naive-DP prediction for the naive row.

``--memory-limited``: a parameter-heavy model (the MLP unless ``--model`` says otherwise) on
devices whose memory is set (``Cluster.device.memory_bytes``) to ``memory_limited_fraction`` of
what a whole replica's parameters, gradients and optimizer state need (or ``--memory`` MiB).
Naive data parallelism and DDP are refused by a pre-check stating needed vs available bytes
(``baselines.replicated_state_fit``); autopar plans under the limit and its measured peak is
shown beside it.

Module layout: the baselines live in ``testing.baselines`` (constructors, the eager step, the
memory pre-check and measurement); this module holds the benchmark's models, the measuring loop
(``time_interleaved``), the worker that runs every setup on a rank, and the table
(``format_table``, pure).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import math
import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["BenchSpec", "Row", "format_table", "bench_worker", "run_bench", "load_bench_model", "BENCH_MODELS",
           "memory_limited_fraction", "time_steps", "time_interleaved", "parse_constraints"]

MIB = 2.0**20


def memory_limited_fraction(world: int) -> float:
    """The share of a whole replica's parameters + gradients + optimizer state that
    ``--memory-limited`` gives each of ``world`` devices: 1.4 / world (at most 0.75). That is 40%
    above the fully sharded state (1 / world; autopar plans for 90% of a device: 26% of the
    sharded state left for activations and step temporaries), and on 4 or more devices below the
    parameters and gradients alone (half of it with Adam), so that only sharded parameters (ZeRO-3
    or tensor parallelism) fit; on 2 devices (0.7) sharding the optimizer state is enough."""
    return min(0.75, 1.4 / world)


def _gpt():
    """The example GPT (``GPTConfig()``: 2 layers x 64, vocabulary 256, sequence 32), batch 16."""
    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    cfg = GPTConfig()
    idx, tgt = example_batch(cfg, 16)
    return GPT(cfg), (idx,), gpt_loss, tgt


def _mlp():
    """The parameter-heavy MLP (dim 512, hidden 2048, 4 residual layers: 8.4M parameters), batch 32."""
    from examples.mlp import MLP, example_batch, mlp_loss

    x, t = example_batch(512, 32)
    return MLP(512, 2048, 4), (x,), mlp_loss, t


BENCH_MODELS: dict[str, Callable] = {"gpt": _gpt, "mlp": _mlp}


def load_bench_model(name: str):
    """(model, example_inputs, loss_fn, target) for "gpt", "mlp" or a ``MODULE:FACTORY`` returning
    that 4-tuple (the global batch: every rank gets the same one)."""
    from autopar.errors import AutoparError

    if name in BENCH_MODELS:
        return BENCH_MODELS[name]()
    from autopar.factory import call_factory

    model, inputs, loss_fn, target = call_factory(name)
    if loss_fn is None:
        raise AutoparError(f"autopar bench needs a loss: {name} must return (model, example_inputs, loss_fn, "
                           "example_target), the global batch, so that every setup trains the same step")
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), loss_fn, target


@dataclass(frozen=True)
class BenchSpec:
    """What to run. ``steps``: timed steps per setup, in ``rounds`` interleaved rounds, after
    ``warmup`` untimed ones. ``memory_bytes``: the per-device memory of the cluster autopar plans
    for, and that the replicated baselines are checked against. ``memory_limited`` without ``memory_bytes``:
    ``memory_limited_fraction(world)`` of a whole replica's training state. Neither:
    ``Cluster.local``'s RAM / nproc. ``also``: constraint strings (``"dp=4,tp=1,zero=0"``), each
    an extra autopar row with its plan forced, to tell the plan's choice from the runtime."""

    model: str = "gpt"
    steps: int = 60  # on a shared CPU machine 20 steps spread 0.91-1.32x between runs, 60 0.90-1.05x
    rounds: int = 4
    warmup: int = 2
    memory_limited: bool = False
    memory_bytes: int | None = None
    also: tuple[str, ...] = ()
    seed: int = 0
    lr: float = 1e-3

    def __post_init__(self):
        from autopar.errors import AutoparError

        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise AutoparError(f"--steps must be a positive integer, got {self.steps!r}")
        if not (isinstance(self.warmup, int) and self.warmup >= 1):
            raise AutoparError(f"warmup must be at least 1 step (Adam makes its state in the first), got {self.warmup!r}")
        for text in self.also:
            parse_constraints(text)
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise AutoparError(f"--memory must be a positive number of MiB, got {self.memory_bytes / MIB:g}")


@dataclass(frozen=True)
class Row:
    """One setup's figures (None: not measured or not predicted). ``not_run``: the short reason a
    row has no measurement ("refused", "n/a"), with the long one in ``notes``; ``notes``: footnotes
    (how the communication share was measured, why not, why the row did not run)."""

    key: str
    name: str
    step_s: float | None = None
    peak_bytes: float | None = None
    comm_share: float | None = None
    predicted_step_s: float | None = None
    predicted_peak_bytes: float | None = None
    predicted_comm_share: float | None = None
    not_run: str = ""
    notes: tuple[str, ...] = ()


def _ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1e3:.1f}"


def _mib(b: float | None) -> str:
    return "—" if b is None else f"{b / MIB:.2f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.1f}%"


def format_table(rows: list[Row], *, title: str = "", limit_bytes: float | None = None,
                 footer: tuple[str, ...] = ()) -> str:
    """The bench's Markdown table: one line per row, footnotes [1], [2], ... under it.

    >>> print(format_table([Row("naive", "naive data parallel", 0.2, 2**20, 0.5), Row("x", "x", 0.1, 2**20, None,
    ...                     notes=("why",))]).splitlines()[2])
    | naive data parallel | 200.0 | 1.00 | 50.0% | 1.00 | — | — | — | — |
    """
    notes: list[str] = []

    def mark(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    naive = next((r for r in rows if r.key == "naive" and r.step_s), None)
    head = ["setup", "step ms (median)", "peak MiB / rank", "comm %", "speedup vs naive", "predicted ms",
            "measured / predicted", "predicted peak MiB", "predicted comm %"]
    if limit_bytes is not None:
        head.insert(3, f"within {limit_bytes / MIB:.1f} MiB")
    lines = [f"| {' | '.join(head)} |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        marks = "".join(mark(n) for n in r.notes)
        if r.not_run:
            step, comm = f"{r.not_run} {marks}".strip(), "—"
        else:
            step = _ms(r.step_s)
            comm = (_pct(r.comm_share) if r.comm_share is not None else "n/a") + (f" {marks}" if marks else "")
        cells = [r.name, step, _mib(r.peak_bytes), comm,
                 f"{naive.step_s / r.step_s:.2f}" if naive and r.step_s else "—",
                 _ms(r.predicted_step_s),
                 f"{r.step_s / r.predicted_step_s:.2f}" if r.step_s and r.predicted_step_s else "—",
                 _mib(r.predicted_peak_bytes), _pct(r.predicted_comm_share)]
        if limit_bytes is not None:
            cells.insert(3, "—" if r.peak_bytes is None else ("yes" if r.peak_bytes <= limit_bytes else "**no**"))
        lines.append(f"| {' | '.join(cells)} |")
    out = ([title, ""] if title else []) + lines
    if notes:
        out += [""] + [f"[{i + 1}] {n}" for i, n in enumerate(notes)]
    if footer:
        out += [""] + list(footer)
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- timing
def time_steps(step: Callable[[], Any], steps: int, comm_s: Callable[[], float] | None = None,
               warmup: int = 0) -> tuple[list[float], list[float]]:
    """Run ``warmup`` untimed steps, then ``steps`` steps each after a barrier (every rank starts
    together); return the wall seconds of each, and the seconds blocked in communication during
    each (``comm_s``: a running total; empty without it)."""
    import time

    import torch.distributed as dist

    for _ in range(warmup):
        step()
    walls, comms = [], []
    for _ in range(steps):
        dist.barrier()
        c0 = comm_s() if comm_s is not None else 0.0
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
        if comm_s is not None:
            comms.append(comm_s() - c0)
    return walls, comms


def time_interleaved(timed: dict[str, tuple[Callable, Callable | None]], steps: int, rounds: int,
                     warmup: int = 0) -> tuple[dict[str, list], dict[str, list]]:
    """``timed``: name -> (step, running seconds blocked in communication or None). Each runs
    ``warmup`` untimed steps, then ``rounds`` rounds of ``ceil(steps / rounds)`` timed steps, all
    setups one after another in each round (their order rotated from round to round) so that
    they share the machine's drift. Returns (wall seconds, blocked seconds) per step per name."""
    for step, _ in timed.values():
        for _ in range(warmup):
            step()
    per_round = math.ceil(steps / rounds)
    walls: dict[str, list] = {k: [] for k in timed}
    comms: dict[str, list] = {k: [] for k in timed}
    order = list(timed)
    for r in range(rounds):
        gc.collect()  # what the last round left to the cyclic collector, not in the next one's steps
        shift = r % max(len(order), 1)
        for k in order[shift:] + order[:shift]:
            w, c = time_steps(timed[k][0], per_round, timed[k][1])
            walls[k] += w
            comms[k] += c
    return walls, comms


# ---------------------------------------------------------------------------------------------- the worker
_COMM_AUTOPAR = "autopar's CommStats: seconds blocked in each collective and in each asynchronous one's wait"
_ORDER = ("naive", "ddp", "fsdp2", "tp", "autopar")
_NAMES = {"naive": "naive data parallel", "ddp": "torch DDP", "fsdp2": "torch FSDP2 fully_shard",
          "tp": "torch parallelize_module (hand TP)", "autopar": "autopar (free plan)"}


def parse_constraints(text: str) -> dict[str, int]:
    """``"dp=4,tp=1,zero=0"`` -> ``{"dp": 4, "tp": 1, "zero": 0}`` (``--also``: integer constraints)."""
    from autopar.constraints import Constraints
    from autopar.errors import ConstraintError

    known = [f.name for f in dataclasses.fields(Constraints) if f.type in ("int | None", int)]
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = (x.strip() for x in part.partition("="))
        if not eq or not value.isdigit() or key not in known:
            raise ConstraintError(f"--also {text!r}: expected KEY=INT pairs separated by commas, KEY one of "
                                  f"{', '.join(known)} (e.g. dp=4,tp=1,zero=0); got {part!r}")
        out[key] = int(value)
    Constraints(**out)  # its own checks (zero in 0..3, positive degrees)
    return out


def _predicted(pred) -> dict:
    """A plan's (or its naive baseline's) predicted step time, peak and communication share."""
    if pred is None:
        return {}
    comm = pred.blocking_comm_s + pred.exposed_comm_s
    return {"predicted_step_s": pred.step_time_s, "predicted_peak_bytes": pred.peak_memory_bytes,
            "predicted_comm_share": comm / pred.step_time_s if pred.step_time_s > 0 else None}


def _plan_lines(plan) -> list[str]:
    keep = ("mesh ", "parameters:", "pipeline:")
    return [line for line in plan.summary().splitlines() if line.startswith(keep)]


@dataclass
class _Bench:
    """One rank's setups, and the rows of those that could not run."""

    setups: dict
    rows: dict
    models: dict  # key -> ParallelModel (autopar rows)


def _build(spec: BenchSpec, model, inputs, loss_fn, target, make_opt, cluster, fit) -> _Bench:
    """Every setup from copies of ``model``; the replicated ones only where ``fit`` says they fit."""
    import autopar
    from autopar.errors import AutoparError
    from autopar.testing import baselines as bl

    world = cluster.world_size
    b = _Bench({}, {}, {})

    def unrun(key: str, short: str, why: str, name: str | None = None) -> None:
        b.rows[key] = Row(key, name or _NAMES[key], not_run=short, notes=(why,))

    for key, build in (("naive", bl.naive_dp), ("ddp", bl.ddp)):
        if not fit.fits:
            unrun(key, "refused", f"{_NAMES[key]}: {fit.describe()}")
            continue
        try:
            b.setups[key] = build(copy.deepcopy(model), make_opt, loss_fn, inputs, target)
        except AutoparError as exc:
            unrun(key, "n/a", f"{_NAMES[key]}: {exc}")
    try:
        b.setups["fsdp2"] = bl.fsdp2(copy.deepcopy(model), make_opt, loss_fn, inputs, target)
    except AutoparError as exc:
        unrun("fsdp2", "n/a", f"FSDP2: {exc}")
    tp_plan, why = bl.hand_tp_plan(model, world)
    if tp_plan is None:
        unrun("tp", "n/a", f"hand tensor parallelism: {why}")
    else:
        b.setups["tp"] = bl.tensor_parallel(copy.deepcopy(model), make_opt, loss_fn, inputs, target, tp_plan)
    plans = [("autopar", _NAMES["autopar"], {})]  # the free plan, then any forced by --also
    for text in spec.also:
        c = parse_constraints(text)
        plans.append((f"autopar:{text}", f"autopar Constraints({', '.join(f'{k}={v}' for k, v in c.items())})", c))
    for key, name, constraints in plans:
        try:
            pm = autopar.compile(copy.deepcopy(model), cluster, inputs, loss_fn=loss_fn, example_target=target,
                                 optimizer=make_opt, constraints=autopar.Constraints(**constraints))
        except AutoparError as exc:
            unrun(key, "n/a", f"{name}: {type(exc).__name__}: {exc}", name)
            continue
        b.models[key] = pm
        b.setups[key] = bl.Setup(name, functools.partial(pm.train_step, *inputs, target=target),
                                 comm_s=functools.partial(_blocked_s, pm), comm_note=_COMM_AUTOPAR)
    return b


def _blocked_s(pm) -> float:
    return sum(pm.comm.stats.seconds.values())


def _warm_up_and_measure_memory(b: _Bench, spec: BenchSpec, inputs, target) -> tuple[dict, dict]:
    """Warm every setup up (Adam makes its state in its first step; the first step is every setup's
    same step: its loss is returned), then measure one step of each under the memory tracker.
    DDP's last warm-up step is a synchronised one: its gradients are then the views of its buckets,
    which the tracker sees. Returns (first loss, peak bytes) per setup."""
    from autopar.testing.baselines import measure_setup_memory

    first_loss = {}
    for k, s in b.setups.items():
        first_loss[k] = s.step()
        if s.without_comm is not None:
            s.without_comm()
        for _ in range(max(spec.warmup - 1, 1 if s.without_comm is not None else 0)):
            s.step()
    peaks = {}
    for k, s in b.setups.items():
        pm = b.models.get(k)
        if pm is None:
            peaks[k] = measure_setup_memory(s).peak_bytes
        else:  # this process holds every setup at once: autopar's own storages, as the baselines' are counted
            m = pm.measure_step(*inputs, target=target).memory
            peaks[k] = m.peak_bytes - m.unaccounted_bytes
    return first_loss, peaks


def _rows(b: _Bench, gathered: list, plan) -> list[Row]:
    """The table's rows from every rank's (median step, communication share, peak) per setup."""
    rows = dict(b.rows)
    for k, s in b.setups.items():
        shares = [g[k][1] for g in gathered]
        pred = {}
        if k in b.models:
            pred = _predicted(b.models[k].plan.predicted)
        elif k == "naive" and plan is not None:
            pred = _predicted(plan.baseline.predicted)
        rows[k] = Row(k, s.name, step_s=max(g[k][0] for g in gathered), peak_bytes=max(g[k][2] for g in gathered),
                      comm_share=None if shares[0] is None else statistics.fmean(shares),
                      notes=(s.comm_note,) if s.comm_note else (), **pred)
    if "naive" in rows and rows["naive"].not_run and plan is not None:
        rows["naive"] = dataclasses.replace(rows["naive"], **_predicted(plan.baseline.predicted))
    return [rows[k] for k in _ORDER if k in rows] + [r for k, r in rows.items() if k not in _ORDER]


def bench_worker(spec: BenchSpec) -> dict[str, Any]:
    """One rank of ``autopar bench`` (run it under ``autopar.launch``): builds every setup from the
    same weights, measures them, and returns on every rank ``{"rows": [Row], "title", "limit_bytes",
    "footer"}`` (the figures gathered over the ranks)."""
    import torch.distributed as dist

    import autopar
    from autopar.testing import baselines as bl
    from autopar.runtime.launch import init_distributed

    world = int(os.environ["WORLD_SIZE"])
    init_distributed("gloo", world)
    torch.manual_seed(spec.seed)
    model, inputs, loss_fn, target = load_bench_model(spec.model)
    bl.make_replicas_equal(model)
    make_opt = functools.partial(_adamw, lr=spec.lr)
    cluster = autopar.Cluster.local(world)
    fit = bl.replicated_state_fit(model, make_opt, cluster.device.memory_bytes)
    limit = spec.memory_bytes
    if limit is None and spec.memory_limited:
        limit = int(memory_limited_fraction(world) * fit.needed_bytes)
    if limit is not None:
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=int(limit)))
        fit = dataclasses.replace(fit, available_bytes=int(limit))

    b = _build(spec, model, inputs, loss_fn, target, make_opt, cluster, fit)
    first_loss, peaks = _warm_up_and_measure_memory(b, spec, inputs, target)
    timed = {}
    for k, s in b.setups.items():
        timed[k] = (s.step, s.comm_s)
        if s.without_comm is not None:
            timed[k + ":alone"] = (s.without_comm, None)
    rounds = max(1, min(spec.rounds, spec.steps))
    walls, comms = time_interleaved(timed, spec.steps, rounds)
    mine = {}
    for k, s in b.setups.items():
        median = statistics.median(walls[k])
        if s.comm_s is not None:
            share = sum(comms[k]) / sum(walls[k])
        elif s.without_comm is not None:  # exposed communication by difference (clamped at 0: noise)
            share = max(0.0, 1.0 - statistics.median(walls[k + ":alone"]) / median)
        else:
            share = None
        mine[k] = (median, share, peaks[k])
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    plan = b.models["autopar"].plan if "autopar" in b.models else None
    rows = _rows(b, gathered, plan)
    for pm in b.models.values():
        pm.close()

    params = sum(p.numel() for p in model.parameters())
    batch = next((x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim()), None)
    title = (f"autopar bench: {type(model).__name__} ({params / 1e6:.2f}M parameters, global batch {batch}), {world} gloo "
             f"processes, AdamW; median of {len(next(iter(walls.values()), []))} timed steps per setup in {rounds} "
             f"interleaved rounds after {spec.warmup} warm-up step(s)")
    footer = []
    if limit is not None:
        footer.append(f"memory limit: {limit / MIB:.1f} MiB per device (Cluster.device.memory_bytes; autopar plans for "
                      f"90% of it)")
    if plan is not None:
        footer.append("autopar's plan: " + "; ".join(_plan_lines(plan)))
        footer.append(f"the plan's naive data-parallel prediction: {plan.baseline.note}")
    losses = list(first_loss.values())
    if losses:
        spread = (max(losses) - min(losses)) / max(abs(statistics.fmean(losses)), 1e-12)
        footer.append(f"every row trains the same model from the same weights on the same global batch: first-step "
                      f"loss {losses[0]:.6f} ({len(losses)} setups, relative spread {spread:.1e})")
    footer.append("step time: the slowest rank's median; peak: the worst rank, one step, every tensor storage "
                  "(the same tracker for every row: autopar.memory_tracker.MemoryTracker, for DTensors their local "
                  "shards, memory_tracker.MemoryTracker); comm %: mean over the ranks")
    return {"rows": rows, "title": title, "limit_bytes": limit, "footer": tuple(footer)}


def _adamw(params, lr: float):
    return torch.optim.AdamW(params, lr=lr)


def run_bench(spec: BenchSpec, nproc: int, timeout_s: float = 1800.0) -> tuple[str, dict]:
    """Launch ``nproc`` local gloo processes running ``bench_worker(spec)``; return (the table, rank
    0's result)."""
    from autopar.runtime.launch import launch

    result = launch(bench_worker, nproc, spec, timeout_s=timeout_s)[0]
    return format_table(result["rows"], title=result["title"], limit_bytes=result["limit_bytes"],
                        footer=result["footer"]), result
