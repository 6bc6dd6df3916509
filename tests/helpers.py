"""Helpers shared by the test modules and their workers (``autopar.launch`` ranks import this
module by name, as they import ``habit_loops``: keep it top-level and free of test state)."""
from __future__ import annotations

import torch

import autopar


def error_of(fn) -> str:
    """``"ExceptionType: message"`` of what ``fn()`` raised, or ``"no error"``: a worker reports
    a refusal to the parent as text, where the test matches it."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def sgd(ps):
    """The optimizer factory of the small-MLP tests: SGD with momentum."""
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def one_device_losses(model, batches, loss_fn, optimizer=sgd) -> list[float]:
    """The losses of ``model`` trained on one device over ``batches`` ((input, target) pairs) with
    ``optimizer(params)``, one step per batch: the reference a parity test compares against."""
    opt = optimizer(list(model.parameters()))
    out = []
    for x, t in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), t)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def compiled_mlp(cluster, rows: int = 16, **kw):
    """``examples.mlp``'s MLP(64, 256, 2) compiled for ``train_step`` (SGD with momentum, its mean
    squared loss) on an example batch of ``rows`` rows, seeded: (pm, x, target). ``kw`` goes to
    ``autopar.compile`` (constraints=, plan=, check_inputs=, ...)."""
    from examples.mlp import MLP, example_batch, mlp_loss

    torch.manual_seed(0)
    x, t = example_batch(64, rows)
    pm = autopar.compile(MLP(64, 256, 2), cluster, (x,), example_target=t, loss_fn=mlp_loss, optimizer=sgd, **kw)
    return pm, x, t


def native_loop_errors(pm, ref, make_optimizer, batches, loss_fn, steps: int) -> tuple[float, float]:
    """Train ``pm`` and its one-device reference ``ref`` side by side in the native loop
    (``loss.backward()``, ``make_optimizer(model)``'s ``step``/``zero_grad``) for ``steps`` steps:
    the worst relative error of the loss and of any gradient (read before each step)."""
    from autopar.testing.parity import relative_error

    runs = [(pm, make_optimizer(pm)), (ref, make_optimizer(ref))]
    loss_err = grad_err = 0.0
    for s in range(steps):
        x, t = batches[s % len(batches)]
        losses, grads = [], []
        for m, o in runs:
            loss = loss_fn(m(*(x if isinstance(x, tuple) else (x,))), t)
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append({k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                          for k, p in m.named_parameters()})
            o.step()
            o.zero_grad()
        loss_err = max(loss_err, abs(losses[0] - losses[1]) / abs(losses[1]))
        assert grads[0].keys() == grads[1].keys()
        grad_err = max(grad_err, max(relative_error(grads[0][k], grads[1][k]) for k in grads[1]))
    return loss_err, grad_err


def measured_comm_bytes(case: str, constraints) -> tuple[dict, dict]:
    """One measured ``train_step`` (after a first one) of the parity zoo's ``case`` compiled under
    ``constraints`` with SGD: bytes per collective kind, measured and predicted."""
    from autopar.testing.parity import build_case

    model, batches, loss_fn = build_case(case)
    x, t = batches[0]
    pm = autopar.compile(model, autopar.Cluster.local(), (x,), example_target=t, loss_fn=loss_fn,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), constraints=constraints)
    pm.train_step(x, target=t)
    m = pm.measure_step(x, target=t)
    return dict(m.comm_bytes), dict(m.predicted_comm_bytes)
