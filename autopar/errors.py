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
