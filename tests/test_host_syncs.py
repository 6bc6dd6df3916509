"""No host syncs in a dense-model training step (issue 47): nothing in ``train_step`` or in the
torch-native loop (``loss_fn(pm(x), y).backward()``, ``opt.step()``) reads a tensor's value on
the host, so a step never waits for the device; the loss is handed back as a tensor, read when
the caller reads it.

``HostReads`` records every read of a tensor's value while a step runs: at torch's dispatcher
(``aten._local_scalar_dense``, what ``.item()``, ``float()``, ``int()`` and ``bool()`` of a tensor
end in) and at the Python API (``Tensor.item``, ``tolist``, ``numpy``, ``__bool__``,
``__float__``, ``__int__``, ``__index__``: ``tolist`` and ``numpy`` never reach the
dispatcher). On 2 gloo processes, for the example GPT and MLP under dp, tp and ZeRO-3 (and the
GPT with padded targets in 2 microbatches, whose exact token mean weighs the microbatches by
their target counts), every step of ``train_step`` (``check_inputs="never"``) and every step of
the native loop after the first ``FIRST_CHECKED_STEPS`` (which compare the ranks' batches on the
host, by design) reads nothing, and so does every step of the compiled program
(``compile="aot_eager"``, GPT under dp, tp and ZeRO-3) after the first, which compiles; the
losses then read equal single-device training within 1e-5.
SGD with momentum: torch's Adam reads its step count with ``.item()`` (a CPU tensor unless
``capturable=True``, so no device sync on a GPU, but a read this counter cannot tell apart).
"""
from __future__ import annotations

import contextlib
import copy
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from helpers import one_device_losses, sgd

TOL = 1e-5
STEPS = 4
READS = frozenset({"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__complex__"})
CASES = [
    ("gpt", {"dp": 2}),
    ("gpt", {"tp": 2}),
    ("gpt", {"dp": 2, "zero": 3}),
    ("gpt_padded", {"dp": 2, "microbatches": 2}),  # token counts weigh the microbatches (train_step only)
    ("mlp", {"dp": 2}),
    ("mlp", {"tp": 2}),
    ("mlp", {"dp": 2, "zero": 3}),
]
COMPILED = [("gpt", {"dp": 2}), ("gpt", {"tp": 2}), ("gpt", {"dp": 2, "zero": 3})]  # compile="aot_eager" too


def _site() -> str:
    """The innermost frame of autopar or of this test that led to the read."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if frame.name in ("__torch_function__", "__torch_dispatch__"):
            continue  # the counter's own frames
        if "/autopar/" in frame.filename or "/examples/" in frame.filename or frame.filename.endswith("test_host_syncs.py"):
            return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.line}"
    return "outside autopar"


class _PythonReads(TorchFunctionMode):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.log.append(f"Tensor.{name} at {_site()}")
        return func(*args, **(kwargs or {}))


class _DispatchedReads(TorchDispatchMode):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default or func is torch.ops.aten.item.default:
            self.log.append(f"{func} at {_site()}")
        return func(*args, **(kwargs or {}))


class HostReads:
    """``with HostReads() as reads: ...``: ``reads`` lists every host read of a tensor's value
    inside the block (one per layer that saw it), each with the autopar line that made it."""

    def __enter__(self) -> list:
        self.log: list[str] = []
        self._modes = [_PythonReads(self.log), _DispatchedReads(self.log)]
        for mode in self._modes:
            mode.__enter__()
        return self.log

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _case(name: str):
    """(model, batches, loss_fn), seeded alike on every rank."""
    torch.manual_seed(0)
    if name == "mlp":
        from examples.mlp import MLP, example_batch, mlp_loss

        return MLP(64, 256, 2), [example_batch(64, 16, seed=s) for s in range(STEPS)], mlp_loss
    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    cfg = GPTConfig()
    model = GPT(cfg)
    batches = [example_batch(cfg, 8, seed=s) for s in range(STEPS)]
    if name == "gpt_padded":  # ignored targets (-100): the microbatches' token counts differ
        for s, (_, tgt) in enumerate(batches):
            g = torch.Generator().manual_seed(100 + s)
            for row, length in enumerate(torch.randint(1, cfg.block_size + 1, (8,), generator=g).tolist()):
                tgt[row, length:] = -100
    return model, batches, gpt_loss




def _train_step_reads(name: str, constraints: dict, compile=False) -> dict:
    """``compile=``: the compiled program's steps; the first (which compiles) is not counted."""
    model, batches, loss_fn = _case(name)
    start = copy.deepcopy(model)
    x0, t0 = batches[0]
    pm = autopar.compile(model, autopar.Cluster.local(), (x0,), example_target=t0, loss_fn=loss_fn, optimizer=sgd,
                         constraints=autopar.Constraints(**constraints), check_inputs="never", compile=compile)
    reads, losses, kinds = [], [], []
    for step, (x, t) in enumerate(batches):
        with HostReads() if not (compile and step == 0) else contextlib.nullcontext([]) as log:
            loss = pm.train_step(x, target=t)
        if not (compile and step == 0):
            reads.append(log)
        kinds.append((type(loss).__name__, tuple(loss.shape) if isinstance(loss, torch.Tensor) else None))
        losses.append(float(loss))  # read here, after the step
    pm.close()
    return {"reads": reads, "losses": losses, "kinds": kinds, "want": one_device_losses(start, batches, loss_fn)}


def _native_loop_reads(name: str, constraints: dict) -> dict:
    from autopar.runtime.input_checks import FIRST_CHECKED_STEPS

    model, batches, loss_fn = _case(name)
    start = copy.deepcopy(model)
    pm = autopar.compile(model, autopar.Cluster.local(), (batches[0][0],), constraints=autopar.Constraints(**constraints))
    opt = sgd(pm.parameters())
    reads, losses = [], []
    for x, t in batches:
        with HostReads() as log:
            loss = loss_fn(pm(x), t)
            loss.backward()
            opt.step()
            opt.zero_grad()
        reads.append(log)
        losses.append(float(loss.detach()))
    pm.close()
    return {"reads": reads[FIRST_CHECKED_STEPS:], "losses": losses, "want": one_device_losses(start, batches, loss_fn)}


def host_reads_worker(cases: list) -> list[dict]:
    out = []
    for name, constraints in cases:
        r = {"train_step": _train_step_reads(name, constraints)}
        if name != "gpt_padded":
            r["native"] = _native_loop_reads(name, constraints)
        if (name, constraints) in COMPILED:
            r["compiled"] = _train_step_reads(name, constraints, compile="aot_eager")
        out.append(r)
    return out


@pytest.fixture(scope="module")
def results():
    return autopar.launch(host_reads_worker, 2, CASES, timeout_s=900)


def _rel(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want))


PATHS = [(i, path) for i, (name, cons) in enumerate(CASES) for path in ("train_step", "native", "compiled")
         if path == "train_step" or (path == "native" and name != "gpt_padded")  # microbatches are train_step's
         or (path == "compiled" and (name, cons) in COMPILED)]


@pytest.mark.slow
@pytest.mark.parametrize("index,path", PATHS, ids=[f"{CASES[i][0]}-{'-'.join(f'{k}{v}' for k, v in CASES[i][1].items())}-{p}"
                                                   for i, p in PATHS])
def test_no_host_reads_in_a_step(results, index, path):
    name, constraints = CASES[index]
    for rank, per_rank in enumerate(results):
        r = per_rank[index][path]
        for step, log in enumerate(r["reads"]):
            assert not log, f"{name} {constraints} {path}, rank {rank}, step {step}: {len(log)} host reads:\n" + \
                "\n".join(sorted(set(log)))
        # the losses, read after each step, are still the single-device ones (the same on every rank)
        assert _rel(r["losses"], r["want"]) <= TOL, f"{name} {constraints} {path}: {r['losses']} vs {r['want']}"
        if path != "native":  # a float32 0-dim tensor, read when the caller reads it
            assert r["kinds"] == [("Tensor", ())] * STEPS, r["kinds"]


def test_host_reads_counts_every_kind_of_read():
    """The counter sees each way of reading a value (a counter that saw nothing would pass anything)."""
    t = torch.arange(3.0)
    ways = {"item": lambda: t.sum().item(), "float": lambda: float(t.sum()), "int": lambda: int(t.argmax()),
            "bool": lambda: bool(t.sum() > 0), "if": lambda: 1 if t.sum() > 0 else 0, "tolist": lambda: t.tolist(),
            "numpy": lambda: t.numpy()}
    for way, read in ways.items():
        with HostReads() as log:
            read()
        assert log, f"{way}: not counted"
    with HostReads() as log:
        (t * 2 + 1).sum()
    assert log == []
