"""The errors ``trace_model`` raises for a model it cannot capture: the user module that was running
and the innermost line of user code, whether the failure is data-dependent control flow (which no
capture can plan), and for a mixture-of-experts layer computing each expert on its routed tokens,
the forms autopar plans instead; and the description of a model output that is not a loss.

Invariant: every capture failure becomes one ``TraceError``, raised from the original exception,
that names the module and (where there is one) the user source line.
"""
from __future__ import annotations

import linecache
import traceback
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from autopar.errors import TraceError

if TYPE_CHECKING:
    from autopar.module_tracker import ModuleTracker


def _user_frame(exc: BaseException) -> tuple[str, int, str] | None:
    """Innermost traceback frame outside torch and autopar: (file, line, source)."""
    best = None
    for frame in traceback.extract_tb(exc.__traceback__):
        f = frame.filename.replace("\\", "/")
        if "/torch/" in f or "/autopar/" in f or "/site-packages/" in f or f.startswith("<"):
            continue
        best = (frame.filename, frame.lineno or 0, (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip())
    return best


_DATA_DEPENDENT_HINTS = (
    "data-dependent",
    "DataDependent",
    "Could not guard on data-dependent",
    "aten._local_scalar_dense",
    "item()",
    "Cannot call numpy",
    "nonzero",
)


def is_data_dependent(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(h in text for h in _DATA_DEPENDENT_HINTS)


def raise_trace_error(exc: BaseException, tracker: ModuleTracker) -> None:
    path, cls = tracker.current()
    frame = _user_frame(exc)
    where = f" at {frame[0]}:{frame[1]}: `{frame[2]}`" if frame else ""
    text = f"{type(exc).__name__}: {exc}"
    module = f"module '{path}' ({cls})" if path else f"the model's top-level forward ({cls})"
    if any(h in text for h in _DATA_DEPENDENT_HINTS):
        msg = (
            f"autopar cannot trace {module}{where}: it branches on (or reads) tensor values, and a "
            "plan must hold for every input. Rewrite the branch with tensor ops (torch.where, "
            "masking, torch.cond) or move the data-dependent part out of the model."
        )
        if any(_looks_like_experts(tracker.modules[m]) for m in tracker.stack):
            msg += (" It looks like a mixture-of-experts layer computing each expert on the tokens routed to it "
                    "(sizes that depend on the routing), in a way autopar cannot follow: a Python loop or branch "
                    "over tensor values (such as the experts that were hit), or outside one module whose output is "
                    "per token. "
                    "autopar plans such loops inside a module that takes the tokens and returns one row per token "
                    "(run whole on each device's tokens), and the two forms that keep sizes known: grouped matmuls "
                    "over the tokens sorted by expert (torch.nn.functional.grouped_mm; Hugging Face models: "
                    "config._experts_implementation = 'grouped_mm'), or a fixed capacity per expert (einsums over "
                    "[experts, capacity, d]); see the README's 'Mixture of experts'.")
    else:
        msg = (
            f"autopar could not trace {module}{where}. The failure was: {text.splitlines()[0][:400]}. "
            "autopar needs a forward pass torch.fx can capture with fake tensors (no .item(), numpy "
            "or data-dependent shapes)."
        )
    raise TraceError(msg) from exc


def _looks_like_experts(module: torch.nn.Module) -> bool:
    """A weight stacked over experts (3 or more dims, its own), or a ModuleList of two or more
    modules of one class with equally shaped parameters."""
    if not isinstance(module, torch.nn.modules.conv._ConvNd) and any(p.dim() >= 3 for p in module.parameters(recurse=False)):
        return True
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) >= 2:
            shapes = {(type(m), tuple(tuple(p.shape) for p in m.parameters())) for m in child}
            if len(shapes) == 1 and next(iter(shapes))[1]:
                return True
    return False


def describe_output(out) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, dict):
        return f"{type(out).__name__} with {sorted(k for k, v in out.items() if v is not None)}"
    return type(out).__name__


# ops whose floating operands must share one dtype in eager torch ("mat1 and mat2 must have the
# same dtype"), which fake tensors do not check
_SAME_DTYPE_OPS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "einsum", "conv1d",
    "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "scaled_dot_product_attention", "_grouped_mm", "grouped_mm"})


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def refuse_mixed_dtypes(graph: fx.Graph, model: torch.nn.Module, autocast_dtype: torch.dtype | None = None) -> None:
    """An op eager torch refuses for operands of different floating dtypes (an fp64 batch into an
    fp32 model's linear) is refused here, naming the module, the op and both dtypes: fake tensors
    trace it without a word, and the program would fail (or compute in another precision) later.
    Under autocast (``autocast_dtype``) the operands autocast casts count as that dtype (float64 is
    never cast)."""
    classes = {path: _class_name(m) for path, m in model.named_modules()}

    def as_run(dtype):
        return autocast_dtype if autocast_dtype is not None and dtype != torch.float64 else dtype

    for n in graph.nodes:
        if n.op != "call_function" or _op_name(n) not in _SAME_DTYPE_OPS:
            continue
        vals = [a.meta.get("val") for a in n.all_input_nodes]
        floats = [v.dtype for v in vals if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
        if len({as_run(d) for d in floats}) < 2:
            continue
        dtypes = list(dict.fromkeys(floats))
        path = n.meta.get("autopar.module", "")
        where = f"module '{path}' ({classes.get(path, '?')})" if path else f"the model's top-level forward ({_class_name(model)})"
        inputs = [a for a in n.all_input_nodes if a.meta.get("autopar.kind") in ("input", "target")]
        params = {v.dtype for a in n.all_input_nodes if a.meta.get("autopar.kind") == "param"
                  for v in [a.meta.get("val")] if isinstance(v, torch.Tensor)}
        fix = "cast one to the other's dtype in the model"
        if inputs or params:
            want = next(iter(params)) if params else dtypes[0]
            fix = (f"cast the batch to the model's dtype before passing it (e.g. x.to({want}) for example_inputs and "
                   f"every batch), or the model to the batch's (model.to(dtype))")
        raise TraceError(
            f"{where} calls {_op_name(n)} on tensors of dtypes {', '.join(map(str, dtypes))}, which torch refuses "
            f"(its operands must share one dtype: \"mat1 and mat2 must have the same dtype\"): {fix}")


def refuse_empty_batch(inputs: tuple) -> None:
    """A batch of 0 rows (an empty last batch, a filter that kept nothing) plans nothing to train."""
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == 0:
            raise TraceError(
                f"example input {i} has 0 rows (shape {tuple(x.shape)}): an empty batch has nothing to plan or train. "
                "Plan with a batch of the size training uses (the DataLoader's batch_size; DataLoader(drop_last=True) "
                "keeps short or empty last batches out)")
        if isinstance(x, torch.Tensor):
            return  # the first tensor input sets the batch (later ones may be empty by design: a cache)


_DATA_DEPENDENT_OPS = {"_unique2": "torch.unique", "unique_dim": "torch.unique(dim=...)", "_unique": "torch.unique",
                       "unique_consecutive": "torch.unique_consecutive", "nonzero": "torch.nonzero",
                       "masked_select": "torch.masked_select (or boolean-mask indexing x[mask])",
                       "repeat_interleave": "torch.repeat_interleave with tensor repeats"}


def raise_data_dependent_size(graph: fx.Graph, model: torch.nn.Module, key: str) -> None:
    """Raise the ``TraceError`` for a value whose size depends on tensor values (``key``: the node
    mark ``data_dependent`` writes) left outside any token-wise module: naming the op that made it,
    its module, and the forms that plan."""
    classes = {path: _class_name(m) for path, m in model.named_modules()}
    n = next(n for n in graph.nodes if n.meta.get(key))
    origin = next((a for a in graph.nodes if a.meta.get(key) and a.op == "call_function"
                   and not any(b.meta.get(key) for b in a.all_input_nodes)), n)
    path = origin.meta.get("autopar.module", "")
    where = f"module '{path}' ({classes.get(path, '?')})" if path else f"the model's top-level forward ({_class_name(model)})"
    op = _op_name(origin)
    raise TraceError(
        f"autopar cannot plan {where}: it calls {_DATA_DEPENDENT_OPS.get(op, op)} (aten.{op}), whose output size "
        "depends on the tensor values, and a plan must hold for every batch. autopar plans such sizes only inside a "
        "module that takes the tokens and returns one row per token (run whole on each device's tokens; see the "
        "README's 'Mixture of experts'). Otherwise keep the size fixed (e.g. a fixed number of classes: "
        "torch.bincount(x, minlength=n) or one_hot instead of torch.unique; torch.where(mask, x, 0) instead of "
        "x[mask]), or compute the data-dependent part outside the model and pass it in as an input")


def _class_name(m: torch.nn.Module) -> str:
    """A module's class name (a module sharded in place, ``Autopar<Class>``: its own class's)."""
    return getattr(type(m), "_autopar_original_class", type(m)).__name__
