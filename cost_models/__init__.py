"""Cost models: pure functions of a :class:`~autopar.cluster.Cluster` spec, in seconds and bytes.

Nothing here reads the live machine; hardware numbers are data (:mod:`.hardware`).

Example:
    >>> from autopar.cluster import Cluster
    >>> from autopar.cost_models import CommGroup, collective_time
    >>> collective_time("all_reduce", 2**20, CommGroup(1, 1), Cluster.preset("dgx-a100"))
    0.0
"""

from autopar.cost_models.communication import (
    COLLECTIVE_KINDS,
    CommGroup,
    axis_group,
    collective_time,
)
from autopar.cost_models.compute import (
    ATTENTION_EFFICIENCY,
    MATMUL_EFFICIENCY,
    MEMORY_EFFICIENCY,
    OP_KINDS,
    OTHER_EFFICIENCY,
    POINTWISE_EFFICIENCY,
    dtype_bytes,
    op_time,
)
from autopar.cost_models.memory import (
    PrecisionPolicy,
    optimizer_state_bytes_per_param,
    precision_policy,
    training_state_bytes_per_param,
)

__all__ = [
    "ATTENTION_EFFICIENCY",
    "COLLECTIVE_KINDS",
    "CommGroup",
    "MATMUL_EFFICIENCY",
    "MEMORY_EFFICIENCY",
    "OP_KINDS",
    "OTHER_EFFICIENCY",
    "POINTWISE_EFFICIENCY",
    "PrecisionPolicy",
    "axis_group",
    "collective_time",
    "dtype_bytes",
    "op_time",
    "optimizer_state_bytes_per_param",
    "precision_policy",
    "training_state_bytes_per_param",
]
