"""From the search's chosen attempt to the ``Plan`` users read and the runtime runs.

Every float a plan holds is rounded to 9 significant digits (``_r``), so planning twice, on any
rank, writes the same JSON.
"""
from __future__ import annotations

import math

import torch

from autopar.layouts import format_layout
from autopar.plan import Alternative, NodePlacement, ParamPlacement, Plan, Predicted, SolverReport, Stage, fingerprint_of
from autopar.planner.blocks import BlockInfo
from autopar.planner.comm_model import predict_comm_bytes
from autopar.planner.meshes import axis_names
from autopar.planner.evaluate import autocast_dtype, incident_edges, model_flops, node_alternatives
from autopar.planner.problem import producer_of
from autopar.trace import TracedGraph

__all__ = ["extract_plan", "predicted_of"]


def _r(x: float) -> float:
    return float(f"{float(x):.9g}")


def predicted_of(att, comm_bytes: bool = True) -> Predicted:
    """The plan's predictions from an attempt's evaluation (step time, communication, memory, MFU).
    ``comm_bytes=False``: no bytes per collective kind (a pipeline stage's submesh plan: the
    pipeline plan counts them per rank, ``pipeline_rank_bytes``)."""
    ev = att.evaluation
    ctx = att.problem.ctx
    flops = model_flops(att.problem)
    peak = ctx.cluster.device.peak_flops.for_dtype(ctx.policy.compute_dtype)
    world = math.prod(ctx.mesh_shape)
    mfu = flops / (ev.step_time_s * world * peak) if ev.step_time_s > 0 else 0.0
    return Predicted(
        step_time_s=_r(ev.step_time_s),
        compute_s=_r(ev.compute_s),
        comm_s=tuple((k, _r(v)) for k, v in sorted(ev.comm_by_kind.items())),
        exposed_comm_s=_r(ev.exposed_s),
        blocking_comm_s=_r(ev.blocking_s),
        overlappable_comm_s=_r(ev.overlap_s),
        peak_memory_bytes=_r(ev.peak_bytes),
        memory_bytes=tuple((k, _r(v)) for k, v in ev.memory.categories.items()),
        comm_bytes=tuple((k, float(v)) for k, v in sorted(
            predict_comm_bytes(att.problem, att.solution.choice, att.evaluation.recompute,
                               autocast_dtype=autocast_dtype(att.problem)).items())) if comm_bytes else (),
        model_flops=_r(flops),
        mfu=_r(mfu),
    )


def extract_plan(traced, blocks: BlockInfo, cluster, att, c, precision, optimizer, baseline, free_time, outcomes,
                 comm_bytes: bool = True) -> Plan:
    """The Plan of the search's chosen attempt ``att`` (``attempts.Attempt``): per-node and per-parameter
    placements with their best alternatives, predictions, the solver's report, notes, fingerprint.
    ``comm_bytes``: as ``predicted_of``'s."""
    problem, choice = att.problem, att.solution.choice
    incident = incident_edges(problem)
    alts = node_alternatives(problem, choice, incident)
    rep = blocks.rep
    node_records = []
    param_records = []
    ctx = problem.ctx
    names = axis_names(att.mesh)
    from autopar.planner.costing import param_memory

    formatted: dict[int, tuple] = {}  # id(strategy) -> its (outs, ins, grad_ins) as the plan writes them
    held: dict[tuple, float] = {}  # (id(strategy), shape, dtype) -> a parameter's bytes per device
    for n in traced.graph.nodes:
        if n.op == "output":
            continue
        r = rep[n.name]
        if n.op == "call_function" and n.target.__class__.__name__ == "builtin_function_or_method" and n.target.__name__ == "getitem":
            base, idx = producer_of(n)
            v = problem.nodes[rep[base.name]]
            s = v.strategies[choice[v.name]]
            lay = s.outs[idx]
            node_records.append(NodePlacement(n.name, "getitem", n.meta.get("autopar.module", ""),
                                              (format_layout(lay) if lay is not None else "-",),
                                              (format_layout(lay) if lay is not None else "-",),
                                              (format_layout(lay) if lay is not None else "-",), r if r != n.name else ""))
            continue
        v = problem.nodes[r]
        s = v.strategies[choice[r]]
        if id(s) not in formatted:  # (a repeated block's instances share their representative's strategy)
            formatted[id(s)] = (tuple(format_layout(o) if o is not None else "-" for o in s.outs),
                                tuple(format_layout(i) if i is not None else "any" for i in s.ins),
                                tuple(format_layout(g) if g is not None else "any" for g in s.grad_ins))
        outs, ins, grad_ins = formatted[id(s)]
        share = 1.0 / v.count
        alt_records = ()
        if r == n.name:
            alt_records = tuple(
                Alternative(v.strategies[i].describe(), _r(dt), _r(dm)) for dt, dm, i in alts.get(r, [])
            )
        node_records.append(NodePlacement(
            name=n.name,
            op=str(n.target) if n.op == "call_function" else n.meta.get("autopar.kind", n.op),
            module=n.meta.get("autopar.module", ""),
            outs=outs,
            ins=ins,
            grad_ins=grad_ins,
            rep=r if r != n.name else "",
            compute_s=_r((v.fwd_s[choice[r]] + v.bwd_s[choice[r]]) * share),
            alternatives=alt_records,
            excluded=tuple(v.excluded[:3]) if r == n.name else (),
            fallback=v.fallback,
        ))
        if n.meta.get("autopar.kind") == "param":
            meta = n.meta["autopar.outputs"][0]
            key = (id(s), tuple(meta.shape), meta.dtype)
            if key not in held:
                held[key] = _r(param_memory(meta, s, ctx))
            param_records.append(ParamPlacement(
                fqn=n.meta["autopar.fqn"], node=n.name,
                layout=outs[0] if s.outs[0] is not None else format_layout(s.outs[0]),
                zero_axes=tuple(names[a] for a in s.zero_axes), shape=meta.shape,
                bytes_per_device=held[key],
                zero_stage=s.zero_stage if s.zero_axes else 0,
            ))
    mesh_axes = tuple(zip(names, att.mesh))
    from autopar.planner.axis_use import axis_use

    # how the operators use each axis (the summary says it: a free plan's 'dp' axis may also split weights)
    use = axis_use(traced.graph, {r.name: r for r in node_records}, [r.name for r in node_records], mesh_axes)
    stage = Stage(0, mesh_axes, 0, tuple(node_records), tuple(param_records), axis_use=use)
    predicted = predicted_of(att, comm_bytes)
    sol = att.solution
    report = SolverReport(sol.status, _r(sol.gap), _r(sol.objective_s), _r(sol.bound_s), sol.num_vars, sol.num_constraints,
                          tuple(outcomes), sol.stopped)
    versions = (("autopar", _autopar_version()), ("torch", torch.__version__.split("+")[0]))
    from autopar.constraints import constraints_json

    cjson = constraints_json(c)
    fp = fingerprint_of(traced.gm.code, _shapes_key(traced), cluster.to_json(), cjson, precision, repr(optimizer), repr(versions))
    notes = []
    fallbacks = sorted({str(v.node.target) for v in problem.nodes.values() if v.fallback and v.node.op == "call_function"})
    if fallbacks:
        notes.append("ops without a sharding rule run replicated: " + ", ".join(fallbacks))
    limited = [label for label, outcome in outcomes if "time limit" in outcome]
    if att.solution.time_limit_hit:
        notes.append(f"not proven optimal: the ILP solver stopped at its time limit (SolverConfig.time_limit_s) with "
                     f"this plan {att.solution.gap * 100:.2f}% above its lower bound; planning again may give a "
                     "different plan (a longer time limit proves it)")
    elif att.solution.status != "OPTIMAL":
        notes.append(f"not proven optimal: this plan is at most {att.solution.gap * 100:.2f}% slower than the best "
                     f"(by the ILP's LP bound); proving it would take a MIP over {att.solution.unproven_columns} "
                     "columns, predicted too slow (SolverConfig(prove_limit=0) runs it)")
    if limited and not att.solution.time_limit_hit:
        notes.append(f"the ILP solver stopped at its time limit for {len(limited)} other candidate(s) "
                     f"({'; '.join(limited[:3])}): one of them might be faster than this plan")
    if any(_per_shard_mean(v.node) for v in problem.nodes.values()):
        notes.append("a batch-sharded mean loss with class weights or label smoothing is averaged per shard: exact "
                     "unless targets use ignore_index (unweighted mean losses are summed and divided by the count of "
                     "targets, exactly)")
    return Plan(
        fingerprint=fp, versions=versions, model_class=traced.model_class, cluster_json=cluster.to_json(),
        precision=precision, optimizer=optimizer.name, optimizer_spec=optimizer, constraints=cjson, mesh_axes=mesh_axes,
        microbatches=att.microbatches, recompute=bool(att.evaluation.recompute), schedule=None, stages=(stage,),
        recompute_blocks=tuple(p for p in att.problem.block_instances() if p in att.evaluation.recompute),
        predicted=predicted, baseline=baseline, solver=report,
        free_step_time_s=_r(free_time) if free_time is not None else None, notes=tuple(notes),
    )


def _shapes_key(traced: TracedGraph) -> str:
    parts = []
    for n in traced.graph.nodes:
        outs = n.meta.get("autopar.outputs", ())
        parts.append(f"{n.name}:{[(m.shape, str(m.dtype)) if m else None for m in outs]}")
    return "|".join(parts)


def _autopar_version() -> str:
    try:
        from importlib.metadata import version

        return version("autopar")
    except Exception:  # noqa: BLE001 - not installed (source checkout)
        return "0+unknown"


def _per_shard_mean(node) -> bool:
    """A cross-entropy / NLL loss still reduced by mean (``loss_rewrite`` left it: weights or smoothing)."""
    from autopar.node_view import OpView

    if not ("cross_entropy" in str(node.target) or "nll_loss" in str(node.target)):
        return False
    return OpView(node).arg("reduction", 1) == 1
