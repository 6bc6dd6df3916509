"""Training-state memory model: precision policies and optimizer descriptions, in bytes.

Precision policies (:func:`precision_policy`) describe what the runtime does, as torch's
``autocast`` plus FSDP2's ``MixedPrecisionPolicy`` do it:

* ``"fp32"``: everything in fp32.
* ``"bf16-mixed"``: parameters are stored, updated and accumulate their gradients in fp32 (the
  parameter *is* the master copy); the program runs under ``torch.autocast(bf16)``, so matmul-like
  ops compute in bf16 on a bf16 copy of their weights (one per parameter per forward, saved for
  backward: activation memory, not state); ZeRO-3 parameters are cast to bf16 before they are
  gathered; gradients are reduced in ``reduce_dtype`` (fp32 by default, as FSDP2's default).
* ``"bf16-mixed-reduce-bf16"``: the same, with gradients reduced in bf16.

So the persistent state of a parameter is 4 (weights) + 4 (gradient) + optimizer state bytes per
element (Adam: 8): 16, the bf16 working copy (2) living only from its forward use to its backward.

An :class:`OptimizerSpec` describes the optimizer that runs: how many per-parameter state tensors
it keeps (in the parameter's dtype) and the temporaries its step allocates (a ``foreach``
implementation: a multiple of all parameters; a per-parameter loop: of the current and the
previous one). :func:`describe_optimizer` measures both on probes.

Example:
    >>> training_state_bytes_per_param(optimizer_spec("adam"), precision_policy("bf16-mixed"))
    {'param': 4.0, 'grad': 4.0, 'optimizer': 8.0}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from autopar.cost_models.compute import dtype_bytes
from autopar.errors import ConstraintError

__all__ = [
    "PrecisionPolicy",
    "precision_policy",
    "OptimizerSpec",
    "optimizer_spec",
    "describe_optimizer",
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

# Number of per-parameter state tensors each named optimizer keeps.
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
    """Dtypes of compute (autocast), parameters (storage, update, gradient accumulation),
    gradient reduction and optimizer state. Invariant: names are canonical ("fp32", "bf16")."""

    name: str
    compute_dtype: str
    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    optimizer_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConstraintError(f"PrecisionPolicy.name must be a non-empty string, got {self.name!r}")
        for f in ("compute_dtype", "param_dtype", "reduce_dtype", "optimizer_dtype"):
            object.__setattr__(self, f, _canonical(f, getattr(self, f)))
        if "fp16" in (self.compute_dtype, self.param_dtype, self.reduce_dtype):
            raise ConstraintError("fp16 needs loss scaling, which autopar does not do; use bf16")
        if self.param_dtype != "fp32" and self.compute_dtype != self.param_dtype:
            raise ConstraintError("mixed precision keeps parameters in fp32 (param_dtype='fp32')")

    @property
    def mixed(self) -> bool:
        """Whether the program runs under autocast (compute dtype narrower than the parameters)."""
        return self.compute_dtype != self.param_dtype

    @property
    def torch_compute_dtype(self):
        return _torch_dtype(self.compute_dtype)

    @property
    def torch_reduce_dtype(self):
        return _torch_dtype(self.reduce_dtype)


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


PRECISION_POLICIES = {
    "fp32": PrecisionPolicy("fp32", "fp32"),
    "bf16-mixed": PrecisionPolicy("bf16-mixed", "bf16"),
    "bf16-mixed-reduce-bf16": PrecisionPolicy("bf16-mixed-reduce-bf16", "bf16", reduce_dtype="bf16"),
}


def precision_policy(name: str | PrecisionPolicy) -> PrecisionPolicy:
    """The built-in policy called ``name`` ("fp32", "bf16-mixed", "bf16-mixed-reduce-bf16")."""
    if isinstance(name, PrecisionPolicy):
        return name
    if name not in PRECISION_POLICIES:
        raise ConstraintError(
            f"unknown precision policy {name!r}; known policies: {', '.join(PRECISION_POLICIES)}"
        )
    return PRECISION_POLICIES[name]


@dataclass(frozen=True)
class OptimizerSpec:
    """What an optimizer costs in memory: ``states`` tensors the size of each parameter it updates
    (in the parameter's dtype), and the temporaries of its step, for parameter sizes
    ``s_1..s_n`` in update order: ``temp_total * sum(s) + max_i(temp_cur * s_i + temp_prev * s_(i-1))``
    (a ``foreach`` implementation makes whole-list temporaries; a per-parameter loop makes some
    for the current parameter and keeps one from the previous, e.g. Adam's ``denom``)."""

    name: str
    states: int
    temp_total: float = 0.0
    temp_cur: float = 0.0
    temp_prev: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.states, int) or self.states < 0:
            raise ConstraintError(f"OptimizerSpec.states must be an integer >= 0, got {self.states!r}")
        if min(self.temp_total, self.temp_cur, self.temp_prev) < 0:
            raise ConstraintError("OptimizerSpec temporaries must be >= 0")

    def step_temporary_bytes(self, sizes: list[float]) -> float:
        """Peak bytes the step allocates for parameters of ``sizes`` bytes, in update order."""
        loop = max((self.temp_cur * s + self.temp_prev * (sizes[i - 1] if i else 0.0) for i, s in enumerate(sizes)),
                   default=0.0)
        return self.temp_total * sum(sizes) + loop


def optimizer_spec(optimizer: str | OptimizerSpec) -> OptimizerSpec:
    """A named optimizer ("sgd", "sgd-momentum", "adam", "adamw") as torch runs it by default on
    CPU (a per-parameter loop; pass a measured ``describe_optimizer`` result for anything else)."""
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    key = optimizer.lower() if isinstance(optimizer, str) else optimizer
    if key not in OPTIMIZER_STATES:
        raise ConstraintError(
            f"unknown optimizer {optimizer!r}; known optimizers: {', '.join(OPTIMIZER_STATES)} "
            "(or pass an optimizer factory to autopar.compile, which measures it)"
        )
    adam = OPTIMIZER_STATES[key] == 2
    return OptimizerSpec(key, OPTIMIZER_STATES[key], 0.0, 2.0 if adam else 0.0, 1.0 if adam else 0.0)


_PROBE = 1 << 16  # elements per probe parameter: large enough that scalar bookkeeping is noise


def describe_optimizer(factory: Callable[[list], Any], device: str = "cpu") -> OptimizerSpec:
    """Measure the optimizer ``factory`` builds: run steps on probe parameters and count the state
    tensors it keeps per parameter and the temporaries of a (second) step.

    Probes of 1, 2 and 4 parameters of ``_PROBE`` elements give the three temporaries of
    ``OptimizerSpec`` (peaks ``(cur + total) a``, ``(cur + prev + 2 total) a``,
    ``(cur + prev + 4 total) a``)."""
    import torch

    from autopar.memory_tracker import MemoryTracker

    if isinstance(factory, torch.optim.Optimizer):
        raise ConstraintError(
            f"optimizer= got a {type(factory).__name__} instance; autopar builds the optimizer over each rank's "
            f"shards, so pass a factory instead: optimizer=lambda ps: torch.optim.{type(factory).__name__}(ps, ...)")
    peaks, states, name = [], 0, "optimizer"
    for count in (1, 2, 4):
        ps = [torch.nn.Parameter(torch.zeros(_PROBE, device=device)) for _ in range(count)]
        try:
            opt = factory(ps)
        except Exception as exc:  # noqa: BLE001 - a bad factory is a user error, said clearly
            raise ConstraintError(
                f"optimizer= must be a function from a parameter list to a torch.optim.Optimizer "
                f"(e.g. lambda ps: torch.optim.AdamW(ps, lr=1e-3)); calling it failed: {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConstraintError(
                f"optimizer= must return a torch.optim.Optimizer, got {type(opt).__name__}; "
                "pass a factory such as lambda ps: torch.optim.AdamW(ps, lr=1e-3)")
        name = type(opt).__name__
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        states = max(sum(1 for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.shape == p.shape)
                     for p in ps)
        with MemoryTracker() as tracker:
            tracker.register([t for p in ps for t in [p, p.grad, *opt.state[p].values()] if isinstance(t, torch.Tensor)],
                             "params")
            before = tracker.current_bytes
            with tracker.phase("optimizer"):
                opt.step()
        peaks.append(max(tracker.report().peak_bytes - before, 0) / (4.0 * _PROBE))  # in probe sizes
    total = max((peaks[2] - peaks[1]) / 2.0, 0.0)
    prev = max(peaks[1] - peaks[0] - total, 0.0)
    cur = max(peaks[0] - total, 0.0)
    return OptimizerSpec(name, states, round(total, 2), round(cur, 2), round(prev, 2))


def optimizer_state_bytes_per_param(optimizer: str | OptimizerSpec, policy: PrecisionPolicy) -> float:
    """Optimizer-state bytes per parameter element (state tensors in ``policy.optimizer_dtype``)."""
    return float(optimizer_spec(optimizer).states * dtype_bytes(policy.optimizer_dtype))


def training_state_bytes_per_param(optimizer: str | OptimizerSpec, policy: PrecisionPolicy) -> dict[str, float]:
    """Persistent bytes per parameter element by kind: "param", "grad", "optimizer".

    fp32 + adam: 4 + 4 + 8 = 16; bf16-mixed + adam: the same 16 (the bf16 working copy is
    activation memory, see the module docstring).
    """
    return {
        "param": float(dtype_bytes(policy.param_dtype)),
        "grad": float(dtype_bytes(policy.param_dtype)),
        "optimizer": optimizer_state_bytes_per_param(optimizer, policy),
    }
