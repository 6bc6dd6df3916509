"""autopar.trace: graph capture on fake tensors, node metadata, clear errors."""
import inspect
import resource

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.trace import TensorMeta, trace_model

from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss


class TwoHeads(nn.Module):
    """Returns a tuple; has a buffer and a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU())
        self.cls = nn.Linear(8, 3)
        self.reg = nn.Linear(8, 2)
        self.register_buffer("scale", torch.ones(3))
        self.offset = nn.Parameter(torch.zeros(2), requires_grad=False)

    def forward(self, x):
        h = self.body(x)
        return self.cls(h) * self.scale, self.reg(h) + self.offset


def two_head_loss(out, target):
    logits, reg = out
    return F.cross_entropy(logits, target) + reg.pow(2).mean()


def test_every_node_has_shape_and_dtype_metadata():
    cfg = GPTConfig()
    idx, tgt = example_batch(cfg, 8)
    tg = trace_model(GPT(cfg), idx, loss_fn=gpt_loss, example_target=tgt)
    kinds = set()
    for n in tg.graph.nodes:
        kind = n.meta["autopar.kind"]
        kinds.add(kind)
        assert "autopar.module" in n.meta
        if kind == "output":
            continue
        outs = n.meta["autopar.outputs"]
        assert isinstance(outs, tuple) and outs, n.name
        for m in outs:
            if m is None:
                continue
            assert isinstance(m, TensorMeta)
            assert all(isinstance(s, int) for s in m.shape)
            assert isinstance(m.dtype, torch.dtype)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):  # the metadata is the traced value's shape and dtype
            assert outs[0].shape == tuple(val.shape) and outs[0].dtype == val.dtype
    assert kinds == {"param", "input", "target", "op", "output"}
    assert tg.has_loss
    # a few known values
    assert tg.node("input_0").meta["autopar.outputs"][0] == TensorMeta((8, 32), torch.int64)
    loss = next(n for n in tg.graph.nodes if n.op == "call_function" and "cross_entropy" in str(n.target))
    assert loss.meta["autopar.outputs"][0] == TensorMeta((), torch.float32)
    sdpa = [n for n in tg.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert len(sdpa) == 2
    assert sdpa[0].meta["autopar.outputs"][0].shape == (8, 4, 32, 16)
    assert sdpa[0].meta["autopar.module"] == "blocks.0.attn"
    assert sdpa[1].meta["autopar.module"] == "blocks.1.attn"
    # gradient flow: every float op downstream of a parameter needs a gradient, the integer input not
    assert loss.meta["autopar.needs_grad"]
    assert not tg.node("input_0").meta["autopar.needs_grad"]
    assert tg.num_params == sum(p.numel() for p in GPT(cfg).parameters())


def test_meta_device_model_traces_without_allocating():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with torch.device("meta"):
        model = nn.Linear(100_000, 100_000)  # 40 GB of fp32 weights if it were real
    x = torch.empty(4, 100_000, device="meta")
    tg = trace_model(model, x)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 1024 * 1024  # under 1 GiB of growth
    assert tg.num_params == 100_000 * 100_000 + 100_000
    assert tg.node("p_weight").meta["autopar.outputs"][0] == TensorMeta((100_000, 100_000), torch.float32)
    lin = next(n for n in tg.graph.nodes if n.op == "call_function")
    assert lin.meta["autopar.outputs"][0].shape == (4, 100_000)
    assert not tg.has_loss  # a [4, 100000] output is not a loss
    # the model itself was not materialised
    assert model.weight.device.type == "meta"


def test_tuple_output_with_loss_fn():
    model = TwoHeads()
    tg = trace_model(model, torch.randn(5, 4), loss_fn=two_head_loss, example_target=torch.randint(0, 3, (5,)))
    assert tg.has_loss
    out = next(n for n in tg.graph.nodes if n.op == "output")
    leaves = [a for a in torch.utils._pytree.tree_leaves(out.args) if isinstance(a, torch.fx.Node)]
    assert len(leaves) == 1
    loss = leaves[0]
    assert loss.meta["autopar.outputs"][0].shape == ()
    assert tg.target_name == "target"
    assert tg.node("target").meta["autopar.kind"] == "target"
    assert tg.node("target").meta["autopar.outputs"][0].dtype == torch.int64
    # the frozen parameter is a parameter that needs no gradient; the buffer never does
    off = next(n for n, f in tg.param_fqns.items() if f == "offset")
    assert tg.node(off).meta["autopar.kind"] == "param" and not tg.node(off).meta["autopar.needs_grad"]
    assert tg.node("b_scale").meta["autopar.kind"] == "buffer"
    assert tg.buffer_fqns == {"b_scale": "scale"}


def test_tuple_output_without_loss_is_not_a_loss():
    tg = trace_model(TwoHeads(), torch.randn(5, 4))
    assert not tg.has_loss
    out = next(n for n in tg.graph.nodes if n.op == "output")
    assert len(out.args[0]) == 2


def test_param_placeholders_map_to_state_dict_names():
    cfg = GPTConfig(n_layer=2)
    model = GPT(cfg)
    idx, tgt = example_batch(cfg, 2)
    tg = trace_model(model, idx, loss_fn=gpt_loss, example_target=tgt)
    sd = model.state_dict()
    assert sorted(tg.param_fqns.values()) == sorted(k for k, _ in model.named_parameters())
    placeholders = [n for n in tg.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        if n.meta["autopar.kind"] != "param":
            continue
        fqn = tg.param_fqns[n.name]
        assert n.meta["autopar.fqn"] == fqn
        assert fqn in sd
        assert n.meta["autopar.outputs"][0].shape == tuple(sd[fqn].shape)
        assert n.meta["autopar.module"] == fqn.rpartition(".")[0]
    assert tg.param_fqns["p_blocks_1_mlp_fc_weight"] == "blocks.1.mlp.fc.weight"
    # order: parameters, then inputs, then the target
    kinds = [n.meta["autopar.kind"] for n in placeholders]
    assert kinds == ["param"] * len(tg.param_fqns) + ["input", "target"]
    assert tg.input_names == ["input_0"]


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent branch
            return self.lin(x)
        return x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.stack = nn.Sequential(nn.Linear(4, 4), Gate())

    def forward(self, x):
        return self.stack(x)


def test_data_dependent_branch_names_submodule_and_line():
    with pytest.raises(autopar.TraceError) as info:
        trace_model(Gated(), torch.randn(2, 4))
    msg = str(info.value)
    assert "module 'stack.1' (Gate)" in msg
    assert "if x.sum() > 0:" in msg
    line = inspect.getsource(Gate.forward).splitlines()[1]
    lineno = inspect.getsourcelines(Gate.forward)[1] + 1
    assert line.strip().startswith("if x.sum() > 0:")
    assert f"test_trace.py:{lineno}" in msg
    assert "torch.where" in msg  # a suggested fix
    assert isinstance(info.value, ValueError)


def test_item_call_is_a_trace_error():
    class Reads(nn.Module):
        def forward(self, x):
            return x * float(x.mean().item())

    with pytest.raises(autopar.TraceError, match="top-level forward"):
        trace_model(Reads(), torch.randn(3))


def test_bad_arguments():
    with pytest.raises(autopar.TraceError, match="nn.Module"):
        trace_model(lambda x: x, torch.randn(2))
    with pytest.raises(autopar.TraceError, match="example_target"):
        trace_model(nn.Linear(2, 2), torch.randn(2, 2), loss_fn=F.mse_loss)
    with pytest.raises(autopar.TraceError, match="example_inputs"):
        trace_model(nn.Linear(2, 2), {"x": torch.randn(2, 2)})


def test_export_capture_matches_make_fx_and_computes_the_loss():
    """The torch.export fallback yields the same graph contract as the make_fx capture."""
    from collections import Counter

    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    idx, tgt = example_batch(cfg, 8)
    a = trace_model(model, (idx,), loss_fn=gpt_loss, example_target=tgt, capture="make_fx")
    b = trace_model(model, (idx,), loss_fn=gpt_loss, example_target=tgt, capture="export")
    ops = lambda t: Counter(str(n.target) for n in t.graph.nodes if n.op == "call_function")  # noqa: E731
    assert ops(a) == ops(b)
    assert a.param_fqns == b.param_fqns and b.input_names == ["input_0"] and b.target_name == "target"
    assert {n.meta["autopar.module"] for n in a.graph.nodes} == {n.meta["autopar.module"] for n in b.graph.nodes}
    params = dict(model.named_parameters())
    args = [params[f] for f in b.param_fqns.values()] + [idx, tgt]
    loss = b.gm(*args)
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    assert torch.allclose(loss, gpt_loss(model(idx), tgt), rtol=1e-6)
    with pytest.raises(autopar.TraceError, match="capture must be"):
        trace_model(model, (idx,), loss_fn=gpt_loss, example_target=tgt, capture="dynamo")



def test_tensor_inputs_memo_follows_rewrites_and_dies_with_its_graph():
    import gc
    import weakref

    import torch.fx as fx

    from autopar.trace import tensor_inputs

    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    x, lin, relu = [n for n in gm.graph.nodes if n.op != "output"]
    assert tensor_inputs(relu) == [lin] and tensor_inputs(relu) == [lin]  # second call: memo
    relu.args = (x,)  # a pass rewires the node: the memo must not answer for the old args
    assert tensor_inputs(relu) == [x]
    ref = weakref.ref(gm)
    del gm, x, lin, relu
    gc.collect()
    assert ref() is None  # the memo lives in node.meta and holds no graph alive


def test_in_place_ops_on_temporaries_become_out_of_place():
    """``out += identity`` and ``ReLU(inplace=True)``: rewritten where no alias can see the write;
    later readers of the mutated value read the new node; buffer updates stay in place."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.bn = nn.BatchNorm1d(8)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            out = self.bn(self.fc(x))
            out += x
            view = out[:, :4]
            y = self.relu(out)
            view.mul_(2)  # a write through a view: left as traced
            return y.sum() + view.sum()

    m = Block()
    tg = trace_model(m, torch.randn(4, 8))
    names = [str(n.target) for n in tg.graph.nodes if n.op == "call_function"]
    assert "aten.add.Tensor" in names and "aten.relu.default" not in names  # relu_ reads a viewed value
    assert "aten.mul_.Tensor" in names and "aten.relu_.default" in names
    assert any("add_" in t for t in names)  # num_batches_tracked += 1 stays in place
    x = torch.randn(4, 8)
    ref = m(x)
    params = [p for p in m.parameters()] + [b.clone() for b in m.buffers()]
    torch.testing.assert_close(tg.gm(*params, x), ref)
