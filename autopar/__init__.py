"""autopar: automatic parallelization of PyTorch training.

Plan a plain single-device model for a cluster::

    import autopar
    plan = autopar.plan(model, autopar.Cluster.preset("dgx-h100", nodes=4), example_inputs)
    print(plan.summary())
"""
from autopar.cluster import Cluster, DeviceSpec, LinkSpec, PeakFlops
from autopar.constraints import Constraints, annotate
from autopar.errors import (
    AutoparError,
    CheckpointError,
    ClusterSpecError,
    ConstraintError,
    NoFeasiblePlanError,
    PlanFormatError,
    TraceError,
    WeightsError,
)
from autopar.plan import Plan
from autopar.api import plan
from autopar.planner.ilp import SolverConfig
from autopar.runtime.checkpoint import Checkpointing, Resumed
from autopar.runtime.monitor import Monitoring, SlowStepWarning
from autopar.runtime.compile import compile
from autopar.runtime.launch import launch
from autopar.runtime.parallel_model import ParallelModel
from autopar.runtime.in_place import export_module
from autopar.runtime.weights import WeightsLoad, load_weights, save_weights

__all__ = [
    "Cluster", "DeviceSpec", "LinkSpec", "PeakFlops", "Constraints", "annotate", "Plan", "plan",
    "SolverConfig", "compile", "Checkpointing", "Resumed", "Monitoring", "SlowStepWarning", "CheckpointError", "launch", "ParallelModel", "export_module", "AutoparError", "ClusterSpecError", "ConstraintError", "NoFeasiblePlanError",
    "PlanFormatError", "TraceError", "load_weights", "save_weights", "WeightsLoad", "WeightsError",
]
