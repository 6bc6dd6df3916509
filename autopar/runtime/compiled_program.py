"""The per-rank program under ``torch.compile`` (``autopar.compile(..., compile=True)``).

``traceable(program, comm)`` is a copy of a per-rank program whose calls of the eager runtime
(``reshard``, ``reshard_start``/``reshard_finish``, ``gather_param_start``/``gather_param_finish``)
are the IR's registered ops (``autopar.ir_ops``, implemented in ``runtime.compiled_ops``) with
the mesh's sizes and this rank's coordinates as constants: dynamo traces it as one graph (no
Python function of the runtime is left to break on), AOTAutograd derives the backward from the
ops' autograd formulas (the conjugate reshard, the gradient reduce-scatter of a gathered
parameter), and the backend ("inductor", or "aot_eager" to skip code generation) compiles both.

What differs from the eager program, by design of this first path:
* every op runs its collectives synchronously inside the graph (the eager program starts
  parameter gathers and batch-only collectives early and reduces ZeRO-3 gradients
  asynchronously); gradient bucketing (``GradSync``) stays outside the graph, as compiled DDP's;
* gathered parameters are not gathered again in backward (no ``param_regather`` hooks):
  AOTAutograd keeps what its partitioner saves, so a ZeRO-3 step holds gathered weights longer.
A batch norm over a split batch runs ``traced_batch_norm`` (its statistics through
``autopar::all_reduce``). A pipeline stage's program is compiled as a program of its own (the
schedule's sends and receives stay outside). A program calling another runtime function
(dropless expert dispatch, context-parallel attention) is refused with an ``AutoparError`` naming it.

``CompiledPrograms`` holds one compiled callable per program a ``ParallelModel`` runs (built on
first use, kept while the model lives).
"""
from __future__ import annotations

import importlib
import operator

import torch
import torch.fx as fx

from autopar.errors import AutoparError
from autopar.ir import gather_param_finish, gather_param_start, reshard, reshard_finish, reshard_start, sharded_batch_norm
from autopar.ir_ops import ALL_REDUCE, GATHER_PARAM, RESHARD
from autopar.layouts import R, format_layout
from autopar.runtime.comm import MeshComm

importlib.import_module("autopar.runtime.compiled_ops")  # registers the ops' implementations (no name used)

__all__ = ["BACKENDS", "check_compile_arg", "traceable", "gathered_view", "traced_batch_norm", "CompiledPrograms"]

BACKENDS = ("inductor", "aot_eager", "eager")


def check_compile_arg(value) -> str | None:
    """The backend ``compile=`` asks for (True: "inductor"), None for eager; bad values refused."""
    if value is False or value is None:
        return None
    if value is True:
        return "inductor"
    if isinstance(value, str) and value in BACKENDS:
        return value
    raise AutoparError(f"compile= takes True (torch.compile with Inductor), False (eager, the default) or a backend name "
                       f"{BACKENDS}, got {value!r}")


def gathered_view(buf: torch.Tensor, dim: int, size: int | None) -> torch.Tensor:
    """The gathered parameter in a gather's padded buffer (``prefetch.gather_param_finish``'s view)."""
    return (buf[:size] if size is not None else buf).movedim(0, dim)


def traced_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled=True, *,
                      sync_axes=(), channel_layout=None, sizes=(), coords=()):
    """``runtime.batch_norm.sharded_batch_norm`` as ops dynamo traces: the per-channel sums are
    ``autopar::all_reduce``d over ``sync_axes`` (the same two passes: mean, then the centred
    variance, in fp32) and autograd derives the backward (the op's gradient is the all-reduce of
    the sums' gradients, SyncBatchNorm's two per-channel sums); the weight and bias gradients stay
    this shard's partial sums, as the eager op's. The running statistics are updated in place."""
    if not training:
        return torch.ops.aten.batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps,
                                         cudnn_enabled)
    dims, shape = [0] + list(range(2, x.dim())), [1, -1] + [1] * (x.dim() - 2)
    count = x.numel() // max(x.shape[1], 1)
    for a in sync_axes:
        count *= sizes[a]

    def total(t):
        return ALL_REDUCE(t, list(sync_axes), sizes, coords, "a batch norm's statistics") if sync_axes else t

    mean = total(x.sum(dims, dtype=torch.float32)) / count
    centred = x.float() - mean.view(shape)
    var = total((centred * centred).sum(dims)) / count
    y = centred * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            m, v = mean.detach(), var.detach() * (count / max(count - 1, 1))
            if channel_layout is not None:  # every rank updates every channel (tiny gathers)
                whole = format_layout((R,) * len(sizes))
                m, v = (RESHARD(t, channel_layout, whole, None, None, [running_mean.numel()], sizes, coords, None, None,
                                "a batch norm's running statistics") for t in (m, v))
            running_mean.mul_(1 - momentum).add_(m.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(v.to(running_var.dtype), alpha=momentum)
    return y.to(x.dtype)


def _listed(x):
    return [int(v) for v in x] if x is not None else None


def traceable(program: fx.GraphModule, comm: MeshComm) -> fx.GraphModule:
    """A copy of ``program`` (sharing its attributes) calling the IR's ops on ``comm``'s mesh."""
    for sub in program.modules():  # a recomputed block or a pipeline stage: not rewritten (yet)
        if sub is not program and isinstance(sub, fx.GraphModule) and any(_runtime_call(n) for n in sub.graph.nodes):
            raise AutoparError("compile=True cannot run this program yet: it holds a submodule graph that calls the runtime "
                               "(activation checkpointing or pipeline stages); compile without compile=")
    new = _copy_graph(program.graph)
    sizes, coords = list(comm.sizes), list(comm.coords)
    for node in list(new.nodes):
        if node.op != "call_function":
            continue
        t = node.target
        if t is reshard or t is reshard_start:
            x, src, dst, gsrc, gdst = node.args
            kw = node.kwargs
            args = (x, src, dst, gsrc, gdst, _listed(kw.get("shape")), sizes, coords, kw.get("dtype"),
                    kw.get("reduce_dtype"), kw.get("site"))
            _replace(new, node, RESHARD, args)
        elif t is reshard_finish:
            node.replace_all_uses_with(node.args[0])
            new.erase_node(node)
        elif t is gather_param_start:
            x, axis, dim, size = node.args
            kw = node.kwargs
            if not kw.get("grad", True):
                with new.inserting_before(node):
                    x = new.call_method("detach", (x,))
            args = (x, axis, dim, size, sizes, coords, kw.get("dtype"), kw.get("reduce_dtype"),
                    list(kw.get("grad_all_reduce", ())), kw.get("site"))
            _replace(new, node, GATHER_PARAM, args)
        elif t is gather_param_finish:
            node.target = gathered_view
        elif t is sharded_batch_norm:
            node.target = traced_batch_norm
            node.kwargs = {**node.kwargs, "sizes": sizes, "coords": coords}
        elif _runtime_call(node):
            raise AutoparError(f"compile=True cannot run this program yet: it calls {t.__module__}.{t.__name__} "
                               f"(node {node.name}), which has no registered op; compile without compile=")
    new.lint()
    return fx.GraphModule(program, new)


def _runtime_call(node: fx.Node) -> bool:
    """Whether ``node`` calls a Python function of autopar (the eager runtime)."""
    t = node.target
    return node.op == "call_function" and not isinstance(t, torch._ops.OpOverload) and t is not operator.getitem \
        and getattr(t, "__module__", "").startswith("autopar.")


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    out = fx.Graph()
    env: dict = {}
    ret = out.graph_copy(graph, env)
    out.output(ret)
    return out


def _replace(graph: fx.Graph, node: fx.Node, target, args: tuple) -> None:
    with graph.inserting_before(node):
        made = graph.call_function(target, args)
    made.meta.update(node.meta)
    node.replace_all_uses_with(made)
    graph.erase_node(node)


class CompiledPrograms:
    """One ``torch.compile``d callable per per-rank program (keyed by the program object)."""

    def __init__(self, backend: str):
        self.backend = backend
        self._made: dict[int, tuple[fx.GraphModule, object]] = {}

    def callable_for(self, program: fx.GraphModule, comm: MeshComm):
        hit = self._made.get(id(program))
        if hit is None or hit[0] is not program:
            fn = torch.compile(traceable(program, comm), backend=self.backend, dynamic=False)
            hit = self._made[id(program)] = (program, fn)
        return hit[1]

    def run(self, pm, program: fx.GraphModule, args):
        """``program(*args)`` compiled, under the model's autocast (mixed precision)."""
        fn = self.callable_for(program, pm.comm)
        if pm._policy.mixed:
            with torch.autocast(pm._device.type, dtype=pm._policy.torch_compute_dtype):
                return fn(*args)
        return fn(*args)
