"""How a value crosses a pipeline stage boundary: as planned, or in pieces (Megatron-LM's
scatter/gather of pipeline sends).

``boundary_sender`` is ``stages.cut_model``'s ``boundary``: it prices, per value, sending it
as planned against sending a mesh axis's pieces and regathering them; ``send_layouts`` lists,
per stage of a cut, the values it sends in pieces (``Stage.send_layouts``, which
``passes.boundary_sends`` runs). Pure functions of the submesh plan's placements and costs.
"""
from __future__ import annotations

__all__ = ["boundary_sender", "send_layouts"]


def send_layouts(graph, cut, n_stages: int) -> tuple:
    """Per stage, the values it sends on in pieces (``boundary_sender``): those a later stage uses."""
    users = {n.name: [u.name for u in n.users] for n in graph.nodes if n.name in cut.send_layouts}
    out = [[] for _ in range(n_stages)]
    for name, layout in sorted(cut.send_layouts.items()):
        s = cut.stage_of.get(name, n_stages - 1)
        if any(cut.stage_of.get(u, n_stages - 1) > s for u in users[name]):
            out[s].append((name, layout))
    return tuple(tuple(x) for x in out)


def boundary_sender(ctx, m: int, link_bw: float):
    """``cut_model``'s ``boundary``: a value replicated, or partially summed, over a mesh axis of
    the stage's submesh crosses a boundary as that axis's pieces when that is faster: each rank of
    the axis sends ``1/n`` of it (a partial sum is reduce-scattered first) and the receiving stage
    gathers it back into its planned layout; in backward the reverse. Megatron-LM's scatter/gather
    of pipeline sends. Pays where stages meet over a slower link than the axis's own (stages on
    different nodes, tensor parallel inside one). The piece is cut along the value's largest
    unsplit dim after the first that divides evenly; one axis at most."""
    from autopar.layouts import Partial, Replicate, Shard, divides_evenly, format_layout, grad_layout, parse_layout
    from autopar.planner.costing import reshard_time
    from autopar.trace import TensorMeta

    def seconds(micro, src, dst) -> float:
        return sum(reshard_time(micro, src, dst, ctx).values())

    chosen: dict[tuple, object] = {}  # per (shape, dtype, gradient, layout, bytes): the values alike decide alike

    def choose(node, layout: str | None, nbytes: float):
        metas = node.meta.get("autopar.outputs") or ()
        if layout in (None, "-") or len(metas) != 1 or metas[0] is None or not metas[0].is_floating or nbytes <= 0:
            return None
        key = (tuple(metas[0].shape), metas[0].dtype, bool(node.meta.get("autopar.needs_grad", False)), layout, nbytes)
        if key not in chosen:
            chosen[key] = _choose(metas[0], key[2], layout, nbytes)
        return chosen[key]

    def _choose(meta, grads: bool, layout: str, nbytes: float):
        planned = parse_layout(layout)
        micro = TensorMeta((meta.shape[0] // m,) + tuple(meta.shape[1:]), meta.dtype) if meta.shape and \
            meta.shape[0] % m == 0 else meta
        split = {p.dim for p in planned if isinstance(p, Shard)}
        best, best_cost = None, 2.0 * nbytes / link_bw
        for a, (p, n) in enumerate(zip(planned, ctx.mesh_shape)):
            if n == 1 or not (isinstance(p, Replicate) or p == Partial("sum")):
                continue
            # dim 0 is left whole: it is what microbatches cut (the batch), or a length of their own
            for d in sorted(set(range(1, len(meta.shape))) - split, key=lambda d: -micro.shape[d]):
                pieces = tuple(Shard(d) if i == a else q for i, q in enumerate(planned))
                if not divides_evenly(micro.shape, pieces, ctx.mesh_shape):
                    continue
                again = seconds(micro, planned, pieces) + seconds(micro, pieces, planned)
                if grads:
                    gp, gq = grad_layout(planned), grad_layout(pieces)
                    again += seconds(micro, gp, gq) + seconds(micro, gq, gp)
                cost = 2.0 * nbytes / n / link_bw + m * again
                if cost < best_cost * (1 - 1e-9):
                    best, best_cost = (format_layout(pieces), nbytes / n, m * again), cost
                break
        return best
    return choose
