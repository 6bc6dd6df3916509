"""Pretrained weights into experts the plan stacks, and out again (issue 43 for ``autopar.stack_experts``).

``examples.moe`` with its experts as an ``nn.ModuleList`` called in a loop: the trace stacks each
weight position of the experts into one parameter ``P.*.suffix`` that ep= splits on dim 0. On 4
gloo processes under expert-parallel plans, per-expert checkpoints (safetensors, a torch file)
load row by row into the stacked shards (each rank reading only its experts' bytes), the first
step's loss is the one-device model's, ``save_weights`` writes each expert under its own key
(what the one-device model's ``load_state_dict`` reads), and the user's module sharded in place
holds every parameter in ``state_dict()`` (the stacked ones under their stacked keys).
"""
from __future__ import annotations

import os

import pytest
import torch

import autopar
from autopar.errors import WeightsError

TOL = 1e-5
LAYOUTS = [{"dp": 4, "ep": 2, "zero": 0}, {"ep": 4}]


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.05)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    from autopar.testing.parity import relative_error

    return relative_error(a, b)


def expert_worker(root: str, layouts: list[dict]) -> list[dict]:
    import torch.distributed as dist

    from autopar.testing.parity import build_case

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    ref, batches, loss_fn = build_case("moe_modules", seed=0)
    x, y = batches[0]
    sources = [os.path.join(root, "safetensors"), os.path.join(root, "model.pt")]
    out = []
    for i, cons in enumerate(layouts):
        model, _, _ = build_case("moe_modules", seed=10 + i)  # other values: the load must replace them all
        pm = autopar.compile(model, autopar.Cluster.local(4), (x,), example_target=y, loss_fn=loss_fn, optimizer=_sgd,
                             constraints=autopar.Constraints(**cons))
        stacked = dict(pm._traced.stacked)
        report = autopar.load_weights(model, sources[i % 2])  # the user's module, sharded in place
        loaded = pm.full_state_dict()
        r = {"constraints": cons, "mesh": pm.plan.mesh, "stacked": stacked,
             "load_err": max(_rel(loaded[k], v) for k, v in ref.state_dict().items()),
             "bytes_read": report.bytes_read, "slice_bytes": report.slice_bytes,
             "local_bytes": sum(t.to_local().numel() * 4 for t in dict(pm.state_dict(keep_vars=True)).values()),
             "expert_rows": {k: pm.state_dict()[k].to_local().shape[0] for k in stacked}}
        # model.state_dict() of the module sharded in place: every parameter, the stacked ones under their keys
        sd = model.state_dict()
        r["module_keys"] = sorted(sd)
        # an optimizer over model.parameters() holds every parameter the plan trains (the stacked experts too)
        r["params_missing"] = sorted(n for n, p in pm.named_parameters() if all(p is not q for q in model.parameters()))
        r["module_rows_err"] = max(_rel(sd[f].full_tensor()[e], loaded[m]) for f, ms in stacked.items()
                                   for e, m in enumerate(ms))
        # first step against one device
        want = loss_fn(ref(x), y)
        r["loss_err"] = abs(pm.train_step(x, target=y) - float(want)) / abs(float(want))
        folder, path = os.path.join(root, f"out{i}"), os.path.join(root, f"out{i}.pt")
        autopar.save_weights(model, folder)
        autopar.save_weights(pm, path, format="torch")
        full = pm.full_state_dict()
        # back to one device with the experts unstacked, and the eager forward of a batch of another shape
        plain = autopar.export_module(model)
        r["export_err"] = max(_rel(plain.state_dict()[k], v) for k, v in full.items())
        with torch.no_grad():
            got, want = torch.utils._pytree.tree_leaves(model(x[:1])), torch.utils._pytree.tree_leaves(plain(x[:1]))
            r["eager_err"] = max(_rel(a, b) for a, b in zip(got, want, strict=True))
        dist.barrier()
        if rank == 0:
            from safetensors.torch import load_file

            for name, back in (("safetensors", load_file(os.path.join(folder, "model.safetensors"))),
                               ("torch", torch.load(path, weights_only=True))):
                one, _, _ = build_case("moe_modules", seed=99)
                one.load_state_dict(back, strict=True)  # the one-device model reads it as it is
                r[f"{name}_keys"] = sorted(back) == sorted(full)
                r[f"{name}_err"] = max(float((one.state_dict()[k] - v).abs().max()) for k, v in full.items())
        out.append(r)
        pm.close()
    # keys that do not fit are named: a member missing, one too many
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    model, _, _ = build_case("moe_modules", seed=20)
    pm = autopar.compile(model, autopar.Cluster.local(4), (x,), example_target=y, loss_fn=loss_fn, optimizer=_sgd,
                         constraints=autopar.Constraints(**layouts[0]))
    errors = {}
    for name, src in (("missing", {k: v for k, v in sd.items() if k != "blocks.0.moe.experts.3.0.weight"}),
                      ("unexpected", {**sd, "blocks.0.moe.experts.4.0.weight": sd["blocks.0.moe.experts.3.0.weight"]}),
                      ("shape", {**sd, "blocks.1.moe.experts.2.2.weight": sd["blocks.1.moe.experts.2.2.weight"][:3]})):
        try:
            autopar.load_weights(pm, src)
            errors[name] = None
        except WeightsError as exc:
            errors[name] = str(exc)
    pm.close()
    out.append(errors)
    return out


@pytest.fixture(scope="module")
def expert_results(tmp_path_factory):
    from safetensors.torch import save_file

    from autopar.testing.parity import build_case

    root = tmp_path_factory.mktemp("expert-weights")
    ref, _, _ = build_case("moe_modules", seed=0)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    (root / "safetensors").mkdir()
    save_file(sd, str(root / "safetensors" / "model.safetensors"), metadata={"format": "pt"})
    torch.save(sd, root / "model.pt")
    return autopar.launch(expert_worker, 4, str(root), LAYOUTS, timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=["dp2xep2", "ep4"])
def test_stacked_experts_load_train_and_export_per_expert(expert_results, index):
    per_rank = [r[index] for r in expert_results]
    r0 = per_rank[0]
    label = f"{r0['constraints']} on {r0['mesh']}"
    stacked = r0["stacked"]
    n_experts = len(next(iter(stacked.values())))
    assert stacked and n_experts == 4, stacked
    members = {m for ms in stacked.values() for m in ms}
    for rank, r in enumerate(per_rank):
        assert r["load_err"] == 0.0, (label, rank, r["load_err"])
        assert r["loss_err"] <= TOL, (label, rank, r["loss_err"])
        # ep splits the experts: each rank holds some rows only, and reads only those bytes
        assert all(rows < n_experts for rows in r["expert_rows"].values()), (label, r["expert_rows"])
        assert r["slice_bytes"] == r["local_bytes"], (label, rank, r["slice_bytes"], r["local_bytes"])
        assert r["bytes_read"] <= 1.1 * r["slice_bytes"], (label, rank, r["bytes_read"], r["slice_bytes"])
        # model.state_dict(): nothing silently missing; the stacked DTensors hold each member's row
        assert set(stacked) <= set(r["module_keys"]) and not members & set(r["module_keys"]), (label, r["module_keys"])
        assert r["module_rows_err"] == 0.0, (label, rank, r["module_rows_err"])
        assert r["params_missing"] == [], (label, rank, r["params_missing"])
        assert r["export_err"] == 0.0, (label, rank, r["export_err"])
        assert r["eager_err"] <= TOL, (label, rank, r["eager_err"])
    for name in ("safetensors", "torch"):
        assert r0[f"{name}_keys"], (label, name)
        assert r0[f"{name}_err"] == 0.0, (label, name, r0[f"{name}_err"])


@pytest.mark.slow
def test_expert_keys_that_do_not_fit_are_named(expert_results):
    for out in expert_results:
        errors = out[-1]
        assert errors["missing"] and "missing from the source: blocks.0.moe.experts.3.0.weight" in errors["missing"]
        assert errors["unexpected"] and "unexpected in the source (not keys of the model): blocks.0.moe.experts.4.0.weight" \
            in errors["unexpected"]
        assert errors["shape"] and "blocks.1.moe.experts.2.2.weight has shape (3, 128) in the source" in errors["shape"] \
            and "row 2 of blocks.1.moe.experts.*.2.weight" in errors["shape"], errors["shape"]
