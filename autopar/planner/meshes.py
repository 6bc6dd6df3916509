"""One stage's device mesh: device counts per axis, with the axes' names.

Most meshes are ('dp', 'tp'), and a plain tuple ``(dp, tp)`` stands for one. With expert
parallelism over fewer devices than the data parallelism (``Constraints(dp=D, ep=E)``, E < D)
the mesh is ('dp', 'ep') = ``(D // E, E)``, or with tensor parallelism ('dp', 'ep', 'tp') =
``(D // E, E, T)``: 'dp' and 'ep' are data axes (the batch is sharded on both, nested:
``[S(0), S(0)]``, see ``layouts.DATA_AXIS_NAMES``), and the inner one, 'ep', also holds the
experts. Tokens then meet their experts by all-to-alls among E
neighbouring ranks, and each expert's gradient is summed over the D // E groups that hold it.

HSDP (``Constraints(hsdp=S)``, or chosen by the search on several nodes) is the ('dp',
'dp_shard') mesh ``(D // S, S)``, or ('dp', 'dp_shard', 'tp') = ``(D // S, S, T)``: both are data
axes (the batch nested on them), and ZeRO-3 shards parameters, gradients and optimizer state on
the inner one, 'dp_shard' (``shard_axis``, a node or a group of neighbouring ranks), keeping them
replicated on 'dp' (across groups): a gradient is reduce-scattered in its group, then its shard is
all-reduced across groups; a parameter is all-gathered within its group (FSDP2's HSDP).

Context parallelism (``Constraints(cp=C)``, or tried by the search when no other mesh fits) is the
('dp', 'cp', 'tp') mesh ``(D, C, T)``: 'cp' (``CONTEXT_AXIS``, a ``layouts.CONTEXT_AXIS_NAMES``
role) sits between the data and tensor axes, inside a node with 'tp' where ``C * T`` divides the
node; attention may split its queries along the sequence there (``strategies.rules.sdpa``).

``MeshShape`` carries the names; it compares and hashes with them, so the planner's memos keyed
by mesh keep a ('dp', 'ep') mesh apart from the ('dp', 'tp') mesh of the same sizes.
"""
from __future__ import annotations

import math

from autopar.layouts import DATA_AXIS_NAMES

__all__ = ["DEFAULT_AXES", "MeshShape", "axis_names", "data_axes", "data_degree", "describe", "expert_data_mesh", "hsdp_mesh", "shard_axis", "SHARD_AXIS",
           "CONTEXT_AXIS", "context_mesh"]

DEFAULT_AXES = ("dp", "tp")
SHARD_AXIS = "dp_shard"  # HSDP's axis of ZeRO-3 shards (replicated on 'dp')
CONTEXT_AXIS = "cp"  # context parallelism's axis (layouts.CONTEXT_AXIS_NAMES)


class MeshShape(tuple):
    """Device counts per mesh axis (a tuple) with the axes' names (``names``)."""

    names: tuple[str, ...]

    def __new__(cls, sizes, names):
        obj = super().__new__(cls, tuple(sizes))
        if len(names) != len(obj):
            raise ValueError(f"mesh {tuple(obj)} needs one name per axis, got {names}")
        obj.names = tuple(names)
        return obj

    def __eq__(self, other):
        return tuple.__eq__(self, other) is True and axis_names(self) == axis_names(other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return tuple.__hash__(self) if self.names == DEFAULT_AXES else hash((tuple(self), self.names))

    def __repr__(self):
        return f"MeshShape({tuple(self)}, {self.names})"

    def __reduce__(self):
        return MeshShape, (tuple(self), self.names)


def axis_names(mesh) -> tuple[str, ...]:
    """The names of ``mesh``'s axes (('dp', 'tp') for a plain tuple)."""
    return getattr(mesh, "names", DEFAULT_AXES[: len(mesh)])


def data_axes(mesh) -> tuple[int, ...]:
    """The axes the batch is split on under data parallelism (outer first)."""
    return tuple(a for a, name in enumerate(axis_names(mesh)) if name in DATA_AXIS_NAMES)


def data_degree(mesh) -> int:
    """Devices the batch is split over under data parallelism (the product of the data axes)."""
    return math.prod(mesh[a] for a in data_axes(mesh))


def describe(mesh) -> str:
    """``'dp=2 tp=4'``: each axis's name and size (for labels and messages)."""
    return " ".join(f"{name}={n}" for name, n in zip(axis_names(mesh), mesh))


def expert_data_mesh(data: int, ep: int, tp: int = 1) -> MeshShape:
    """The ('dp', 'ep') mesh of ``data`` data-parallel devices with experts over ``ep`` of them
    (``ep`` divides ``data`` and is smaller); with ``tp > 1``, the ('dp', 'ep', 'tp') mesh of
    ``data * tp`` devices, tensor parallelism innermost."""
    if tp > 1:
        return MeshShape((data // ep, ep, tp), ("dp", "ep", "tp"))
    return MeshShape((data // ep, ep), ("dp", "ep"))


def hsdp_mesh(data: int, shard: int, tp: int = 1) -> MeshShape:
    """The HSDP mesh of ``data`` data-parallel devices in groups of ``shard`` (``shard`` divides
    ``data`` and is smaller): ('dp', 'dp_shard') = ``(data // shard, shard)``, with ``tp > 1``
    ('dp', 'dp_shard', 'tp'), tensor parallelism innermost, the shard groups next to it."""
    if tp > 1:
        return MeshShape((data // shard, shard, tp), ("dp", SHARD_AXIS, "tp"))
    return MeshShape((data // shard, shard), ("dp", SHARD_AXIS))


def shard_axis(mesh) -> int | None:
    """The axis of an HSDP mesh that ZeRO-3 shards on ('dp_shard'); None on any other mesh."""
    names = axis_names(mesh)
    return names.index(SHARD_AXIS) if SHARD_AXIS in names else None


def context_mesh(data: int, cp: int, tp: int = 1) -> MeshShape:
    """The ('dp', 'cp', 'tp') mesh ``(data, cp, tp)``: context parallelism over ``cp`` ranks next to
    the tensor-parallel ones (tensor parallelism innermost, then the context axis)."""
    return MeshShape((data, cp, tp), ("dp", CONTEXT_AXIS, "tp"))
