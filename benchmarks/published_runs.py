"""One published run (an entry of ``benchmarks/published_runs.json``) -> what autopar plans for it.

The papers' FLOPs formulas, the mapping of a run's published configuration to
``autopar.Constraints`` and of its hardware to an ``autopar.Cluster`` (with the calibrated
constants, if any), the planning of one run (``plan_entry``) and the conversion of a predicted
step time to throughput in the paper's own unit. The module-level ``*_OVERRIDE``, ``FREE_PLANS``
and ``INTER_NODE_GBPS`` flags live here only: ``published_comparison.main`` and
``published_calibration`` set them as ``published_runs.NAME = ...``. See
``published_comparison.py`` for the user documentation.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

import autopar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

RUNS_JSON = os.path.join(ROOT, "benchmarks", "published_runs.json")
PEAK_16BIT = {"A100": 312e12, "H100": 989e12}  # the peaks the papers divide by
A100_40GB = dict(memory_bytes=40 * 10**9, memory_bandwidth=1.555e12)  # A100 40GB SXM datasheet


# --- the papers' FLOPs formulas ---------------------------------------------------------------

def narayanan_eq3_flops(B, s, l, h, V):
    """Narayanan et al. 2021, Eq. 3: FLOPs per iteration incl. the recomputed forward pass."""
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def korthikanti_model_flops(B, s, L, h, V):
    """Korthikanti et al. 2022, App. A: model FLOPs per iteration (no recompute)."""
    return 72 * B * L * s * h**2 * (1 + s / (6 * h) + V / (12 * h * L))


def mpt_flops_per_token(N, L, d, s):
    """llm-foundry README: MFU counts 6*N + 12*L*d*s FLOPs per token (N = all parameters)."""
    return 6 * N + 12 * L * d * s


def family(entry: dict) -> str:
    i = entry["id"]
    if i.startswith("narayanan21-t1"):
        return "narayanan-t1"
    if i.startswith("narayanan21-t2-zero3"):
        return "narayanan-t2-zero3"
    if i.startswith("narayanan21-t2-ptdp"):
        return "narayanan-t2-ptdp"
    if i.startswith("korthikanti22"):
        return "korthikanti"
    if i.startswith("mpt-"):
        return "mpt"
    return "other"


def _gpu(entry):
    return "H100" if entry["gpu"].startswith("H100") else "A100"


# --- mapping a published entry to a planner call ----------------------------------------------

def representable(entry: dict) -> str | None:
    """None if the row can be planned, else why not."""
    m, c = entry["model"], entry["config"]
    if family(entry) == "other":
        if c.get("tp") is None or c.get("global_batch") is None:
            return "tensor-parallel degree and global batch not published: config cannot be forced"
        return "no FLOPs formula wired for this source"
    if m["ffn_hidden"] != 4 * m["hidden"]:
        return f"ffn_hidden {m['ffn_hidden']} != 4*hidden: the example GPT has a 4x MLP"
    if not entry["gpu"].startswith(("A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB")):
        return f"no preset for {entry['gpu']}"
    return None


def forced(entry: dict) -> tuple[dict, list[str]]:
    """The published configuration as Constraints arguments, and the mapping notes."""
    c, notes = entry["config"], []
    tp = c.get("tp") or 1
    dp = c.get("dp") or entry["gpus"] // (tp * (c.get("pp") or 1))
    zero = c.get("zero")
    if zero is None:
        zero = 0
        notes.append("zero null -> 0 (no distributed optimizer in Megatron-LM 2021)")
    rc = c.get("recompute")
    if rc == "full":
        recompute = True
    elif rc == "none":
        recompute = False
    elif rc == "selective":
        recompute = False
        notes.append("selective recompute -> recompute=False (no selective option)")
    else:
        recompute = True
        notes.append("recompute null -> True (Eq. 3 counts recompute)")
    if c.get("sequence_parallel"):
        notes.append("sequence parallel left to the ILP")
    pp = c.get("pp") or 1
    mb = c.get("micro_batch")
    if pp > 1 and not mb:
        mb = 1
        notes.append("micro_batch null -> 1 (Megatron's pipelined runs; Table 2 publishes 1)")
    micro = 1
    if mb:
        per_replica = c["global_batch"] / dp
        micro = max(1, round(per_replica / mb))
    out = dict(dp=dp, tp=tp, zero=zero, recompute=recompute, microbatches=micro)
    if pp > 1:
        out.update(pp=pp, schedule="1f1b")
        notes.append("schedule 1f1b (whether a row used the interleaved schedule is not published)")
    return out, notes


def attention_for(entry: dict) -> str:
    """How the published stack ran attention: Megatron-LM of 2021-2022 (Narayanan, Korthikanti)
    had no flash attention, so its (heads x seq x seq) scores went through device memory
    (scale/mask/softmax fused into one kernel; the example GPT's "math" path runs mask and
    softmax as two, and no attention dropout); MPT ran a fused flash kernel."""
    return "math" if family(entry).startswith(("narayanan", "korthikanti")) else "sdpa"


class HalfOutputLayerNorm(torch.nn.LayerNorm):
    """A LayerNorm whose output is bf16, as Megatron-LM's fused LayerNorm (apex FusedLayerNorm,
    half precision in and out) ran it; under autocast torch's layer_norm returns fp32, so every
    tensor-parallel gather of its output would move twice the bytes the published stack moved."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(torch.bfloat16)


def layernorm_for(entry: dict) -> str:
    """"half" where the published stack's LayerNorm emitted half precision (Megatron-LM 2021-2022:
    Narayanan, Korthikanti), else "autocast" (torch's LayerNorm under autocast: fp32 out)."""
    return "half" if family(entry).startswith(("narayanan", "korthikanti")) else "autocast"


def _half_layernorms(model: torch.nn.Module) -> None:
    """Replace the model's LayerNorms by ``HalfOutputLayerNorm`` of the same shape (meta tensors)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.LayerNorm:
                setattr(parent, name, HalfOutputLayerNorm(child.normalized_shape, eps=child.eps,
                                                          elementwise_affine=child.elementwise_affine))


# set by --calibrate-on: a measured (calibrated) matmul efficiency replacing the preset's
EFFICIENCY_OVERRIDE: float | None = None
# set by --calibrate-comm-on: the achieved fraction of inter-node bandwidth (LinkSpec.efficiency)
COMM_EFFICIENCY_OVERRIDE: float | None = None
# set by --calibrate-rails-on: how many NICs of a node one collective drives (LinkSpec.rails)
RAILS_OVERRIDE: float | None = None
# set by --calibrate-exposed-on: the share of overlappable communication left exposed
# (Cluster.exposed_comm_share)
EXPOSED_OVERRIDE: float | None = None
# set by --free: also plan every row without constraints and compare
FREE_PLANS = False
# set by --inter-node-gbps: an assumed node-to-node fabric (Gb/s per node, all NICs) for rows whose
# source does not state it (a sensitivity check, printed in each row's notes)
INTER_NODE_GBPS: float | None = None
# with --free: the families whose rows get a free plan (None: all)
FREE_FAMILIES: set | None = None
# cleared by --no-stack-fields: the public spec fields a row's software stack sets (STACK_FIELDS)
USE_STACK_FIELDS = True

# Spec fields that describe a row's *software stack*, not its hardware (issue 44, item 3): the
# value, and why. Not fitted on any row. The presets keep every other field as shipped.
STACK_FIELDS = {
    "narayanan-t2-zero3": dict(
        rails=1.0,
        why="DeepSpeed ZeRO-3 of 2021: its gathers and gradient reduce-scatters over all ranks of every node "
            "cross the node boundary through one NIC per node (LinkSpec.rails=1, one ring channel's NIC), "
            "where NCCL's multi-channel rings drive all 8 (the preset). Value set, not fitted; the evidence "
            "for it is these rows' own flat published step time (66.75 s at 768 and 1536 GPUs): see "
            "benchmarks/README.md, issue 44 section"),
}


def cluster_for(entry: dict) -> tuple[autopar.Cluster, list[str]]:
    cl = autopar.Cluster.preset(entry["cluster_preset"], nodes=entry["nodes"])
    notes = []
    if EFFICIENCY_OVERRIDE is not None:
        cl = dataclasses.replace(cl, device=dataclasses.replace(cl.device, matmul_efficiency=EFFICIENCY_OVERRIDE))
        notes.append(f"matmul_efficiency {EFFICIENCY_OVERRIDE:.3f} (calibrated)")
    if INTER_NODE_GBPS is not None and cl.nodes > 1:
        per_gpu = INTER_NODE_GBPS * 1e9 / 8 / cl.devices_per_node
        cl = dataclasses.replace(cl, inter_node=dataclasses.replace(cl.inter_node, bandwidth=per_gpu))
        notes.append(f"assumed {INTER_NODE_GBPS:.0f} Gb/s node-to-node ({per_gpu / 1e9:.1f} GB/s per GPU)")
    if COMM_EFFICIENCY_OVERRIDE is not None:
        cl = dataclasses.replace(cl, inter_node=dataclasses.replace(cl.inter_node, efficiency=COMM_EFFICIENCY_OVERRIDE))
        notes.append(f"inter-node efficiency {COMM_EFFICIENCY_OVERRIDE:.3f} (calibrated)")
    stack = STACK_FIELDS.get(family(entry)) if USE_STACK_FIELDS else None
    if RAILS_OVERRIDE is not None:
        cl = dataclasses.replace(cl, inter_node=dataclasses.replace(cl.inter_node, rails=RAILS_OVERRIDE))
        notes.append(f"inter-node rails {RAILS_OVERRIDE:.2f} (calibrated)")
    elif stack is not None and "rails" in stack:
        cl = dataclasses.replace(cl, inter_node=dataclasses.replace(cl.inter_node, rails=stack["rails"]))
        notes.append(f"inter-node rails {stack['rails']:g} (software stack field, not fitted)")
    if EXPOSED_OVERRIDE is not None:
        cl = dataclasses.replace(cl, exposed_comm_share=EXPOSED_OVERRIDE)
        notes.append(f"exposed communication share {EXPOSED_OVERRIDE:.3f} (calibrated)")
    if entry["gpu"].startswith("A100-SXM4-40GB"):
        dev = dataclasses.replace(cl.device, name="A100-SXM4-40GB", **A100_40GB)
        cl = dataclasses.replace(cl, device=dev)
        notes.append("A100 40GB: preset memory/bandwidth overridden")
    assert cl.world_size == entry["gpus"], (entry["id"], cl.world_size)
    return cl, notes


def published_and_predicted(entry: dict, step_s: float) -> dict:
    """Throughput in the paper's unit: published value, predicted value, and the unit name."""
    m, c, rep = entry["model"], entry["config"], entry["reported"]
    B, s, l, h, V, n = c["global_batch"], m["seq_len"], m["layers"], m["hidden"], m["vocab"], entry["gpus"]
    fam = family(entry)
    if fam.startswith("narayanan"):
        F = narayanan_eq3_flops(B, s, l, h, V)
        pub = rep["tflops_per_gpu"]
        return dict(unit="TFLOP/s/GPU (Eq. 3)", published=pub, predicted=F / (step_s * n) / 1e12,
                    published_step_s=F / (pub * 1e12 * n), derived="")
    if fam == "korthikanti":
        F = korthikanti_model_flops(B, s, l, h, V)
        peak = PEAK_16BIT["A100"]
        if rep.get("mfu") is not None:
            pub, derived = rep["mfu"] * 100, ""
        else:
            pub, derived = F / (rep["seconds_per_iteration"] * n * peak) * 100, "MFU derived from published s/iter"
        return dict(unit="MFU % (App. A)", published=pub, predicted=F / (step_s * n * peak) * 100,
                    published_step_s=rep.get("seconds_per_iteration"), derived=derived)
    if fam == "mpt":
        per_tok = mpt_flops_per_token(m["params_b"] * 1e9, l, h, s)
        peak = PEAK_16BIT[_gpu(entry)]
        pub = rep["mfu"] * 100
        tokens = B * s
        return dict(unit="MFU % (6N+12Lds)", published=pub, predicted=per_tok * tokens / step_s / (n * peak) * 100,
                    published_step_s=tokens / rep["tokens_per_s"], derived="")
    raise ValueError(fam)


def _rails_tag(cluster) -> str:
    r = cluster.inter_node.rails
    return "all NICs" if r is None else f"rails={r:g}"


def forced_strategies(kw: dict, cluster) -> list[str]:
    """What the published configuration relies on, in the classes ``plan_strategies`` names: a
    pipeline; data parallelism whose groups hold one rank per node or several (several: the
    node's NICs a collective drives, ``LinkSpec.rails``, matters, so the class names it); ZeRO."""
    dp, tp, pp = kw["dp"], kw["tp"], kw.get("pp", 1)
    # a stage's dp x tp ranks are contiguous, tp fastest: a dp group's ranks sit tp apart
    per_node = max(1, cluster.devices_per_node // tp) if tp < cluster.devices_per_node else 1
    spans = dp * tp > cluster.devices_per_node and dp > 1
    out = [] if kw["recompute"] else ["no recompute"]
    if pp > 1:
        out.append("pipeline")
    if tp > 1:
        out.append("tensor (intra-node)" if tp <= cluster.devices_per_node else "tensor (inter-node)")
    if dp > 1:
        zero = {0: "dp", 1: "ZeRO-1/2", 2: "ZeRO-1/2", 3: "ZeRO-3"}[kw["zero"]]
        out.append(f"{zero} over nodes, several ranks/node ({_rails_tag(cluster)})" if spans and per_node > 1
                   else f"{zero} over nodes, 1 rank/node" if spans else f"{zero} (intra-node)")
    return out


def plan_strategies(plan, cluster) -> list[str]:
    """The strategy classes of a plan (``forced_strategies``' names), read from its stages' axis
    use (data / tensor / ZeRO-3 per mesh axis) and its parameters' ZeRO stage."""
    mesh = list(plan.stages[0].mesh)
    dpn = cluster.devices_per_node
    pp = plan.pipeline_degree
    out = [] if plan.recompute or plan.recompute_blocks else ["no recompute"]
    if pp > 1:
        out.append("pipeline")
    roles: dict[str, set] = {}
    for st in plan.stages:
        for ax, rs in st.axis_use:
            roles.setdefault(ax, set()).update(rs)
    zero12 = any(p.zero_stage in (1, 2) and p.zero_axes for st in plan.stages for p in st.params)
    for i, (ax, size) in enumerate(mesh):
        rs = roles.get(ax, set())
        if size == 1 or not rs:
            continue
        inner = 1
        for _, s in mesh[i + 1:]:
            inner *= s
        # a group along this axis: ranks `inner` apart; it spans nodes when size*inner > dpn
        spans = size * inner > dpn
        per_node = max(1, dpn // inner) if inner < dpn else 1
        if "tensor" in rs:
            out.append("tensor (intra-node)" if not spans else "tensor (inter-node)")
        if "data" in rs or "ZeRO-3" in rs:
            kind = "ZeRO-3" if "ZeRO-3" in rs else ("ZeRO-1/2" if zero12 else "dp")
            out.append(f"{kind} over nodes, several ranks/node ({_rails_tag(cluster)})" if spans and per_node > 1
                       else f"{kind} over nodes, 1 rank/node" if spans else f"{kind} (intra-node)")
    return sorted(set(out), key=out.index)


def _model_and_batch(entry: dict, notes: list[str]) -> tuple[torch.nn.Module, torch.Tensor]:
    """The row's GPT on the meta device (attention and LayerNorm as its stack ran them) and its batch."""
    m, c = entry["model"], entry["config"]
    attention = attention_for(entry)
    if attention == "math":
        notes.append("attention materialised (no flash attention in this stack)")
    with torch.device("meta"):
        model = GPT(GPTConfig(m["vocab"], m["seq_len"], m["layers"], m["heads"], m["hidden"], attention=attention))
        if layernorm_for(entry) == "half":
            _half_layernorms(model)
            notes.append("LayerNorm output bf16 (Megatron's fused LayerNorm)")
    return model, torch.empty(c["global_batch"], m["seq_len"], dtype=torch.long, device="meta")


def plan_restricted(entry: dict, kw: dict, relaxed: int = 1) -> dict:
    """The row planned under ``Constraints(**kw)`` (the free plan restricted to validated
    strategies), on the cluster its forced plan used (``relaxed`` x device memory): its predicted
    throughput in the paper's unit, layout and strategy classes, or ``ok=False`` and the error."""
    cluster, _ = cluster_for(entry)
    if relaxed > 1:
        dev = cluster.device
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(dev, memory_bytes=dev.memory_bytes * relaxed))
    model, idx = _model_and_batch(entry, [])
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(model, cluster, (idx,), loss_fn=gpt_loss, example_target=idx, precision="bf16-mixed",
                            constraints=autopar.Constraints(**kw))
    except autopar.NoFeasiblePlanError as exc:
        return dict(ok=False, constraints=dict(kw), error=str(exc).split(". ")[0], plan_s=time.perf_counter() - t0)
    return dict(ok=True, constraints=dict(kw), step_s=plan.predicted.step_time_s, pp=plan.pipeline_degree,
                mesh=plan.mesh, schedule=plan.schedule, microbatches=plan.microbatches,
                predicted=published_and_predicted(entry, plan.predicted.step_time_s)["predicted"],
                strategies=plan_strategies(plan, cluster), plan_s=time.perf_counter() - t0)


def plan_entry(entry: dict) -> dict:
    kw, notes = forced(entry)
    cluster, cnotes = cluster_for(entry)
    notes += cnotes
    model, idx = _model_and_batch(entry, notes)
    t0 = time.perf_counter()
    plan, err, relaxed = None, "", 1
    while plan is None:
        try:
            plan = autopar.plan(model, cluster, (idx,), loss_fn=gpt_loss, example_target=idx, precision="bf16-mixed",
                                constraints=autopar.Constraints(**kw))
        except autopar.NoFeasiblePlanError as exc:
            err = str(exc)
            if not ("memory" in err or "GiB" in err) or relaxed >= 4:
                break
            # The published run fitted; ours does not: bf16-mixed (autocast) keeps the residual
            # stream and the checkpointed block inputs in fp32, where Megatron-LM and DeepSpeed
            # trained in half precision with fp32 master weights. Changing the published
            # configuration (more microbatches) would change what is compared (ZeRO-3 gathers
            # every parameter once per microbatch), so the memory check is relaxed instead.
            relaxed *= 2
            dev = cluster.device
            cluster = dataclasses.replace(cluster, device=dataclasses.replace(dev, memory_bytes=dev.memory_bytes * 2))
    plan_s = time.perf_counter() - t0
    out = dict(id=entry["id"], family=family(entry), gpus=entry["gpus"], forced=dict(kw), notes=notes, plan_s=plan_s,
               strategies=forced_strategies(kw, cluster), gpu=_gpu(entry), relaxed=relaxed,
               devices_per_node=cluster.devices_per_node)
    if relaxed > 1 and plan is not None:
        notes.append(f"the published configuration does not fit our memory model (fp32 residual stream under "
                     f"autocast); planned with {relaxed}x device memory")
    if plan is None:
        out.update(ok=False, error=err.split(". ")[0])
        return out
    step = plan.predicted.step_time_s
    kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for node in plan.nodes.values():
        k = "matmul" if any(t in node.op for t in ("linear", ".mm", "bmm", "addmm", "matmul", "einsum")) else (
            "attention" if "scaled_dot_product_attention" in node.op else "other")
        kinds[k] += node.compute_s
    out.update(ok=True, step_s=step, compute_s=plan.predicted.compute_s, exposed_comm_s=plan.predicted.exposed_comm_s,
               blocking_comm_s=plan.predicted.blocking_comm_s, comm_s=dict(plan.predicted.comm_s),
               compute_by_kind=kinds, peak_gib=plan.predicted.peak_memory_bytes / 2**30,
               planner_mfu=plan.predicted.mfu, recompute=plan.recompute, mesh=plan.mesh)
    out.update(published_and_predicted(entry, step))
    out["ratio"] = out["predicted"] / out["published"]
    out["error_pct"] = (out["ratio"] - 1) * 100
    if FREE_PLANS and (FREE_FAMILIES is None or family(entry) in FREE_FAMILIES):
        t0 = time.perf_counter()
        try:
            free = autopar.plan(model, cluster, (idx,), loss_fn=gpt_loss, example_target=idx, precision="bf16-mixed")
        except autopar.NoFeasiblePlanError as exc:
            out.update(free_ok=False, free_error=str(exc).split(". ")[0])
        else:
            out.update(free_ok=True, free_step_s=free.predicted.step_time_s, free_pp=free.pipeline_degree,
                       free_mesh=free.mesh, free_schedule=free.schedule, free_microbatches=free.microbatches,
                       free_predicted=published_and_predicted(entry, free.predicted.step_time_s)["predicted"],
                       free_strategies=plan_strategies(free, cluster))
        out["free_plan_s"] = time.perf_counter() - t0
    return out
