"""Predicted vs published training throughput, with the published configuration forced.

For every run in ``benchmarks/published_runs.json`` that the GPT of ``examples/gpt.py`` can
represent (pipelined runs through ``Constraints(pp=, schedule="1f1b")``), plan the published
shape on the published cluster with the published parallel configuration fixed through ``autopar.Constraints`` (tp, dp, ZeRO stage,
recompute, gradient-accumulation microbatches; precision bf16-mixed), take the predicted step
time, and convert it to throughput *in the paper's own unit with the paper's own FLOPs formula*
(recorded in each entry's ``flops_formula``):

* Narayanan et al. 2021 (Megatron-LM, SC21), Tables 1 and 2: teraFLOP/s per GPU with Eq. 3,
  ``F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))`` per iteration (GEMMs only, *including* the
  recomputed forward pass), divided by iteration time and GPU count.
* Korthikanti et al. 2022 (sequence parallelism / selective recompute): model-FLOPs utilisation,
  ``72*B*L*s*h^2*(1 + s/(6h) + V/(12*h*L))`` per iteration over (time * GPUs * 312 TFLOP/s). The
  full-recompute row publishes only its iteration time (1.42 s); its MFU is derived from that.
* MosaicML MPT (llm-foundry benchmark table): MFU with ``(6*N + 12*L*d*s)`` FLOPs per token,
  ``N`` = all parameters, against 312 (A100) / 989 (H100) TFLOP/s.

Ratio = predicted / published throughput (> 1: the planner is optimistic); error % = (ratio - 1)
* 100. By default nothing is tuned: the cost models run with the checked-in presets. Rows the
example model cannot represent (e.g. OPT-175B, whose tp and batch are unknown) are listed as
skipped with the reason.

Calibration (what ``autopar calibrate`` will do from a measured run): each constant is fitted on
one run, and every run used for a fit is left out of the table, so every printed row is a
prediction for a configuration the calibration did not see.

* ``--calibrate-on ID``: the device's matmul efficiency (``DeviceSpec.matmul_efficiency``).
* ``--calibrate-rails-on ID``: ``LinkSpec.rails``, how many of a node's NICs one collective over a
  group with several ranks per node drives at once (presets: all of them, NCCL's multi-channel
  rings). Fitted on a ZeRO-3 row, whose gathers span every rank of every node; groups with one
  rank per node (PTD-P's data-parallel all-reduce, pipeline sends) do not depend on it.
* ``--calibrate-exposed-on ID``: ``Cluster.exposed_comm_share``, the share of overlappable
  communication that stays exposed however much compute could hide it. Fitted on a run whose
  communication could hide behind its compute; with ``--calibrate-rails-on`` the two are fitted
  alternately (two rounds).
* ``--calibrate-comm-on ID``: ``LinkSpec.efficiency`` of the inter-node link (every inter-node
  collective slower by one factor; kept for comparison: one factor cannot serve both the ZeRO-3
  and the PTD-P rows).

``--free`` also plans every row without constraints (pipelines included) and prints the free
plan's predicted throughput beside the forced configuration's.

How each row is mapped, and what differs from the published run:

* Model: GPT of ``examples/gpt.py`` (LayerNorm, GELU MLP 4x, learned positions, biases, untied
  LM head) with the published layers / hidden / heads / seq / vocab. Megatron's GPT matches this
  closely; MPT has no biases, tied embeddings and ALiBi (a few % fewer parameters / FLOPs outside
  the GEMMs).
* zero: the published stage; Megatron-LM 2021 had no distributed optimizer, so ``null`` there
  maps to ``zero=0``.
* recompute: "full" -> True, "none" -> False. "selective" (Korthikanti) has no equivalent in the
  planner (its recompute is whole blocks): mapped to False, whose FLOPs are the same as selective
  (flash attention recomputes the attention core anyway) but whose memory is larger. ``null`` on
  the Narayanan ZeRO-3 rows maps to True, because the paper's Eq. 3 counts recompute.
* sequence parallelism: not a constraint; the planner's ILP may or may not choose it.
* microbatches (gradient accumulation steps) = global_batch / (dp * micro_batch) when the micro
  batch is published, else 1. If that plan does not fit in memory, the script doubles the
  device memory (up to 4x) until it does and says so in the row: the published runs did fit,
  but bf16-mixed here is autocast, which keeps the residual stream (and so the checkpointed
  block inputs) in fp32 where those stacks kept it in half precision; more microbatches instead
  would change what is compared (ZeRO-3 gathers every parameter once per microbatch).
* attention: Megatron-LM 2021-2022 (Narayanan, Korthikanti) had no flash attention, so the GPT
  runs its "math" attention (scores materialised; its scale/mask/softmax as separate ops where
  Megatron fused them, and no attention dropout); MPT ran a flash kernel ("sdpa").
* A100-40GB rows (MPT): the dgx-a100 preset with device memory 40 GB and 1.555 TB/s (A100 40GB
  SXM datasheet); everything else as the 80GB preset.

Usage::

    python benchmarks/published_comparison.py                  # all rows (~10 minutes on 2 cores)
    python benchmarks/published_comparison.py --family narayanan-t1
    python benchmarks/published_comparison.py --only mpt-7b-h100-8gpu,korthikanti22-22b-full-recompute
    python benchmarks/published_comparison.py --list
    python benchmarks/published_comparison.py --json out.json
    python benchmarks/published_comparison.py --family narayanan-t1,narayanan-t2-zero3,narayanan-t2-ptdp \
        --free --calibrate-on narayanan21-t1-18.4b --calibrate-rails-on narayanan21-t2-zero3-174.6b-768gpu \
        --calibrate-exposed-on narayanan21-t2-zero3-529.6b-640gpu
"""
from __future__ import annotations

import argparse
import json
import sys

import published_runs as runs  # owns the *_OVERRIDE / FREE_PLANS / INTER_NODE_GBPS flags main sets
from published_calibration import calibrate_comm, calibrate_exposed
from published_runs import RUNS_JSON, cluster_for, family, forced, plan_entry, representable

WITHIN = 0.15


def print_free(rows: list[dict]) -> None:
    """The free plan (no constraint but precision) beside the published configuration forced."""
    print("\nfree plan (autopar.plan without constraints) vs the published configuration forced:")
    print(f"{'id':<36} {'forced':>8} {'free':>8} {'free/forced':>11}  free plan")
    for r in rows:
        if not r.get("ok") or "free_ok" not in r:
            continue
        if not r["free_ok"]:
            print(f"{r['id']:<36} {r['predicted']:8.1f} {'-':>8} {'-':>11}  NO PLAN: {r['free_error'][:90]}")
            continue
        mesh = " ".join(f"{k}={v}" for k, v in r["free_mesh"].items())
        pipe = (f"pp={r['free_pp']} {mesh} {r['free_schedule']} m={r['free_microbatches']}" if r["free_pp"] > 1
                else f"{mesh} microbatches={r['free_microbatches']}")
        print(f"{r['id']:<36} {r['predicted']:8.1f} {r['free_predicted']:8.1f} {r['free_predicted'] / r['predicted']:11.3f}  "
              f"{pipe} ({r['free_plan_s']:.0f} s)")
    frees = [r for r in rows if r.get("free_ok")]
    if frees:
        slower = [r["id"] for r in frees if r["free_predicted"] < r["predicted"] * (1 - 1e-6)]
        print(f"  free plan no slower than the forced one: {len(frees) - len(slower)}/{len(frees)}"
              + (f" (slower: {', '.join(slower)})" if slower else ""))


# --- reporting ---------------------------------------------------------------------------------

def print_table(rows: list[dict]) -> None:
    hdr = (f"{'id':<36} {'gpus':>5} {'tp':>2} {'dp':>5} {'z':>1} {'rc':>2} {'mb':>3} {'unit':<20} {'pub':>7} {'pred':>7} "
           f"{'ratio':>6} {'err%':>6} {'pub s':>7} {'pred s':>7} {'mm s':>6} {'attn s':>6} {'oth s':>6} {'exp.c s':>7} {'GiB':>5} {'plan s':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        f = r["forced"]
        head = f"{r['id']:<36} {r['gpus']:>5} {f['tp']:>2} {f['dp']:>5} {f['zero']:>1} {'y' if f['recompute'] else 'n':>2} {f['microbatches']:>3}"
        if not r["ok"]:
            print(f"{head} NO PLAN: {r['error'][:110]}")
            continue
        k = r["compute_by_kind"]
        pub_s = f"{r['published_step_s']:7.2f}" if r.get("published_step_s") else f"{'-':>7}"
        print(f"{head} {r['unit']:<20} {r['published']:7.1f} {r['predicted']:7.1f} {r['ratio']:6.2f} {r['error_pct']:+6.1f} "
              f"{pub_s} {r['step_s']:7.2f} {k['matmul']:6.2f} {k['attention']:6.2f} {k['other']:6.2f} "
              f"{r['exposed_comm_s'] + r['blocking_comm_s']:7.2f} {r['peak_gib']:5.1f} {r['plan_s']:6.1f}")
    notes = [(r["id"], "; ".join(r["notes"] + ([r["derived"]] if r.get("derived") else []))) for r in rows if r["notes"] or r.get("derived")]
    if notes:
        print("\nnotes:")
        for i, n in notes:
            print(f"  {i}: {n}")
    print("\ncolumns: z=ZeRO stage, rc=recompute, mb=microbatches (grad accumulation); pub/pred = throughput in the "
          "paper's unit; ratio = pred/pub; pub s = published (or derived) s/iteration; pred s = predicted step; "
          "mm/attn/oth s = predicted compute by kind (fwd+bwd+recompute); exp.c s = exposed+blocking communication; "
          "GiB = predicted peak per device; plan s = autopar.plan wall time (incl. the comparison plan without constraints)")


def print_summary(rows: list[dict]) -> None:
    ok = [r for r in rows if r["ok"]]
    if not ok:
        print("\nno row planned")
        return
    def summ(rs, label):
        errs = [abs(r["error_pct"]) for r in rs]
        within = sum(e <= WITHIN * 100 for e in errs)
        mean_signed = sum(r["error_pct"] for r in rs) / len(rs)
        print(f"  {label:<22} rows {len(rs):>2}  mean |error| {sum(errs) / len(errs):6.1f}%  mean signed {mean_signed:+6.1f}%  "
              f"within {WITHIN:.0%}: {within}/{len(rs)}  ratio range {min(r['ratio'] for r in rs):.2f}-{max(r['ratio'] for r in rs):.2f}")
    print("\nsummary (error = predicted vs published throughput):")
    summ(ok, "all")
    for fam in sorted({r["family"] for r in ok}):
        summ([r for r in ok if r["family"] == fam], fam)
    failed = [r["id"] for r in rows if not r["ok"]]
    if failed:
        print(f"  no plan for {len(failed)} row(s): {', '.join(failed)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated entry ids")
    ap.add_argument("--family", help="narayanan-t1, narayanan-t2-zero3, korthikanti or mpt (comma-separated)")
    ap.add_argument("--list", action="store_true", help="list the entries and whether they are planned")
    ap.add_argument("--json", help="write the raw results to this file")
    ap.add_argument("--calibrate-on", metavar="ID",
                    help="calibrate the matmul efficiency on this one run (a new cluster spec, as `autopar "
                         "calibrate` will), then predict the selected rows with it; the calibration row is excluded")
    ap.add_argument("--calibrate-comm-on", metavar="ID",
                    help="then calibrate the inter-node link efficiency (achieved fraction of bandwidth in "
                         "collectives) on this one, communication-bound run; it is excluded too")
    ap.add_argument("--calibrate-rails-on", metavar="ID",
                    help="then calibrate LinkSpec.rails (how many of a node's NICs one collective over several "
                         "ranks per node drives) on this one run; it is excluded too")
    ap.add_argument("--calibrate-exposed-on", metavar="ID",
                    help="then calibrate Cluster.exposed_comm_share (the share of overlappable communication that "
                         "stays exposed) on this one run, whose communication could hide behind compute; with "
                         "--calibrate-rails-on too, the two are fitted alternately (two rounds); excluded too")
    ap.add_argument("--constants", metavar="EFF,RAILS,SHARE",
                    help="set matmul efficiency, inter-node rails and exposed communication share directly (as "
                         "printed by a calibration run; '-' keeps the preset), instead of fitting them again")
    ap.add_argument("--free", action="store_true",
                    help="also plan each row without constraints (the free plan, pipelines included) and print "
                         "its predicted throughput beside the forced configuration's")
    ap.add_argument("--inter-node-gbps", type=float, metavar="GBPS",
                    help="assume this node-to-node bandwidth (Gb/s per node, all NICs together) for multi-node "
                         "rows, e.g. 1600 for 8x200G; for sources that do not state their fabric")
    args = ap.parse_args(argv)
    if args.constants:
        vals = [None if v.strip() == "-" else float(v) for v in args.constants.split(",")]
        if len(vals) != 3:
            ap.error("--constants takes three comma-separated values: matmul efficiency, rails, exposed share")
        runs.EFFICIENCY_OVERRIDE, runs.RAILS_OVERRIDE, runs.EXPOSED_OVERRIDE = vals
    if args.free:
        runs.FREE_PLANS = True
    if args.inter_node_gbps is not None:
        runs.INTER_NODE_GBPS = args.inter_node_gbps
    entries = json.load(open(RUNS_JSON))
    todo, skipped = [], []
    for e in entries:
        why = representable(e)
        (skipped.append((e["id"], why)) if why else todo.append(e))
    if args.list:
        for e in todo:
            kw, notes = forced(e)
            print(f"plan  {e['id']:<36} {family(e):<19} {kw}")
        for i, why in skipped:
            print(f"skip  {i:<36} {why}")
        return 0
    if args.only:
        want = set(args.only.split(","))
        unknown = want - {e["id"] for e in entries}
        if unknown:
            ap.error(f"unknown id(s) {sorted(unknown)}; see --list")
        todo = [e for e in todo if e["id"] in want]
    if args.family:
        fams = set(args.family.split(","))
        todo = [e for e in todo if family(e) in fams]
    def entry_of(rid):
        ref = next((e for e in entries if e["id"] == rid), None)
        if ref is None:
            ap.error(f"unknown id {rid!r}; see --list")
        return ref

    if args.calibrate_on:
        ref = entry_of(args.calibrate_on)
        print(f"calibrating on {ref['id']} ...", file=sys.stderr, flush=True)
        r = plan_entry(ref)
        base = cluster_for(ref)[0].device.matmul_efficiency
        kinds = r["compute_by_kind"]
        scaled = kinds["matmul"] + kinds["attention"]
        rest = r["step_s"] - scaled
        runs.EFFICIENCY_OVERRIDE = base * scaled / (r["published_step_s"] - rest)
        print(f"calibrated on {ref['id']}: matmul_efficiency {base:.3f} -> {runs.EFFICIENCY_OVERRIDE:.3f} "
              f"(predicted {r['step_s']:.3f} s/iter vs published {r['published_step_s']:.3f} s)\n")
    if args.calibrate_comm_on:
        runs.COMM_EFFICIENCY_OVERRIDE = calibrate_comm(entry_of(args.calibrate_comm_on), "efficiency")
    rounds = 2 if args.calibrate_rails_on and args.calibrate_exposed_on else 1
    for _ in range(rounds):  # the two constants interact: fit them alternately
        if args.calibrate_rails_on:
            runs.RAILS_OVERRIDE = calibrate_comm(entry_of(args.calibrate_rails_on), "rails")
        if args.calibrate_exposed_on:
            runs.EXPOSED_OVERRIDE = calibrate_exposed(entry_of(args.calibrate_exposed_on))
    left_out = {args.calibrate_on, args.calibrate_comm_on, args.calibrate_rails_on, args.calibrate_exposed_on}
    todo = [e for e in todo if e["id"] not in left_out]
    rows = []
    for e in todo:
        print(f"planning {e['id']} ...", file=sys.stderr, flush=True)
        rows.append(plan_entry(e))
    print("predicted vs published throughput, published configuration forced, precision bf16-mixed, "
          + ("calibrated constants (see above)\n" if (runs.EFFICIENCY_OVERRIDE or runs.COMM_EFFICIENCY_OVERRIDE
                                                    or runs.RAILS_OVERRIDE or runs.EXPOSED_OVERRIDE is not None)
             else "cost-model constants as checked in\n"))
    print_table(rows)
    print_summary(rows)
    if runs.FREE_PLANS:
        print_free(rows)
    if not (args.only or args.family):
        print(f"\nskipped {len(skipped)} entries: " + "; ".join(
            f"{why} ({sum(1 for _, w in skipped if w == why)})" for why in dict.fromkeys(w for _, w in skipped)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
