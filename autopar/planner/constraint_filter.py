"""What the user's constraints allow: a filter over each node's candidate strategies, and the
checks that constraints name things that exist (pins, attention heads).

``make_filter`` returns ``allowed(node, strategy) -> None | reason``: None keeps the strategy, a
reason excludes it (the plan lists it under the node's excluded alternatives). Pins may name the
axes of ``AXES`` = ("dp", "tp", "ep", "dp_shard"); a mesh has ('dp', 'tp'), ('dp', 'ep') or the HSDP
('dp', 'dp_shard') (``planner.meshes``), with 'tp' beside the last two where tensor parallelism has devices.
"""
from __future__ import annotations

import fnmatch
import math

import torch.fx as fx

from autopar.constraints import MESH_AXES, Constraints
from autopar.errors import ConstraintError
from autopar.ir import context_split_axis, is_local_batch
from autopar.node_view import op_name
from autopar.layouts import Layout, Replicate, Shard, parse_placement, state_dim
from autopar.planner.experts import expert_axes, expert_params
from autopar.planner.meshes import CONTEXT_AXIS, axis_names, data_axes, data_degree, describe, shard_axis
from autopar.regions import REGION_FLOPS_KEY
from autopar.strategies import Strategy
from autopar.strategies.rules import rule_for
from autopar.trace import TracedGraph, tensor_inputs

__all__ = ["AXES", "make_filter", "validate_pins", "check_heads", "pin_key"]

AXES = MESH_AXES


def _matches(fqn: str, pattern: str) -> bool:
    return fqn == pattern or fnmatch.fnmatchcase(fqn, pattern)


def _pin_layout_ok(layout: Layout, axes: tuple, mesh_shape) -> bool:
    for axis_name, text in axes:
        a = axis_names(mesh_shape).index(axis_name)
        want = parse_placement(text)
        if mesh_shape[a] == 1:
            continue
        if layout[a] != want:
            return False
    return True


def validate_pins(traced: TracedGraph, c: Constraints, mesh: tuple[int, ...]) -> None:
    fqns = list(traced.param_fqns.values())
    names = axis_names(mesh)
    for pattern, axes in c.placements + c.outputs:
        for axis_name, _ in axes:
            if axis_name not in names:
                hint = (" (an 'ep' axis exists with experts over fewer devices than the data parallelism: "
                        "Constraints(dp=D, ep=E) with E < D and tp=1)" if axis_name == "ep" else
                        " (the HSDP mesh has it: Constraints(hsdp=S))" if axis_name == "dp_shard" else "")
                raise ConstraintError(f"pin {pattern!r} names mesh axis {axis_name!r}, which this plan's mesh "
                                      f"({describe(mesh)}) does not have{hint}")
    for pattern, axes in c.placements:
        if not any(_matches(f, pattern) for f in fqns):
            merged = next((f for f, members in traced.stacked.items() if any(_matches(m, pattern) for m in members)), None)
            if merged is not None:  # one expert's weight: the trace merged the experts (autopar.stack_experts)
                raise ConstraintError(
                    f"placement pin {pattern!r} names one expert's weight, but the experts written as modules were "
                    f"merged into one parameter per weight position, stacked over the experts (dim 0): pin "
                    f"{merged!r} (and its dims one higher), or use Constraints(ep=) to split the experts")
            raise ConstraintError(f"placement pin {pattern!r} matches no parameter; parameters look like {fqns[:4]}")
        for axis_name, text in axes:
            p = parse_placement(text)
            if mesh[names.index(axis_name)] == 1 and not isinstance(p, Replicate):
                raise ConstraintError(
                    f"placement pin {pattern!r} shards on axis {axis_name!r}, but that axis has size 1 in this "
                    f"plan ({dict(zip(names, mesh))}); set {axis_name}= to more than 1 or drop the pin"
                )
    modules = {n.meta.get("autopar.module", "") for n in traced.graph.nodes}
    for pattern, axes in c.outputs:
        if not any(_matches(m, pattern) for m in modules):
            raise ConstraintError(f"output pin for module {pattern!r} matches no module of the model")


def check_heads(traced: TracedGraph, c: Constraints) -> None:
    if not c.tp or c.tp == 1:
        return
    for n in traced.graph.nodes:
        if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target):
            q = tensor_inputs(n)[0].meta["autopar.outputs"][0]
            heads = q.shape[1]
            if heads % c.tp:
                raise ConstraintError(
                    f"tp={c.tp} cannot split attention in module '{n.meta.get('autopar.module')}': it has "
                    f"{heads} heads, not divisible by {c.tp}; use a tp dividing {heads}"
                )


def output_nodes_of(traced: TracedGraph, pattern: str) -> set[str]:
    """Per module instance matching ``pattern``: its last op node (the module's output)."""
    last: dict[str, str] = {}
    for n in traced.graph.nodes:
        m = n.meta.get("autopar.module", "")
        if n.op != "call_function" or n.meta.get("autopar.kind") != "op":
            continue
        parts = m.split(".") if m else []
        for k in range(len(parts), 0, -1):
            prefix = ".".join(parts[:k])
            if _matches(prefix, pattern):
                last[prefix] = n.name
                break
    return set(last.values())


def pin_key(c: Constraints):
    """A function naming the pins that apply to a node (so pinned blocks do not share decisions)."""
    if not c.placements and not c.outputs and not c.zero_params:
        return None

    def key(node: fx.Node) -> tuple:
        fqn = node.meta.get("autopar.fqn", "")
        module = node.meta.get("autopar.module", "")
        return (tuple(g for g, _ in c.placements if fqn and _matches(fqn, g)),
                tuple(g for g, _ in c.outputs if _matches(module, g) or any(_matches(p, g) for p in _prefixes(module))),
                tuple(g for g, _ in c.zero_params if fqn and _matches(fqn, g)))

    return key


def _named(axes, names) -> str:
    return ", ".join(f"'{names[a]}'" for a in axes)


def _prefixes(module: str) -> list[str]:
    parts = module.split(".") if module else []
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def make_filter(traced: TracedGraph, c: Constraints, mesh: tuple[int, ...], microbatches: int = 1):
    """``allowed(node, strategy)``: None, or why ``c`` excludes the strategy on ``mesh``.

    On a ('dp', 'ep') or ('dp', 'ep', 'tp') mesh (``planner.meshes``) 'dp' and 'ep' are data
    axes: what ``dp=`` asks of axis 'dp' it asks of both (the batch split, whole weights), except
    that experts live split on 'ep'; ``tp=`` rules apply to the 'tp' axis, wherever it is."""
    names = axis_names(mesh)
    dp_a = 0
    # where ZeRO shards: 'dp', or on an HSDP mesh 'dp_shard' (parameters then replicated on 'dp')
    hsdp_a = shard_axis(mesh)
    zero_a = dp_a if hsdp_a is None else hsdp_a
    data_parallel = c.dp is not None or c.hsdp is not None  # every input's batch split on the data axes
    tp_a = names.index("tp") if "tp" in names else None  # ('dp', 'ep') meshes have none
    tensor_parallel = tp_a is not None and mesh[tp_a] > 1 and (c.tp or 1) > 1
    cp_a = names.index(CONTEXT_AXIS) if CONTEXT_AXIS in names and mesh[names.index(CONTEXT_AXIS)] > 1 else None
    data = [a for a in data_axes(mesh) if mesh[a] > 1]
    out_pins = {}
    for pattern, axes in c.outputs:
        for name in output_nodes_of(traced, pattern):
            out_pins[name] = axes

    data_nodes: set[str] = set()  # values computed from the batch (inputs / target)
    for n in traced.graph.nodes:
        if n.meta.get("autopar.kind") in ("input", "target") or any(a.name in data_nodes for a in tensor_inputs(n)):
            data_nodes.add(n.name)

    local = is_local_batch(traced.graph)
    batch = traced.global_batch
    # (several: the experts nested over them, outer first); an 'ep' axis holds experts, also where
    # the free search proposed its mesh (planner.experts.free_expert_meshes)
    ep_axes = expert_axes(mesh, c.ep if c.ep is not None or "ep" not in names else mesh[names.index("ep")])
    experts = expert_params(traced.graph) if ep_axes else {}
    ep_rule = (f"ep={math.prod(mesh[a] for a in ep_axes)} shards experts (dim 0) on {'axes' if len(ep_axes) > 1 else 'axis'} "
               f"{', '.join(repr(names[a]) for a in ep_axes)}" if ep_axes else "")

    def allowed(node: fx.Node, s: Strategy) -> str | None:
        kind = node.meta.get("autopar.kind")
        if kind in ("input", "target") and s.outs[0] is None:
            return None  # a non-tensor input (None for an optional argument)
        if kind in ("input", "target"):
            lay = s.outs[0]
            meta = node.meta["autopar.outputs"][0]
            if local and meta is not None and meta.shape and meta.shape[0] == batch and any(lay[a] != Shard(0) for a in data):
                return f"local batches: each rank passes its rows of the batch, split over axes {_named(data, names)}"
            if local and any(isinstance(p, Shard) and p.dim == 0 for a, p in enumerate(lay) if a not in data_axes(mesh)):
                return "local batches: the batch dim is split over the data axes only"
            if data_parallel and any(lay[a] != Shard(0) for a in data):
                return f"dp={c.dp or data_degree(mesh)} shards the batch (dim 0) of every input on axes {_named(data, names)}"
            if c.tp is not None and tp_a is not None and mesh[tp_a] > 1 and lay[tp_a] != Replicate():
                return f"tp={c.tp} keeps inputs whole on axis 'tp' (tensor parallel, not data parallel)"
        if kind == "param":
            lay = s.outs[0]
            fqn = node.meta["autopar.fqn"]
            # this parameter's ZeRO stage: its own (``zero_params``, a per-stage choice) or the blanket one
            z = next((level for pattern, level in c.zero_params if _matches(fqn, pattern)), c.zero)
            if s.zero_stage == 1 and z != 1 and microbatches == 1:
                # ZeRO-1 keeps whole gradients and moves more bytes than ZeRO-2 (all-reduce, then
                # all-gather); it can only win when gradients accumulate over microbatches
                return "ZeRO-1 is dominated by ZeRO-2 without gradient accumulation"
            meta = node.meta["autopar.outputs"][0]
            pinned = any(_matches(fqn, pattern) for pattern, _ in c.placements)  # a pin beats the blanket rule
            if z is None and hsdp_a is not None and not pinned:
                # an HSDP mesh (forced by hsdp=, or the free search's twin of a (dp, tp) mesh) is
                # ZeRO-3 within the groups (a pinned layout, as ``compile``'s other programs pin, stands)
                z = 3
            if tensor_parallel and len(meta.shape) >= 2 and not isinstance(lay[tp_a], Shard) and not pinned:
                if any(d % mesh[tp_a] == 0 for d in meta.shape):
                    return f"tp={c.tp} shards every weight matrix on axis 'tp' (tensor parallel)"
            for pattern, axes in c.placements:
                if _matches(fqn, pattern) and not _pin_layout_ok(lay, axes, mesh):
                    return f"pinned to {dict(axes)}"
            if node.name in experts:
                if any(lay[a] != Shard(0) or a in s.zero_axes for a in ep_axes):
                    return ep_rule
                if dp_a in ep_axes:
                    return None  # the data-parallel axis holds experts, not replicas: no ZeRO there
            if z in (0, 1, 2) and any(
                    a != dp_a and (a in s.zero_axes or (isinstance(lay[a], Shard) and not (node.name in experts and a in ep_axes)))
                    for a in data):
                return f"zero={z} keeps parameters whole on the data axes (ZeRO's shards are on 'dp')"
            if z is not None and hsdp_a is not None and mesh[dp_a] > 1 and (not isinstance(lay[dp_a], Replicate)
                                                                            or dp_a in s.zero_axes):
                return f"hsdp={mesh[hsdp_a]} keeps parameters and their state replicated on 'dp' (across its groups)"
            if z is not None and mesh[zero_a] > 1:
                sharded_dp = isinstance(lay[zero_a], Shard)
                zero_dp = zero_a in s.zero_axes
                # a parameter with no whole dim larger than 1 (a scalar, a bias already split on
                # 'tp') has nothing to shard on 'dp': every stage keeps it replicated there
                # (whole: as the parameter would be with 'dp' replicated)
                shardable = state_dim(meta.shape, tuple(p if a != zero_a else Replicate() for a, p in enumerate(lay))) is not None
                if z == 0 and (sharded_dp or zero_dp):
                    return "zero=0 keeps parameters and optimizer state replicated on 'dp'"
                if z in (1, 2) and sharded_dp:
                    return f"zero={z} keeps parameters replicated on 'dp' (zero=3 shards them)"
                if z in (1, 2) and shardable and not (zero_dp and s.zero_stage == z):
                    return f"zero={z} shards optimizer state{' and gradients' if z == 2 else ''} on 'dp' with parameters replicated there"
                if z == 3 and not sharded_dp:
                    # (a dim that does not divide evenly is sharded unevenly, padded as FSDP2 does;
                    # a dim already sharded on 'tp' is not available to 'dp')
                    if shardable:
                        return "zero=3 shards every parameter on 'dp'"
                if z == 3 and sharded_dp:
                    # as FSDP2: the first dim left whole by 'tp' (dim 0 when it can), so gathers,
                    # re-gathers and gradient reduce-scatters need no strided copies
                    first_whole = state_dim(meta.shape, tuple(p if a != zero_a else Replicate() for a, p in enumerate(lay)))
                    if first_whole is None or lay[zero_a] != Shard(first_whole):
                        return "zero=3 shards a parameter's first whole dim on 'dp' (as FSDP2: no strided copies)"
        if kind == "op" and data_parallel and mesh[dp_a] > 1 and node.name in data_nodes and rule_for(node) is not None:
            # (an op without a rule runs replicated whatever the plan: it is resliced after)
            out = next((o for o in s.outs if o is not None), None)
            meta = node.meta["autopar.outputs"][0]
            if out is not None and meta is not None and meta.numel > 1 and any(isinstance(out[a], Replicate) for a in data):
                return f"dp={c.dp or data_degree(mesh)} keeps batch-derived values split on axes {_named(data, names)}"
        if kind == "op" and data_parallel and data:
            # data parallel: every op uses whole weights on the data axes (stored sharded there only
            # under ZeRO-3, and then gathered before use), so activations keep their batch shards
            for arg, lay in zip(tensor_inputs(node), s.ins):
                if arg.meta.get("autopar.kind") != "param" or lay is None:
                    continue
                for a in data:
                    if not (arg.name in experts and a in ep_axes) and not isinstance(lay[a], Replicate):
                        return f"dp={c.dp or data_degree(mesh)} uses whole weights on axis '{names[a]}'"  # (an expert is used where it lives)
        if kind == "op" and tensor_parallel and REGION_FLOPS_KEY not in node.meta:
            # tensor parallel: weights are used sharded on 'tp', never gathered there (that would be
            # FSDP on the tp axis, which zero= expresses); a token-wise region (a dropless MoE layer)
            # splits its tokens on 'tp' instead, its weights whole
            for arg, lay in zip(tensor_inputs(node), s.ins):
                if arg.meta.get("autopar.kind") == "param" and lay is not None:
                    shape = arg.meta["autopar.outputs"][0].shape
                    if len(shape) >= 2 and any(d % mesh[tp_a] == 0 for d in shape) and not isinstance(lay[tp_a], Shard):
                        return f"tp={c.tp} computes with weights sharded on 'tp'"
        if kind == "op" and experts:
            # each expert computes on the devices that hold it: tokens move to it, it does not move
            for arg, lay in zip(tensor_inputs(node), s.ins):
                if arg.name in experts and lay is not None and any(lay[a] != Shard(0) for a in ep_axes):
                    return f"{ep_rule}: tokens move to their experts, experts are not gathered"
        if kind == "op" and cp_a is not None and c.cp is not None and op_name(node) == "scaled_dot_product_attention" \
                and context_split_axis(node, s.ins[0], mesh) != cp_a:
            return f"cp={c.cp} splits attention's queries along the sequence on axis 'cp' (context parallel)"
        if node.name in out_pins and kind == "op":
            if not _pin_layout_ok(s.outs[0], out_pins[node.name], mesh):
                return f"output pinned to {dict(out_pins[node.name])}"
        return None

    return allowed
