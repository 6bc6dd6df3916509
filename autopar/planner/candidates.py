"""What the outer search tries and within what: the submesh shapes (``mesh_candidates``), the
microbatch counts (``microbatch_counts``) and the share of device memory a plan may use. Below
``search``, ``pipeline_search`` and ``diagnose``, which all read them.
"""
from __future__ import annotations

from autopar.cluster import Cluster
from autopar.constraints import Constraints
from autopar.errors import ConstraintError
from autopar.planner.meshes import context_mesh, expert_data_mesh, hsdp_mesh

__all__ = ["USABLE_MEMORY_FRACTION", "PIPELINE_STAGES", "mesh_candidates", "context_mesh_candidates", "microbatch_counts"]

# Fraction of device memory a plan may use: the rest is for the allocator's fragmentation, the
# CUDA context and library workspaces (cuBLAS, NCCL buffers).
USABLE_MEMORY_FRACTION = 0.9
# the ``_cache`` key under which ``pipeline_search`` tells the search of a submesh plan how many
# stages will split it: a rank then holds that share of the model's parameters and states
PIPELINE_STAGES = "pipeline_stages"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_candidates(cluster: Cluster, c: Constraints, hsdp: bool = True) -> list[tuple[int, int]]:
    """(dp, tp) shapes of one stage's submesh to try (the whole cluster without pipelining, a
    ``1/pp`` share of it with ``Constraints(pp=)``), validated against the constraints (errors
    name the constraint). With ``Constraints(hsdp=S)`` only HSDP meshes ('dp', 'dp_shard'[, 'tp'],
    ``planner.meshes``); without it, on several nodes and with dp and ZeRO left free (``hsdp``: the
    caller plans a whole single-stage mesh), each (dp, tp) mesh whose data ranks span nodes also
    gets its HSDP twin, sharded within a node and replicated across nodes."""
    pp = c.pp or 1
    if c.schedule is not None and pp == 1:
        raise ConstraintError(f"schedule={c.schedule!r} applies to pipeline plans (pp > 1); leave schedule unset for pp=1")
    if cluster.world_size % pp:
        raise ConstraintError(
            f"pp={pp} does not divide the {cluster.world_size} devices of the cluster; choose a divisor of "
            f"{cluster.world_size} (e.g. {', '.join(str(d) for d in _divisors(cluster.world_size) if d <= 64)})")
    world = cluster.world_size // pp
    for name in ("dp", "tp"):
        v = getattr(c, name)
        if v is not None and world % v:
            raise ConstraintError(
                f"{name}={v} does not divide the {world} devices of {'a pipeline stage' if pp > 1 else 'the cluster'}; choose a divisor of {world} "
                f"(e.g. {', '.join(str(d) for d in _divisors(world) if d <= 64)})"
            )
    if c.cp is None and c.dp is not None and c.tp is not None and c.dp * c.tp != world:
        raise ConstraintError(f"dp={c.dp} x tp={c.tp} = {c.dp * c.tp} but {'a pipeline stage' if pp > 1 else 'the cluster'} has "
                              f"{world} devices; the product must equal {'the world size / pp' if pp > 1 else 'the world size'}")
    if c.tp is not None:
        tps = [c.tp]
    elif c.dp is not None:
        tps = [world // c.dp]
    else:
        tps = [t for t in _divisors(min(cluster.devices_per_node, world)) if world % t == 0]
    if c.ep is not None and world % c.ep:
        raise ConstraintError(f"ep={c.ep} does not divide the {world} devices of "
                              f"{'a pipeline stage' if pp > 1 else 'the cluster'}; choose a divisor of {world}")
    if c.cp is not None:
        return _context_meshes(cluster, c, world, tps)
    meshes = [(world // t, t) for t in tps]
    if c.hsdp is not None:
        hsdp_meshes = [hsdp_mesh(world // t, c.hsdp, tp=t) for t in tps if (world // t) % c.hsdp == 0 and world // t > c.hsdp]
        if not hsdp_meshes:
            raise ConstraintError(
                f"hsdp={c.hsdp} must divide the data-parallel degree and be smaller, but the data degrees allowed are "
                f"{sorted({world // t for t in tps})}; choose hsdp dividing one of them (e.g. the devices of a node)")
        return hsdp_meshes
    if (hsdp and cluster.nodes > 1 and (c.pp or 1) == 1 and c.dp is None and c.zero is None and not c.zero_params
            and (c.ep or 1) == 1):
        for t in tps:
            shard = cluster.devices_per_node // t  # the data ranks of one node
            if shard > 1 and (world // t) % shard == 0 and world // t > shard:
                meshes.append(hsdp_mesh(world // t, shard, tp=t))
    if c.ep is not None and c.ep > 1:
        # experts over fewer devices than the data parallelism: the data axis split in two, the
        # inner one 'ep' ('dp', 'ep'), beside a 'tp' axis where tensor parallelism has devices
        # (meshes.py); with dp given, those are the only meshes that honour it
        inner = [expert_data_mesh(world // t, c.ep, tp=t) for t in tps
                 if 1 < c.ep < world // t and (world // t) % c.ep == 0]
        if inner:
            meshes = inner if c.dp is not None else meshes + inner
    return meshes


def context_mesh_candidates(cluster: Cluster, c: Constraints) -> list:
    """The ('dp', 'cp', 'tp') meshes (``planner.meshes.context_mesh``) the free search tries for a
    model with attention when no other single-stage mesh fits: every context degree above 1 that,
    with the tensor-parallel degree, divides a node (both axes inside it)."""
    if c.pp not in (None, 1) or c.hsdp is not None or (c.ep or 1) > 1:
        return []
    world = cluster.world_size
    tps = [c.tp] if c.tp is not None else [t for t in _divisors(min(cluster.devices_per_node, world)) if world % t == 0]
    return [context_mesh(world // (t * cp), cp, t) for t in tps for cp in _divisors(cluster.devices_per_node // t)
            if cp > 1 and world % (t * cp) == 0 and (c.dp is None or c.dp * cp * t == world)]


def _context_meshes(cluster: Cluster, c: Constraints, world: int, tps: list[int]) -> list:
    """The meshes ``Constraints(cp=C)`` allows: ('dp', 'cp', 'tp') = (world / (C * T), C, T)."""
    if c.hsdp is not None or (c.ep or 1) > 1:
        raise ConstraintError(f"cp={c.cp} with {'hsdp' if c.hsdp is not None else 'ep'} is not supported: context "
                              "parallelism runs on a ('dp', 'cp', 'tp') mesh; drop one of them")
    if c.tp is None and c.dp is not None:
        tps = [world // (c.dp * c.cp)] if world % (c.dp * c.cp) == 0 else []
    meshes = [context_mesh(world // (t * c.cp), c.cp, t) for t in tps
              if t >= 1 and world % (t * c.cp) == 0 and (c.dp is None or c.dp * c.cp * t == world)]
    if not meshes:
        raise ConstraintError(f"cp={c.cp} does not fit the {world} devices with dp={c.dp} and tp={c.tp}: dp x cp x tp "
                              f"must equal {world}; choose cp dividing {world} (and dp, tp to match)")
    return meshes


def microbatch_counts(batch: int, dp: int) -> list[int]:
    """Gradient-accumulation counts 2, 4, 8, ... that cut ``batch`` into equal microbatches which
    still split evenly over ``dp`` (fewest steps first)."""
    counts, m = [], 2
    while batch % m == 0 and (batch // m) % dp == 0:
        counts.append(m)
        m *= 2
    return counts
