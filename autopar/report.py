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


def _roles(plan) -> dict[str, tuple[str, ...]]:
    """How the operators use each axis of a single-stage plan's mesh (``Stage.axis_use``)."""
    return dict(plan.stages[0].axis_use) if len(plan.stages) == 1 else {}


def zero_stage(pp, mesh_axes, roles) -> int:
    """A parameter's ZeRO stage: 1 or 2 where its optimizer state (and gradients) shard on data
    axes, 3 where it is stored split on an axis its operators use it whole on (``axis_use``), else 0."""
    if pp.zero_axes:
        return pp.zero_stage
    return 3 if any("ZeRO-3" in roles.get(a, ()) and "tensor" not in roles.get(a, ()) for a in _split_axes(pp, mesh_axes)) else 0


def _split_axes(pp, mesh_axes) -> list[str]:
    from autopar.layouts import Shard, parse_layout

    return [name for (name, size), p in zip(mesh_axes, parse_layout(pp.layout)) if size > 1 and isinstance(p, Shard)]


def param_sharding(pp, mesh_axes, roles) -> str:
    """What the summary says of one parameter: its ZeRO stage on which axes, its tensor split."""
    parts = []
    if pp.zero_axes:
        parts.append(f"ZeRO-{pp.zero_stage} on {'/'.join(pp.zero_axes)}")
    for axis in _split_axes(pp, mesh_axes):
        use = roles.get(axis, ())
        if "tensor" in use and "ZeRO-3" in use:
            parts.append(f"split on {axis} (tensor or ZeRO-3)")
        elif "tensor" in use or not use:
            parts.append(f"tensor-split on {axis}")
        else:
            parts.append(f"ZeRO-3 on {axis}")
    return " + ".join(parts) or "ZeRO-0 (whole on every rank)"


def _normal_name(name: str) -> str:
    """"AdamW" (a class, as compile's measured spec names it) and "adamw" (a priced name) alike;
    "sgd-momentum" is SGD's."""
    return name.lower().replace("_", "-").removesuffix("-momentum")


def _optimizer_text(plan) -> str:
    used = plan.observed.get("optimizer")
    if used is None:
        return f"optimizer {plan.optimizer}"
    if _normal_name(used) == _normal_name(plan.optimizer):
        return f"optimizer {used} (the loop's)"
    return f"optimizer priced for {plan.optimizer}; the loop steps {used}"


def note_optimizer(plan, optimizer) -> str:
    """Record in ``plan.observed`` the optimizer a ParallelModel's loop steps (train_step's, or the
    native loop's given to ``track``); return a note when the plan priced another one, else ""."""
    used = type(optimizer).__name__
    plan.observed["optimizer"] = used
    if _normal_name(used) == _normal_name(plan.optimizer):
        return ""
    return (f"the plan priced the optimizer state of {plan.optimizer}, but the loop steps {used}: its predicted memory "
            f"(optimizer_state, optimizer_step) is {plan.optimizer}'s; compile with optimizer= to price the one that runs")


def _axes_lines(plan) -> list[str]:
    """How a single-stage plan uses its mesh axes, and why a free plan is not the plan forcing its mesh."""
    from autopar.layouts import Shard, parse_layout

    use = plan.stages[0].axis_use
    if not use:
        return []
    data = [a for a, roles in use if "data" in roles]
    whole = sorted({a for n in plan.nodes.values() if n.op in ("input", "target") and n.outs and n.outs[0] not in ("-", "any")
                    for (a, size), p in zip(plan.mesh_axes, parse_layout(n.outs[0]))
                    if a in data and size > 1 and not (isinstance(p, Shard) and p.dim == 0)})
    words = {"data": "data (a share of the batch each)", "tensor": "tensor (weights split)",
             "ZeRO-3": "ZeRO-3 (weights stored split, gathered to use)"}
    line = "axes: " + "; ".join(f"'{a}' {' + '.join(words[r] for r in roles) or 'unused'}" for a, roles in use)
    if whole:
        line += f"; the batch enters whole on {', '.join(repr(a) for a in whole)} (each rank slices its rows)"
    lines = [line]
    import json

    c = json.loads(plan.constraints)
    mixed = [a for a, roles in use if (a == "dp" and "tensor" in roles) or (a == "tp" and "data" in roles)]
    if c.get("dp") is None and c.get("tp") is None and (whole or mixed):
        forced = ", ".join(f"{a}={n}" for a, n in plan.mesh_axes if a in ("dp", "tp"))
        differs = ([f"the batch whole on {', '.join(repr(a) for a in whole)}"] if whole else []) + [
            f"'{a}' used for {' + '.join(r for r in dict(use)[a])}" for a in mixed]
        lines.append(f"note: this mesh is a device grid each operator uses its own way (here: {'; '.join(differs)}); "
                     f"Constraints({forced}) forces it as written: every input split on the batch over 'dp', weights "
                     f"whole there where used, 'tp' for tensor parallelism only. That is another plan, predicted no "
                     f"faster than this one (the optimum over meshes and layouts)")
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
    lines.append(f"mesh {mesh} | precision {plan.precision} | {_optimizer_text(plan)} | "
                 f"recompute {rc} | microbatches {plan.microbatches}")
    if len(plan.stages) > 1:
        lines.extend(_pipeline_lines(plan))
    else:
        lines.extend(_axes_lines(plan))
    roles = _roles(plan)
    stages = defaultdict(int)
    for pp in plan.params.values():
        stages[param_sharding(pp, plan.mesh_axes, roles)] += 1
    lines.append(f"parameters: {len(plan.params)} tensors: "
                 + ", ".join(f"{n} {what}" for what, n in sorted(stages.items(), key=lambda kv: (-kv[1], kv[0]))))
    if plan.timings:
        t = plan.timings
        total = t.get("plan_s", t.get("trace_s", 0.0) + t.get("search_s", 0.0))
        parts = [f"{k[:-2].replace('_', ' ')} {t[k]:.2f} s" for k in ("trace_s", "search_s", "solve_s") if k in t]
        lines.append(f"planned in {total:.2f} s" + (f" ({', '.join(parts)})" if parts else ""))
    lines.append("")
    # per-module table
    rows: dict[str, dict] = defaultdict(lambda: {"compute": 0.0, "params": 0, "layouts": set(), "count": set(),
                                                 "zero": set()})
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
        rows[key]["layouts"].add(pp.layout)
        rows[key]["zero"].add(zero_stage(pp, plan.mesh_axes, roles))
    header = (f"{'module':<32} {'x':>4} {'params':>12} {'compute':>14}  {'ZeRO':<6}  "
              f"parameter layouts [{', '.join(a for a, _ in plan.mesh_axes)}]")
    lines.append(header)
    lines.append("-" * len(header))
    for key in sorted(rows, key=lambda k: (-rows[k]["compute"], k)):
        r = rows[key]
        cnt = len(r["count"]) or 1
        lay = ", ".join(sorted(r["layouts"]))[:60]
        zero = "/".join(str(z) for z in sorted(r["zero"])) if r["zero"] else ""
        lines.append(f"{key:<32} {cnt:>4} {r['params']:>12,} {_ms(r['compute']):>14}  {zero:<6}  {lay}")
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
