"""Capture a model (plus its loss) as a torch.fx graph of aten ops, on fake tensors only.

``trace_model`` runs ``make_fx(pre_dispatch=True)`` over ``loss_fn(model(*inputs), target)`` with
every parameter, buffer and input replaced by a fake tensor of the same shape and dtype, so a
model built on the meta device (a 175B-parameter shape) is planned without allocating anything.
The pre-dispatch graph keeps high-level ops (``aten.linear``, ``aten.scaled_dot_product_attention``,
``aten.layer_norm``): fewer nodes, and at run time each op still picks its device's kernel.

Node metadata written here (the ``autopar.*`` keys, read by strategies, planner and passes):

* ``autopar.kind``: "param" | "buffer" | "input" | "target" | "op" | "output"
* ``autopar.fqn``: for params/buffers, the name in ``model.state_dict()``
* ``autopar.module``: dotted path of the innermost user module that produced the node ("" = root)
* ``autopar.outputs``: tuple of ``TensorMeta`` (one per output; ``None`` for non-tensor outputs)
* ``autopar.needs_grad``: whether a gradient flows back through the node in training
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch
import torch._dynamo.config  # noqa: F401  (see below)
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.data_dependent import DATA_DEPENDENT_KEY, dim_value, mark_data_dependent, size_hints
from autopar.errors import TraceError
from autopar.functionalize import functionalize_inplace
from autopar.grouped_mm import redirect_grouped_mm
from autopar.regions import outline_token_regions
from autopar.stamp import STAMPED_KEY, stamp_repeated_blocks
from autopar.loss_rewrite import exact_token_mean
from autopar.module_tracker import ModuleTracker, model_class_name
from autopar.trace_errors import describe_output, is_data_dependent, raise_trace_error, raise_data_dependent_size
from autopar.traced_graph import TensorMeta, TracedGraph, tensor_inputs, tensor_key

# ``torch._dynamo.config`` above: FakeTensorMode imports it on its first construction (0.5-0.7 s
# here); importing it with autopar keeps that one-time import out of the first plan's time, where
# ``benchmarks/plan_speed.py`` would count it as planning (it reports import time separately).

__all__ = ["TensorMeta", "TracedGraph", "trace_model", "tensor_inputs", "tensor_key", "ModuleTracker", "model_class_name"]


def _meta_of(value: Any, hints: dict | None = None) -> TensorMeta | None:
    """``hints``: planning estimates of data-dependent sizes (``data_dependent.size_hints``)."""
    if isinstance(value, torch.Tensor):
        if hints is not None:
            return TensorMeta(tuple(dim_value(s, hints) for s in value.shape), value.dtype)
        return TensorMeta(tuple(int(s) for s in value.shape), value.dtype)
    return None


def _fake_like(t: torch.Tensor, device: str, requires_grad: bool) -> torch.Tensor:
    out = torch.empty(tuple(t.shape), dtype=t.dtype, device=device)
    return out.requires_grad_(requires_grad) if requires_grad else out


def _sanitize(fqn: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in fqn)


class _UseExport(Exception):
    """Internal: capture="export" was asked for."""


class _TrainStep(torch.nn.Module):
    """model + loss as one module, so torch.export captures the loss too (params under model.)."""

    def __init__(self, model, loss_fn, n_in: int, finish):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.n_in = n_in
        self.finish = finish

    def forward(self, *args):
        out = self.model(*args[: self.n_in])
        return self.loss_fn(out, args[self.n_in]) if self.loss_fn is not None else self.finish(out)


def _capture_with_export(model, inputs, loss_fn, target, n_state, device_type, tracker, finish) -> fx.GraphModule:
    """The fallback capture: torch.export (non-strict; it fakes the state itself) on the model's
    device, then the graph's device arguments pointed at ``device_type``. Placeholders come out in the same order as the
    make_fx path: parameters, buffers, inputs, target."""
    state = next(iter(list(model.parameters()) + list(model.buffers())), None)
    where = state.device if state is not None else torch.device("cpu")  # the model's own device
    moved = tuple(x.to(where) if isinstance(x, torch.Tensor) else x for x in inputs)
    args = moved + ((target.to(where),) if loss_fn is not None else ())
    step = _TrainStep(model, loss_fn, len(inputs), finish)
    with tracker.active(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(step, args, strict=False)
    gm = ep.graph_module
    specs = ep.graph_signature.input_specs
    kinds = [s.kind.name for s in specs]
    if any(k not in ("PARAMETER", "BUFFER", "USER_INPUT") for k in kinds):
        raise TraceError(f"torch.export captured inputs autopar cannot map: {sorted(set(kinds))}")
    if len(specs) - kinds.count("USER_INPUT") != n_state:
        raise TraceError("torch.export lifted a different set of parameters/buffers than the model has")
    device = torch.device(device_type)
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.kwargs.get("device"), torch.device) \
                and node.kwargs["device"] != device:
            node.kwargs = {**node.kwargs, "device": device}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if isinstance(out.args[0], (tuple, list)) and len(out.args[0]) == 1 and (loss_fn is not None or finish.scalar):
        out.args = (out.args[0][0],)
    gm.recompile()
    return gm


def as_tuple(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs)
    raise TraceError(
        f"example_inputs must be a tensor or a tuple of tensors (the positional arguments of "
        f"model.forward), got {type(example_inputs).__name__}"
    )


@contextlib.contextmanager
def _no_fx_stack_traces():
    """Skip the Python stack trace fx records on every node (``torch.fx.config``, where this torch
    has the switch): nothing here reads ``node.meta["stack_trace"]`` (module paths come from
    ``nn_module_stack``, untraceable-code errors from the exception), and extracting and
    symbolising a traceback per node was about a tenth of tracing time."""
    import torch.fx.config as fx_config

    had = hasattr(fx_config, "do_not_emit_stack_traces")
    old = getattr(fx_config, "do_not_emit_stack_traces", None)
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        if had:
            fx_config.do_not_emit_stack_traces = old
        else:
            del fx_config.do_not_emit_stack_traces


def _autocast(device_type: str, dtype: torch.dtype | None):
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def trace_model(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    example_target: torch.Tensor | None = None,
    device_type: str = "cpu",
    capture: str = "auto",
    autocast_dtype: torch.dtype | None = None,
    own_loss: bool = False,
    to_user: bool = False,
    regional: bool = True,
) -> TracedGraph:
    """Trace ``loss_fn(model(*example_inputs), example_target)`` into a ``TracedGraph``.

    Inputs and parameters may live on any device, the meta device included: only their shapes
    and dtypes are used. Without ``loss_fn`` the graph returns the model output's tensor leaves
    (``TracedGraph.out_spec`` keeps its structure); with ``own_loss`` it returns the loss the
    model computes itself (``model_loss``). ``to_user``: the outputs go to the user's own loss (the
    torch-native loop), never planned as a loss, even a single scalar.

    ``autocast_dtype``: trace under ``torch.autocast(device_type, autocast_dtype)`` (mixed precision):
    the graph stays the model's (autocast is below pre-dispatch), and every value's recorded dtype
    is the one the runtime, running the program under the same autocast, produces.

    ``regional``: trace each repeated block once and stamp it for its other instances
    (``autopar.stamp``; the graph is the full trace's); False traces every instance.

    ``capture``: "make_fx" (pre-dispatch ``make_fx`` on fake tensors), "export"
    (``torch.export.export(strict=False)``), or "auto": make_fx, and when it fails for a reason
    other than data-dependent control flow (which no capture can plan), torch.export.
    """
    if capture not in ("auto", "make_fx", "export"):
        raise TraceError(f"capture must be 'auto', 'make_fx' or 'export', got {capture!r}")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inputs = as_tuple(example_inputs)
    if loss_fn is not None and example_target is None:
        raise TraceError("loss_fn was given without an example target: pass example_target=")

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    p_names, b_names = list(params), list(buffers)
    n_in = len(inputs)
    has_target = loss_fn is not None

    def fakes(mode) -> list[Any]:
        with mode:
            flat: list[Any] = [_fake_like(p, device_type, p.requires_grad) for p in params.values()]
            flat += [_fake_like(b, device_type, False) for b in buffers.values()]
            flat += [_fake_like(x, device_type, False) if isinstance(x, torch.Tensor) else x for x in inputs]
            if has_target:
                flat.append(_fake_like(example_target, device_type, False))
        return flat

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    flat = fakes(fake_mode)

    n_p, n_b = len(p_names), len(b_names)
    finish = _OwnLoss(model_class_name(model)) if own_loss else _FlatOutputs(scalar_as_is=not to_user)

    def train_fn(*args):
        state = dict(zip(p_names, args[:n_p]))
        state.update(zip(b_names, args[n_p : n_p + n_b]))
        user_in = args[n_p + n_b : n_p + n_b + n_in]
        out = torch.func.functional_call(model, state, tuple(user_in))
        if has_target:
            return loss_fn(out, args[-1])
        return finish(out)

    train_fn._orig_mod = model  # lets make_fx record nn_module_stack against this model

    def capture_make_fx(mode, flat, tracker, stamp=False):
        with mode, tracker.active(), warnings.catch_warnings(), _no_fx_stack_traces(), \
                _autocast(device_type, autocast_dtype), redirect_grouped_mm(), stamp_repeated_blocks(model, stamp) as stamps:
            warnings.simplefilter("ignore")
            gm = make_fx(train_fn, pre_dispatch=True, record_module_stack=True)(*flat)
        gm.meta[STAMPED_KEY] = stamps  # per repeated block: instances traced, stamped, why stamping stopped
        return gm

    tracker = ModuleTracker(model)
    module_prefix = ""
    sized_by_values = None  # (the static trace's error, its tracker) where sizes depend on values
    try:
        if capture == "export":
            raise _UseExport()
        gm = capture_make_fx(fake_mode, flat, tracker, stamp=regional)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - every capture failure becomes one clear error
        if not isinstance(exc, _UseExport) and is_data_dependent(exc):
            # sizes that depend on values (experts computing on their tokens): traced with unbacked
            # sizes, for the token-wise module holding them to be outlined (``autopar.data_dependent``)
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            sized_by_values, tracker = (exc, tracker), ModuleTracker(model)
            fake_mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=ShapeEnv())
            flat = fakes(fake_mode)
            try:
                gm = capture_make_fx(fake_mode, flat, tracker)
            except Exception:  # noqa: BLE001 - the static trace's error says what is wrong
                raise_trace_error(*sized_by_values)
        elif capture == "make_fx":
            raise_trace_error(exc, tracker)
        else:
            gm, static_error = None, exc
    if gm is None:
        try:
            with _autocast(device_type, autocast_dtype):
                gm = _capture_with_export(model, inputs, loss_fn, example_target, n_p + n_b, device_type, tracker, finish)
            module_prefix = "model."
        except Exception as exc2:  # noqa: BLE001
            raise_trace_error(static_error if not isinstance(static_error, _UseExport) else exc2, tracker)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat):
        raise TraceError(
            f"internal: traced graph has {len(placeholders)} placeholders for {len(flat)} inputs"
        )
    param_fqns: dict[str, str] = {}
    buffer_fqns: dict[str, str] = {}
    input_names: list[str] = []
    target_name = None
    for i, ph in enumerate(placeholders):
        if i < n_p:
            kind, fqn = "param", p_names[i]
            ph._rename("p_" + _sanitize(fqn))
            param_fqns[ph.name] = fqn
        elif i < n_p + n_b:
            kind, fqn = "buffer", b_names[i - n_p]
            ph._rename("b_" + _sanitize(fqn))
            buffer_fqns[ph.name] = fqn
        elif i < n_p + n_b + n_in:
            kind, fqn = "input", None
            ph._rename(f"input_{i - n_p - n_b}")
            input_names.append(ph.name)
        else:
            kind, fqn = "target", None
            ph._rename("target")
            target_name = ph.name
        ph.target = ph.name
        ph.meta["autopar.kind"] = kind
        ph.meta["autopar.requires_grad"] = kind == "param" and params[fqn].requires_grad
        if fqn is not None:
            ph.meta["autopar.fqn"] = fqn
        ph.meta["autopar.module"] = fqn.rpartition(".")[0] if fqn else ""

    finish.warn()
    exact_token_mean(gm)  # mean losses over non-ignored targets: sum / count, exact under any split
    functionalize_inplace(gm)  # `out += x`, ReLU(inplace=True): out-of-place where that is safe
    hints = None
    # sizes that depend on values: traced with unbacked sizes, or made by an op's own fake kernel (torch.unique)
    if mark_data_dependent(gm.graph):
        hints = size_hints(gm.graph, lambda n: _module_path(n, module_prefix))
    _annotate_nodes(gm.graph, module_prefix, hints)
    from autopar.stack_experts import stack_expert_modules  # (it reads this module's TensorMeta)

    stacked = stack_expert_modules(gm, fake_mode)  # expert lists called in a loop: one chain over stacked weights
    if stacked:
        param_fqns = {n.name: n.meta["autopar.fqn"] for n in gm.graph.nodes
                      if n.op == "placeholder" and n.meta.get("autopar.kind") == "param"}
    try:
        outline_token_regions(gm, model, tracker.call_args, tracker.calls, tracker.call_outputs)  # dropless MoE layers
    except TraceError:
        raise  # (a module it refuses, saying why)
    except Exception:  # noqa: BLE001 - with data-dependent sizes, the static trace's error says what is wrong
        if hints is None:
            raise
        _data_dependent_error(sized_by_values, gm, model)
    if hints is not None and any(n.meta.get(DATA_DEPENDENT_KEY) for n in gm.graph.nodes):
        _data_dependent_error(sized_by_values, gm, model)  # sizes that depend on values outside any token-wise module
    gm.recompile()
    output_val = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out_leaves = [x for x in pytree.tree_leaves(output_val) if isinstance(x, fx.Node)]
    is_loss = has_target or own_loss or (
        not to_user and len(out_leaves) == 1 and out_leaves[0].meta["autopar.outputs"][0] is not None
        and out_leaves[0].meta["autopar.outputs"][0].numel == 1
    )
    return TracedGraph(
        gm=gm,
        param_fqns=param_fqns,
        buffer_fqns=buffer_fqns,
        input_names=input_names,
        target_name=target_name,
        has_loss=is_loss,
        model_class=model_class_name(model),
        num_params=sum(p.numel() for p in params.values()),
        out_spec=None if (has_target or own_loss) else finish.spec,
        stacked=stacked,
    )


class _FlatOutputs:
    """The model output as the flat list of its tensor leaves (what a graph can return), keeping
    its structure in ``spec``. A non-tensor leaf (a Hugging Face KV cache object) cannot cross the
    program boundary: it becomes None, with a warning naming it."""

    scalar = False

    def __init__(self, scalar_as_is: bool):
        self.scalar_as_is = scalar_as_is
        self.spec = None
        self.dropped: list[str] = []

    def warn(self) -> None:
        if self.dropped:
            warnings.warn(f"the model returns {', '.join(self.dropped)} (not a tensor), which the compiled program cannot "
                          "return; it is returned as None (for a Hugging Face model, pass use_cache=False to its "
                          "config to skip building its KV cache)", stacklevel=3)

    def __call__(self, out):
        if self.scalar_as_is and isinstance(out, torch.Tensor) and out.numel() == 1:
            return out  # a model returning its loss, planned as one (``has_loss``)
        leaves, spec = pytree.tree_flatten(out)
        self.dropped = sorted({type(v).__name__ for v in leaves if not _passes_boundary(v)})
        if self.dropped:
            leaves = [v if _passes_boundary(v) else None for v in leaves]
            out = pytree.tree_unflatten(leaves, spec)
            leaves, spec = pytree.tree_flatten(out)
        self.spec = spec
        return [v for v in leaves]


def _passes_boundary(v) -> bool:
    return v is None or isinstance(v, (torch.Tensor, int, float, bool, str))


class _OwnLoss:
    """The loss a model computes itself: a scalar output, its ``.loss`` (Hugging Face's
    ``labels=`` convention), or the first element of a tuple output when that is a scalar."""

    scalar = True

    def __init__(self, model_class: str):
        self.model_class = model_class

    def warn(self) -> None:
        pass

    def __call__(self, out):
        loss = model_loss(out)
        if loss is None:
            raise TraceError(
                f"{self.model_class} returned {describe_output(out)}, not a loss: train_step without loss_fn needs a model "
                "that returns a scalar loss, or an output with .loss (for Hugging Face models pass labels=); otherwise "
                "pass loss_fn= (and target=) to compile")
        return loss


def model_loss(out):
    """The scalar loss in a model's output (see ``_OwnLoss``), or None."""
    def scalar(v):
        return isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point()

    if scalar(out):
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if scalar(loss):
        return loss
    if isinstance(out, (tuple, list)) and out and scalar(out[0]):
        return out[0]
    return None


def _data_dependent_error(sized_by_values, gm: fx.GraphModule, model: torch.nn.Module):
    """The static trace's error where there was one, else the op that made a value-dependent size."""
    if sized_by_values is not None:
        raise_trace_error(*sized_by_values)
    raise_data_dependent_size(gm.graph, model, DATA_DEPENDENT_KEY)


def _module_path(node: fx.Node, prefix: str = "") -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    fqn = list(stack.values())[-1][0]
    if not isinstance(fqn, str):
        return ""
    if prefix and (fqn + ".").startswith(prefix):
        fqn = fqn[len(prefix):]
    return fqn


def _annotate_nodes(graph: fx.Graph, module_prefix: str = "", hints: dict | None = None) -> None:
    needs_grad: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        if node.op == "output":
            node.meta["autopar.kind"] = "output"
            node.meta["autopar.module"] = ""
            node.meta["autopar.outputs"] = ()
            continue
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)):
            outs = tuple(_meta_of(v, hints) for v in val)
        else:
            outs = (_meta_of(val, hints),)
        node.meta["autopar.outputs"] = outs
        if node.op == "placeholder":
            ng = bool(node.meta.get("autopar.requires_grad", False))
        else:
            node.meta["autopar.kind"] = "op"
            node.meta["autopar.module"] = _module_path(node, module_prefix)
            floating = any(m is not None and m.is_floating for m in outs)
            ng = floating and any(needs_grad.get(a, False) for a in tensor_inputs(node))
        needs_grad[node] = ng
        node.meta["autopar.needs_grad"] = ng
