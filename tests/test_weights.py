"""Pretrained weights into the plan's shards and trained weights out (issue 43, items 3 and 4).

A tiny Hugging Face Llama saved by ``save_pretrained`` (sharded, with an index) is loaded by
``autopar.load_weights`` under dp=2 x tp=2 and pp=2 x dp=2 on 4 gloo processes: each rank reads
at most its slices' bytes plus 10%, the first step's loss is the one-device ``from_pretrained``
model's, and after 3 steps ``autopar.save_weights`` writes a folder whose ``from_pretrained`` model
gives the parallel model's logits (and weights); ``model.state_dict()`` after training (under pp:
each stage's, their union) equals the export and ``model.generate`` runs. A small MLP with buffers on 2 processes loads a
torch state dict (in memory, a file, bf16), a DCP folder and refuses what does not fit.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.errors import WeightsError

TOL = 1e-5
VOCAB = 128


def _config(tied: bool = False):
    import transformers

    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    use_cache=False, tie_word_embeddings=tied)


def _llama(tied: bool = False, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config(tied)).eval()  # eval: no dropout (there is none at 0.0 anyway)


def _lm_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (8, 16), generator=g), torch.randint(0, VOCAB, (8, 16), generator=g))
            for _ in range(3)]


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.05)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    from autopar.testing.parity import relative_error

    return relative_error(a, b)


def _unique_local_bytes(pm, itemsize: int = 4) -> int:
    """This rank's shards' bytes (each tied tensor once), counted from the DTensors themselves."""
    seen, total = set(), 0
    for t in pm.state_dict(keep_vars=True).values():
        if id(t) not in seen:
            seen.add(id(t))
            total += t.to_local().numel() * itemsize
    return total


def _hf_reader_bytes(pm, folder: str) -> int:
    """The tensor bytes torch's ``HuggingFaceStorageReader`` reads loading ``folder`` into ``pm``'s
    DTensors (what weights.py compares its direct slicing with)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class Counting(HuggingFaceStorageReader):
        read = 0

        def read_data(self, plan, planner):
            for item in plan.items:
                n = 1
                for length in item.lengths:
                    n *= length
                self.read += n * torch.empty((), dtype=self.storage_data[item.storage_index].dtype).element_size()
            return super().read_data(plan, planner)

    reader = Counting(folder)
    dcp.load(pm.state_dict(), storage_reader=reader)
    return reader.read


def hf_worker(pretrained: str, tied_pretrained: str, out_root: str, layouts: list[dict]) -> list[dict]:
    """Each layout: load ``pretrained`` into the user's differently initialised Llama (sharded in
    place), first-step loss against the one-device ``from_pretrained`` model, 3 SGD steps, export;
    on every rank the exported folder's model against the parallel model's logits (``pm(x)``; under
    pp ``model(x)``, see below), against a one-device model trained alike, against
    ``model.state_dict()`` and ``model.generate``. Then tied weights in and out, and an untied model
    refusing the tied checkpoint (no ``lm_head.weight``)."""
    import torch.distributed as dist
    import transformers

    rank = int(os.environ["RANK"])  # autopar.launch sets it; compile makes the process group
    batches = _batches()
    x, t = batches[0]
    results = []
    for i, cons in enumerate(layouts):
        model = _llama(seed=100 + i)
        pm = autopar.compile(model, autopar.Cluster.local(4), (x,), example_target=t, loss_fn=_lm_loss,
                             optimizer=_sgd, constraints=autopar.Constraints(**cons))
        # the user's module, sharded in place, is what the weights go into (``runtime.in_place``)
        report = autopar.load_weights(model, pretrained)
        hf_reader_bytes = None if cons.get("pp") else _hf_reader_bytes(pm, pretrained)
        ref = transformers.LlamaForCausalLM.from_pretrained(pretrained)
        ref_opt = _sgd(ref.parameters())
        losses = []
        for xb, tb in batches:
            got = pm.train_step(xb, target=tb)
            want = _lm_loss(ref(xb), tb)
            ref_opt.zero_grad()
            want.backward()
            ref_opt.step()
            losses.append(abs(got - float(want)) / abs(float(want)))
        folder = os.path.join(out_root, f"layout{i}")
        autopar.save_weights(pm, folder, max_shard_size="100KB" if cons.get("pp") else "5GB")  # pp: sharded
        full = pm.full_state_dict()
        with torch.no_grad():
            # the parallel model's logits: the compiled forward (pm(x)); a pipeline plan's program is its
            # training step, so model(x) runs the model's own forward, each module's weights fetched
            # whole from the stage holding them (``in_place._eager``), on every rank
            pm_logits = (model(x) if cons.get("pp") else pm(x)).logits.detach().clone()
            # the model's own methods after training: generate() runs its forward on new shapes
            generated = model.generate(x[:1, :4], max_new_tokens=3, do_sample=False)
        # this rank's state_dict (under pp: its stage's DTensors); the union over ranks is the model
        module_state = {k: v.full_tensor() for k, v in model.state_dict().items()}
        r = {"constraints": cons, "mesh": pm.plan.mesh, "loss_errs": losses, "bytes_read": report.bytes_read,
             "slice_bytes": report.slice_bytes, "local_bytes": _unique_local_bytes(pm), "loaded": len(report.loaded),
             "hf_reader_bytes": hf_reader_bytes}
        dist.barrier()
        exported = transformers.LlamaForCausalLM.from_pretrained(folder)  # on every rank
        with torch.no_grad():
            logits = exported(x).logits
            r["ref_logits_err"] = _rel(logits, ref(x).logits)
            r["pm_logits_err"] = _rel(logits, pm_logits)
        r["state_errs"] = max(_rel(exported.state_dict()[k], v) for k, v in full.items())
        # model.state_dict() after training is what was exported
        r["module_keys"] = sorted(module_state)
        r["exported_keys"] = sorted(exported.state_dict())
        r["module_state_errs"] = max(_rel(exported.state_dict()[k], v) for k, v in module_state.items())
        r["generate_same"] = torch.equal(generated, exported.generate(x[:1, :4], max_new_tokens=3, do_sample=False))
        if rank == 0:
            r["files"] = sorted(os.listdir(folder))
        results.append(r)
        pm.close()
    # tied embeddings: the checkpoint omits lm_head.weight; loaded, exported once, read back tied
    cons = layouts[0]
    pm = autopar.compile(_llama(tied=True, seed=7), autopar.Cluster.local(4), (x,), example_target=t, loss_fn=_lm_loss,
                         optimizer=_sgd, constraints=autopar.Constraints(**cons))
    report = autopar.load_weights(pm, tied_pretrained)
    ref = transformers.LlamaForCausalLM.from_pretrained(tied_pretrained)
    tied = {"tied": report.tied, "loss_err": abs(pm.eval_step(x, target=t) - float(_lm_loss(ref(x), t))) / float(_lm_loss(ref(x), t))}
    folder = os.path.join(out_root, "tied")
    autopar.save_weights(pm, folder)
    dist.barrier()
    if rank == 0:
        from safetensors import safe_open

        with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
            tied["written"] = sorted(f.keys())
        back = transformers.LlamaForCausalLM.from_pretrained(folder)
        tied["back_err"] = _rel(back(x).logits, ref(x).logits)
    pm.close()
    pm = autopar.compile(_llama(seed=8), autopar.Cluster.local(4), (x,), example_target=t, loss_fn=_lm_loss,
                         optimizer=_sgd, constraints=autopar.Constraints(**cons))
    try:
        autopar.load_weights(pm, tied_pretrained)
        tied["untied_error"] = None
    except WeightsError as exc:
        tied["untied_error"] = str(exc)
    pm.close()
    results.append(tied)
    return results


LAYOUTS = [{"dp": 2, "tp": 2}, {"pp": 2, "dp": 2}]


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    pretrained, tied = root / "pretrained", root / "pretrained-tied"
    # sharded: several model-0000i-of-0000n.safetensors files and model.safetensors.index.json
    _llama(seed=3).save_pretrained(pretrained, max_shard_size="40KB")
    _llama(tied=True, seed=4).save_pretrained(tied)
    assert (pretrained / "model.safetensors.index.json").is_file()
    return autopar.launch(hf_worker, 4, str(pretrained), str(tied), str(root / "out"), LAYOUTS, timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=["dp2xtp2", "pp2xdp2"])
def test_hf_llama_loads_trains_and_exports(hf_results, index):
    per_rank = [r[index] for r in hf_results]
    r0 = per_rank[0]
    label = f"{r0['constraints']} on {r0['mesh']}"
    assert max(r0["loss_errs"]) <= TOL, f"{label}: loss vs from_pretrained {r0['loss_errs']}"
    for rank, r in enumerate(per_rank):
        # each rank reads at most its slices' bytes plus 10%, counted by the reader and by the DTensors
        assert r["slice_bytes"] == r["local_bytes"], (label, rank, r["slice_bytes"], r["local_bytes"])
        assert r["bytes_read"] <= 1.1 * r["slice_bytes"], (label, rank, r["bytes_read"], r["slice_bytes"])
        # torch's HuggingFaceStorageReader reads the same bytes (the claim in weights.py's docstring)
        assert r["hf_reader_bytes"] in (None, r["bytes_read"]), (label, rank, r["hf_reader_bytes"], r["bytes_read"])
    full = 4 * sum(p.numel() for p in _llama().parameters())
    assert min(r["slice_bytes"] for r in per_rank) < full, f"{label}: no rank reads less than the whole model"
    for rank, r in enumerate(per_rank):
        assert r["ref_logits_err"] <= TOL and r["state_errs"] <= TOL, (label, rank, r["ref_logits_err"], r["state_errs"])
        # from_pretrained on the exported folder gives the parallel model's logits (on every rank)
        assert r["pm_logits_err"] <= TOL, (label, rank, r["pm_logits_err"])
        # the user's module holds the trained shards and its generate() runs after training
        assert r["module_state_errs"] <= TOL, (label, rank, r["module_state_errs"])
        assert r["generate_same"], f"{label}: rank {rank}'s model.generate differs from the exported model's"
    # model.state_dict(): the whole model on each rank (dp x tp), this stage's part under pp (the union is whole)
    keys = [set(r["module_keys"]) for r in per_rank]
    assert set().union(*keys) == set(r0["exported_keys"]), (label, set(r0["exported_keys"]) - set().union(*keys))
    assert all(k == set(r0["exported_keys"]) for k in keys) == (not r0["constraints"].get("pp")), (label, keys)
    sharded = bool(r0["constraints"].get("pp"))
    assert "config.json" in r0["files"] and ("model.safetensors.index.json" in r0["files"]) == sharded, r0["files"]


@pytest.mark.slow
def test_tied_weights_load_once_and_export_once(hf_results):
    tied = hf_results[0][-1]
    assert tied["tied"] == ("lm_head.weight",)
    assert tied["loss_err"] <= TOL and tied["back_err"] <= TOL
    assert "lm_head.weight" not in tied["written"] and "model.embed_tokens.weight" in tied["written"]
    for r in hf_results:
        assert r[-1]["untied_error"] and "missing from the source: lm_head.weight" in r[-1]["untied_error"]
        assert "tie_word_embeddings=True" in r[-1]["untied_error"]


# ----------------------------------------------------------------------------- a torch MLP on 2 processes


class BufferedMLP(torch.nn.Module):
    """Linear layers, a LayerNorm, a persistent buffer (in checkpoints) and a non-persistent one (not)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.register_buffer("shift", torch.zeros(16))
        self.register_buffer("scale", torch.full((16,), 0.5), persistent=False)

    def forward(self, x):
        return self.norm(x + self.down(F.gelu(self.up(x))) + self.shift) * self.scale


def _mlp_source(seed: int = 5) -> BufferedMLP:
    torch.manual_seed(seed)
    model = BufferedMLP()
    model.shift.normal_()
    return model


def _mlp_batch():
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


MLP_LAYOUTS = [{"dp": 2, "zero": 3}, {"tp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 2}]


def mlp_worker(root: str, layouts: list[dict]) -> dict:
    """Per layout: each source (a dict of full tensors, a torch.save'd file, the same in bf16, a DCP
    folder one device saved) loaded into a differently initialised model, its full state compared;
    the first step's loss against one device; a torch-format export read back. Then the refusals."""
    import torch.distributed as dist

    source = _mlp_source()
    x, t = _mlp_batch()
    sd = source.state_dict()
    bf16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    sources = {"dict": sd, "file": os.path.join(root, "mlp.pt"), "bf16": bf16, "dcp": os.path.join(root, "dcp")}
    out = {"layouts": []}
    for i, cons in enumerate(layouts):
        torch.manual_seed(50 + i)
        pm = autopar.compile(BufferedMLP(), autopar.Cluster.local(2), (x,), example_target=t, loss_fn=F.mse_loss,
                             optimizer=_sgd, constraints=autopar.Constraints(**cons))
        r = {"constraints": cons, "mesh": pm.plan.mesh, "errs": {}, "reads": {}}
        for name, src in sources.items():
            with torch.no_grad():
                for p in pm.parameters():
                    p.to_local().zero_()  # nothing left of the previous source
            report = autopar.load_weights(pm, src)
            full = pm.full_state_dict()
            want = {k: v.float() for k, v in (bf16 if name == "bf16" else sd).items()}
            r["errs"][name] = max(float((full[k] - want[k]).abs().max()) for k in want)
            r["reads"][name] = (report.bytes_read, report.slice_bytes, report.source, dict(report.converted))
        ref = copy.deepcopy(source)
        r["loss_err"] = abs(pm.train_step(x, target=t) - float(F.mse_loss(ref(x), t))) / float(F.mse_loss(ref(x), t))
        path = os.path.join(root, f"export{i}.pt")
        autopar.save_weights(pm, path, format="torch")
        half = os.path.join(root, f"export{i}-bf16")
        autopar.save_weights(pm, half, dtype=torch.bfloat16)  # safetensors of a plain module: no config.json
        full = pm.full_state_dict()
        dist.barrier()
        if dist.get_rank() == 0:
            from safetensors.torch import load_file

            back = torch.load(path, weights_only=True)
            r["export_keys"] = list(back) == list(full)
            r["export_err"] = max(float((back[k] - v).abs().max()) for k, v in full.items())
            back = load_file(os.path.join(half, "model.safetensors"))
            r["bf16_files"] = sorted(os.listdir(half))
            r["bf16_err"] = max(float((back[k].float() - v.to(torch.bfloat16).float()).abs().max()) for k, v in full.items())
            r["bf16_dtypes"] = {str(v.dtype) for v in back.values()}
        out["layouts"].append(r)
        pm.close()
    torch.manual_seed(9)
    pm = autopar.compile(BufferedMLP(), autopar.Cluster.local(2), (x,), example_target=t, loss_fn=F.mse_loss,
                         optimizer=_sgd, constraints=autopar.Constraints(**layouts[0]))
    bad = {
        "missing": {k: v for k, v in sd.items() if k != "up.weight"},
        "unexpected": {**sd, "extra.weight": torch.zeros(3)},
        "shape": {**sd, "up.weight": sd["up.weight"].t().contiguous()},
        "folder": os.path.join(root, "empty"),
    }
    out["errors"] = {}
    for name, src in bad.items():
        try:
            autopar.load_weights(pm, src)
            out["errors"][name] = None
        except WeightsError as exc:
            out["errors"][name] = str(exc)
    try:  # rank 0 cannot make the folder (a file is in the way): every rank raises, none waits
        autopar.save_weights(pm, os.path.join(root, "mlp.pt", "out"))
        out["errors"]["save"] = None
    except WeightsError as exc:
        out["errors"]["save"] = str(exc)
    report = autopar.load_weights(pm, {**bad["missing"], "extra.weight": torch.zeros(3)}, strict=False)
    full = pm.full_state_dict()
    out["lenient"] = {"missing": report.missing, "unexpected": report.unexpected,
                      "others_loaded": all(torch.equal(full[k], v) for k, v in bad["missing"].items())}
    pm.close()
    with torch.device("meta"):  # built on meta, init="skip": the non-persistent ``scale`` is in no checkpoint and
        # no init writes it (BufferedMLP computes it in __init__ only; init="skip" runs the Linears' reset_parameters)
        meta_model = BufferedMLP()
    pm = autopar.compile(meta_model, autopar.Cluster.local(2), (x,), example_target=t, loss_fn=F.mse_loss,
                         optimizer=_sgd, constraints=autopar.Constraints(**layouts[0]), init="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autopar.load_weights(pm, sd)
    out["never_loaded"] = [str(w.message) for w in caught if type(w.message).__name__ == "UninitialisedBufferWarning"]
    pm.close()
    from autopar.testing.parity import build_case

    model, batches, loss_fn = build_case("moe_modules")  # experts in a ModuleList: the trace stacks them
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    pm = autopar.compile(model, autopar.Cluster.local(2), (batches[0][0],), example_target=batches[0][1], loss_fn=loss_fn,
                         optimizer=_sgd, constraints=autopar.Constraints(dp=2))
    autopar.load_weights(pm, sd)  # per-expert keys into the stacked experts (tests/test_expert_weights.py: ep)
    full = pm.full_state_dict()
    out["stacked_err"] = max(float((full[k] - v).abs().max()) for k, v in sd.items())
    pm.close()
    return out


@pytest.fixture(scope="module")
def mlp_results(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("mlp-weights")
    sd = _mlp_source().state_dict()
    torch.save(sd, root / "mlp.pt")
    dcp.save(sd, checkpoint_id=str(root / "dcp"), no_dist=True)
    (root / "empty").mkdir()
    return autopar.launch(mlp_worker, 2, str(root), MLP_LAYOUTS, timeout_s=600)


@pytest.mark.slow
def test_torch_state_dicts_and_dcp_load_into_every_layout(mlp_results):
    for rank, out in enumerate(mlp_results):
        for r in out["layouts"]:
            label = f"rank {rank} {r['constraints']} on {r['mesh']}"
            assert all(e == 0.0 for e in r["errs"].values()), (label, r["errs"])  # bf16 -> fp32 is exact
            for name in ("dict", "file", "bf16"):
                read, slices, kind, _ = r["reads"][name]
                assert kind == "torch" and read <= 1.1 * slices, (label, name, r["reads"][name])
            assert r["reads"]["bf16"][3]["up.weight"] == ("torch.bfloat16", "torch.float32")
            assert r["reads"]["dcp"][2] == "dcp"
            assert r["loss_err"] <= TOL, (label, r["loss_err"])
            if rank == 0:
                assert r["export_keys"] and r["export_err"] == 0.0, (label, r.get("export_err"))
                assert r["bf16_files"] == ["model.safetensors"] and r["bf16_dtypes"] == {"torch.bfloat16"}, label
                assert r["bf16_err"] == 0.0, (label, r["bf16_err"])


@pytest.mark.slow
def test_weights_that_do_not_fit_are_named(mlp_results):
    for out in mlp_results:
        errors = out["errors"]
        for name, pattern in [("missing", r"missing from the source: up\.weight"),
                              ("unexpected", r"unexpected in the source \(not keys of the model\): extra\.weight"),
                              ("shape", r"up\.weight has shape \(16, 64\) in the source, \(64, 16\) in the model"),
                              ("folder", r"holds no weights: expected model\.safetensors"),
                              ("save", r"save_weights: .*mlp\.pt/out: preparing the files: NotADirectoryError")]:
            with pytest.raises(WeightsError, match=pattern):
                if errors[name] is not None:
                    raise WeightsError(errors[name])
        assert "strict=False" in errors["missing"] and "strict=False" not in errors["shape"]
        # init="skip" on a meta model: its non-persistent buffer is in no checkpoint and its init does not write it,
        # so load_weights says so
        assert len(out["never_loaded"]) == 1 and "left scale (a non-persistent buffer) uninitialised" in out["never_loaded"][0]
        assert out["stacked_err"] == 0.0, out["stacked_err"]
        assert out["lenient"] == {"missing": ("up.weight",), "unexpected": ("extra.weight",), "others_loaded": True}


# ----------------------------------------------------------------------------- the file formats, one process


def test_streamed_files_read_back_as_safetensors_and_torch_write_them(tmp_path):
    from safetensors.torch import load_file

    from autopar.runtime.weight_files import (Entry, SafetensorsWriter, TorchFileWriter, WeightFiles, parse_size,
                                              shard_files)

    tensors = {"a.weight": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(4).to(torch.bfloat16), "s": torch.tensor(2.5)}
    entries = [(k, Entry(tuple(v.shape), v.dtype)) for k, v in tensors.items()]
    w = SafetensorsWriter(tmp_path / "x.safetensors", entries)
    for k, v in tensors.items():
        w.write(k, v)
    w.close()
    back = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    files = WeightFiles(tmp_path / "x.safetensors")  # a rank's slices, and only their bytes counted
    assert torch.equal(files.read("a.weight", (slice(1, 3), slice(2, 5))), tensors["a.weight"][1:3, 2:5])
    assert torch.equal(files.read("c", (slice(2, 4),)), tensors["c"][2:4]) and files.bytes_read == 6 * 4 + 2 * 2
    # the torch file: every key in state_dict order, a tied key sharing its tensor's storage
    t = TorchFileWriter(tmp_path / "x.pt", entries + [("tied", entries[0][1])], {"tied": "a.weight"})
    for k, v in tensors.items():
        t.write(k, v)
    t.close()
    back = torch.load(tmp_path / "x.pt", weights_only=True)
    assert list(back) == [*tensors, "tied"] and all(torch.equal(back[k], v) for k, v in tensors.items())
    assert back["tied"].data_ptr() == back["a.weight"].data_ptr()
    # transformers' names and greedy packing; its size spellings
    assert list(shard_files(entries, 10**6, "model", "safetensors")) == ["model.safetensors"]
    files = shard_files(entries, 70, "model", "safetensors")  # 60, 56 + 8 + 4 bytes
    assert files == {"model-00001-of-00002.safetensors": ["a.weight"],
                     "model-00002-of-00002.safetensors": ["b", "c", "s"]}
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(123) == 123
    with pytest.raises(WeightsError, match=r"max_shard_size='lots': give bytes as an int > 0 or a size such as '5GB'"):
        parse_size("lots")
