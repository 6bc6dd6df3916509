"""Training-state memory model: bytes per parameter element for a precision policy + optimizer.

Policies (see :func:`precision_policy`):

* ``"fp32"``: compute, parameters and gradients in fp32; no master copy.
* ``"bf16-mixed"``: bf16 compute and bf16 working parameters, an fp32 master copy of the
  weights, fp32 gradients and fp32 optimizer state. Gradients are fp32 because Megatron-LM
  accumulates and all-reduces them into fp32 "main_grad" buffers for bf16 training (the bf16
  parameter gradient is fused into that buffer, never held separately), which keeps gradient
  accumulation over microbatches exact enough; this is the 18 bytes/parameter of Megatron's
  distributed-optimizer memory table (docs/source/distrib_optimizer.md) before sharding.

Optimizer state is held in ``policy.optimizer_dtype`` (fp32 for both built-in policies).
Activations are not counted here: they depend on liveness and are the planner's job.

Example:
    >>> training_state_bytes_per_param("adam", precision_policy("bf16-mixed"))
    {'param': 2.0, 'master': 4.0, 'grad': 4.0, 'optimizer': 8.0}
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models.compute import dtype_bytes
from autopar.errors import ConstraintError

__all__ = [
    "PrecisionPolicy",
    "precision_policy",
    "optimizer_state_bytes_per_param",
    "training_state_bytes_per_param",
    "PRECISION_POLICIES",
    "OPTIMIZER_STATES",
]

_FLOAT_DTYPES = {
    "fp32": "fp32", "float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16",
}

# Number of per-parameter state tensors each optimizer keeps.
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}


def _canonical(field: str, dtype: object) -> str:
    key = str(dtype).removeprefix("torch.")
    if key not in _FLOAT_DTYPES:
        raise ConstraintError(
            f"PrecisionPolicy.{field} must be a float dtype in {sorted(_FLOAT_DTYPES)}, "
            f"got {dtype!r}"
        )
    return _FLOAT_DTYPES[key]


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of compute, working parameters, master weights (None: no copy), grads, optimizer.

    Invariants: dtype names are canonical ("fp32", "bf16", "fp16"); a master copy, when present,
    differs in dtype from the working parameters.
    """

    name: str
    compute_dtype: str
    param_dtype: str
    master_dtype: str | None
    grad_dtype: str
    optimizer_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConstraintError(
                f"PrecisionPolicy.name must be a non-empty string, got {self.name!r}"
            )
        for f in ("compute_dtype", "param_dtype", "grad_dtype", "optimizer_dtype"):
            object.__setattr__(self, f, _canonical(f, getattr(self, f)))
        if self.master_dtype is not None:
            master = _canonical("master_dtype", self.master_dtype)
            if master == self.param_dtype:
                raise ConstraintError(
                    f"PrecisionPolicy.master_dtype {master!r} equals param_dtype: a master copy "
                    "in the same dtype is redundant; use master_dtype=None"
                )
            object.__setattr__(self, "master_dtype", master)


PRECISION_POLICIES = {
    "fp32": PrecisionPolicy("fp32", "fp32", "fp32", None, "fp32", "fp32"),
    "bf16-mixed": PrecisionPolicy("bf16-mixed", "bf16", "bf16", "fp32", "fp32", "fp32"),
}


def precision_policy(name: str) -> PrecisionPolicy:
    """The built-in policy called ``name`` ("fp32" or "bf16-mixed")."""
    if name not in PRECISION_POLICIES:
        raise ConstraintError(
            f"unknown precision policy {name!r}; known policies: {', '.join(PRECISION_POLICIES)}"
        )
    return PRECISION_POLICIES[name]


def optimizer_state_bytes_per_param(optimizer: str, policy: PrecisionPolicy) -> float:
    """Optimizer-state bytes per parameter element: sgd 0, sgd-momentum 1 state, adam(w) 2."""
    key = optimizer.lower() if isinstance(optimizer, str) else optimizer
    if key not in OPTIMIZER_STATES:
        raise ConstraintError(
            f"unknown optimizer {optimizer!r}; known optimizers: {', '.join(OPTIMIZER_STATES)}"
        )
    return float(OPTIMIZER_STATES[key] * dtype_bytes(policy.optimizer_dtype))


def training_state_bytes_per_param(optimizer: str, policy: PrecisionPolicy) -> dict[str, float]:
    """Bytes per parameter element by kind: keys "param", "master", "grad", "optimizer".

    fp32 + adam: 4 + 0 + 4 + 8 = 16; bf16-mixed + adam: 2 + 4 + 4 + 8 = 18.
    """
    return {
        "param": float(dtype_bytes(policy.param_dtype)),
        "master": 0.0 if policy.master_dtype is None else float(dtype_bytes(policy.master_dtype)),
        "grad": float(dtype_bytes(policy.grad_dtype)),
        "optimizer": optimizer_state_bytes_per_param(optimizer, policy),
    }
