"""The training loops people write, each runnable on one device or on a compiled model (issue 42).

A habit is a function ``habit(side, rec)`` holding the loop a user writes in plain torch (the
same code for both sides): ``side`` builds the model (``side.model``) and either hands it back
(the single-device reference) or compiles it under a plan family (``side.native``,
``side.fused``); ``rec`` records the values the loop sees (losses, gradient norms, learning
rates, evaluation losses). It returns what it trained, whose final parameters and buffers are
compared with the reference's (``compare``). ``tests/test_habits.py`` runs every habit under
every plan family on 4 gloo processes (``run_families``).

Two model bases: the example GPT (``"gpt"``, logits) and the static-capacity mixture of experts
(``"moe"``, logits and an auxiliary loss). Both return ``(logits, aux)`` under the habits that
change the output's structure (``Outputs``: a tuple, a dict, a Hugging Face ``ModelOutput``).
"""
from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers.utils import ModelOutput

import autopar
from autopar.testing.parity import relative_error

SGD = ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
COLLECTIVE_TIMEOUT_S = 90
ADAMW = ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01))


@dataclasses.dataclass
class HabitOutput(ModelOutput):
    """What a Hugging Face model returns: ``.loss`` when called with ``labels=``."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    aux: torch.Tensor | None = None


class Outputs(torch.nn.Module):
    """The base model's ``(logits, aux)`` in the structure a habit uses: "tuple", "dict", or
    "model_output" (``forward(idx, labels=None)``, the loss inside when ``labels`` is given)."""

    def __init__(self, base: torch.nn.Module, kind: str):
        super().__init__()
        self.base, self.kind = base, kind

    def forward(self, idx: torch.Tensor, labels: torch.Tensor | None = None):
        out = self.base(idx)
        logits, aux = out if isinstance(out, tuple) else (out, 1e-3 * out.pow(2).mean())
        if self.kind == "tuple":
            return logits, aux
        if self.kind == "dict":
            return {"logits": logits, "aux": aux}
        loss = None if labels is None else _ce(logits, labels) + 0.01 * aux
        return HabitOutput(loss=loss, logits=logits, aux=aux)


def _ce(logits: torch.Tensor, target: torch.Tensor, **kw) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), **kw)


def base_loss(out, target: torch.Tensor) -> torch.Tensor:
    """The base model's own loss: cross-entropy, plus the experts' auxiliary loss where there is one."""
    return _ce(out[0], target) + 0.01 * out[1] if isinstance(out, tuple) else _ce(out, target)


def own_loss(out: tuple, target: torch.Tensor) -> torch.Tensor:
    """A user's loss on a tuple output: label smoothing and the auxiliary term weighted."""
    logits, aux = out
    return _ce(logits, target, label_smoothing=0.1) + 0.05 * aux


def dict_loss(out: dict, target: torch.Tensor) -> torch.Tensor:
    return _ce(out["logits"], target) + 0.01 * out["aux"]


def build(base: str, output: str = "plain", seed: int | None = 0) -> torch.nn.Module:
    """A fresh model (``seed=None``: from the current RNG state, e.g. after ``manual_seed(s + rank)``)."""
    if seed is not None:
        torch.manual_seed(seed)
    if base == "gpt":
        from examples.gpt import GPT, GPTConfig

        model = GPT(GPTConfig())
    else:
        from examples.moe import MoEConfig, MoEGPT

        model = MoEGPT(MoEConfig())
    return model if output == "plain" else Outputs(model, output)


def batches(base: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Eight global batches of 8 sequences (the same on every rank)."""
    if base == "gpt":
        from examples.gpt import GPTConfig, example_batch

        return [example_batch(GPTConfig(), 8, seed=s) for s in range(8)]
    from examples.moe import MoEConfig, example_batch

    return [example_batch(MoEConfig(), 8, seed=s) for s in range(8)]


class Recorder:
    """The values a loop saw, by name, and notes (refusals) by name."""

    def __init__(self):
        self.series: dict[str, list[float]] = {}
        self.notes: dict[str, str] = {}

    def __call__(self, name: str, value) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if hasattr(value, "full_tensor"):  # clip_grad_norm_ over DTensors returns a DTensor norm
                value = value.full_tensor()
        self.series.setdefault(name, []).append(float(value))


class OneDevice:
    """What ``pm.train_step`` does, on one device: the reference side of the fused habits."""

    def __init__(self, model, make_opt, loss_fn=None, lr_scheduler=None):
        self.module = model
        self.optimizer = make_opt(list(model.parameters()))
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self.loss_fn = loss_fn

    def _loss(self, inputs, target, kwargs):
        out = self.module(*inputs, **kwargs)
        return self.loss_fn(out, target) if self.loss_fn is not None else out.loss

    def train_step(self, *inputs, target=None, **kwargs) -> float:
        loss = self._loss(inputs, target, kwargs)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return float(loss.detach())

    @torch.no_grad()
    def eval_step(self, *inputs, target=None, **kwargs) -> float:
        was = self.module.training
        self.module.eval()
        try:
            return float(self._loss(inputs, target, kwargs))
        finally:
            self.module.train(was)

    def __getattr__(self, name):  # train(), eval(), state_dict(), load_state_dict(), ...
        return getattr(self.__dict__["module"], name)


class Side:
    """Where a habit runs: ``constraints is None`` is the single-device reference; otherwise each
    model is compiled under them on this rank (a plan of the same graph is reused: ``plans``)."""

    def __init__(self, base: str, rank: int = 0, constraints: dict | None = None, plans: dict | None = None,
                 reused: dict | None = None):
        self.base, self.rank, self.constraints = base, rank, constraints
        self.plans = plans if plans is not None else {}
        # (graph key) -> a compiled model of the native loop that later habits reuse (``native``)
        self.reused = reused if reused is not None else {}
        self.batches = batches(base)
        self.compiled: list = []  # to close after the habit
        self.seeded_per_rank = False

    def model(self, output: str = "plain", seed: int | None = 0) -> torch.nn.Module:
        self.seeded_per_rank |= seed is None
        return build(self.base, output, seed)

    def _compile(self, model, key: tuple, *example, **kw):
        plan = self.plans.get(key)
        cons = None if plan is not None or self.constraints is None else autopar.Constraints(**self.constraints)
        # a habit that fails on one rank fails the others within COLLECTIVE_TIMEOUT_S, not 300 s
        pm = autopar.compile(model, autopar.Cluster.local(), *example, constraints=cons, plan=plan,
                             collective_timeout_s=COLLECTIVE_TIMEOUT_S, **kw)
        self.compiled.append((pm, key))
        return pm

    def native(self, model):
        """The model for the torch-native loop: itself, or compiled (planned at its first call).

        A compiled model of the same graph that an earlier habit of this family trained is reused
        (one compile per graph per family, not one per habit): ``model``'s values are loaded into
        it (``load_state_dict`` of full tensors), its gradients set to None and ``train()`` called,
        so the habit starts where a fresh compile would; its own optimizer is new. Not for a model
        seeded per rank (its compile broadcasts rank 0's values: that is what the habit checks)."""
        if self.constraints is None:
            return model
        key = ("native", type(model).__name__, getattr(model, "kind", "plain"))
        pm = None if self.seeded_per_rank else self.reused.get(key)
        if pm is None:
            pm = self._compile(model, key)
            if not self.seeded_per_rank:
                self.reused[key] = pm
            return pm
        self.compiled.append((pm, key))
        pm.load_state_dict(model.state_dict())
        pm.zero_grad(set_to_none=True)
        pm.train()
        return pm

    def fused(self, model, make_opt, loss_fn=None, lr_scheduler=None, ahead: bool = False):
        """The model for ``train_step``: compiled with ``optimizer=``, or its one-device equivalent.
        ``ahead``: planned at compile from the first batch (``pm.optimizer`` exists at once)."""
        if self.constraints is None:
            return OneDevice(model, make_opt, loss_fn, lr_scheduler)
        key = ("fused", type(model).__name__, getattr(model, "kind", "plain"), getattr(loss_fn, "__name__", None))
        x, y = self.batches[0]
        return self._compile(model, key, *(((x,),) if ahead else ()), optimizer=make_opt, loss_fn=loss_fn,
                             lr_scheduler=lr_scheduler, **({"example_target": y} if ahead else {}))

    def close(self, keep: bool = True) -> None:
        """Close what this habit compiled, but the models later habits reuse (``keep``; else
        those too: after a habit that failed, the next one compiles afresh)."""
        kept = {id(pm) for pm in self.reused.values()} if keep else set()
        if not keep:
            self.reused.clear()
        for pm, key in self.compiled:
            if pm.plan is not None:
                self.plans.setdefault(key, pm.plan)
            if id(pm) not in kept:
                pm.close()
        self.compiled.clear()


def final_state(trained) -> dict[str, torch.Tensor]:
    """Every parameter and buffer after the loop, whole (``full_state_dict`` of a compiled model)."""
    module = trained.module if isinstance(trained, OneDevice) else trained
    if hasattr(module, "full_state_dict"):
        return module.full_state_dict()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def reference(base: str, habit: Callable) -> dict[str, Any]:
    """The habit's loop on one device: the values it saw and the final state."""
    rec = Recorder()
    state = final_state(habit(Side(base), rec))
    return {"series": rec.series, "state": state}


def compare(rec: Recorder, state: dict, ref: dict) -> dict[str, Any]:
    """Worst relative error of each recorded series and of the final state against the reference."""
    series = {}
    for name, want in ref["series"].items():
        got = rec.series.get(name)
        if got is None or len(got) != len(want):
            series[name] = f"recorded {got} where one device recorded {want}"
            continue
        series[name] = max(abs(g - w) / max(abs(w), 1e-8) for g, w in zip(got, want))
    errs = {k: relative_error(state[k], v) for k, v in ref["state"].items() if k in state}
    return {"series": series, "extra_series": sorted(set(rec.series) - set(ref["series"])), "notes": dict(rec.notes),
            "param_err": max(errs.values(), default=float("inf")),
            "worst": sorted(errs.items(), key=lambda kv: -kv[1])[:3],
            "missing": sorted(set(ref["state"]) - set(state)), "unexpected": sorted(set(state) - set(ref["state"]))}


def run_families(scenarios: list[tuple[str, str, dict, str]], refs: dict, out_dir: str) -> None:
    """On this rank: every (family, base, constraints, habit) in turn, compared with its reference
    from ``refs``. Each result is written to ``out_dir`` as soon as it exists (``result_path``), so
    that a habit which kills the world (a gloo abort) loses no other habit's result; before each
    habit rank 0 appends its name to ``out_dir/started``. A habit that raises is reported with the
    end of its traceback; the next one still runs."""
    rank = int(os.environ.get("RANK", "0"))
    plans: dict = {}  # (family, graph key) -> plan: a graph planned once per family
    reused: dict = {}  # family -> the native loop's compiled models that its habits share (Side.native)
    for family, base, constraints, name in scenarios:
        if rank == 0:
            with open(os.path.join(out_dir, "started"), "a") as f:
                f.write(f"{family} {name}\n")
        side = Side(base, rank, constraints, plans.setdefault(family, {}), reused.setdefault(family, {}))
        rec = Recorder()
        failed = False
        try:
            trained = HABITS[name][1](side, rec)
            if HABITS[name][2] == "refusal":
                result = {"notes": dict(rec.notes)}
            else:
                result = compare(rec, final_state(trained), refs[(base, name)])
            plan = side.compiled[0][0].plan if side.compiled else None
            result["mesh"] = plan.mesh if plan is not None else None
            result["plan"] = plan_facts(plan) if plan is not None else None
        except Exception as exc:  # noqa: BLE001 - reported to the test that names this habit
            tb = traceback.format_exc().strip().splitlines()
            result = {"error": f"{type(exc).__name__}: {str(exc)[:600]}", "traceback": "\n".join(tb[-12:])[-3000:]}
            failed = True
        try:
            side.close(keep=not failed)
        except Exception as exc:  # noqa: BLE001
            result["close_error"] = repr(exc)[:600]
        with open(result_path(out_dir, rank, family, name), "wb") as f:
            pickle.dump(result, f)
    for models in reused.values():
        for pm in models.values():
            pm.close()


def plan_facts(plan) -> dict[str, Any]:
    """What makes a plan of its family: mesh, stages, ZeRO stages, parameters split by the layout."""
    return {"mesh": plan.mesh, "stages": len(plan.stages),
            "zero": sorted({p.zero_stage for p in plan.params.values() if p.zero_axes}),
            "sharded": sorted(k for k, p in plan.params.items() if "S(" in p.layout)}


def result_path(out_dir: str, rank: int, family: str, habit: str) -> str:
    return os.path.join(out_dir, f"{family}-{habit}-rank{rank}.pkl")


# ---------------------------------------------------------------------------------- the habits
def _train(m, opt, loss_fn, rec, data, before=None, after=None) -> None:
    for x, y in data:
        if before is not None:
            before()
        loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        if after is not None:
            after()
        rec("loss", loss)


def zero_grad_before_keep(s: Side, rec: Recorder):
    """``opt.zero_grad(set_to_none=False)`` before each step: gradients zeroed in place."""
    m = s.native(s.model())
    opt = ADAMW[1](m.parameters())
    _train(m, opt, base_loss, rec, s.batches[:4], before=lambda: opt.zero_grad(set_to_none=False))
    return m


def zero_grad_after_none(s: Side, rec: Recorder):
    """``opt.zero_grad()`` (``set_to_none=True``) after each step."""
    m = s.native(s.model())
    opt = SGD[1](m.parameters())
    _train(m, opt, base_loss, rec, s.batches[:4], after=lambda: opt.zero_grad(set_to_none=True))
    return m


def accumulate_and_clip(s: Side, rec: Recorder):
    """Three ``backward()`` per step (each loss / 3), then ``clip_grad_norm_`` below the norm."""
    m = s.native(s.model())
    opt = SGD[1](m.parameters())
    for step in range(3):
        total = 0.0
        for j in range(3):
            x, y = s.batches[(3 * step + j) % len(s.batches)]
            loss = base_loss(m(x), y) / 3
            loss.backward()
            total += float(loss.detach())
        rec("loss", total)
        rec("grad_norm", torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
        opt.step()
        opt.zero_grad()
    return m


def lr_scheduler(s: Side, rec: Recorder):
    """A warm-up then cosine schedule (``SequentialLR``) stepped after each optimizer step."""
    m = s.native(s.model())
    opt = ADAMW[1](m.parameters())
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)], milestones=[2])
    for x, y in s.batches[:5]:
        loss = base_loss(m(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        rec("loss", loss)
        rec("lr", sched.get_last_lr()[0])
    return m


def eval_between_steps(s: Side, rec: Recorder):
    """``model.eval()`` between training steps, the evaluation loss computed with gradients on
    (never backpropagated) and under ``torch.no_grad()`` in turn, then ``model.train()``."""
    m = s.native(s.model())
    opt = SGD[1](m.parameters())
    xv, yv = s.batches[7]
    for i, (x, y) in enumerate(s.batches[:4]):
        m.train()
        loss = base_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        rec("loss", loss)
        m.eval()
        if i % 2:
            with torch.no_grad():
                rec("eval", base_loss(m(xv), yv))
        else:
            rec("eval", base_loss(m(xv), yv).detach())
    m.train()
    return m


def state_dict_dtensor(s: Side, rec: Recorder):
    """``copy.deepcopy(model.state_dict())`` and the optimizer's (DTensors on a compiled model),
    two more steps, then both loaded back and those steps trained again."""
    m = s.native(s.model())
    opt = ADAMW[1](m.parameters())
    _train(m, opt, base_loss, rec, s.batches[:2], after=opt.zero_grad)
    saved, opt_saved = copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict())
    _train(m, opt, base_loss, rec, s.batches[2:4], after=opt.zero_grad)
    m.load_state_dict(saved)
    opt.load_state_dict(opt_saved)
    _train(m, opt, base_loss, rec, s.batches[2:4], after=opt.zero_grad)
    return m


def state_dict_full(s: Side, rec: Recorder):
    """The full state dict (``get_model_state_dict(full_state_dict=True)``, plain tensors) saved
    with ``torch.save``, two more steps, then ``model.load_state_dict`` of the loaded file."""
    m = s.native(s.model())
    opt = SGD[1](m.parameters())
    _train(m, opt, base_loss, rec, s.batches[:2], after=opt.zero_grad)
    buf = io.BytesIO()
    torch.save(get_model_state_dict(m, options=StateDictOptions(full_state_dict=True)), buf)
    _train(m, opt, base_loss, rec, s.batches[2:4], after=opt.zero_grad)
    buf.seek(0)
    m.load_state_dict(torch.load(buf))
    _train(m, opt, base_loss, rec, s.batches[2:4], after=opt.zero_grad)
    return m


def per_rank_seed(s: Side, rec: Recorder):
    """``torch.manual_seed(seed + rank)`` before the model is built: each rank's initial weights
    differ; training follows rank 0's (the reference is rank 0's model)."""
    torch.manual_seed(1000 + s.rank)
    m = s.native(s.model(seed=None))
    opt = ADAMW[1](m.parameters())
    _train(m, opt, base_loss, rec, s.batches[:3], after=opt.zero_grad)
    return m


def own_loss_tuple(s: Side, rec: Recorder):
    """A model returning a tuple, and the user's own loss on it."""
    m = s.native(s.model("tuple"))
    opt = SGD[1](m.parameters())
    _train(m, opt, own_loss, rec, s.batches[:3], after=opt.zero_grad)
    return m


def dict_output(s: Side, rec: Recorder):
    """A model returning a dict of tensors."""
    m = s.native(s.model("dict"))
    opt = ADAMW[1](m.parameters())
    _train(m, opt, dict_loss, rec, s.batches[:3], after=opt.zero_grad)
    return m


def model_output_kwargs(s: Side, rec: Recorder):
    """Hugging Face's habit: keyword inputs ``model(idx=x, labels=y)``, a ``ModelOutput`` whose
    ``.loss`` is backpropagated."""
    m = s.native(s.model("model_output"))
    opt = SGD[1](m.parameters())
    for x, y in s.batches[:3]:
        out = m(idx=x, labels=y)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        rec("loss", out.loss)
        rec("logits_sum", out.logits.detach().double().sum())
    return m


def fused_zero_grad_before(s: Side, rec: Recorder):
    """``pm.optimizer.zero_grad()`` (``set_to_none=True``) before each ``train_step`` (planned
    ahead: without example inputs ``pm.optimizer`` is None until the first train_step)."""
    t = s.fused(s.model(), ADAMW[1], base_loss, ahead=True)
    for x, y in s.batches[:4]:
        t.optimizer.zero_grad(set_to_none=True)
        rec("loss", t.train_step(x, target=y))
    return t


def fused_zero_grad_after_keep(s: Side, rec: Recorder):
    """``pm.optimizer.zero_grad(set_to_none=False)`` after each ``train_step``."""
    t = s.fused(s.model(), SGD[1], base_loss)
    for x, y in s.batches[:4]:
        rec("loss", t.train_step(x, target=y))
        t.optimizer.zero_grad(set_to_none=False)
    return t


def fused_schedule_and_eval(s: Side, rec: Recorder):
    """``lr_scheduler=`` stepped by train_step; between steps ``eval()``, ``eval_step`` and
    ``train()``. A plan with no evaluation program (pipelines) refuses ``eval_step`` (the
    refusal is recorded) and trains on unharmed."""
    t = s.fused(s.model(), ADAMW[1], base_loss, lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5))
    xv, yv = s.batches[7]
    for x, y in s.batches[:4]:
        t.train()
        rec("loss", t.train_step(x, target=y))
        rec("lr", t.lr_scheduler.get_last_lr()[0])
        t.eval()
        try:
            rec("eval", t.eval_step(xv, target=yv))
        except autopar.AutoparError as exc:
            rec.notes["eval"] = str(exc)
    t.train()
    return t


def fused_state_dict(s: Side, rec: Recorder):
    """``state_dict()`` and ``optimizer.state_dict()`` deep-copied, two steps, both loaded back."""
    t = s.fused(s.model(), SGD[1], base_loss)
    for x, y in s.batches[:2]:
        rec("loss", t.train_step(x, target=y))
    saved, opt_saved = copy.deepcopy(t.state_dict()), copy.deepcopy(t.optimizer.state_dict())
    for x, y in s.batches[2:4]:
        rec("loss", t.train_step(x, target=y))
    t.load_state_dict(saved)
    t.optimizer.load_state_dict(opt_saved)
    for x, y in s.batches[2:4]:
        rec("loss", t.train_step(x, target=y))
    return t


def fused_model_output_kwargs(s: Side, rec: Recorder):
    """``train_step(idx=x, labels=y)``: keyword inputs, the loss the model returns in a ``ModelOutput``."""
    t = s.fused(s.model("model_output"), ADAMW[1])
    for x, y in s.batches[:3]:
        rec("loss", t.train_step(idx=x, labels=y))
    return t


def fused_dict_output_seeded(s: Side, rec: Recorder):
    """Per-rank seeding before the model is built, a dict output and the user's ``loss_fn``."""
    torch.manual_seed(2000 + s.rank)
    t = s.fused(s.model("dict", seed=None), SGD[1], dict_loss)
    for x, y in s.batches[:3]:
        rec("loss", t.train_step(x, target=y))
    return t


def native_loop_refused(s: Side, rec: Recorder):
    """Pipelines run in train_step only: the native loop's first call says so (and the fix)."""
    m = s.native(s.model())
    x, y = s.batches[0]
    try:
        base_loss(m(x), y).backward()
    except autopar.AutoparError as exc:
        rec.notes["native"] = str(exc)
    return None


# name -> (optimizer, loop, path)
HABITS: dict[str, tuple[str, Callable, str]] = {
    "zero_grad_before_keep": ("adamw", zero_grad_before_keep, "native"),
    "zero_grad_after_none": ("sgd", zero_grad_after_none, "native"),
    "accumulate_and_clip": ("sgd", accumulate_and_clip, "native"),
    "lr_scheduler": ("adamw", lr_scheduler, "native"),
    "eval_between_steps": ("sgd", eval_between_steps, "native"),
    "per_rank_seed": ("adamw", per_rank_seed, "native"),
    "own_loss_tuple": ("sgd", own_loss_tuple, "native"),
    "dict_output": ("adamw", dict_output, "native"),
    "model_output_kwargs": ("sgd", model_output_kwargs, "native"),
    "state_dict_dtensor": ("adamw", state_dict_dtensor, "native"),
    "state_dict_full": ("sgd", state_dict_full, "native"),
    "fused_zero_grad_before": ("adamw", fused_zero_grad_before, "fused"),
    "fused_zero_grad_after_keep": ("sgd", fused_zero_grad_after_keep, "fused"),
    "fused_schedule_and_eval": ("adamw", fused_schedule_and_eval, "fused"),
    "fused_model_output_kwargs": ("adamw", fused_model_output_kwargs, "fused"),
    "fused_dict_output_seeded": ("sgd", fused_dict_output_seeded, "fused"),
    "fused_state_dict": ("sgd", fused_state_dict, "fused"),
    "native_loop_refused": ("-", native_loop_refused, "refusal"),
}
