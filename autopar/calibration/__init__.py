"""``autopar calibrate``: measure this machine on the real backend, fit the cost model, write a spec.

    autopar calibrate [--nproc 4] [--out PATH] [--quick]

``calibrate`` launches ``nproc`` processes that measure together (``calibration.microbench``),
fits the cost model's parameters to what they measured (``calibration.fit``) and writes a
cluster spec JSON (``Cluster.to_json``); by default to ``cluster.calibration_path(nproc)``, where
``Cluster.local(nproc)`` reads it from then on. What the spec then holds, over the uncalibrated
local model:

* ``device.peak_flops``: the measured large-matmul rate per dtype (a CPU has no datasheet peak:
  ``matmul_efficiency`` is 1 and a small matmul's lower efficiency comes from ``op_overhead``);
  on a GPU the preset's datasheet peaks stay and ``matmul_efficiency`` is the measured share;
* ``device.matmul_table`` and ``device.linear_table``: fp32 matmul times over a grid of shapes,
  as ``torch.mm`` and as nn.Linear's forward (``x @ W.T``), with operands cold in cache;
* ``device.conv_table``: on CPU processes, fp32 convolutions' forward and backward times over a
  grid of their implicit GEMM's shapes (a convolution is priced by it, not by its FLOPs at the
  matmul rate: a few channels run at a small share of that rate);
* ``device.attention_efficiency`` and ``device.memory_bandwidth`` (stated so that the cost
  model's ``MEMORY_EFFICIENCY`` gives back the measured rate); ``device.attention_costs``:
  attention's forward and backward per (batch, head) pair and per FLOP;
* ``device.op_overhead`` and ``update_op_overhead``: what one op of a training step costs beyond
  its arithmetic (dispatch, autograd's recording and backward nodes; the optimizer's loop),
  from a probe of many small ops trained with AdamW, over the ops the cost model counts in it;
* per collective kind, its latency per hop and bus bandwidth (``LinkSpec.collectives``); the
  link's own (latency, bandwidth) are the all-reduce's; and the measured times themselves per
  kind, group size and message size (``LinkSpec.collective_table``), which the cost model
  interpolates at the group sizes measured;
* ``exposed_comm_share``: the share of a collective left on the critical path with compute
  beside it (1.0 where processes share cores: the collective's threads take compute's time to
  move its bytes); ``exposed_latency_share``: the same of a small collective's waiting (where
  nothing progresses it while the ranks compute, its latency does not hide either:
  ``planner.overlap``);
* ``device.warm_elements``: the optimizer's update and a gradient buffer per element where a
  rank holds 1M elements, beside ``update_element_s`` and ``grad_buffer_element_s`` at 8M; on
  CPU processes, ``device.shared_cache_bytes``: the last-level cache the node's ranks share, which
  says where between the two a plan's ranks are priced;
* ``collective_skew_s``: what a collective waits, beyond its own time, for ranks that arrive
  from compute at different times (each collective call pays it);
* ``device.collective_host_s`` and ``collective_host_byte_s``: on CPU processes, the host's own
  time per collective the runtime issues (a reshard's autograd node, buffers) and per byte of it
  (layout copies), timed with the network left out.

Every figure and where it came from is listed in the spec's ``sources``.
"""
from __future__ import annotations

import dataclasses
import datetime
import pathlib
import platform
import sys
import statistics

from autopar.calibration.comm_probes import SKEW_BYTES, WAIT_BYTES
from autopar.calibration.fit import (collective_skew, exposed_share, fit_attention, fit_collective, fit_compute,
                                     fit_op_cost, monotone_table)
from autopar.calibration.microbench import MicrobenchSpec, measure_rank
from autopar.calibration.training_probe import PROBE_LAYERS, probe_units
from autopar.cluster import Cluster, LinkSpec, PeakFlops, calibration_path
from autopar.errors import AutoparError
from autopar.runtime.writable import check_writable

__all__ = ["calibrate", "fit_cluster", "combine_ranks", "training_overheads", "speed_spread", "check_quiet"]


def _over_ranks(rows_per_rank: list[list], keep: int, reduce) -> list[tuple]:
    """The first rank's rows, each with its first ``keep`` items (what was measured: a size, a
    shape) and every later item (a time) reduced over the ranks' same rows by ``reduce``."""
    return [tuple(row[:keep]) + tuple(reduce(rows[i][j] for rows in rows_per_rank) for j in range(keep, len(row)))
            for i, row in enumerate(rows_per_rank[0])]


# per compute table, its leading columns that say what was measured (the rest are times)
_MEASURED_COLUMNS = {"gemm": 3, "gemm_linear": 3, "attention_grad": 2, "conv": 3}


def combine_ranks(per_rank: list[dict]) -> dict:
    """One set of measurements from every rank's: compute times by their median over ranks (each
    rank ran the same op), collective and overlap times by their mean (a collective ends on
    every rank at about the same time; the mean spreads the barrier's skew)."""
    median, mean = statistics.median, statistics.fmean
    first = per_rank[0]
    comp = first["compute"]
    compute = {key: _over_ranks([r["compute"][key] for r in per_rank], _MEASURED_COLUMNS.get(key, 1), median)
               for key in comp if key != "matmul"}
    compute["matmul"] = {d: _over_ranks([r["compute"]["matmul"][d] for r in per_rank], 1, median) for d in comp["matmul"]}
    out: dict = {"world": first["world"], "device_type": first["device_type"], "compute": compute,
                 **{k: first[k] for k in ("cores", "local_world", "shared_cache_bytes") if k in first},
                 "training": {k: median(r["training"][k] for r in per_rank) for k in first["training"]},
                 "ops": {name: _over_ranks([r["ops"][name] for r in per_rank], 1, median) for name in first.get("ops", {})}}
    if "speed" in first:  # window by window, the slowest rank's (a window ends at a barrier on every rank)
        out["speed"] = [max(col) for col in zip(*(r["speed"] for r in per_rank))]
    if "collectives" in first:
        out["collectives"] = {k: _over_ranks([r["collectives"][k] for r in per_rank], 2, mean) for k in first["collectives"]}
        out["overlap"] = {k: ([mean(col) for col in zip(*(r["overlap"][k] for r in per_rank))] if isinstance(v, list)
                              else mean(r["overlap"][k] for r in per_rank)) for k, v in first["overlap"].items()}
        if "waiting" in first:  # pass by pass: the ranks' passes are the same seconds
            out["waiting"] = {**{k: mean(r["waiting"][k] for r in per_rank) for k in ("comm_s", "compute_s", "together_s")},
                              "shares": [mean(col) for col in zip(*(r["waiting"]["shares"] for r in per_rank))]}
        for key in ("collective_host_s", "collective_host_byte_s"):
            if key in first:
                out[key] = median(r[key] for r in per_rank)
        if "skew" in first:
            out["skew"] = {"compute_s": mean(r["skew"]["compute_s"] for r in per_rank),
                           "kinds": {k: [mean(r["skew"]["kinds"][k][i] for r in per_rank) for i in range(2)]
                                     for k in first["skew"]["kinds"]}}
            if "excess" in first["skew"]:  # window by window: the ranks' windows are the same seconds
                out["skew"]["excess"] = [mean(col) for col in zip(*(r["skew"]["excess"] for r in per_rank))]
        if "pipeline" in first:
            pl = first["pipeline"]
            out["pipeline"] = {"m": pl["m"], "compute_s": mean(r["pipeline"]["compute_s"] for r in per_rank),
                               "step_s": [mean(r["pipeline"]["step_s"][i] for r in per_rank) for i in range(len(pl["m"]))],
                               # pass by pass: the ranks' passes are the same seconds
                               "excess": [mean(col) for col in zip(*(r["pipeline"]["excess"] for r in per_rank))]}
    return out


def training_overheads(training: dict, matmul_rate: float) -> tuple[float, float, tuple[float, float]]:
    """(seconds per forward/backward op, seconds per optimizer-update op, the update's (seconds
    per element, more per state)) from the probe's measured times (``training_probe.training_ops``):
    its matmuls' arithmetic taken out, over the ops the cost model counts in it
    (``training_probe.probe_units``); SGD's (no state) and AdamW's (two) update of a large parameter,
    their ops' fixed cost taken out, per element."""
    fwd_bwd_units, update_units = probe_units()
    arithmetic = training["matmul_flops"] / matmul_rate
    per_op = max(training["fwd_bwd_s"] - arithmetic, 0.0) / fwd_bwd_units
    per_update_op = training["step_s"] / update_units
    return per_op, per_update_op, _update_per_element(training, per_update_op)


def _update_per_element(training: dict, per_update_op: float, suffix: str = "") -> tuple[float, float]:
    """SGD's and AdamW's update per element (the second: per state) from the probe's steps over
    ``update_numel{suffix}`` elements, held in tensors of ``UPDATE_CHUNK``, each tensor's ops'
    fixed cost taken out."""
    from autopar.calibration.training_probe import UPDATE_CHUNK
    from autopar.planner.costing import update_ops

    numel = training[f"update_numel{suffix}"]
    tensors = max(1, numel // UPDATE_CHUNK)
    sgd = max(training[f"sgd_update_s{suffix}"] - tensors * update_ops(0) * per_update_op, 0.0) / numel
    adam = max(training[f"adamw_update_s{suffix}"] - tensors * update_ops(2) * per_update_op, 0.0) / numel
    return sgd, max(adam - sgd, 0.0) / 2


def fit_cluster(measured: dict, base: Cluster, when: str = "") -> Cluster:
    """``base`` with the parameters fitted to ``measured`` (``combine_ranks``'s form). Pure."""
    from autopar.cost_models.compute import MEMORY_EFFICIENCY

    comp = measured["compute"]
    fits = {d: fit_compute(rows, comp["stream"], comp["attention"] if d == "float32" else ())
            for d, rows in comp["matmul"].items()}
    f32 = fits["float32"]
    dev = base.device
    sources = [f"autopar calibrate{' on ' + when if when else ''}: {measured['world']} {measured['device_type']} "
               f"process(es) measured together",
               f"torch.mm dispatch {f32.overhead * 1e6:.1f} us, fp32 matmul {f32.matmul_rate / 1e9:.2f} GFLOP/s, "
               f"streaming {f32.memory_bandwidth / 1e9:.2f} GB/s"]
    if base.device_type == "cpu":  # no datasheet: the best measured rates are the peaks
        best = max([f32.matmul_rate] + [2.0 * m * k * n / t for m, k, n, t in comp.get("gemm", [])])
        rate = {d: fits[d].matmul_rate * best / f32.matmul_rate for d in fits}
        bf16 = rate.get("bfloat16", best)
        peaks = PeakFlops(fp32=best, tf32=best, bf16=bf16, fp16=rate.get("float16", bf16))
        matmul_eff = 1.0
    else:
        peaks = dev.peak_flops
        matmul_eff = min(1.0, f32.matmul_rate / peaks.for_dtype("fp32"))
    att_eff = None
    if f32.attention_rate is not None:
        att_eff = min(1.0, f32.attention_rate / peaks.fp32)
        sources.append(f"attention {f32.attention_rate / 1e9:.2f} GFLOP/s (efficiency {att_eff:.2f})")
    attention_costs = None
    if len(comp.get("attention_grad", ())) >= 3:
        attention_costs = fit_attention(comp["attention_grad"])
        sources.append(f"attention per (batch, head) pair and GFLOP, forward: {attention_costs[0] * 1e6:.2f} us + "
                       f"{attention_costs[1] * 1e15:.0f} us, backward: {attention_costs[2] * 1e6:.2f} us + "
                       f"{attention_costs[3] * 1e15:.0f} us")
    op_overhead, update_overhead, per_element = training_overheads(measured["training"], f32.matmul_rate)
    sources.append(f"a training step's op: {op_overhead * 1e6:.1f} us (forward and backward, autograd), "
                   f"{update_overhead * 1e6:.1f} us (optimizer update); from a {PROBE_LAYERS}-layer probe")
    sources.append(f"optimizer update per element: {per_element[0] * 1e9:.2f} ns + {per_element[1] * 1e9:.2f} ns per "
                   "state (SGD and AdamW measured)")
    grad_buffer = None
    if "grad_add_s" in measured["training"]:
        numel = measured["training"]["update_numel"]
        grad_buffer = (measured["training"]["grad_zero_s"] / numel, measured["training"]["grad_add_s"] / numel)
        sources.append(f"a gradient buffer per element: zeroed {grad_buffer[0] * 1e9:.2f} ns, a gradient added into it "
                       f"{grad_buffer[1] * 1e9:.2f} ns ({numel * 4 / 2**20:.0f} MiB buffers in turn, cold)")
    warm = None
    if "update_numel_warm" in measured["training"] and grad_buffer is not None:
        t = measured["training"]
        few = t["update_numel_warm"]
        warm = (float(few), float(t["update_numel"]), *_update_per_element(t, update_overhead, "_warm"),
                t["grad_zero_s_warm"] / few, t["grad_add_s_warm"] / few)
        sources.append(f"the same where a rank updates {few / 2**20:.0f}M elements a step: update {warm[2] * 1e9:.2f} ns "
                       f"+ {warm[3] * 1e9:.2f} ns per state, gradient zeroed {warm[4] * 1e9:.2f} ns, added "
                       f"{warm[5] * 1e9:.2f} ns (against {t['update_numel'] / 2**20:.0f}M above)")
        if measured.get("shared_cache_bytes"):
            sources.append(f"between the two by the {measured['shared_cache_bytes'] / 2**20:.0f} MiB last-level cache "
                           f"the node's ranks share: warm while their parameters, gradients and optimizer states "
                           f"fill at most half of it, cold from all of it")
    if measured.get("speed"):
        sources.append(speed_source(measured["speed"]))
    op_costs = tuple((name, *fit_op_cost(rows)) for name, rows in sorted(measured.get("ops", {}).items()))
    if comp.get("gemm"):
        effs = [2.0 * m * k * n / t / peaks.fp32 for m, k, n, t in comp["gemm"]]
        sources.append(f"{len(effs)} fp32 matmul shapes (m, k, n in {sorted({r[0] for r in comp['gemm']})}): "
                       f"efficiency {min(effs):.2f} to {max(effs):.2f} of {peaks.fp32 / 1e9:.1f} GFLOP/s")
    if comp.get("gemm_linear") and comp.get("gemm"):
        ratios = [b[3] / a[3] for a, b in zip(comp["gemm"], comp["gemm_linear"])]
        sources.append(f"the same shapes as nn.Linear's forward (x @ W.T): {min(ratios):.2f} to {max(ratios):.2f}x "
                       f"torch.mm's time (median {statistics.median(ratios):.2f}x)")
    conv_table = conv_rows(comp.get("conv", ()))
    if conv_table:
        effs = [2.0 * m * k * n / f / peaks.fp32 for m, k, n, f, _ in conv_table]
        back = [b / f for _, _, _, f, b in conv_table]
        sources.append(f"{len(conv_table)} fp32 convolutions (3x3; implicit GEMM m in {sorted({r[0] for r in conv_table})}, "
                       f"k in {sorted({r[1] for r in conv_table})}, n in {sorted({r[2] for r in conv_table})}): forward "
                       f"efficiency {min(effs):.3f} to {max(effs):.2f} of {peaks.fp32 / 1e9:.1f} GFLOP/s, backward "
                       f"{min(back):.1f} to {max(back):.1f}x the forward's time")
    if op_costs:
        sources.append("per element, forward / backward: " + ", ".join(
            f"{name} {f * 1e9:.2f} / {b * 1e9:.2f} ns" for name, f, b in op_costs))
    device = dataclasses.replace(dev, peak_flops=peaks, matmul_efficiency=matmul_eff, attention_efficiency=att_eff,
                                 attention_costs=attention_costs,
                                 op_costs=op_costs, matmul_table=tuple(tuple(r) for r in comp.get("gemm", [])),
                                 linear_table=tuple(tuple(r) for r in comp.get("gemm_linear", [])),
                                 conv_table=conv_table,
                                 op_overhead=op_overhead, update_op_overhead=update_overhead,
                                 update_element_s=per_element, grad_buffer_element_s=grad_buffer,
                                 warm_elements=warm, shared_cache_bytes=measured.get("shared_cache_bytes"),
                                 collective_host_s=measured.get("collective_host_s", 0.0),
                                 collective_host_byte_s=measured.get("collective_host_byte_s", 0.0),
                                 memory_bandwidth=f32.memory_bandwidth / MEMORY_EFFICIENCY)
    cluster = dataclasses.replace(base, device=device)
    if "collectives" in measured:
        rows = []
        for kind, points in measured["collectives"].items():
            r = fit_collective(kind, points)
            rows.append((kind, r.latency, r.bandwidth))
            sources.append(f"{kind}: {r.latency * 1e6:.1f} us per hop, bus bandwidth {r.bandwidth / 1e9:.2f} GB/s")
        ar = next(r for r in rows if r[0] == "all_reduce")
        table = monotone_table([(kind, int(p), float(b), float(t)) for kind, points in measured["collectives"].items()
                                for p, b, t in points])
        link = LinkSpec(bandwidth=ar[2], latency=ar[1], collectives=tuple(rows), collective_table=table)
        ov = measured["overlap"]
        share = exposed_share(ov["compute_s"], ov["comm_s"], ov["together_s"])
        rounds = ", ".join(f"{x:.2f}" for x in ov.get("shares", ()))
        sources.append(f"exposed share of overlapped communication {share:.2f} (compute {ov['compute_s'] * 1e3:.2f} ms, "
                       f"all-reduce {ov['comm_s'] * 1e3:.2f} ms, together {ov['together_s'] * 1e3:.2f} ms"
                       + (f"; the median round of {rounds})" if rounds else ")"))
        local, cores = measured.get("local_world", measured["world"]), measured.get("cores")
        if measured["device_type"] == "cpu" and cores is not None and local >= cores and share < 1.0:
            # gloo moves the bytes with CPU threads: with a process on every core, a collective
            # progresses only when a rank's compute yields its core. The probe's short rounds
            # catch the scheduler's gaps (0.1 to 1.0 on one machine); a training step's do not
            share = 1.0
            sources.append(f"exposed share taken as 1.00: {local} processes on {cores} CPU core(s) leave none to "
                           "progress communication while the ranks compute")
        latency_share = None
        if "waiting" in measured:
            wt = measured["waiting"]
            latency_share = statistics.median(wt["shares"])
            sources.append(f"exposed share of a collective's waiting beside compute {latency_share:.2f}, the median over "
                           f"{len(wt['shares'])} passes (a {WAIT_BYTES // 1024} KiB all-reduce {wt['comm_s'] * 1e6:.0f} us "
                           f"alone, small layers {wt['compute_s'] * 1e6:.0f} us, both {wt['together_s'] * 1e6:.0f} us)")
        skew = 0.0
        if "skew" in measured:
            sk = measured["skew"]
            if "excess" in sk:
                skew, how = max(0.0, statistics.median(sk["excess"])), f"{len(sk['excess'])} paired windows"
            else:  # measured before the paired windows
                skew, how = statistics.median(collective_skew(sk["compute_s"], alone, together)
                                              for alone, together in sk["kinds"].values()), "kinds"
            sources.append(f"a collective's wait for ranks arriving from compute: {skew * 1e6:.1f} us, the median over "
                           f"{how} (after {sk['compute_s'] * 1e3:.2f} ms of compute, a {SKEW_BYTES // 1024} KiB " + ", ".join(
                               f"{kind} takes {(together - sk['compute_s']) * 1e6:.0f} us against {alone * 1e6:.0f}"
                               for kind, (alone, together) in sk["kinds"].items()) + " alone)")
        per_micro, message_s = 0.0, link.measured_time("send_recv", 2, 64.0)
        if "pipeline" in measured and message_s is not None:
            pl = measured["pipeline"]
            per_micro = pipeline_microbatch_seconds(pl["excess"], message_s)
            sources.append(f"a pipeline schedule's work per microbatch and stage: {per_micro * 1e6:.1f} us (1F1B over "
                           f"{pl['m'][0]} and {pl['m'][-1]} microbatches: {pl['step_s'][0] * 1e3:.2f} and "
                           f"{pl['step_s'][-1] * 1e3:.2f} ms)")
        if device.collective_host_s or device.collective_host_byte_s:
            sources.append(f"the host's own time per collective (a reshard's autograd node, buffers, layout copies): "
                           f"{device.collective_host_s * 1e6:.1f} us + {device.collective_host_byte_s * 1e6 * 2**10:.2f} "
                           "us per KiB")
        cluster = dataclasses.replace(cluster, intra_node=link,
                                      inter_node=link if base.nodes == 1 else base.inter_node,
                                      exposed_comm_share=share, exposed_latency_share=latency_share,
                                      collective_skew_s=skew,
                                      pipeline_microbatch_s=per_micro)
    return dataclasses.replace(cluster, sources=tuple(sources))


# the most the speed probe's windows may differ (their 80th percentile over their 20th) in a
# calibration that is kept: beyond it the machine's speed moved while it was measured (other work
# on its cores), and the spec would price moments of it. A fifth of the windows at either end
# may be outliers: 4 gloo processes of a 2-core VM read the same matmul at 57-90 GFLOP/s in 50-200
# ms windows of a quiet minute (80th / 20th percentile 1.05-1.1x), 38-79 in a calibration beside
# other work
SPEED_SPREAD_LIMIT = 1.3
CALIBRATION_TRIES = 2  # measurements before a noisy calibration is refused


def speed_spread(windows) -> float:
    """The 80th over the 20th percentile of the speed probe's window times
    (``microbench.SPEED_PROBE``; inclusive quantiles). Pure.

    >>> round(speed_spread([2.0e-3, 2.2e-3, 3.4e-3]), 3)
    1.404
    """
    q = statistics.quantiles(list(windows) * (1 if len(windows) > 1 else 2), n=5, method="inclusive")
    return q[-1] / max(q[0], 1e-12)


def speed_source(windows) -> str:
    """The spec's line saying how much the machine's speed moved while it was calibrated."""
    from autopar.calibration.microbench import SPEED_SHAPE

    m, k, n = SPEED_SHAPE
    rates = [2.0 * m * k * n / t / 1e9 for t in windows]
    return (f"machine speed while calibrating: a {m}x{k}x{n} fp32 matmul at {min(rates):.1f} to {max(rates):.1f} "
            f"GFLOP/s (median {statistics.median(rates):.1f}) over {len(windows)} windows from start to end (80th / "
            f"20th percentile of their times {speed_spread(windows):.2f}x, kept below {SPEED_SPREAD_LIMIT}x)")


def check_quiet(measured: dict, allow_noisy: bool = False) -> bool:
    """Whether ``measured`` (``combine_ranks``'s form) was taken on a machine whose speed held
    (``speed_spread`` of its speed windows within ``SPEED_SPREAD_LIMIT``); ``allow_noisy``: always."""
    return allow_noisy or "speed" not in measured or speed_spread(measured["speed"]) <= SPEED_SPREAD_LIMIT


def conv_rows(measured) -> tuple[tuple[int, int, int, float, float], ...]:
    """``DeviceSpec.conv_table`` from the probe's (m, k, n, forward s, forward + backward s): the
    backward's own time, never below a tenth of the forward's (timing noise can put the two
    windows' difference near 0). Pure.

    >>> conv_rows([(256, 72, 8, 1e-4, 3.5e-4)])
    ((256, 72, 8, 0.0001, 0.00025),)
    """
    return tuple((int(m), int(k), int(n), float(f), max(float(b) - float(f), 0.1 * float(f))) for m, k, n, f, b in measured)


def pipeline_microbatch_seconds(excess: list[float], message_s: float) -> float:
    """What a pipeline schedule costs per microbatch and stage beyond the stage's compute and its
    two messages (activation forward, gradient back): the median over the probe's passes of each
    pass's slope of step time over the microbatch counts less that pass's compute (``excess``,
    ``comm_probes.probe_pipeline``), less those messages; never below 0.

    >>> round(pipeline_microbatch_seconds([6e-4, 9e-4, 1e-3], 2e-4), 6)
    0.0005
    """
    return max(0.0, statistics.median(excess) - 2.0 * message_s)


# a GPU's name -> the preset whose datasheet peaks its measured efficiencies are taken against
GPU_PRESETS = (("H200", "dgx-h200"), ("H100", "dgx-h100"), ("A100", "dgx-a100"))


def calibration_backend(nproc: int, asked: str | None = None) -> str:
    """What ``autopar calibrate`` measures: ``asked`` ("gloo": CPU processes, "nccl": one GPU per
    process), else NCCL where CUDA shows at least ``nproc`` GPUs, else gloo."""
    if asked not in (None, "gloo", "nccl"):
        raise AutoparError(f"autopar calibrate: --backend must be gloo (CPU processes) or nccl (one GPU each), "
                           f"got {asked!r}")
    if asked == "gloo":
        return asked
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if asked is None:
        return "nccl" if gpus >= nproc else "gloo"
    if gpus < nproc:
        fix = f"use --nproc {gpus} or --backend gloo" if gpus else "use --backend gloo (CPU processes)"
        raise AutoparError(f"autopar calibrate --backend nccl: {nproc} process(es) need {nproc} GPU(s), one each; CUDA "
                           f"shows {gpus} here: {fix}")
    return asked


def gpu_base_cluster(nproc: int) -> Cluster:
    """The cluster ``--backend nccl`` fits onto: the datasheet preset of this machine's GPU
    (``GPU_PRESETS``) as ``nproc`` devices of one node, each with the GPU's memory. The fit keeps
    the datasheet's peak FLOP/s and measures the efficiencies against it; links that are not
    measured (one GPU: none) keep the preset's."""
    import torch

    name = torch.cuda.get_device_name(0)
    preset = next((p for key, p in GPU_PRESETS if key in name), None)
    if preset is None:
        raise AutoparError(f"autopar calibrate --backend nccl: no datasheet for the GPU {name!r} (known: "
                           f"{', '.join(k for k, _ in GPU_PRESETS)}): its peak FLOP/s is what the measured efficiency "
                           "is taken against. Add its preset to autopar.cost_models.hardware, or measure the CPU "
                           "processes with --backend gloo")
    base = Cluster.preset(preset)
    memory = int(torch.cuda.get_device_properties(0).total_memory)
    return dataclasses.replace(base, name="local-cuda", nodes=1, devices_per_node=nproc,
                               device=dataclasses.replace(base.device, memory_bytes=memory))


def calibrate(nproc: int, out: str | pathlib.Path | None = None, quick: bool = False,
              timeout_s: float = 600.0, backend: str | None = None,
              allow_noisy: bool = False) -> tuple[Cluster, pathlib.Path]:
    """Measure ``nproc`` local processes on ``backend`` (``calibration_backend``: gloo for CPU
    processes, nccl for one GPU each), fit, write the spec (default: ``calibration_path(nproc)``,
    which ``Cluster.local(nproc)`` then uses; GPUs: ``calibration_path(nproc, "cuda")``); return it
    and its path. A measurement whose speed probe moved beyond ``SPEED_SPREAD_LIMIT`` is taken
    again, up to ``CALIBRATION_TRIES`` times, then refused (``allow_noisy``: kept; ``quick``
    calibrations, the tests', are never refused)."""
    from autopar.runtime.launch import launch

    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise AutoparError(f"autopar calibrate: --nproc must be a positive integer, got {nproc!r}")
    backend = calibration_backend(nproc, backend)
    path = pathlib.Path(out) if out is not None else calibration_path(nproc, "cuda" if backend == "nccl" else "cpu")
    # before minutes of measurements: the spec's folder must take the file (``runtime.writable``)
    check_writable(path.parent, "calibration output folder", every_rank_writes=False)
    spec = MicrobenchSpec(quick=quick, repeats=3 if quick else 5, backend=backend)
    base = gpu_base_cluster(nproc) if backend == "nccl" else Cluster.local(nproc, calibrated=False)
    spreads = []
    for _ in range(CALIBRATION_TRIES):
        if backend == "nccl":
            # spawned: this process has touched CUDA (the GPU's name), and a forked child must not inherit that
            per_rank = launch(measure_rank, nproc, spec, timeout_s=timeout_s)
        else:
            # forked from a server that imported the measurements once: spawned, 4 ranks importing autopar
            # on 2 cores took 5 s of the minute
            per_rank = launch(measure_rank, nproc, spec, timeout_s=timeout_s, start_method="forkserver")
        measured = combine_ranks(per_rank)
        if check_quiet(measured, allow_noisy or quick):
            break
        spreads.append(speed_spread(measured["speed"]))
        print(f"autopar calibrate: the machine's speed moved {spreads[-1]:.2f}x while it was measured (limit "
              f"{SPEED_SPREAD_LIMIT}x); measuring again", file=sys.stderr, flush=True)
    else:
        raise AutoparError(
            f"autopar calibrate: the machine's speed moved while it was measured, {CALIBRATION_TRIES} times "
            f"({', '.join(f'{x:.2f}x' for x in spreads)}: the 80th over the 20th percentile of the same matmul's windows; "
            f"limit {SPEED_SPREAD_LIMIT}x): a spec from it would price one moment of a machine shared with other "
            "work. Calibrate when nothing else runs on its cores, or pass --allow-noisy (calibrate(allow_noisy=True)) "
            "to write it anyway")
    when = f"{platform.node() or 'this machine'}, {datetime.date.today().isoformat()}"
    cluster = fit_cluster(measured, base, when)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(cluster.to_json())
    tmp.replace(path)  # a reader never sees half a spec
    return cluster, path
