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
* ``device.attention_efficiency``, ``device.memory_bandwidth`` (stated so that the cost model's
  ``MEMORY_EFFICIENCY`` gives back the measured rate) and ``device.op_overhead``;
* per collective kind, its latency per hop and bus bandwidth (``LinkSpec.collectives``); the
  link's own (latency, bandwidth) are the all-reduce's;
* ``exposed_comm_share``: the share of a collective left on the critical path with compute
  beside it (1.0 where processes share cores: the collective's threads take compute's time).

Every figure and where it came from is listed in the spec's ``sources``.
"""
from __future__ import annotations

import dataclasses
import datetime
import pathlib
import platform
import statistics

from autopar.calibration.fit import exposed_share, fit_collective, fit_compute
from autopar.calibration.microbench import MicrobenchSpec, measure_rank
from autopar.cluster import Cluster, LinkSpec, PeakFlops, calibration_path
from autopar.errors import AutoparError

__all__ = ["calibrate", "fit_cluster", "combine_ranks"]


def combine_ranks(per_rank: list[dict]) -> dict:
    """One set of measurements from every rank's: compute times by their median over ranks (each
    rank ran the same op), collective and overlap times by their mean (a collective ends on
    every rank at about the same time; the mean spreads the barrier's skew)."""
    first = per_rank[0]
    comp = first["compute"]
    out: dict = {"world": first["world"], "device_type": first["device_type"], "compute": {
        "matmul": {d: [(rows[i][0], statistics.median(r["compute"]["matmul"][d][i][1] for r in per_rank))
                       for i in range(len(rows))] for d, rows in comp["matmul"].items()},
        **{key: [(rows[i][0], statistics.median(r["compute"][key][i][1] for r in per_rank))
                 for i in range(len(rows))] for key, rows in comp.items() if key != "matmul"},
    }}
    if "collectives" in first:
        out["collectives"] = {k: [(p, n, statistics.fmean(r["collectives"][k][i][2] for r in per_rank))
                                  for i, (p, n, _) in enumerate(rows)]
                              for k, rows in first["collectives"].items()}
        out["overlap"] = {k: statistics.fmean(r["overlap"][k] for r in per_rank) for k in first["overlap"]}
    return out


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
               f"per-op overhead {f32.overhead * 1e6:.1f} us, fp32 matmul {f32.matmul_rate / 1e9:.2f} GFLOP/s, "
               f"streaming {f32.memory_bandwidth / 1e9:.2f} GB/s"]
    if base.device_type == "cpu":  # no datasheet: the measured rates are the peaks
        rate = {d: fits[d].matmul_rate for d in fits}
        bf16 = rate.get("bfloat16", f32.matmul_rate)
        peaks = PeakFlops(fp32=f32.matmul_rate, tf32=f32.matmul_rate, bf16=bf16, fp16=rate.get("float16", bf16))
        matmul_eff = 1.0
    else:
        peaks = dev.peak_flops
        matmul_eff = min(1.0, f32.matmul_rate / peaks.for_dtype("fp32"))
    att_eff = None
    if f32.attention_rate is not None:
        att_eff = min(1.0, f32.attention_rate / (peaks.fp32 if base.device_type == "cpu" else peaks.for_dtype("fp32")))
        sources.append(f"attention {f32.attention_rate / 1e9:.2f} GFLOP/s (efficiency {att_eff:.2f})")
    device = dataclasses.replace(dev, peak_flops=peaks, matmul_efficiency=matmul_eff, attention_efficiency=att_eff,
                                 op_overhead=f32.overhead,
                                 memory_bandwidth=f32.memory_bandwidth / MEMORY_EFFICIENCY)
    cluster = dataclasses.replace(base, device=device)
    if "collectives" in measured:
        rows = []
        for kind, points in measured["collectives"].items():
            r = fit_collective(kind, points)
            rows.append((kind, r.latency, r.bandwidth))
            sources.append(f"{kind}: {r.latency * 1e6:.1f} us per hop, bus bandwidth {r.bandwidth / 1e9:.2f} GB/s")
        ar = next(r for r in rows if r[0] == "all_reduce")
        link = LinkSpec(bandwidth=ar[2], latency=ar[1], collectives=tuple(rows))
        ov = measured["overlap"]
        share = exposed_share(ov["compute_s"], ov["comm_s"], ov["together_s"])
        sources.append(f"exposed share of overlapped communication {share:.2f} (compute {ov['compute_s'] * 1e3:.2f} ms, "
                       f"all-reduce {ov['comm_s'] * 1e3:.2f} ms, together {ov['together_s'] * 1e3:.2f} ms)")
        cluster = dataclasses.replace(cluster, intra_node=link,
                                      inter_node=link if base.nodes == 1 else base.inter_node,
                                      exposed_comm_share=share)
    return dataclasses.replace(cluster, sources=tuple(sources))


def calibrate(nproc: int, out: str | pathlib.Path | None = None, quick: bool = False,
              timeout_s: float = 600.0) -> tuple[Cluster, pathlib.Path]:
    """Measure ``nproc`` local gloo processes, fit, write the spec (default:
    ``calibration_path(nproc)``, which ``Cluster.local(nproc)`` then uses); return it and its path."""
    from autopar.runtime.launch import launch

    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise AutoparError(f"autopar calibrate: --nproc must be a positive integer, got {nproc!r}")
    base = Cluster.local(nproc, calibrated=False)
    per_rank = launch(measure_rank, nproc, MicrobenchSpec(quick=quick, repeats=3 if quick else 5), timeout_s=timeout_s)
    when = f"{platform.node() or 'this machine'}, {datetime.date.today().isoformat()}"
    cluster = fit_cluster(combine_ranks(per_rank), base, when)
    path = pathlib.Path(out) if out is not None else calibration_path(nproc)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(cluster.to_json())
    tmp.replace(path)  # a reader never sees half a spec
    return cluster, path
