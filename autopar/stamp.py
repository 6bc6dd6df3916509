"""Regional tracing: a repeated block is traced once by ``make_fx`` and stamped for its other instances.

Tracing costs ``make_fx``'s own work per op (about 0.7 ms a node on fake tensors), so a decoder
of 26 identical layers costs 26 layers of it on every rank. Within ``stamp_repeated_blocks(model)``
the instances of a repeated block (siblings in a container: ``layers.0``, ``layers.1``, ...) are
traced as follows: the first instance called is traced normally and recorded as the *template*
(its nodes, its inputs' and state's nodes, its outputs); the second is traced normally too and
checked against the template (the same ops, arguments and metadata once paths are renamed): a
mismatch turns stamping off for the group; every further instance whose call matches the template
is *stamped*: the template's nodes are copied into the graph with its inputs, parameters and
buffers replaced by this instance's, each node named as ``make_fx`` names it (one counter per op
name over the whole graph), its ``nn_module_stack`` renamed to this instance's path, its other
metadata (fake values included) the template's, and the block's outputs fresh fake tensors of the
template's shapes, tracked by ``make_fx`` as any op's results. Nodes come out in the order the full
trace would make them: the graph is the full trace's (``tests/test_stamp.py`` compares them).

Invariant: an instance is stamped only when everything its trace can depend on is the template's:
the same class and ``forward``, the same submodules (classes, relative names), parameters and
buffers (names, shapes, strides, dtypes, ``requires_grad``), equal plain attributes of every
submodule (``training`` included) except attributes that differ between instances and that the
template's forward never read (Hugging Face's ``layer_idx``, read only with a KV cache), no hooks
inside the block, the same inputs' structure and metadata (shapes, strides, dtypes, which inputs
are the same tensor, equal non-tensor arguments), the same grad and autocast modes, and not called
before. The template itself must be self-contained: its nodes read only its inputs, its state and
the model's parameters or buffers; no graph constants (``get_attr``), no sizes that depend on values
or symbols, no in-place write to an input or to state, no attribute written during its forward,
no output that is a view of an input, outputs that are tensors, None or plain constants, and no
autopar region ops (grouped matmuls: ``outline_token_regions`` needs their modules' calls). Otherwise
the instance (or the whole group) is traced normally: the fallback is the full trace, unchanged.

Random ops (dropout) carry no seed or offset in the pre-dispatch graph: each stamped node is the
same op on this instance's values, as the full trace makes it, and the runtime draws for it as
for any node. What cannot be checked: Python side effects of a block's forward outside its own
modules (a global counter, a cache on a shared object); the second, checked instance catches
those that change the graph from the first call to the next.

Hand-written because torch's regional facilities (``torch.compiler.nested_compile_region``, the
``invoke_subgraph`` higher-order op) belong to Dynamo and leave a call of a nested subgraph in
the graph, not the inlined pre-dispatch ops every later stage of autopar reads.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["stamp_repeated_blocks", "StampStats", "STAMPED_KEY", "graph_signature"]

STAMPED_KEY = "autopar.stamped"  # GraphModule.meta: the trace's ``StampStats`` per group

_SIMPLE = (type(None), bool, int, float, str, torch.dtype, torch.device)
_SKIP_ATTRS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "forward",
                         "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                         "_load_state_dict_post_hooks"})
_HOOK_ATTRS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


@dataclass
class StampStats:
    """What happened, per group (the container path and class): instances traced, stamped, and why
    stamping stopped (empty when it did not)."""

    traced: int = 0
    stamped: int = 0
    refused: dict[str, str] = field(default_factory=dict)


def _token(v: Any, depth: int = 0) -> Any:
    """A value as compared between instances: plain values by value, containers by their items
    (Hugging Face's per-layer ``_kernel_funcs`` dicts hold the same functions), others by identity."""
    if isinstance(v, _SIMPLE):
        return ("v", type(v), v)
    if isinstance(v, (tuple, frozenset)) and all(isinstance(x, _SIMPLE) for x in v):
        return ("v", type(v), v)
    if depth < 3 and isinstance(v, (tuple, list)):
        return ("seq", type(v), tuple(_token(x, depth + 1) for x in v))
    if depth < 3 and isinstance(v, functools.partial):  # (Gemma's ``GELUTanh.act``, one per instance)
        return ("partial", _token(v.func, depth + 1), _token(v.args, depth + 1), _token(v.keywords, depth + 1))
    if depth < 3 and isinstance(v, torch.nn.Module) and not _has_hooks(v):  # (held, not registered)
        return ("module", type(v), tuple(_attrs(v, depth + 1).items()), _token(v._parameters, depth + 1),
                _token(v._buffers, depth + 1), _token(v._modules, depth + 1))
    if depth < 3 and isinstance(v, dict):
        return ("dict", type(v), tuple((_token(k, depth + 1), _token(x, depth + 1)) for k, x in v.items()))
    return ("id", id(v))


def _tensor_sig(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)


def _attrs(mod: torch.nn.Module, depth: int = 0) -> dict[str, Any]:
    return {k: _token(v, depth) for k, v in vars(mod).items() if k not in _SKIP_ATTRS and k not in _HOOK_ATTRS}


def _has_hooks(mod: torch.nn.Module) -> bool:
    return any(getattr(mod, h, None) for h in _HOOK_ATTRS)


def _structure(inst: torch.nn.Module) -> tuple | None:
    """Class, forward, submodules, state metadata of a block instance (None: never stamped)."""
    subs = list(inst.named_modules(remove_duplicate=False))
    if "forward" in vars(inst) or any(_has_hooks(m) for n, m in subs if n):
        return None
    state = [(n, _tensor_sig(t)) for n, t in inst.named_parameters(remove_duplicate=False)]
    state += [(n, _tensor_sig(t)) for n, t in inst.named_buffers(remove_duplicate=False)]
    return (type(inst), type(inst).forward, tuple((n, type(m)) for n, m in subs), tuple(state))


def _candidate_groups(model: torch.nn.Module) -> list[tuple[str, list[tuple[str, torch.nn.Module]]]]:
    """Siblings of one container with the same structure, outermost containers first, three or more
    (the template, the checked one, at least one stamped). A block inside another is not a candidate."""
    groups, covered = [], []
    for path, mod in model.named_modules():
        if any(path.startswith(c + ".") for c in covered):
            continue
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            continue
        by_sig: dict[tuple, list] = {}
        for name, child in mod.named_children():
            sig = _structure(child)
            if sig is not None:
                by_sig.setdefault(sig, []).append((f"{path}.{name}" if path else name, child))
        found = [(path, members) for members in by_sig.values() if len(members) >= 3]
        groups += found
        if found:
            covered.append(path)
    return groups


def _varying(members: list[tuple[str, torch.nn.Module]]) -> dict[str, frozenset[str]]:
    """Per relative submodule name, the plain attributes whose values differ between instances."""
    per = [{n: _attrs(m) for n, m in inst.named_modules(remove_duplicate=False)} for _, inst in members]
    out: dict[str, frozenset[str]] = {}
    for name, first in per[0].items():
        keys = set().union(*(p[name].keys() for p in per))
        out[name] = frozenset(k for k in keys if any(p[name].get(k) != first.get(k) for p in per))
    return out


class _ReadTracker:
    """Swaps the class of each submodule with varying attributes for a subclass whose properties
    record reads and writes of those attributes (a data descriptor wins over the instance dict);
    the subclass keeps the original's name, module and qualname (``nn_module_stack`` records them)."""

    def __init__(self, inst: torch.nn.Module, varying: dict[str, frozenset[str]]):
        self.read: set[str] = set()
        self.swapped: list[tuple[torch.nn.Module, type]] = []
        try:
            for name, mod in inst.named_modules(remove_duplicate=False):
                if varying.get(name):
                    sub = self._subclass(type(mod), name, varying[name])
                    self.swapped.append((mod, type(mod)))
                    mod.__class__ = sub
        except Exception:
            self.restore()
            raise

    def _subclass(self, cls: type, name: str, attrs: frozenset[str]) -> type:
        read = self.read

        def prop(attr):
            def get(obj):
                read.add(f"{name}.{attr}" if name else attr)
                return obj.__dict__[attr]

            def put(obj, value):
                read.add(f"{name}.{attr}" if name else attr)
                obj.__dict__[attr] = value
            return property(get, put)

        sub = type(cls.__name__, (cls,), {a: prop(a) for a in attrs})
        sub.__module__, sub.__qualname__ = cls.__module__, cls.__qualname__
        return sub

    def restore(self) -> None:
        for mod, cls in self.swapped:
            mod.__class__ = cls


@dataclass
class _Template:
    path: str
    nodes: list[fx.Node]
    inputs: list[fx.Node | None]  # per input leaf
    state: list[fx.Node]
    out_spec: Any
    outs: list[tuple]  # per output leaf: ("node", i, requires_grad) | ("in", i, _) | ("state", i, _) | ("const", v, _)
    signature: tuple
    stack_depth: int
    call_deltas: dict[str, int]


class _Group:
    def __init__(self, container: str, members, varying):
        self.container = container
        self.paths = {id(m): p for p, m in members}
        self.varying = varying
        self.template: _Template | None = None
        self.checked = False
        self.off: str | None = None


class _Stamper:
    def __init__(self, model: torch.nn.Module):
        self.stats: dict[str, StampStats] = {}
        self.installed: list[torch.nn.Module] = []
        for container, members in _candidate_groups(model):
            group = _Group(container, members, _varying(members))
            key = f"{container}[{type(members[0][1]).__name__}]"
            self.stats[key] = StampStats()
            for _, inst in members:
                inst.forward = self._stub(inst, group, self.stats[key])
                self.installed.append(inst)

    def remove(self) -> None:
        for inst in self.installed:
            vars(inst).pop("forward", None)

    def _stub(self, inst, group: _Group, stats: StampStats):
        real = type(inst).forward.__get__(inst)

        def forward(*args, **kwargs):
            from torch.fx.experimental.proxy_tensor import get_proxy_mode

            mode = get_proxy_mode()
            if mode is None or group.off is not None or not hasattr(mode.tracer, "module_stack"):
                return real(*args, **kwargs)
            return self._call(inst, real, group, stats, mode.tracer, args, kwargs)
        return forward

    def _call(self, inst, real, group: _Group, stats: StampStats, tracer, args, kwargs):
        path = group.paths[id(inst)]
        leaves, spec = pytree.tree_flatten((args, kwargs))
        sig = _call_signature(leaves, spec, tracer, path)
        if sig is None:
            stats.traced += 1
            return real(*args, **kwargs)
        t = group.template
        if t is not None and group.checked and sig == t.signature:
            stats.stamped += 1
            return _stamp(t, inst, path, tracer, leaves)
        stats.traced += 1
        if t is not None and sig != t.signature:
            return real(*args, **kwargs)
        rec = _record(inst, real, group, tracer, args, kwargs, leaves, path, sig)
        if t is None:
            group.template, reason = rec[0], rec[1]
        else:
            reason = rec[1] or _same(t, rec[0])
            group.checked = reason is None
        if reason is not None:
            group.off = stats.refused[path] = reason
        return rec[2]


def _call_signature(leaves, spec, tracer, path: str) -> tuple | None:
    """What the trace of a call depends on besides the module: None where it cannot be stamped."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    if tracer.num_calls.get(path, 0) > 1:  # (call_module counted this call already)
        return None
    toks, seen = [], {}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if get_proxy_slot(leaf, tracer, None) is None or any(isinstance(s, torch.SymInt) for s in leaf.shape):
                return None
            toks.append(("t", _tensor_sig(leaf), leaf.storage_offset(), seen.setdefault(id(leaf), len(seen))))
        elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return None
        else:
            toks.append(_token(leaf))
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) + tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    return (spec, tuple(toks), modes)


def _state(inst) -> list[torch.Tensor]:
    return [t for _, t in inst.named_parameters(remove_duplicate=False)] + \
        [t for _, t in inst.named_buffers(remove_duplicate=False)]


def _node_of(t: torch.Tensor, tracer) -> fx.Node | None:
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    slot = get_proxy_slot(t, tracer, None)
    return None if slot is None else slot.proxy.node


def _snapshot(inst) -> list:
    return [(n, {k: id(v) for k, v in vars(m).items() if k != "forward"},
             {k: id(v) for d in ("_parameters", "_buffers", "_modules") for k, v in getattr(m, d).items()})
            for n, m in inst.named_modules(remove_duplicate=False)]


def _record(inst, real, group: _Group, tracer, args, kwargs, leaves, path, sig):
    """Trace one instance normally; returns (template or None, why it cannot be one, output)."""
    graph = tracer.graph
    last = next(iter(reversed(graph.nodes)))
    calls_before = dict(tracer.num_calls)
    depth = len(tracer.module_stack)
    before = _snapshot(inst)
    # (before the forward: make_fx re-points a tensor at the node of an op returning it, ``x.to(x.dtype)``)
    inputs = [_node_of(x, tracer) if isinstance(x, torch.Tensor) else None for x in leaves]
    state = [_node_of(x, tracer) for x in _state(inst)]
    try:
        reads = _ReadTracker(inst, group.varying)
    except Exception:  # noqa: BLE001 - a class that refuses a subclass (__init_subclass__): no stamping
        return None, "its modules' attributes cannot be watched", real(*args, **kwargs)
    try:
        out = real(*args, **kwargs)
    finally:
        reads.restore()
    nodes = []
    for n in reversed(graph.nodes):
        if n is last:
            break
        nodes.append(n)
    nodes.reverse()
    if reads.read:
        return None, f"its forward reads {sorted(reads.read)[0]}, which differs between instances", out
    if _snapshot(inst) != before:
        return None, "its forward sets an attribute of one of its modules", out
    if any(s is None for s in state):
        return None, "a parameter or buffer has no graph node", out
    reason = _self_contained(nodes, inputs, state)
    outs, out_spec = _outputs(out, nodes, inputs, state, tracer)
    if reason is None and outs is None:
        reason = "an output is not a tensor of the block, an input, None or a plain constant"
    deltas = {p[len(path):]: c - calls_before.get(p, 0) for p, c in tracer.num_calls.items()
              if p.startswith(path + ".") and c != calls_before.get(p, 0)}
    t = _Template(path, nodes, inputs, state, out_spec, outs or [], sig, depth, deltas)
    return (t if reason is None else None), reason, out


def _self_contained(nodes, inputs, state) -> str | None:
    from torch.multiprocessing.reductions import StorageWeakRef

    inside = set(nodes)
    given = {n for n in inputs if n is not None} | set(state)
    outside_storages = set()
    for n in given:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            outside_storages.add(StorageWeakRef(v.untyped_storage()))
    for n in nodes:
        if n.op != "call_function":
            return f"it makes a {n.op} node ({n.name})"
        target = n.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "autopar":
            return f"it calls {target} (a region op)"
        for a in n.all_input_nodes:
            if a not in inside and a not in given and a.op != "placeholder":
                return f"{n.name} reads {a.name}, made outside the block"
        val = n.meta.get("val")
        for v in (val if isinstance(val, (tuple, list)) else (val,)):
            if isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape):
                return f"{n.name} has a symbolic size"
            if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return f"{n.name} is a symbolic value"
        if _writes_outside(n, outside_storages):
            return f"{n.name} writes in place into an input, a parameter or a buffer"
    return None


def _writes_outside(n: fx.Node, outside_storages) -> bool:
    from torch.multiprocessing.reductions import StorageWeakRef

    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return False
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
        for leaf in pytree.tree_leaves(value):
            v = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
            if not isinstance(v, torch.Tensor) or StorageWeakRef(v.untyped_storage()) in outside_storages:
                return True
    return False


def _outputs(out, nodes, inputs, state, tracer):
    """Each output leaf as where its value comes from; (None, spec) where one cannot be stamped."""
    from torch.multiprocessing.reductions import StorageWeakRef

    leaves, spec = pytree.tree_flatten(out)
    index = {n: i for i, n in enumerate(nodes)}
    given = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in [*inputs, *state]
             if n is not None and isinstance(n.meta.get("val"), torch.Tensor)}
    outs, storages = [], {}
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            if _token(leaf)[0] != "v":
                return None, spec
            outs.append(("const", leaf, None))
            continue
        node = _node_of(leaf, tracer)
        if node in index:
            ref = StorageWeakRef(leaf.untyped_storage())
            if ref in given or storages.setdefault(ref, node) is not node or (leaf.requires_grad and leaf.is_leaf):
                return None, spec
            outs.append(("node", index[node], leaf.requires_grad))
        elif node is not None and node in inputs:
            outs.append(("in", inputs.index(node), None))
        elif node is not None and node in state:
            outs.append(("state", state.index(node), None))
        else:
            return None, spec
    return outs, spec


def _same(t: _Template, other: _Template | None) -> str | None:
    """Whether a second instance's trace is the template's with its paths renamed."""
    if other is None:
        return "the second instance cannot be a template"
    if len(other.nodes) != len(t.nodes) or other.outs != t.outs:
        return f"{other.path} traces to other ops than {t.path}"
    env = dict(zip(t.inputs, other.inputs))
    env.update(zip(t.state, other.state))
    env.update(zip(t.nodes, other.nodes))
    env.pop(None, None)
    for a, b in zip(t.nodes, other.nodes):
        mapped = fx.node.map_arg((a.args, a.kwargs), lambda n: env.get(n, n))
        if a.target != b.target or mapped != (b.args, b.kwargs) or _base(a.name) != _base(b.name) \
                or _val_sig(a) != _val_sig(b) or _rename_stack(a.meta.get("nn_module_stack"), t.path, other.path, 0) \
                != _rename_stack(b.meta.get("nn_module_stack"), "", "", 0):
            return f"{other.path} traces to other ops than {t.path} (at {b.name})"
    return None


def _val_sig(n: fx.Node):
    val = n.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return tuple(_tensor_sig(v) if isinstance(v, torch.Tensor) else type(v) for v in vals)


def _base(name: str) -> str:
    head, _, tail = name.rpartition("_")
    return head if head and tail.isdigit() else name


def _rename_stack(stack, old: str, new: str, keep: int):
    """``nn_module_stack`` with the template's path ``old`` renamed ``new`` after the first ``keep``
    entries (the stack around the call, taken from the live stack)."""
    if stack is None or not old:
        return stack
    out = {}
    for i, (key, (fqn, cls)) in enumerate(stack.items()):
        if i >= keep:
            key = _swap(key, old, new)
            fqn = _swap(fqn, old, new)
        out[key] = (fqn, cls)
    return out


def _swap(s: str, old: str, new: str) -> str:
    return new + s[len(old):] if s == old or s.startswith(old + ".") or s.startswith(old + "@") else s


def _make_fx_name(graph: fx.Graph, n: fx.Node) -> str | None:
    """The name candidate ``make_fx`` gives a node (the graph's namespace adds the counter)."""
    if isinstance(n.target, torch._ops.OpOverload):
        return graph._target_to_str(n.target.overloadpacket.__name__)
    return None


def _stamp(t: _Template, inst, path: str, tracer, leaves):
    """Copy the template's nodes for this instance; returns the block's output."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, track_tensor_tree

    graph = tracer.graph
    env: dict[fx.Node, fx.Node] = {}
    inputs = [_node_of(x, tracer) if isinstance(x, torch.Tensor) else None for x in leaves]
    env.update((a, b) for a, b in zip(t.inputs, inputs) if a is not None)
    state = _state(inst)
    env.update(zip(t.state, (_node_of(x, tracer) for x in state)))
    outer = {k: (fqn, _class_name(cls)) for k, (fqn, cls) in tracer.module_stack.items()}
    for tn in t.nodes:
        args, kwargs = fx.node.map_arg((tn.args, tn.kwargs), lambda n: env.get(n, n))
        new = graph.create_node(tn.op, tn.target, args, kwargs, name=_make_fx_name(graph, tn))
        new.meta = dict(tn.meta)
        stack = tn.meta.get("nn_module_stack")
        if stack is not None:
            inner = list(_rename_stack(stack, t.path, path, t.stack_depth).items())[t.stack_depth:]
            new.meta["nn_module_stack"] = type(stack)([*outer.items(), *inner])
        env[tn] = new
    for rel, count in t.call_deltas.items():
        tracer.num_calls[path + rel] = tracer.num_calls.get(path + rel, 0) + count
    out = []
    with disable_proxy_modes_tracing():
        for kind, v, *grad in t.outs:
            if kind == "node":
                node = env[t.nodes[v]]
                val = t.nodes[v].meta["val"]
                fresh = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
                if grad[0]:
                    fresh = fresh.requires_grad_().clone()
                track_tensor_tree(fresh, fx.Proxy(node, tracer), constant=None, tracer=tracer)
                out.append(fresh)
            elif kind == "in":
                out.append(leaves[v])
            elif kind == "state":
                out.append(state[v])
            else:
                out.append(v)
    return pytree.tree_unflatten(out, t.out_spec)


def _class_name(cls) -> str:
    return cls.__module__ + "." + cls.__qualname__ if isinstance(cls, type) else cls


@contextlib.contextmanager
def stamp_repeated_blocks(model: torch.nn.Module, enabled: bool = True):
    """Within this context a ``make_fx`` trace of ``model`` stamps its repeated blocks (module
    docstring). Yields the per-group ``StampStats`` (empty when disabled or nothing repeats)."""
    if not enabled:
        yield {}
        return
    stamper = _Stamper(model)
    try:
        yield stamper.stats
    finally:
        stamper.remove()


def graph_signature(gm: fx.GraphModule) -> list[tuple]:
    """What later stages read of a traced graph, node by node in order (name, op, target, args,
    kwargs, every ``autopar.*`` meta key, ``nn_module_stack``, the fake values' shapes, strides and
    dtypes), then its code: equal for the regional and the full trace of a model."""
    out: list[tuple] = []
    for n in gm.graph.nodes:
        meta = {k: v for k, v in n.meta.items() if k.startswith("autopar.")}
        val = n.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else (val,)
        vs = tuple((tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in vals)
        stack = n.meta.get("nn_module_stack")
        out.append((n.name, n.op, str(n.target), str(n.args), str(n.kwargs), repr(meta),
                    repr(list(stack.items())) if stack is not None else None, vs))
    out.append(("code", gm.code))
    return out
