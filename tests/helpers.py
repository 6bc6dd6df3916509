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


def routed_rows(pm, case: str, x) -> list[list[int]]:
    """Per MoE layer, the rows the router of ``case``'s model sends to each expert for the global
    batch ``x`` under ``pm``'s current weights, read from the model's own router on one device (a
    copy loaded with ``pm.full_state_dict()``; hooks on a Hugging Face ``gate`` or on the
    examples' ``GroupedExperts``), not from the runtime."""
    from autopar.testing.parity import build_case

    model, _, _ = build_case(case)
    model.load_state_dict(pm.full_state_dict())
    counts, hooks = [], []

    def count(choice, n):
        counts.append(torch.bincount(choice.flatten(), minlength=n).tolist())

    for module in model.modules():
        if hasattr(module, "gate") and hasattr(module.gate, "top_k"):  # transformers' routers
            hooks.append(module.gate.register_forward_hook(
                lambda mod, args, out: count(out[2], mod.num_experts)))
        elif type(module).__name__ == "GroupedExperts":  # examples/moe.py: forward(tokens, choice, gate)
            hooks.append(module.register_forward_pre_hook(
                lambda mod, args: count(args[1], mod.w_in.shape[0])))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return counts


def routed_all_to_all_bytes(predicted: int, routed: list[list[int]], rank: int, ep: int, row_bytes: int) -> int:
    """The all-to-all bytes rank ``rank`` of an ``ep``-rank expert group sends in one step of a
    dropless expert layer per entry of ``routed`` (``routed_rows``), from the plan's ``predicted``
    bytes for balanced routing: per layer it sends its own tokens' rows out (forward) and their
    gradients back (backward), the same under any routing; and the rows its experts received
    back (forward) and their gradients out (backward): ``row_bytes`` each, so the routing moves
    the bytes by 2 x (rows received - rows balanced) x ``row_bytes`` per layer (the row counts'
    all-to-all is fixed). Rank k holds the k-th block of experts; the tokens split evenly."""
    extra = 0
    for counts in routed:
        block = len(counts) // ep
        received = sum(counts[rank * block:(rank + 1) * block])
        extra += 2 * (received - sum(counts) // ep) * row_bytes
    return predicted + extra
