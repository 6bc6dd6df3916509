"""What a training step costs beyond its GEMMs' arithmetic (part of ``autopar calibrate``'s
measurements, ``calibration.microbench``): a probe of small layers forward and backward and its
optimizer step (the cost model's ``op_overhead`` and ``update_op_overhead``), the optimizer's
update per element of one large parameter (``update_element_s``), and a gradient buffer's
zeroing and accumulation per element (``grad_buffer_element_s``).
"""
from __future__ import annotations

import itertools

import torch

from autopar.calibration.timing import MicrobenchSpec, SpreadProbe, per_op_spread, progress

__all__ = ["PROBE_LAYERS", "PROBE_WIDTH", "PROBE_ROWS", "UPDATE_NUMEL", "probe_units", "training_ops"]

# The probe of what one op costs in a training step beyond its arithmetic: a chain of small
# linear + GELU + reshape layers, forward and backward with autograd, then AdamW's update.
PROBE_LAYERS, PROBE_WIDTH, PROBE_ROWS = 24, 16, 8
# windows of the probe: its op cost prices every op of a dispatch-bound model, and over 20 ms
# windows on 4 processes sharing 2 cores its forward + backward read 2.8-5.6 ms within one launch
# (100 ms windows: 3.0-4.0)
PROBE_WINDOW_S, PROBE_REPEATS = 0.1, 3
# the large parameter whose update is timed per element (32 MiB; with its gradient and AdamW's two
# states 128 MiB, twice COLD_BYTES: a training step's optimizer streams its state from memory, not
# from cache; at 4 MiB the update timed 2.8-4.3 ns per element on 4 processes sharing 2 cores,
# at 32 MiB 7.7, what an 8.4M-parameter MLP's AdamW step took per element)
UPDATE_NUMEL = 1 << 23
# the same where a rank updates few elements, its state then in cache (``DeviceSpec.warm_elements``;
# 16 MiB of parameter, gradient and AdamW's states a rank)
WARM_NUMEL = 1 << 20
# both held as a model holds its parameters, in tensors of at most this many elements (AdamW over
# one 8M-element tensor took 3.5 ns per element on 2 processes, over eight of 1M 2.9)
UPDATE_CHUNK = 1 << 20
UPDATE_REPEATS = 2  # windows per spec.repeats of the per-element update and gradient buffer costs
GRAD_BUFFERS = 4  # gradient buffers of UPDATE_NUMEL the zeroing and accumulation rotate over (128 MiB)


def probe_units() -> tuple[int, int]:
    """(ops the cost model charges ``op_overhead`` for in the probe's forward and backward, ops
    it charges ``update_op_overhead`` for in its AdamW update), counted by ``planner.costing``'s
    rules: a linear is one op forward and ``BWD_OPS["matmul"]`` backward, a GELU one and one, a
    reshape none (a view); the loss's sum one and one; ``update_ops(2)`` per parameter."""
    from autopar.planner.costing import BWD_OPS, update_ops

    per_layer = (1 + BWD_OPS["matmul"]) + (1 + BWD_OPS["pointwise"])
    return PROBE_LAYERS * per_layer + 2, update_ops(2) * 2 * PROBE_LAYERS


def _probe_model(device: torch.device) -> torch.nn.Module:
    class Reshaped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(PROBE_WIDTH, PROBE_WIDTH)

        def forward(self, x):
            return torch.nn.functional.gelu(self.linear(x)).reshape(PROBE_ROWS, PROBE_WIDTH)

    return torch.nn.Sequential(*[Reshaped() for _ in range(PROBE_LAYERS)]).to(device)


def training_ops(spec: MicrobenchSpec, device: torch.device, barrier, spread: SpreadProbe | None = None) -> dict:
    """Seconds of the probe's forward + backward, and of its optimizer step, on the slowest rank
    (with ``spread``: registered there, timed again between the calibration's later parts)."""
    progress("a training step's per-op costs (autograd, optimizer)")
    model = _probe_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randn(PROBE_ROWS, PROBE_WIDTH, device=device)

    def fwd_bwd():
        model(x).sum().backward()

    fwd_bwd()
    opt.step()  # the state exists from here on
    flops = 2.0 * PROBE_ROWS * PROBE_WIDTH * PROBE_WIDTH * PROBE_LAYERS * 3  # forward and both backward GEMMs
    spread = spread if spread is not None else SpreadProbe(device, barrier)
    for name, fn in (("fwd_bwd_s", fwd_bwd), ("step_s", opt.step)):
        spread.add(name, fn, min(spec.repeats, PROBE_REPEATS), PROBE_WINDOW_S)
    out = {**spread.medians(), "matmul_flops": flops, "params": sum(p.numel() for p in model.parameters()),
           "update_numel": UPDATE_NUMEL}
    # per element: SGD (no state) and AdamW (two) updating one large parameter; and a gradient
    # buffer of its size, zeroed once a step, each microbatch's gradient added into it in place:
    # cold, each call on the next of GRAD_BUFFERS (one buffer back to back stays in a large
    # last-level cache: 0.14 / 0.27 ns per element on 2 processes, against 0.39 / 0.49 rotating
    # over 128 MiB and 0.45 / ~0.6 in the MLP's steps). The largest costs of a parameter-heavy
    # step, so their windows are many and in passes (one call each; two calibrations minutes
    # apart had read AdamW 3.7 and 4.5 ns per element from 5 windows back to back)
    fns, names = [], []
    for numel, suffix in ((UPDATE_NUMEL, ""), (WARM_NUMEL, "_warm")):
        fns += _update_calls(numel, device)
        names += [f"{k}{suffix}" for k in ("sgd_update_s", "adamw_update_s", "grad_zero_s", "grad_add_s")]
    out.update(zip(names, per_op_spread(fns, device, UPDATE_REPEATS * spec.repeats, barrier)))
    out["update_numel_warm"] = WARM_NUMEL
    return out


def _update_calls(numel: int, device: torch.device) -> list:
    """SGD's and AdamW's step over ``numel`` elements of parameters (tensors of ``UPDATE_CHUNK``),
    zeroing their gradients, adding a gradient into them: the calls, the buffers taken in turn
    from ``GRAD_BUFFERS`` sets."""
    params = [torch.nn.Parameter(torch.zeros(min(UPDATE_CHUNK, numel), device=device))
              for _ in range(max(1, numel // UPDATE_CHUNK))]
    for p in params:
        p.grad = torch.randn_like(p)
    pool = [[p.grad for p in params]] + [[torch.randn_like(p) for p in params] for _ in range(GRAD_BUFFERS - 1)]
    turn = itertools.count()

    def zero():
        for g in pool[next(turn) % GRAD_BUFFERS]:
            g.zero_()

    def accumulate():
        i = next(turn)
        for g, h in zip(pool[i % GRAD_BUFFERS], pool[(i + 1) % GRAD_BUFFERS]):
            g.add_(h)

    updates = [torch.optim.SGD(params, lr=1e-6), torch.optim.AdamW(params, lr=1e-6)]
    for o in updates:
        o.step()
    return [o.step for o in updates] + [zero, accumulate]
