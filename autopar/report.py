"""Human-readable views of a Plan: summary table, per-module explanation, plan diff."""
from __future__ import annotations

import re
from collections import defaultdict

__all__ = ["plan_summary", "plan_explain", "plan_diff"]

GiB = 2**30


def _ms(s: float) -> str:
    return f"{s * 1e3:,.3f} ms"


def format_bytes(b: float) -> str:
    """Bytes for people: GiB from a tenth of one, else MiB."""
    if b >= 0.1 * GiB:
        return f"{b / GiB:,.2f} GiB"
    return f"{b / 2**20:,.2f} MiB"


def _constraints_text(text: str) -> str:
    import json

    items = {k: v for k, v in json.loads(text).items() if v not in (None, [])}
    return ", ".join(f"{k}={v}" for k, v in sorted(items.items())) or "none"


def _group_key(module: str, depth: int = 2) -> str:
    """Collapse block instances: 'blocks.17.attn.qkv' -> 'blocks.*.attn'."""
    parts = module.split(".") if module else []
    parts = ["*" if p.isdigit() else p for p in parts]
    return ".".join(parts[: depth + (1 if "*" in parts[:depth] else 0)]) or "<root>"


def _pipeline_lines(plan) -> list[str]:
    """The stages of a pipeline plan: which layers, which ranks, time per microbatch, peak memory."""
    size = plan.stage_size
    per_rank = f" ({plan.virtual_stages} per rank)" if plan.virtual_stages > 1 else ""
    lines = [f"pipeline: {len(plan.stages)} stages{per_rank} x {size} device(s) | schedule {plan.schedule} | "
             f"{plan.microbatches} microbatches | predicted bubble {plan.bubble_fraction * 100:.1f}% of the step",
             f"  {'stage':>5} {'ranks':>9}  {'fwd+bwd / microbatch':>20}  {'peak memory':>12}  {'submesh axes used for':<24}  layers"]
    for st in plan.stages:
        ranks = f"{st.first_rank}-{st.first_rank + size - 1}" if size > 1 else str(st.first_rank)
        mine = [b for b in plan.recompute_blocks if any(n.module.startswith(b + ".") for n in st.nodes)]
        rc = f" (recomputes {len(mine)} block(s))" if mine else ""
        # ZeRO-1/2 (state sharded); ZeRO-3 (stored sharded, gathered for use: planner.axis_use)
        zero = sorted({p.zero_stage for p in st.params if p.zero_axes}
                      | {3 for _, roles in st.axis_use if "ZeRO-3" in roles})
        rc += f" (ZeRO-{'/'.join(map(str, zero))})" if zero else ""
        use = ", ".join(f"{axis}: {'+'.join(r for r in roles if r != 'ZeRO-3') or '-'}" for axis, roles in st.axis_use) or "-"
        lines.append(f"  {st.index:>5} {ranks:>9}  {_ms(st.predicted_time_s):>20}  {format_bytes(st.peak_memory_bytes):>12}  "
                     f"{use:<24}  {st.span}{rc}")
        for name, layout in st.send_layouts:
            placed = plan.nodes.get(name)
            whole = placed.outs[0] if placed is not None and placed.outs else "?"
            lines.append(f"  {'':>5} {'':>9}  sends '{name}' ({whole}) in pieces {layout}, regathered where received")
    return lines


def plan_summary(plan) -> str:
    from autopar.cluster import Cluster

    cluster = Cluster.from_json(plan.cluster_json)
    p = plan.predicted
    lines = []
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh_axes)
    lines.append(f"autopar plan {plan.fingerprint} for {plan.model_class} on {cluster.name}: "
                 f"{cluster.nodes} node(s) x {cluster.devices_per_node} {cluster.device.name}")
    rc = "off"
    if plan.recompute_blocks:
        rc = f"{len(plan.recompute_blocks)} block(s): {', '.join(plan.recompute_blocks[:4])}" + (
            ", ..." if len(plan.recompute_blocks) > 4 else "")
    lines.append(f"mesh {mesh} | precision {plan.precision} | optimizer {plan.optimizer} | "
                 f"recompute {rc} | microbatches {plan.microbatches}")
    if len(plan.stages) > 1:
        lines.extend(_pipeline_lines(plan))
    zero = sorted({f"{a} (ZeRO-{pp.zero_stage})" for pp in plan.params.values() for a in pp.zero_axes})
    sharded = sum(1 for pp in plan.params.values() if "S(" in pp.layout)
    lines.append(f"parameters: {len(plan.params)} tensors, {sharded} sharded"
                 + (f", optimizer state sharded on {zero}" if zero else ""))
    lines.append("")
    # per-module table
    rows: dict[str, dict] = defaultdict(lambda: {"compute": 0.0, "params": 0, "layouts": set(), "count": set()})
    for n in plan.nodes.values():
        key = _group_key(n.module)
        rows[key]["compute"] += n.compute_s
        m = re.search(r"\.(\d+)(\.|$)", n.module)
        if m:
            rows[key]["count"].add(m.group(1))
    for pp in plan.params.values():
        key = _group_key(pp.fqn.rpartition(".")[0])
        numel = 1
        for s in pp.shape:
            numel *= s
        rows[key]["params"] += numel
        rows[key]["layouts"].add(pp.layout + ("+zero" if pp.zero_axes else ""))
    header = f"{'module':<32} {'x':>4} {'params':>12} {'compute':>14}  parameter layouts [{', '.join(a for a, _ in plan.mesh_axes)}]"
    lines.append(header)
    lines.append("-" * len(header))
    for key in sorted(rows, key=lambda k: (-rows[k]["compute"], k)):
        r = rows[key]
        cnt = len(r["count"]) or 1
        lay = ", ".join(sorted(r["layouts"]))[:60]
        lines.append(f"{key:<32} {cnt:>4} {r['params']:>12,} {_ms(r['compute']):>14}  {lay}")
    lines.append("")
    comm = ", ".join(f"{k} {_ms(v)}" for k, v in p.comm_s) or "none"
    if len(plan.stages) > 1:
        lines.append(f"predicted step time  {_ms(p.step_time_s)}  (the {plan.schedule} schedule over the stages' compute and "
                     f"communication, bubble {plan.bubble_fraction * 100:.1f}%; one stage's submesh alone: compute "
                     f"{_ms(p.compute_s)} + blocking comm {_ms(p.blocking_comm_s)} + exposed comm {_ms(p.exposed_comm_s)})")
    else:
        lines.append(f"predicted step time  {_ms(p.step_time_s)}  = compute {_ms(p.compute_s)} + blocking comm "
                     f"{_ms(p.blocking_comm_s)} + exposed overlappable comm {_ms(p.exposed_comm_s)}")
    lines.append(f"communication        {comm}")
    if p.comm_bytes:
        whose = ("per device of the busiest pipeline rank; each stage's rank in Stage.comm_bytes" if len(plan.stages) > 1
                 else "per device")
        lines.append("bytes per step       " + ", ".join(f"{k} {format_bytes(v)}" for k, v in p.comm_bytes)
                     + f" ({whose}; measure with ParallelModel.measure_step)")
    mem = dict(p.memory_bytes)
    kept = ("params", "grads", "optimizer_state")
    lines.append(f"peak memory / device {format_bytes(p.peak_memory_bytes)} of {format_bytes(cluster.device.memory_bytes)} "
                 f"(kept: {', '.join(f'{k} {format_bytes(mem[k])}' for k in kept if k in mem)}; most at once during the step: "
                 f"{', '.join(f'{k} {format_bytes(v)}' for k, v in mem.items() if k not in kept)})")
    lines.append(f"model FLOPs / step   {p.model_flops:.3e}  MFU {p.mfu * 100:.1f}%")
    b = plan.baseline
    if b.predicted is not None:
        ratio = b.predicted.step_time_s / p.step_time_s if p.step_time_s else float("nan")
        lines.append(f"baseline {b.name}: {_ms(b.predicted.step_time_s)}/step, peak {format_bytes(b.predicted.peak_memory_bytes)}"
                     f" ({b.note}); this plan is {ratio:.2f}x its speed")
    else:
        lines.append(f"baseline {b.name}: {b.note}")
    if plan.free_step_time_s is not None:
        extra = plan.override_cost_s
        pct = 100 * extra / plan.free_step_time_s if plan.free_step_time_s else 0.0
        lines.append(f"constraints ({_constraints_text(plan.constraints)}) cost {_ms(extra)} (+{pct:.1f}%) vs the free optimum {_ms(plan.free_step_time_s)}")
    s = plan.solver
    why = "" if s.stopped == "optimal" else f" (stopped: {s.stopped}; gap to the best lower bound proved)"
    lines.append(f"solver {s.status}, gap {s.gap * 100:.2f}%{why}, {s.num_vars} variables; "
                 f"candidates tried: {len(s.candidates)}")
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def plan_explain(plan, module_path: str = "") -> str:
    nodes = plan.nodes_in(module_path) if module_path else list(plan.nodes.values())
    if not nodes:
        modules = sorted({n.module for n in plan.nodes.values() if n.module})[:10]
        raise KeyError(f"no node in module {module_path!r}; modules look like {modules}")
    lines = [f"why the plan lays out '{module_path or '<model>'}' this way (deltas: other nodes fixed)"]
    for n in nodes:
        if n.op in ("getitem",) or n.op.startswith("aten.view") or n.op.startswith("aten.transpose"):
            continue
        ref = plan.nodes.get(n.rep) if n.rep else n
        head = f"{n.name:<28} {n.op:<40} out {', '.join(n.outs)}"
        if n.ins:
            head += f" <- {', '.join(n.ins)}"
        lines.append(head)
        if n.rep:
            lines.append(f"    shares the decision of {n.rep} (repeated block)")
        for a in ref.alternatives:
            lines.append(f"    alternative {a.strategy}: {a.delta_time_s * 1e3:+.4f} ms, {a.delta_memory_bytes / 2**20:+.1f} MiB")
        for desc, why in ref.excluded:
            lines.append(f"    excluded {desc}: {why}")
        if n.fallback:
            lines.append("    no sharding rule for this op: runs replicated")
    for pp in plan.params.values():
        if not module_path or pp.fqn.startswith(module_path + ".") or pp.fqn == module_path:
            lines.append(f"param {pp.fqn} {tuple(pp.shape)} {pp.layout}"
                         + _uneven_note(pp, plan)
                         + (f" optimizer state sharded on {list(pp.zero_axes)}" if pp.zero_axes else "")
                         + f", {pp.bytes_per_device / 2**20:.1f} MiB/device")
    return "\n".join(lines)


def _uneven_note(pp, plan) -> str:
    """' (stored unevenly: ...)' for a parameter sharded FSDP2-style on a dim that does not divide."""
    from autopar.layouts import parse_layout, uneven_dims

    sizes = tuple(size for _, size in plan.mesh_axes)
    names = [name for name, _ in plan.mesh_axes]
    pairs = sorted(uneven_dims(pp.shape, (parse_layout(pp.layout),), sizes))
    if not pairs:
        return ""
    parts = [f"dim {d} ({pp.shape[d]}) over '{names[a]}' ({sizes[a]}), padded to {-(-pp.shape[d] // sizes[a]) * sizes[a]}"
             for a, d in pairs]
    return " (stored unevenly, gathered before use: " + "; ".join(parts) + ")"


def plan_diff(a, b) -> str:
    lines = []
    if a.mesh_axes != b.mesh_axes:
        lines.append(f"mesh: {dict(a.mesh_axes)} -> {dict(b.mesh_axes)}")
    for field in ("precision", "optimizer", "recompute", "microbatches", "constraints"):
        if getattr(a, field) != getattr(b, field):
            lines.append(f"{field}: {getattr(a, field)} -> {getattr(b, field)}")
    pa, pb = a.params, b.params
    for fqn in sorted(set(pa) | set(pb)):
        x, y = pa.get(fqn), pb.get(fqn)
        if x is None or y is None:
            lines.append(f"param {fqn}: {'added' if x is None else 'removed'}")
        elif (x.layout, x.zero_axes) != (y.layout, y.zero_axes):
            lines.append(f"param {fqn}: {x.layout}{'+zero' if x.zero_axes else ''} -> {y.layout}{'+zero' if y.zero_axes else ''}")
    na, nb = a.nodes, b.nodes
    changed = [n for n in na if n in nb and (na[n].outs, na[n].ins) != (nb[n].outs, nb[n].ins) and not na[n].rep]
    for n in changed[:40]:
        lines.append(f"node {n}: out {', '.join(na[n].outs)} -> {', '.join(nb[n].outs)}")
    if len(changed) > 40:
        lines.append(f"... and {len(changed) - 40} more nodes")
    dt = b.predicted.step_time_s - a.predicted.step_time_s
    dm = b.predicted.peak_memory_bytes - a.predicted.peak_memory_bytes
    lines.append(f"predicted step time {a.predicted.step_time_s * 1e3:.3f} -> {b.predicted.step_time_s * 1e3:.3f} ms ({dt * 1e3:+.3f}); "
                 f"peak memory {dm / 2**30:+.2f} GiB")
    return "\n".join(lines) if lines else "plans are identical"
