"""``model.to(...)``, ``.half()``, ``.cuda()``... and BatchNorm statistics on a model sharded in place
(issue 43's loose ends; ``runtime.module_moves``, ``runtime.in_place``).

On 2 gloo processes, under tensor parallelism and data parallelism:

* a move or conversion that changes nothing (``model.to("cpu")``, ``.float()``, ``.to(torch.float32)``,
  ``.cpu()``, ``pm.to("cpu")``) returns the model with the same parameter objects on the same storage,
  and ``model(x)`` still gives what it gave; also before the plan exists (compile without example inputs);
* one that would change the shards (``.half()``, ``.bfloat16()``, ``.double()``, ``.to(torch.float16)``,
  ``.cuda()``, ``.to("meta")``, ``.to_empty(...)``, ``pm.half()``) is refused with an ``AutoparError``
  naming the change and the fix (``precision='bf16-mixed'``, a Cluster's ``device_type``,
  ``export_module``), and leaves the model as it was: before, ``.half()`` turned the DTensors
  float16 while the program went on reading the float32 shards;
* the same on a submodule (``model[0].half()``, ``model[2].to(torch.float16)``, ``pm``'s submodule):
  before, a child's ``.half()`` converted its DTensors silently and the program went on training
  the old float32 shards; a no-op move of a child returns it unchanged, and ``export_module``'s
  copy is a plain module again (its children convert, their class is the user's);
* BatchNorm in train mode outside ``train_step`` (``model(x)`` under ``no_grad``: a batch of other
  shapes runs eagerly, the compiled shape runs the program) updates the running statistics as one
  device does (ResNet-18's layout, small), and ``eval()`` then gives one device's outputs;
* under a pipeline plan (pp=2), ``model(x)`` under ``no_grad`` runs eagerly on every rank with one
  module's weights whole at a time (never the model's), equal to the exported one-device model;
  also where a parameter is read outside its own module's forward (``_SharedReads``: the root's
  ``F.linear(h, self.wte.weight)`` head tied to the embedding, block 5 reading block 0's bias),
  on pp=2 and pp=2 x dp=2: the logits equal one device's (before and after a train_step), with
  at most one module's weights plus the parameters read outside their module whole at a time.
  Before, a rank whose stage does not hold such a parameter failed (``_Scale`` has no ``g``); one
  whose stage holds it met it as its stage's DTensor.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from helpers import error_of

TOL = 1e-5
LAYOUTS = [{"tp": 2}, {"dp": 2}]


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


def _mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _storage(model) -> list:
    return [(id(p), p._local_tensor.untyped_storage().data_ptr(), p.dtype) for p in model.parameters()]


def moves_worker() -> dict:
    import torch

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = {}
    for cons in LAYOUTS:
        model = _mlp()
        pm = autopar.compile(model, autopar.Cluster.local(), (x,), constraints=autopar.Constraints(**cons))
        with torch.no_grad():
            before = model(x).clone()
        held = _storage(model)
        r = {}
        for name, move in (("to_cpu", lambda: model.to("cpu")), ("float", lambda: model.float()),
                           ("to_f32", lambda: model.to(torch.float32)), ("cpu", lambda: model.cpu()),
                           ("to_device_dtype", lambda: model.to(torch.device("cpu"), torch.float32)),
                           ("pm_to_cpu", lambda: pm.to("cpu"))):
            got = move()
            r[name] = got is model or got is pm
        r["noop_same_storage"] = _storage(model) == held
        with torch.no_grad():
            r["noop_out_err"] = _rel(model(x), before)
        child_noop = model[0].to("cpu") is model[0] and model[2].float() is model[2]
        r["refused"] = {name: error_of(move) for name, move in (
            ("child_half", lambda: model[0].half()), ("child_to_f16", lambda: model[2].to(torch.float16)),
            ("child_meta", lambda: model[2].to("meta")), ("pm_child_half", lambda: pm.get_submodule("0").half()),
            ("half", lambda: model.half()), ("bfloat16", lambda: model.bfloat16()), ("double", lambda: model.double()),
            ("to_f16", lambda: model.to(torch.float16)), ("cuda", lambda: model.cuda()),
            ("meta", lambda: model.to("meta")), ("to_empty", lambda: model.to_empty(device="cpu")),
            ("pm_half", lambda: pm.half()))}
        r["after_refusals_same"] = _storage(model) == held
        r["child_noop"] = child_noop and _storage(model) == held
        with torch.no_grad():
            r["after_refusals_err"] = _rel(model(x), before)
        plain = autopar.export_module(model)
        r["export_children_plain"] = (type(plain[0]) is torch.nn.Linear and plain[0].half() is plain[0]
                                      and plain[0].weight.dtype == torch.float16)
        copied = copy.deepcopy(model[0])  # a copy is no part of the program: it converts as any module
        r["copy_converts"] = copied.half() is copied and copied.weight.dtype == torch.float16
        out[str(cons)] = r
        pm.close()
    # before the plan exists: placeholders; the same rules
    model = _mlp()
    pm = autopar.compile(model, autopar.Cluster.local(), constraints=autopar.Constraints(tp=2))
    r = {"unplanned_noop": model.to("cpu") is model and model.float() is model,
         "unplanned_half": error_of(lambda: model.half())}
    with torch.no_grad():
        r["unplanned_then_runs_err"] = _rel(model(x), _mlp()(x))
    out["unplanned"] = r
    pm.close()
    out["batch_norm"] = _batch_norm()
    out["pp_eager"] = _pipelined_eager()
    return out


def _pipelined_eager() -> dict:
    """pp=2 over 8 linear layers: after a train_step, ``model(x)`` under ``no_grad`` (a pipeline plan
    runs it eagerly, each module's weights fetched from the stage holding them) equals the exported
    one-device model, and at no point does the module tree hold more than one module's weights whole
    (counted in a forward hook of every module, while its weights are in place)."""
    import torch
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    pm = autopar.compile(model, autopar.Cluster.local(), (x,), loss_fn=torch.nn.functional.mse_loss, example_target=y,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), constraints=autopar.Constraints(pp=2))
    pm.train_step(x, target=y)
    whole = []

    def count(mod, *_):
        whole.append(sum(p.numel() for m in model.modules() for p in m._parameters.values()
                         if p is not None and not isinstance(p, DTensor)))

    handles = [m.register_forward_hook(count) for m in model]
    with torch.no_grad():
        got = model(x[:3])  # a pipeline plan: eager, on every rank
    for h in handles:
        h.remove()
    plain = autopar.export_module(model)
    with torch.no_grad():
        want = plain(x[:3])
    # each stage's module is refused on every rank, the rank holding it and the one that does not
    halves = [error_of(lambda: model[i].half()) for i in (0, 7)]
    r = {"halves": halves, "stages": len(pm.plan.stages), "err": _rel(got, want), "type": type(got).__name__,
         "most_whole": max(whole), "one_module": 32 * 32 + 32, "model": sum(p.numel() for p in plain.parameters()),
         "hooks_ran": len(whole)}
    pm.close()
    return r


V, D, LAYERS = 64, 32, 6


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D, D)

    def forward(self, h, other=None):
        h = h + torch.tanh(self.fc(h))
        return h if other is None else h + other.fc.bias  # another module's parameter, read here


class _Scale(torch.nn.Module):
    """Holds a parameter it never uses itself (its forward is never called): the root reads it."""

    def __init__(self):
        super().__init__()
        self.g = torch.nn.Parameter(1 + 0.1 * torch.randn(V))


class _SharedReads(torch.nn.Module):
    """A decoder-like stack whose head is the embedding read in the root's forward, scaled by a
    parameter of a module never called (only the last stage uses it), and whose last block reads
    the first block's bias: parameters used outside their own module's forward."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(LAYERS))
        self.scale = _Scale()

    def forward(self, idx):
        h = self.wte(idx)
        for i, b in enumerate(self.blocks):
            h = b(h, self.blocks[0] if i == LAYERS - 1 else None)
        return torch.nn.functional.linear(h, self.wte.weight) * self.scale.g


def _lm_loss(out, t):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())


def shared_reads_worker(cons: dict) -> dict:
    """pp eager ``model(x)`` of ``_SharedReads`` against one device, before and after a train_step
    (the one-device model trained by the same SGD step on the same batch)."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = _SharedReads()
    ref = _SharedReads()
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, V, (8, 5), generator=g), torch.randint(0, V, (8, 5), generator=g)
    pm = autopar.compile(model, autopar.Cluster.local(), (x,), loss_fn=_lm_loss, example_target=y,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), constraints=autopar.Constraints(**cons))
    whole = []

    def count(*_):
        whole.append(sum(p.numel() for m in model.modules() for p in m._parameters.values()
                         if p is not None and not isinstance(p, DTensor)))

    handles = [m.register_forward_hook(count) for m in model.modules() if m is not model]
    r = {"stages": len(pm.plan.stages)}
    with torch.no_grad():
        r["before_err"] = _rel(model(x[:3]), ref(x[:3]))
    for h in handles:
        h.remove()
    pm.train_step(x, target=y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    _lm_loss(ref(x), y).backward()
    opt.step()
    with torch.no_grad():
        r["after_err"] = _rel(model(x[:3]), ref(x[:3]))
    r["most_whole"] = max(whole)
    r["bound"] = D * D + D + V * D + D + V  # one block, plus what is read outside: the embedding, block 0's bias, g
    r["model"] = sum(p.numel() for p in ref.parameters())
    pm.close()
    return r


def _batch_norm() -> dict:
    """ResNetTiny (ResNet-18's layout) under dp=2 and tp=2: train-mode forwards outside train_step,
    eager (batch 4) and compiled (batch 8), against one device; then eval outputs."""
    import torch

    from examples.real_models import ResNetTiny

    def make():
        torch.manual_seed(0)
        return ResNetTiny().train()

    g = torch.Generator().manual_seed(2)
    x8, x4, x5 = (torch.randn(n, 3, 16, 16, generator=g) for n in (8, 4, 5))
    out = {}
    for cons in LAYOUTS:
        model, ref = make(), make()
        pm = autopar.compile(model, autopar.Cluster.local(), (x8,), constraints=autopar.Constraints(**cons))
        r = {}
        for label, x in (("eager", x4), ("compiled", x8), ("eager_again", x4)):
            with torch.no_grad():
                got, want = model(x), ref(x)
            stats = {k: v.full_tensor() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
            r[label] = {"out_err": _rel(got, want),
                        "stats_err": max(_rel(v, ref.state_dict()[k]) for k, v in stats.items() if "running" in k),
                        "batches_tracked": sorted({int(v) for k, v in stats.items() if "num_batches" in k}),
                        "want_tracked": sorted({int(v) for k, v in ref.state_dict().items() if "num_batches" in k})}
        model.eval()
        ref.eval()
        with torch.no_grad():
            r["eval_err"] = _rel(model(x5), ref(x5))
        out[str(cons)] = r
        pm.close()
    return out


@pytest.fixture(scope="module")
def results():
    return autopar.launch(moves_worker, 2, timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("cons", [str(c) for c in LAYOUTS])
def test_a_move_that_changes_nothing_is_a_no_op(results, cons):
    for rank, out in enumerate(results):
        r = out[cons]
        for name in ("to_cpu", "float", "to_f32", "cpu", "to_device_dtype", "pm_to_cpu"):
            assert r[name], (rank, cons, name)
        assert r["noop_same_storage"] and r["noop_out_err"] == 0.0, (rank, cons, r)


@pytest.mark.slow
@pytest.mark.parametrize("cons", [str(c) for c in LAYOUTS])
def test_a_conversion_is_refused_naming_the_fix_and_changes_nothing(results, cons):
    for rank, out in enumerate(results):
        r = out[cons]
        for name, msg in r["refused"].items():
            assert msg.startswith("AutoparError: "), (rank, cons, name, msg)
            assert "after autopar.compile" in msg and "autopar.export_module(model).to(...)" in msg, (name, msg)
            assert "precision='bf16-mixed'" in msg and "device_type" in msg, (name, msg)
        for name, change in (("half", "float32 to torch.float16"), ("bfloat16", "float32 to torch.bfloat16"),
                             ("double", "float32 to torch.float64"), ("to_f16", "float32 to torch.float16"),
                             ("meta", "cpu to meta"), ("pm_half", "float32 to torch.float16")):
            assert change in r["refused"][name], (rank, cons, name, r["refused"][name])
        for name, change in (("child_half", "float32 to torch.float16"), ("child_to_f16", "float32 to torch.float16"),
                             ("child_meta", "cpu to meta"), ("pm_child_half", "float32 to torch.float16")):
            assert change in r["refused"][name], (rank, cons, name, r["refused"][name])
        assert "model.0 (a Linear)" in r["refused"]["child_half"], r["refused"]["child_half"]
        assert r["after_refusals_same"] and r["after_refusals_err"] == 0.0, (rank, cons, r)
        assert r["child_noop"] and r["export_children_plain"] and r["copy_converts"], (rank, cons, r)


@pytest.mark.slow
def test_before_the_plan_the_same_rules(results):
    for rank, out in enumerate(results):
        r = out["unplanned"]
        assert r["unplanned_noop"], (rank, r)
        assert r["unplanned_half"].startswith("AutoparError: ") and "float32 to torch.float16" in r["unplanned_half"], r
        assert r["unplanned_then_runs_err"] <= TOL, (rank, r)


@pytest.mark.slow
@pytest.mark.parametrize("cons", [str(c) for c in LAYOUTS])
def test_batch_norm_statistics_outside_train_step_as_one_device(results, cons):
    for rank, out in enumerate(results):
        r = out["batch_norm"][cons]
        for label in ("eager", "compiled", "eager_again"):
            s = r[label]
            assert s["out_err"] <= TOL and s["stats_err"] <= TOL, (rank, cons, label, s)
            assert s["batches_tracked"] == s["want_tracked"], (rank, cons, label, s)
        assert r["eval_err"] <= TOL, (rank, cons, r["eval_err"])


@pytest.mark.slow
@pytest.mark.parametrize("cons,nproc", [({"pp": 2}, 2), ({"pp": 2, "dp": 2}, 4)], ids=["pp2", "pp2xdp2"])
def test_pipelined_eager_fetches_parameters_read_outside_their_module(cons, nproc):
    for rank, r in enumerate(autopar.launch(shared_reads_worker, nproc, cons, timeout_s=600)):
        assert r["stages"] == 2, (rank, r)
        assert r["before_err"] <= TOL and r["after_err"] <= TOL, (rank, r)
        assert r["most_whole"] <= r["bound"] < r["model"], (rank, r)


@pytest.mark.slow
def test_pipelined_eager_forward_holds_one_module_whole_at_a_time(results):
    for rank, out in enumerate(results):
        r = out["pp_eager"]
        assert r["stages"] == 2 and r["hooks_ran"] == 8, (rank, r)
        assert r["type"] == "Tensor" and r["err"] <= TOL, (rank, r)
        assert r["most_whole"] == r["one_module"] < r["model"], (rank, r)
        for msg in r["halves"]:
            assert msg.startswith("AutoparError: ") and "float32 to torch.float16" in msg, (rank, msg)
