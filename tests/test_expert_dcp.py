"""A DCP checkpoint with one key per expert into the experts the plan stacks (issue 43, ``autopar.load_weights``).

``examples.moe`` with its experts as an ``nn.ModuleList`` called in a loop: the trace stacks each
weight position of the experts into one parameter ``P.*.suffix`` that ep= splits on dim 0. A DCP
checkpoint ``dcp.save`` wrote from the one-device model holds each expert under its own key
(``blocks.0.moe.experts.3.0.weight``). On 4 gloo processes under expert-parallel plans it loads into
the stacked shards, each row of a rank's shard read straight from its member's entry
(``weight_dcp.row_targets``), as safetensors and torch files already do: the loaded full state is
the one-device model's exactly, each rank reads only its experts' bytes (within 10% of its slices),
and the first step's loss is the one-device model's. A checkpoint saved in bfloat16 loads converted.
Before, such a checkpoint was refused ("a DCP checkpoint cannot fill row by row").
"""
from __future__ import annotations

import pytest
import torch

import autopar

TOL = 1e-5
LAYOUTS = [{"dp": 4, "ep": 2, "zero": 0}, {"ep": 4}]


def _case(seed: int):
    """(model, first batch, loss_fn): ``examples.moe`` in its static form, seeded."""
    from examples.moe import MoEConfig, MoEGPT, example_batch, moe_loss

    torch.manual_seed(seed)
    cfg = MoEConfig(expert_modules=True)
    return MoEGPT(cfg), example_batch(cfg, 8, seed=0), moe_loss


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.05)


def dcp_worker(folders: dict[str, str], layouts: list[dict]) -> list[dict]:
    ref, (x, y), loss_fn = _case(0)
    want_loss = float(loss_fn(ref(x), y))
    bf16 = {k: v.to(torch.bfloat16).float() if v.is_floating_point() else v for k, v in ref.state_dict().items()}
    out = []
    for i, cons in enumerate(layouts):
        r = {"constraints": cons}
        for name, folder in folders.items():
            model, _, _ = _case(10 + i)  # other values: the load must replace every one
            pm = autopar.compile(model, autopar.Cluster.local(4), (x,), example_target=y, loss_fn=loss_fn,
                                 optimizer=_sgd, constraints=autopar.Constraints(**cons))
            stacked = dict(pm._traced.stacked)
            try:
                report = autopar.load_weights(model, folder)  # the user's module, sharded in place
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                r[name] = {"error": f"{type(exc).__name__}: {exc}"}
                pm.close()
                continue
            loaded = pm.full_state_dict()
            want = bf16 if name == "bf16" else ref.state_dict()
            r[name] = {
                "stacked": stacked, "source": report.source,
                "rows": {k: pm.state_dict()[k].to_local().shape[0] for k in stacked},
                "load_err": max(float((loaded[k] - v).abs().max()) for k, v in want.items()),
                "keys": sorted(loaded) == sorted(want),
                "stacked_loaded": set(stacked) <= set(report.loaded),
                "converted": len(report.converted),
                "bytes_read": report.bytes_read, **_chunk_bytes(pm, stacked, folder),
                "loss_err": abs(pm.train_step(x, target=y) - want_loss) / abs(want_loss) if name == "fp32" else 0.0,
            }
            pm.close()
        out.append(r)
    return out


def _chunk_bytes(pm, stacked: dict, folder: str) -> dict:
    """The stored bytes DCP must read on this rank from a checkpoint one device saved (each tensor
    one stored chunk, read whole where it overlaps a slice: ``weight_dcp``): every tensor this rank
    holds a part of, except the stacked experts: only the members of the rows it holds; and the
    checkpoint's total."""
    from torch.distributed.checkpoint import FileSystemReader

    length = {i.fqn: info.length for i, info in FileSystemReader(folder).read_metadata().storage_data.items()}
    keys, seen = [], set()
    for k, t in pm.state_dict(keep_vars=True).items():
        local = t.to_local()
        if id(t) in seen or local.numel() == 0:
            continue
        seen.add(id(t))
        if k in stacked:
            (chunk,) = t.__create_chunk_list__()
            keys += stacked[k][chunk.offsets[0]: chunk.offsets[0] + chunk.sizes[0]]
        else:
            keys.append(k)
    return {"chunk_bytes": sum(length[k] for k in keys), "total_bytes": sum(length.values())}


@pytest.fixture(scope="module")
def dcp_results(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("expert-dcp")
    ref, _, _ = _case(0)
    folders = {"fp32": str(root / "fp32"), "bf16": str(root / "bf16")}
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    dcp.save(sd, checkpoint_id=folders["fp32"], no_dist=True)  # the one-device model's keys: one per expert
    dcp.save({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()},
             checkpoint_id=folders["bf16"], no_dist=True)
    return autopar.launch(dcp_worker, 4, folders, LAYOUTS, timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=["dp4xep2", "ep4"])
@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_per_expert_dcp_checkpoint_loads_into_stacked_experts(dcp_results, index, name):
    for rank, out in enumerate(dcp_results):
        r = out[index][name]
        label = (out[index]["constraints"], name, rank)
        assert "error" not in r, (label, r.get("error"))
        n_experts = len(next(iter(r["stacked"].values())))
        assert r["stacked"] and n_experts == 4, (label, r["stacked"])
        assert all(rows < n_experts for rows in r["rows"].values()), (label, r["rows"])  # ep splits the experts
        assert r["source"] == "dcp" and r["keys"], label
        assert r["load_err"] == 0.0, (label, r["load_err"])
        assert r["stacked_loaded"], label
        assert (r["converted"] > 0) == (name == "bf16"), (label, r["converted"])
        # each rank reads its experts' members only (plus DCP's whole chunks of the other tensors it holds part of)
        assert r["chunk_bytes"] < 0.8 * r["total_bytes"], (label, r["chunk_bytes"], r["total_bytes"])
        assert r["bytes_read"] == r["chunk_bytes"], (label, r["bytes_read"], r["chunk_bytes"])
        assert r["loss_err"] <= TOL, (label, r["loss_err"])
