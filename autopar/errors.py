"""Exception hierarchy for autopar.

Every user-facing error is an :class:`AutoparError`, which is a ``ValueError`` so that callers
catching bad-input errors generically keep working. Messages name the offending field, node,
dim or mesh axis with the bad value, and suggest a fix. ``assert`` is kept for internal
invariants only.
"""

__all__ = [
    "AutoparError",
    "ClusterSpecError",
    "TraceError",
    "ConstraintError",
    "NoFeasiblePlanError",
    "PlanFormatError",
    "PlanMismatchError",
    "WorkerFailedError",
    "CollectiveError",
    "InputMismatchError",
    "DeferredInitError",
]


class AutoparError(ValueError):
    """Base class of all autopar user errors."""


class ClusterSpecError(AutoparError):
    """A cluster / device / link specification is invalid or cannot be decoded."""


class TraceError(AutoparError):
    """The model cannot be traced or its traced graph is unusable."""


class ConstraintError(AutoparError):
    """A user constraint or training setting (annotation, precision, optimizer) is invalid."""


class NoFeasiblePlanError(AutoparError):
    """No plan satisfies the constraints (e.g. the per-device memory limit)."""


class PlanFormatError(AutoparError):
    """A serialized plan is malformed or has an unsupported schema version."""


class WorkerFailedError(AutoparError, RuntimeError):
    """A process started by ``autopar.launch`` raised, died without a result (killed, crashed,
    ``os._exit``) or did not finish in time. Also a ``RuntimeError``, as launch raised before."""


class CollectiveError(AutoparError, RuntimeError):
    """A collective in a training step timed out or lost a peer: the ranks did not all run the
    same step (one skipped it, stopped, or died). Also a ``RuntimeError``, as torch raises it."""


class InputMismatchError(AutoparError):
    """A batch given to a step does not match the compiled example (number of inputs, shape,
    dtype), or the ranks hold different batches where every rank must hold the same one."""


class PlanMismatchError(PlanFormatError):
    """A plan does not describe the model it is applied to (other parameters, shapes or graph)."""


class DeferredInitError(AutoparError):
    """A model built on the meta device could not be initialised shard by shard (``runtime.shard_init``)."""


class CheckpointError(AutoparError):
    """A checkpoint that cannot be saved or loaded: incomplete, altered, of another model, or
    holding state that does not load safely."""


class WeightsError(AutoparError):
    """Weights that do not fit the model (missing, unexpected or misshapen keys), or a weights
    source or destination that cannot be read or written (``autopar.load_weights``/``save_weights``)."""
