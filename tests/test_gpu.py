"""The GPU suite: autopar on CUDA, checked against the plain model on the same GPU.

    python -m pytest -m gpu              # on a machine with a CUDA GPU (a few minutes on one GPU)
    python benchmarks/gpu_check.py       # runs this suite too, and prints a table

Without CUDA every test here is collected and skipped (the reason says so).

* one process on one GPU (NCCL, initialised as "cpu:gloo,cuda:nccl"): ``train_step`` with SGD and
  AdamW and the native loop's gradients against the plain model, fp32 with TF32 off, within
  1e-5 (the project's parity goal); the peak measured by CUDA's caching allocator
  (``measure_step``) within the fidelity tolerance of the plan's prediction (``fidelity_misses``:
  the peak within 15%);
* 2 processes sharing that GPU over gloo with CUDA tensors (NCCL refuses two ranks on one GPU):
  every collective kind of ``MeshComm`` called directly, and then data-parallel, ZeRO-3, tensor-
  and expert-parallel plans trained against the plain model (all-reduce, all-gather,
  reduce-scatter, all-to-all and its variable-size form, each named as run); the asynchronous
  checkpoint saved and loaded into a fresh compile; a pipeline plan, whose sends gloo cannot
  carry for CUDA tensors, refused with the error naming NCCL.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

import autopar

TOL = 1e-5
NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False here; run the GPU suite on a machine with a GPU"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


def one_gpu() -> autopar.Cluster:
    """One H100-like device (the preset's figures), world size 1."""
    return dataclasses.replace(autopar.Cluster.preset("dgx-h100"), name="one-gpu", devices_per_node=1)


def _exact_fp32() -> None:
    """fp32 matmuls in full precision (TF32 would differ from the reference by ~1e-3)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _optimizer(name: str):
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)
    return lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)


def _train_against_reference(pm, ref, make, loss_fn, batches, device) -> dict:
    """``pm.train_step`` and the plain model ``ref`` (already on ``device``) on the same batches:
    the worst relative difference of the loss per step and of every parameter and buffer after."""
    from autopar.testing.parity import relative_error

    ref_opt = make(list(ref.parameters()))
    loss_err = 0.0
    for x, t in batches:
        x, t = x.to(device), t.to(device)
        got = pm.train_step(x, target=t)
        ref_opt.zero_grad()
        want = loss_fn(ref(x), t)
        want.backward()
        ref_opt.step()
        loss_err = max(loss_err, abs(got - float(want.detach())) / abs(float(want.detach())))
    full = pm.full_state_dict()
    errs = {k: relative_error(full[k], v) for k, v in ref.state_dict().items() if k in full}
    return {"loss_err": loss_err, "param_err": max(errs.values()), "missing": sorted(set(ref.state_dict()) - set(full)),
            "worst": sorted(errs.items(), key=lambda kv: -kv[1])[:3]}


# ---------------------------------------------------------------- one process, one GPU (NCCL)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_train_step_on_one_gpu_matches_the_plain_model(world1, opt):
    import torch.distributed as dist

    from autopar.testing.parity import build_case

    _exact_fp32()
    model, batches, loss_fn = build_case("gpt")
    device = torch.device("cuda", torch.cuda.current_device())
    ref = copy.deepcopy(model).to(device)
    x0, t0 = (v.to(device) for v in batches[0])
    make = _optimizer(opt)
    pm = autopar.compile(model, one_gpu(), (x0,), example_target=t0, loss_fn=loss_fn, optimizer=make)
    assert "cuda:nccl" in str(dist.get_backend_config())  # NCCL beside gloo
    r = _train_against_reference(pm, ref, make, loss_fn, batches[:4], device)
    assert all(p.device.type == "cuda" for p in pm.parameters())
    pm.close()
    assert not r["missing"] and r["loss_err"] <= TOL and r["param_err"] <= TOL, r


def test_native_loop_gradients_on_one_gpu_match_the_plain_model(world1):
    from autopar.testing.parity import build_case, relative_error

    _exact_fp32()
    model, batches, loss_fn = build_case("gpt")
    device = torch.device("cuda", torch.cuda.current_device())
    ref = copy.deepcopy(model).to(device)
    pm = autopar.compile(model, one_gpu())
    x, t = (v.to(device) for v in batches[0])
    got_loss = loss_fn(pm(x), t)
    got_loss.backward()
    want_loss = loss_fn(ref(x), t)
    want_loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    got = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
           for n, p in pm.named_parameters() if p.grad is not None}
    assert set(got) == set(grads), (sorted(got), sorted(grads))
    errs = {n: relative_error(got[n], g) for n, g in grads.items()}
    pm.close()
    got_loss, want_loss = float(got_loss.detach()), float(want_loss.detach())
    assert abs(got_loss - want_loss) <= TOL * abs(want_loss), (got_loss, want_loss)
    assert max(errs.values()) <= TOL, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("model_name", ["gpt", "mlp"])
def test_cuda_peak_memory_measured_by_the_allocator_matches_the_plan(world1, model_name):
    """``measure_step`` on CUDA reads ``torch.cuda.max_memory_allocated`` (the caching allocator's
    peak over the step); it stays within the fidelity tolerance of the plan's prediction."""
    from autopar.testing.fidelity import MIB, fidelity_misses, fidelity_worker

    r = fidelity_worker(model_name, {}, cluster=one_gpu())
    assert r["peak"] > MIB, r["table"]  # a real device measurement, not an empty one
    assert fidelity_misses(r) == [], (fidelity_misses(r), r["table"])


# ---------------------------------------------------------------- 2 processes sharing one GPU over gloo
GLOO_PLANS = [("gpt", {"dp": 2, "zero": 0}), ("gpt", {"dp": 2, "zero": 3}), ("gpt", {"tp": 2}),
              ("moe_dropless", {"dp": 2, "ep": 2}), ("moe", {"dp": 2, "ep": 2})]


def _direct_collectives(rank: int, device) -> dict[str, str]:
    """Every ``MeshComm`` collective (and a broadcast) on CUDA tensors over the world group, each
    checked against its known result: "ok", or what went wrong."""
    import torch.distributed as dist

    from autopar.runtime.comm import MeshComm

    comm = MeshComm((dist.group.WORLD,), (2,), (rank,))
    f = dict(device=device, dtype=torch.float32)
    out: dict[str, str] = {}

    def check(kind, fn, want):
        try:
            got = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out[kind] = "ok" if torch.equal(got.cpu(), torch.tensor(want, dtype=torch.float32)) else f"got {got.tolist()}"
        except Exception as exc:  # noqa: BLE001 - reported per kind
            out[kind] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    def all_reduce(async_op=False):
        t = torch.full((4,), float(rank + 1), **f)
        w = comm.all_reduce(t, 0, async_op=async_op)
        if w is not None:
            w.wait()
        return t

    def all_gather():
        o = torch.empty(4, **f)
        comm.all_gather(o, torch.full((2,), float(rank), **f), 0)
        return o

    def reduce_scatter():
        o = torch.empty(2, **f)
        w = comm.reduce_scatter(o, torch.arange(4, **f) * (rank + 1), 0, async_op=True)
        w.wait()
        return o

    def all_to_all():
        o = torch.empty(2, **f)
        comm.all_to_all(o, torch.tensor([10.0 * rank, 10.0 * rank + 1], **f), 0)
        return o

    def all_to_all_v():  # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 1 and 1
        inp = torch.tensor([0.0, 1.0, 2.0], **f) if rank == 0 else torch.tensor([10.0, 11.0], **f)
        in_splits = [1, 2] if rank == 0 else [1, 1]
        out_splits = [1, 1] if rank == 0 else [2, 1]
        o = torch.empty(sum(out_splits), **f)
        comm.all_to_all_v(o, inp, 0, out_splits, in_splits)
        return o

    def broadcast():
        t = torch.full((3,), float(rank + 7), **f)
        dist.broadcast(t, src=0)
        return t

    check("all_reduce", all_reduce, [3.0] * 4)
    check("all_reduce (async)", lambda: all_reduce(True), [3.0] * 4)
    check("all_gather", all_gather, [0.0, 0.0, 1.0, 1.0])
    check("reduce_scatter (async)", reduce_scatter, [0.0, 3.0] if rank == 0 else [6.0, 9.0])
    check("all_to_all", all_to_all, [0.0, 10.0] if rank == 0 else [1.0, 11.0])
    check("all_to_all_v", all_to_all_v, [0.0, 10.0] if rank == 0 else [1.0, 2.0, 11.0])
    check("broadcast", broadcast, [7.0] * 3)
    return out


def gloo_cuda_worker(root: str, device_type: str = "cuda") -> dict:
    """One of 2 ranks sharing GPU 0 over gloo: direct collectives, plans against the plain model,
    the asynchronous checkpoint, and the refused pipeline. (``device_type="cpu"``: the same
    code on CPU tensors, a dry run of the harness where no GPU is at hand.)"""
    import torch.distributed as dist

    from autopar.testing.parity import build_case

    cluster = dataclasses.replace(autopar.Cluster.local(2), device_type=device_type)  # backend gloo
    device = torch.device(device_type)
    if device_type == "cuda":
        os.environ["LOCAL_RANK"] = "0"  # both ranks on the one GPU (compile sets the device from it)
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        _exact_fp32()
    out: dict = {"plans": []}
    kept = None
    make = _optimizer("sgd")
    for case, constraints in GLOO_PLANS:
        model, batches, loss_fn = build_case(case)
        ref = copy.deepcopy(model).to(device)
        x0, t0 = batches[0]
        pm = autopar.compile(model, cluster, (x0,), example_target=t0, loss_fn=loss_fn, optimizer=make,
                             constraints=autopar.Constraints(**constraints))
        r = _train_against_reference(pm, ref, make, loss_fn, batches[:3], device)
        r.update(case=case, constraints=constraints, mesh=pm.plan.mesh,
                 kinds=sorted(k for k, n in pm.comm.stats.calls.items() if n),
                 on_cuda=all(p.device.type == "cuda" for p in pm.parameters()))
        out["plans"].append(r)
        if constraints == {"dp": 2, "zero": 3}:
            kept = (pm, case, constraints, batches)
        else:
            pm.close()
    out["direct"] = _direct_collectives(dist.get_rank(), device)
    # the asynchronous checkpoint of the ZeRO-3 model: device shards staged to the host, written in
    # the background over the checkpoint's own gloo group, loaded into a fresh compile
    pm, case, constraints, batches = kept
    folder = pm.save(root, asynchronous=True)
    pm.wait_saved()
    want = (pm.full_state_dict(), pm.full_optimizer_state_dict())
    model, _, loss_fn = build_case(case)
    x0, t0 = batches[0]
    fresh = autopar.compile(model, cluster, (x0,), example_target=t0, loss_fn=loss_fn, optimizer=make,
                            constraints=autopar.Constraints(**constraints))
    fresh.load(folder)
    got = (fresh.full_state_dict(), fresh.full_optimizer_state_dict())
    out["checkpoint"] = {"tensors": len(want[0]) + len(want[1]),
                         "differ": sorted(k for i in range(2) for k, v in want[i].items()
                                          if not torch.equal(got[i][k].cpu(), v.cpu()))}
    fresh.close()
    pm.close()
    # a pipeline plan: its sends would hand CUDA memory to gloo's sockets
    model, batches, loss_fn = build_case("gpt")
    x0, t0 = batches[0]
    try:
        autopar.compile(model, cluster, (x0,), example_target=t0, loss_fn=loss_fn, optimizer=make,
                        constraints=autopar.Constraints(pp=2))
        out["pipeline"] = "not refused"
    except autopar.AutoparError as exc:
        out["pipeline"] = str(exc)
    return out


@pytest.mark.slow
def test_two_processes_sharing_the_gpu_over_gloo_with_cuda_tensors(tmp_path):
    results = autopar.launch(gloo_cuda_worker, 2, str(tmp_path), timeout_s=420)
    for rank, r in enumerate(results):
        assert r["direct"] == {k: "ok" for k in r["direct"]}, (rank, r["direct"])
        for p in r["plans"]:
            assert p["on_cuda"] and not p["missing"], (rank, p)
            assert p["loss_err"] <= TOL and p["param_err"] <= TOL, (rank, p)
        kinds = {k for p in r["plans"] for k in p["kinds"]}
        assert {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"} <= kinds, kinds
        assert r["checkpoint"]["tensors"] > 0 and r["checkpoint"]["differ"] == [], (rank, r["checkpoint"])
        assert "gloo's send and recv take CPU tensors only" in r["pipeline"] and "backend='nccl'" in r["pipeline"], \
            r["pipeline"]
