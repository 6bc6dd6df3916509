"""Parity: train the compiled program and a single-device reference side by side and compare.

Used by the parity tests and ``benchmarks/gpu_check.py``. ``parity_worker`` runs in every rank
(under ``autopar.launch`` or torchrun); rank 0 also trains the reference model itself (small
models only) and reports the largest relative differences it saw.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from autopar.grouped_mm import redirect_grouped_mm

__all__ = ["parity_worker", "parity_suite", "parity_failures", "build_case", "relative_error", "native_loop_worker",
           "native_loop_suite"]


def relative_error(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-3) -> float:
    """Per-tensor relative error ``||a - b|| / max(||b||, floor * sqrt(numel))`` (L2 over the tensor).

    Why L2 and not the worst element: Adam divides each gradient entry by its own magnitude, so
    an entry whose gradient is a near-cancelling sum (its float error relatively large) moves by
    up to ``lr`` whatever the summation order; tensor parallelism changes that order. The tensor
    as a whole still matches to float precision, which is what this measures. The floor: a value
    that is zero in exact arithmetic (the running mean of a BatchNorm fed by a bias-free linear
    map of normalised values) is float noise of ~1e-9 on one device as on many; at the parity
    tolerance of 1e-5 the floor of 1e-3 per element is ``torch.allclose``'s default atol of 1e-8.
    """
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    denom = max(float(b.norm()), floor * max(b.numel(), 1) ** 0.5)
    return float((a - b).norm()) / denom


def build_case(name: str, seed: int = 0):
    """(model, batches, loss_fn) for a named parity case; the same on every rank.
    ``real:<name>``: an architecture of ``examples.real_models`` (tiny Hugging Face configs, CNNs)."""
    if name.startswith("real:"):
        from examples.real_models import build_real

        return build_real(name[5:], seed)
    torch.manual_seed(seed)
    if name == "gpt":
        from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

        cfg = GPTConfig()
        model = GPT(cfg)
        batches = [example_batch(cfg, 8, seed=s) for s in range(8)]
        return model, batches, gpt_loss
    if name == "gpt_padded":  # rows padded to different lengths: ignored targets fall unevenly over ranks and microbatches
        from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

        cfg = GPTConfig()
        model = GPT(cfg)
        batches = []
        for s in range(8):
            idx, tgt = example_batch(cfg, 8, seed=s)
            g = torch.Generator().manual_seed(100 + s)
            for row, length in enumerate(torch.randint(1, cfg.block_size + 1, (8,), generator=g).tolist()):
                tgt[row, length:] = -100
            batches.append((idx, tgt))
        return model, batches, gpt_loss
    if name == "gpt_wide_vocab":  # 4 layers and a vocabulary 16x the default: the head outweighs a layer
        from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

        cfg = GPTConfig(n_layer=4, vocab_size=4096)
        model = GPT(cfg)
        batches = [example_batch(cfg, 8, seed=s) for s in range(8)]
        return model, batches, gpt_loss
    if name in ("moe_modules", "moe_modules_ce"):  # examples.moe, static form, experts as an nn.ModuleList called in a loop
        from examples.moe import MoEConfig, MoEGPT, example_batch, moe_loss

        cfg = MoEConfig(expert_modules=True)
        return MoEGPT(cfg), [example_batch(cfg, 8, seed=s) for s in range(8)], (moe_loss if name == "moe_modules" else _moe_ce)
    if name == "moe_dropless":  # examples.moe with GroupedExperts: sorted tokens, grouped matmuls
        from examples.moe import MoEConfig, MoEGPT, example_batch, moe_loss

        cfg = MoEConfig(dropless=True)
        model = MoEGPT(cfg)
        return model, [example_batch(cfg, 8, seed=s) for s in range(8)], moe_loss
    if name in ("moe", "moe_ce"):
        # examples.moe: static-capacity top-2 experts with token dropping and an auxiliary loss over
        # the whole batch; "moe_ce": cross-entropy alone (a mean over samples, which microbatches
        # and pipelines preserve; the auxiliary loss, a product of batch means, they do not)
        from examples.moe import MoEConfig, MoEGPT, example_batch, moe_loss

        cfg = MoEConfig()
        model = MoEGPT(cfg)
        batches = [example_batch(cfg, 8, seed=s) for s in range(8)]
        return model, batches, (moe_loss if name == "moe" else _moe_ce)
    if name == "gpt_tuple":
        from examples.gpt import GPTConfig, example_batch, gpt_loss

        cfg = GPTConfig()
        model = _TupleGPT(cfg)
        batches = [example_batch(cfg, 8, seed=s) for s in range(8)]
        return model, batches, _tuple_loss
    if name in ("manual_gpt", "tiny_llama", "tiny_encoder"):
        from autopar.testing.zoo import ManualAttentionGPT, TinyEncoder, TinyLlama, lm_loss

        model = {"manual_gpt": ManualAttentionGPT, "tiny_llama": TinyLlama, "tiny_encoder": TinyEncoder}[name]()
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g))
                   for _ in range(8)]
        return model, batches, lm_loss
    if name == "cnn":
        from autopar.testing.zoo import SmallCNN

        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(8)]
        return SmallCNN(), batches, torch.nn.functional.cross_entropy
    if name == "write_view":
        from autopar.testing.zoo import WriteThroughView

        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(8)]
        return WriteThroughView(), batches, torch.nn.functional.cross_entropy
    if name == "odd_mlp":
        from autopar.testing.zoo import OddMLP

        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(16, 21, generator=g), torch.randn(16, 3, generator=g)) for _ in range(8)]
        return OddMLP(), batches, torch.nn.functional.mse_loss
    if name == "routed_mlp":  # integer, boolean and detached values cross a pipeline cut
        from autopar.testing.zoo import RoutedResidualMLP

        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(8)]
        return RoutedResidualMLP(), batches, torch.nn.functional.cross_entropy
    if name == "where_moe":  # experts on the rows torch.where picks: one token-wise region
        from autopar.testing.zoo import WhereLoopMoE

        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(8)]
        return WhereLoopMoE(), batches, torch.nn.functional.cross_entropy
    if name == "wide_embedding":  # a table worth splitting, then layers worth data parallelism
        from autopar.testing.zoo import WideEmbeddingMLP

        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, 8192, (64, 32), generator=g), torch.randint(0, 5, (64,), generator=g))
                   for _ in range(8)]
        return WideEmbeddingMLP(), batches, torch.nn.functional.cross_entropy
    if name == "mlp":
        from examples.mlp import MLP, example_batch, mlp_loss

        model = MLP(64, 256, 2)
        batches = [example_batch(64, 16, seed=s) for s in range(8)]
        return model, batches, mlp_loss
    raise ValueError(f"unknown parity case {name!r}")


class _TupleGPT(torch.nn.Module):
    """The example GPT returning (logits, auxiliary loss), as MoE-style models do."""

    def __init__(self, cfg):
        super().__init__()
        from examples.gpt import GPT

        self.gpt = GPT(cfg)

    def forward(self, idx):
        logits = self.gpt(idx)
        return logits, 1e-3 * logits.pow(2).mean()


def _tuple_loss(out, target):
    from examples.gpt import gpt_loss

    logits, aux = out
    return gpt_loss(logits, target) + aux


def parity_failures(result: dict[str, Any], tol: float = 1e-5) -> list[str]:
    """What a ``parity_suite`` result got wrong, one line each (empty: exact within ``tol``)."""
    label = f"{result['case']} {result['constraints'] or 'free plan'} ({result['optimizer']}) on mesh {result['mesh']}"
    if result["param_err"] is None:
        return [f"{label}: not compared on this rank (rank 0's result holds the comparison with one device)"]
    failures = []
    if result["missing"]:
        failures.append(f"{label}: full_state_dict lacks {result['missing']}")
    if result["dtensor_mismatch"]:
        failures.append(f"{label}: state_dict() DTensors differ from full_state_dict for {result['dtensor_mismatch']}")
    if not (result["loss_err"] <= tol and result["param_err"] <= tol):
        failures.append(f"{label}: loss err {result['loss_err']:.2e}, param err {result['param_err']:.2e} "
                        f"(worst {result['worst'][:2]})")
    return failures


def _moe_ce(out, target):
    from examples.gpt import gpt_loss

    return gpt_loss(out[0], target)


def parity_suite(cases: list[tuple], steps: int = 5, optimizers: tuple[str, ...] = ("sgd", "adamw")) -> list[dict[str, Any]]:
    """Run (case, constraints[, optimizer]) parity checks in one process group, one optimizer per
    case: a case that names none takes the next of ``optimizers`` in turn (SGD with momentum, then
    AdamW, then SGD ...), so a list of two or more such cases covers both. Adam normalises each
    gradient entry, which would hide a wrong gradient scale; SGD does not; AdamW's decoupled weight
    decay and its state are checked on the other cases. (Each case used to run with both: twice
    the time, for a check that every case's gradients and every optimizer's update are right,
    which alternating keeps as long as each family of plans appears with both over the lists.)

    ``manual_gpt`` (nanoGPT's biased q/k/v projection) is checked with SGD only: its key bias has
    an exactly-zero true gradient (softmax ignores a shift along the keys), so Adam normalises
    float noise of ~1e-10 into full-size updates that differ with summation order (~1e-4 relative
    on that one tensor, in data parallel as much as in tensor parallel).
    """
    out = []
    turn = 0
    for case, constraints, *opt in cases:
        if opt:
            name = opt[0]
        else:
            name = optimizers[turn % len(optimizers)]
            turn += 1
        r = parity_worker(case, constraints, steps, opt=name, lr=0.05 if name == "sgd" else 1e-3)
        r.pop("program"), r.pop("plan")
        r["case"], r["constraints"], r["optimizer"] = case, constraints, name
        out.append(r)
    return out


def _to_double(x):
    if isinstance(x, tuple):
        return tuple(_to_double(v) for v in x)
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def parity_worker(case: str, constraints: dict | None, steps: int = 5, device: str = "cpu", lr: float = 1e-3,
                  opt: str = "adamw", plan=None, tol: float = 1e-5) -> dict[str, Any]:
    """Train ``case`` under ``constraints`` (or the given ``plan``) and, on rank 0 only, a
    single-device copy beside it; report the worst relative differences of the loss and of the
    parameters and buffers. Every rank reports the losses it saw (``losses``: the global loss, the
    same on every rank); only rank 0's result holds the
    comparison (``loss_err``, ``param_err``, ``worst``: None on the other ranks, whose reference
    would be the same computation again; ``parity_failures`` reports them as not compared).

    Ill-conditioned tensors: where a float32 value is dominated by rounding even on one device
    (Adam normalises the noise of a gradient that is zero or nearly so in exact arithmetic, a key
    bias under softmax, the slow pairs of RoPE, into full-size updates whose sign depends on
    summation order; a BatchNorm statistic downstream of such a parameter), a float64 copy of the
    reference gives the exact values. It is trained only when a tensor misses ``tol`` against the
    float32 reference (it can only lower an error). A tensor whose single-device float32 result
    is more than ``tol / 10`` away from exact is then judged against exact: the sharded result
    passes if it is within 100x of the single device's own error (its error is scaled to ``tol``
    at that bound: rounding noise of one summation order against another varies by an order of
    magnitude between tensors; a wrong gradient is off by O(1), 1e3x and more above this).
    ``ill_conditioned`` lists those tensors with (single-device error, sharded error) against exact."""
    import autopar
    import torch.distributed as dist

    model, batches, loss_fn = build_case(case)
    start = copy.deepcopy(model)  # the float32 reference, and the float64 one if it is needed
    if opt == "adamw":
        make_opt = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01)  # noqa: E731
    else:
        make_opt = lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9)  # noqa: E731
    cluster = autopar.Cluster.local() if device == "cpu" else autopar.Cluster.preset("dgx-h100").with_nodes(1)
    x0, t0 = batches[0]
    args0 = x0 if isinstance(x0, tuple) else (x0,)
    pm = autopar.compile(model, cluster, args0, example_target=t0, loss_fn=loss_fn, optimizer=make_opt,
                         constraints=None if plan is not None else autopar.Constraints(**(constraints or {})), plan=plan)
    data = [batches[s % len(batches)] for s in range(steps)]
    got_losses = [float(pm.train_step(*(x if isinstance(x, tuple) else (x,)), target=t)) for x, t in data]
    full = pm.full_state_dict()
    # the sharded state (DTensors, what a checkpoint saves) holds the same values
    stacked = pm._traced.stacked  # experts stacked by the trace: their DTensor holds the members' rows
    whole = {**full, **{k: torch.stack([full[m] for m in members]) for k, members in stacked.items()
                        if all(m in full for m in members)}}
    dtensor_mismatch = sorted(k for k, t in pm.state_dict().items()
                              if k in whole and not torch.equal(t.full_tensor().cpu(), whole[k]))
    sharded = sorted(k for k, p in pm.plan.params.items() if "S(" in p.layout)
    out = {"losses": got_losses, "dtensor_mismatch": dtensor_mismatch, "sharded_params": sharded,
           "mesh": pm.plan.mesh, "program": pm.program.code, "plan": pm.plan,
           "loss_err": None, "param_err": None, "worst": None, "missing": [], "ill_conditioned": {}}
    if dist.is_initialized() and dist.get_rank() != 0:
        return out
    ref = copy.deepcopy(start)
    want_losses = _train_reference(ref, make_opt, loss_fn, data)
    loss_err = max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got_losses, want_losses))
    ref_sd = ref.state_dict()
    errs = {k: relative_error(full[k], ref_sd[k]) for k in ref_sd if k in full}
    ill = {}
    if any(v > tol for k, v in errs.items() if ref_sd[k].is_floating_point()):
        exact = start.double()
        # (float64: torch's grouped_mm kernels take float32 and narrower only)
        with redirect_grouped_mm():
            _train_reference(exact, make_opt, loss_fn, [(_to_double(x), _to_double(t)) for x, t in data])
        exact_sd = exact.state_dict()
        for k in errs:
            if not ref_sd[k].is_floating_point():
                continue  # counters (BatchNorm's num_batches_tracked) are exact or wrong
            noise = relative_error(ref_sd[k], exact_sd[k])
            if noise > tol / 10:
                off = relative_error(full[k], exact_sd[k])
                ill[k] = (noise, off)
                errs[k] = min(errs[k], tol * off / (100 * noise))
    out.update(loss_err=loss_err, param_err=max(errs.values()), missing=sorted(set(ref_sd) - set(full)),
               ill_conditioned=ill, reference_losses=want_losses,
               worst=sorted(errs.items(), key=lambda kv: -kv[1])[:5])
    return out


def _train_reference(model, make_opt, loss_fn, data) -> list[float]:
    """``pm.train_step``'s work on one device: the loss of each step, ``model`` trained in place."""
    o = make_opt(list(model.parameters()))
    losses = []
    for x, t in data:
        o.zero_grad()
        loss = loss_fn(model(*(x if isinstance(x, tuple) else (x,))), t)
        loss.backward()
        o.step()
        losses.append(float(loss.detach()))
    return losses


def native_loop_worker(case: str, constraints: dict | None, steps: int = 4, lr: float = 0.05,
                       max_norm: float = 1.0, batch: str = "global", accumulate: int = 1) -> dict[str, Any]:
    """Train ``case`` in the torch-native loop a user writes, beside a single-device copy in the same
    loop: ``autopar.compile(model, cluster)`` (no examples: planned at the first call), then per step
    ``loss_fn(pm(*x), y).backward()``, ``clip_grad_norm_``, SGD with momentum and a ``StepLR``
    built over ``pm.parameters()`` before the first call. Reports the worst relative difference
    of the loss and of the gradient norm over the steps, of every parameter and buffer after the
    last step (``full_state_dict``), and of ``torch.distributed.checkpoint``'s full state dict.

    ``batch="local"``: compiled ahead with the global batch's shapes, then each rank reads only its
    shard through a ``DistributedSampler(num_replicas=pm.data_parallel_size,
    rank=pm.data_parallel_rank)``; the reference reads the same samples as global batches.
    ``accumulate=k``: each step accumulates the gradients of k batches (each loss divided by k,
    ``backward`` k times) before ``clip_grad_norm_`` and the optimizer step, on both sides."""
    import autopar
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model, batches, loss_fn = build_case(case)
    ref = copy.deepcopy(model)
    cons = autopar.Constraints(**constraints) if constraints else None
    if batch == "local":
        x0 = batches[0][0]
        pm = autopar.compile(model, autopar.Cluster.local(), x0 if isinstance(x0, tuple) else (x0,), constraints=cons,
                             batch="local")
        local_batches = _sampled_shards(batches[:steps * accumulate], pm.data_parallel_size, pm.data_parallel_rank)
    else:
        pm = autopar.compile(model, autopar.Cluster.local(), constraints=cons)
    runs = []
    for m in (pm, ref):
        opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
        runs.append((m, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)))
    loss_err = norm_err = 0.0
    for s in range(steps):
        got = []
        for m, opt, sched in runs:
            value = 0.0
            for j in range(accumulate):
                i = (s * accumulate + j) % len(batches)
                xm, tm = local_batches[i] if m is pm and batch == "local" else batches[i]
                loss = loss_fn(m(*(xm if isinstance(xm, tuple) else (xm,))), tm) / accumulate
                loss.backward()
                value += float(loss.detach())
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            opt.step()
            sched.step()
            opt.zero_grad()
            got.append((value, float(norm)))
        (l1, n1), (l0, n0) = got
        if batch == "local":  # this rank's loss is over its shard: the global batch's is their mean
            l1 = _mean_over_ranks(l1)
        loss_err = max(loss_err, abs(l1 - l0) / max(abs(l0), 1e-12))
        norm_err = max(norm_err, abs(n1 - n0) / max(abs(n0), 1e-12))
    ref_sd = ref.state_dict()
    full = pm.full_state_dict()
    errs = {k: relative_error(full[k], v) for k, v in ref_sd.items()}
    dcp = get_model_state_dict(pm, options=StateDictOptions(full_state_dict=True))
    # pm.eval() and torch.no_grad() as on a module: the evaluation graph (BatchNorm's running
    # statistics, no dropout), planned at its first use over the same shards
    pm.eval()
    ref.eval()
    x, _ = batches[0]
    xm = local_batches[0][0] if batch == "local" else x
    with torch.no_grad():
        got_out, want_out = pm(*(xm if isinstance(xm, tuple) else (xm,))), ref(*(x if isinstance(x, tuple) else (x,)))
    got_out = got_out.logits if hasattr(got_out, "logits") else got_out
    want_out = want_out.logits if hasattr(want_out, "logits") else want_out
    if batch == "local":  # this rank's rows: the sampler's, r, r + shards, ...
        want_out = want_out[pm.data_parallel_rank::pm.data_parallel_size]
    eval_err = relative_error(got_out, want_out)
    pm.train()
    return {"case": case, "constraints": constraints, "batch": batch, "mesh": pm.plan.mesh, "loss_err": loss_err,
            "norm_err": norm_err,
            "param_err": max(errs.values()), "worst": sorted(errs.items(), key=lambda kv: -kv[1])[:3],
            "dcp_keys_match": list(dcp) == list(ref_sd),
            "dcp_err": max(relative_error(dcp[k], v) for k, v in ref_sd.items()) if list(dcp) == list(ref_sd) else None,
            "dtensor_params": all(type(p).__name__ == "DTensor" for p in pm.parameters()), "eval_err": eval_err,
            "eval_no_grad": not got_out.requires_grad}


def native_loop_suite(cases: list[tuple], steps: int = 4) -> list[dict[str, Any]]:
    """``native_loop_worker`` for each (case, constraints[, batch mode]), in one process group."""
    return [native_loop_worker(case, constraints, steps, batch=rest[0] if rest else "global",
                               accumulate=rest[1] if len(rest) > 1 else 1)
            for case, constraints, *rest in cases]


def _sampled_shards(batches: list, replicas: int, rank: int) -> list:
    """This rank's part of each global batch, as a ``DistributedSampler`` (no shuffling) deals
    the samples of the batches laid end to end: a DataLoader of batch size B / replicas over it
    gives rank r the samples r, r + replicas, ... of each global batch."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    per = batches[0][1].shape[0]
    xs = [b[0] if isinstance(b[0], tuple) else (b[0],) for b in batches]
    columns = [torch.cat([x[i] for x in xs]) for i in range(len(xs[0]))] + [torch.cat([b[1] for b in batches])]
    data = TensorDataset(*columns)
    sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=False)
    out = []
    for *x, t in DataLoader(data, batch_size=per // replicas, sampler=sampler):
        out.append((tuple(x) if len(x) > 1 else x[0], t))
    return out


def _mean_over_ranks(value: float) -> float:
    """The mean of every rank's ``value``: an object all-gather (a host float64 tensor would be
    refused by an NCCL-only default group)."""
    from autopar.runtime.agreement import gathered

    every = gathered(float(value))
    return sum(every) / len(every)
