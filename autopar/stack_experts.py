"""Experts written as a list of modules, called in a loop, become one computation over stacked weights.

Many mixture-of-experts layers are written as ``nn.ModuleList`` of small MLPs and a loop::

    expert_out = torch.stack([expert(expert_in[i]) for i, expert in enumerate(self.experts)])

The traced graph then holds E copies of one chain (``select(expert_in, 0, e)`` -> linear ->
activation -> linear), each with its own parameters. Expert parallelism needs the experts'
weights as one tensor ``[E, ...]`` whose dim 0 it can split (``planner.experts``), so this trace
rewrite replaces the E chains by one:

* each weight position ``suffix`` (``0.weight``) of the experts ``P.0 .. P.{E-1}`` becomes one
  parameter placeholder of fqn ``P.*.suffix``, the E weights stacked on a new dim 0
  (``TracedGraph.stacked``: that fqn -> the E member fqns, in expert order);
* ``linear(x, w, b)`` becomes an einsum contracting the stacked weight with dim 0 as the expert
  (batch) dim, plus the stacked bias broadcast over the tokens; an elementwise op runs on the
  stacked values as it is (a value shared by all experts broadcasts);
* ``select(X, 0, e)`` is ``X`` itself, and the ``stack`` of the chains' outputs is the result.

The rewrite applies only where it is exact: the E chains are isomorphic op for op (same targets,
same non-tensor arguments, same shapes), read nothing expert-specific but ``X[e]`` and their own
parameters (each used by its expert alone, alike in shape, dtype and trainability across the
experts), are used only by the ``stack`` on dim 0, and hold only linear and elementwise
(``torch.Tag.pointwise``, not random) ops. Anything else is left as written (the experts then run
data and tensor parallel, and ``ep=`` says why it cannot split them).

Why by hand: ``torch.func.stack_module_state`` + ``vmap`` stack modules the user calls through
them; here the user's loop is already traced, so the chains are merged in the graph.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.traced_graph import TensorMeta, tensor_inputs

__all__ = ["stack_expert_modules", "stacked_fqn", "unstack_entries"]

aten = torch.ops.aten


def stacked_fqn(prefix: str, suffix: str) -> str:
    """The fqn of the stacked parameter of weight position ``suffix`` of the experts under ``prefix``."""
    return f"{prefix}.*.{suffix}"


def unstack_entries(full: dict, stacked: dict[str, tuple[str, ...]]) -> dict:
    """``full`` (entries ``"<fqn>"`` or ``"<fqn>/<key>"``) with every stacked parameter's entry split
    into its members' (row ``e`` to member ``e``; a 0-dim entry, such as a step count, copied to each)."""
    out = {}
    for key, t in full.items():
        fqn, sep, rest = key.partition("/")
        if fqn not in stacked:
            out[key] = t
            continue
        for e, member in enumerate(stacked[fqn]):
            out[member + sep + rest] = t[e].clone() if t.dim() > 0 else t.clone()
    return out


def stack_expert_modules(gm: fx.GraphModule, fake_mode) -> dict[str, tuple[str, ...]]:
    """Rewrite every stack of isomorphic expert chains in ``gm`` (annotated: ``autopar.*`` metas
    set) into one chain over stacked parameters; returns stacked fqn -> member fqns. The new
    placeholders take ``autopar.kind`` "param" and their fqn; the members' placeholders are removed."""
    stacked: dict[str, tuple[str, ...]] = {}
    # graph order, once: rewrites insert nodes, but no chain found later holds one of them
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.stack.default:
            found = _expert_chains(node, position)
            if found is not None:
                stacked.update(_rewrite(gm.graph, node, *found, fake_mode))
    if stacked:
        gm.graph.lint()
        gm.recompile()
    return stacked


def _module(n: fx.Node) -> str:
    return n.meta.get("autopar.module", "")


def _expert_chains(stack: fx.Node, position: dict):
    """(prefix P, chains: per expert its nodes in graph order, routed input X) where ``stack``
    stacks on dim 0 the outputs of E isomorphic chains of modules ``P.0 .. P.{E-1}``; else None."""
    outs = stack.args[0]
    dim = stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
    if dim != 0 or len(outs) < 2 or not all(isinstance(o, fx.Node) and o.op == "call_function" for o in outs):
        return None
    paths = [_module(o).split(".") for o in outs]
    if len({len(p) for p in paths}) != 1:
        return None
    k = next((i for i in range(len(paths[0])) if len({p[i] for p in paths}) > 1), None)
    if k is None or [p[k] for p in paths] != [str(e) for e in range(len(outs))]:
        return None
    prefix = ".".join(paths[0][:k])
    chains, routed = [], None
    for e, out in enumerate(outs):
        member = f"{prefix}.{e}"
        inside = _chain_nodes(out, member)
        if inside is None or set(out.users) != {stack}:
            return None
        for n in inside:
            if n is not out and any(u not in inside for u in n.users):
                return None  # an expert's intermediate used outside it
        for a in dict.fromkeys(a for n in inside for a in n.all_input_nodes if a not in inside):
            if _is_param(a):
                if not a.meta.get("autopar.fqn", "").startswith(member + ".") or any(u not in inside for u in a.users):
                    return None  # another module's weight, or one this expert shares
            elif a.op == "call_function" and a.target is aten.select.int and a.args[1:] == (0, e):
                if routed not in (None, a.args[0]):
                    return None
                routed = a.args[0]
            elif _module(a).startswith(prefix + "."):
                return None
        chains.append(sorted(inside, key=position.__getitem__))
    if routed is None or not _isomorphic(chains, prefix) or not _alike_weights(chains, prefix):
        return None
    return prefix, chains, routed


def _alike_weights(chains: list, prefix: str) -> bool:
    """Whether each weight position holds weights of one shape, dtype and trainability in every expert."""
    seen: dict[str, set] = {}
    for e, chain in enumerate(chains):
        for a in {a for n in chain for a in n.all_input_nodes if _is_param(a)}:
            meta = a.meta["autopar.outputs"][0]
            seen.setdefault(a.meta["autopar.fqn"][len(f"{prefix}.{e}."):], set()).add(
                (tuple(meta.shape), meta.dtype, bool(a.meta.get("autopar.requires_grad"))))
    return all(len(v) == 1 for v in seen.values())


def _is_param(n: fx.Node) -> bool:
    return n.op == "placeholder" and n.meta.get("autopar.kind") == "param"


def _chain_nodes(out: fx.Node, member: str) -> set | None:
    """The nodes of module ``member`` (or below) that ``out`` is computed from, ``out`` included."""
    inside, todo = set(), [out]
    while todo:
        n = todo.pop()
        if n in inside:
            continue
        m = _module(n)
        if n.op != "call_function" or not (m == member or m.startswith(member + ".")):
            continue
        inside.add(n)
        todo.extend(n.all_input_nodes)
    return inside or None


def _role(a, e: int, prefix: str, position: dict):
    """What an argument of an expert-``e`` node is, the same token for every expert where isomorphic."""
    if not isinstance(a, fx.Node):
        return ("const", a)
    if a in position:
        return ("chain", position[a])
    if _is_param(a):
        return ("param", a.meta["autopar.fqn"][len(f"{prefix}.{e}."):])
    if a.op == "call_function" and a.target is aten.select.int and a.args[1:] == (0, e):
        return ("routed",)
    return ("shared", a)


def _isomorphic(chains: list, prefix: str) -> bool:
    """Whether every chain runs chain 0's ops on corresponding arguments, with equal shapes and dtypes,
    and each op is one the rewrite can stack (``_stackable``)."""
    tokens = []
    for e, chain in enumerate(chains):
        position = {n: i for i, n in enumerate(chain)}
        seq = []
        for n in chain:
            if not _stackable(n):
                return False
            args = pytree.tree_map(lambda a: _role(a, e, prefix, position), (n.args, n.kwargs))
            seq.append((n.target, repr(args), tuple(n.meta.get("autopar.outputs") or ())))
        tokens.append(seq)
    return all(t == tokens[0] for t in tokens[1:])


def _stackable(n: fx.Node) -> bool:
    if n.target is aten.linear.default:
        return True
    tags = getattr(n.target, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def _rewrite(graph: fx.Graph, stack: fx.Node, prefix: str, chains: list, routed: fx.Node, fake_mode) -> dict:
    """Replace the chains by one over stacked parameters (see the module docstring)."""
    n_experts = len(chains)
    template = chains[0]
    members: dict[str, list[fx.Node]] = {}  # weight position -> its E placeholders
    for e, chain in enumerate(chains):
        for n in chain:
            for a in n.all_input_nodes:
                if _is_param(a):
                    suffix = a.meta["autopar.fqn"][len(f"{prefix}.{e}."):]
                    if a not in members.setdefault(suffix, []):
                        members[suffix].append(a)
    last_param = None  # placeholders come first, parameters before the rest (TracedGraph)
    for n in graph.nodes:
        if n.op != "placeholder":
            break
        last_param = n if _is_param(n) else last_param
    new_params: dict[str, fx.Node] = {}
    with graph.inserting_after(last_param):
        for suffix, phs in reversed(list(members.items())):
            fqn = stacked_fqn(prefix, suffix)
            first = phs[0]
            ph = graph.placeholder("p_" + "".join(c if c.isalnum() else "_" for c in fqn))
            ph.target = ph.name
            val = first.meta["val"]
            with fake_mode:
                ph.meta["val"] = torch.empty((n_experts, *val.shape), dtype=val.dtype, device=val.device)
            meta = first.meta["autopar.outputs"][0]
            ph.meta.update({"autopar.kind": "param", "autopar.fqn": fqn, "autopar.module": prefix,
                            "autopar.requires_grad": first.meta.get("autopar.requires_grad", False),
                            "autopar.needs_grad": first.meta.get("autopar.needs_grad", False),
                            "autopar.outputs": (TensorMeta((n_experts, *meta.shape), meta.dtype),)})
            new_params[suffix] = ph
    module_stack = _stack_module(template[-1], prefix)

    def emit(target, args, kwargs=None) -> fx.Node:
        new = graph.call_function(target, args, kwargs or {})
        _annotate(new, prefix, module_stack, fake_mode)
        return new

    batched: dict[fx.Node, fx.Node] = {}

    def arg_of(a):
        if not isinstance(a, fx.Node):
            return a
        if a in batched:
            return batched[a]
        if _is_param(a):
            return new_params[a.meta["autopar.fqn"][len(f"{prefix}.0."):]]
        if a.op == "call_function" and a.target is aten.select.int and a.args[1:] == (0, 0):
            return routed
        return a  # shared by every expert: broadcasts

    with graph.inserting_before(stack):
        for n in template:
            args, kwargs = pytree.tree_map(arg_of, (n.args, n.kwargs))
            if n.target is aten.linear.default:
                batched[n] = _stacked_linear(emit, *args, **kwargs)
            else:
                batched[n] = emit(n.target, args, kwargs)
    out = batched[template[-1]]
    stack.replace_all_uses_with(out)
    dead = [stack] + [n for chain in chains for n in reversed(chain)]
    dead += [a for chain in chains for n in chain for a in n.all_input_nodes  # the selects X[e]
             if a.op == "call_function" and a.target is aten.select.int and a.args[0] is routed]
    for n in dict.fromkeys(dead):
        if not n.users:
            graph.erase_node(n)
    for phs in members.values():
        for ph in phs:
            graph.erase_node(ph)
    return {stacked_fqn(prefix, s): tuple(ph.meta["autopar.fqn"] for ph in phs) for s, phs in members.items()}


def _stacked_linear(emit, x: fx.Node, w: fx.Node, b: fx.Node | None = None) -> fx.Node:
    """``linear`` of each expert's rows ``x[e]`` with its weight ``w[e]`` (and bias ``b[e]``):
    an einsum over the expert dim (``emit(target, args)``: a new node, annotated)."""
    rank = len(x.meta["autopar.outputs"][0].shape)
    mid = "abcdfghjklmn"[: rank - 2]
    out = emit(aten.einsum.default, (f"e{mid}i,eoi->e{mid}o", [x, w]))
    if b is None:
        return out
    n_experts, width = b.meta["autopar.outputs"][0].shape
    return emit(aten.add.Tensor, (out, emit(aten.reshape.default, (b, [n_experts] + [1] * (rank - 2) + [width]))))


def _stack_module(node: fx.Node, prefix: str) -> dict:
    """The new nodes' ``nn_module_stack``: the template's, without expert 0's modules."""
    keep = {}
    for key, (fqn, cls) in (node.meta.get("nn_module_stack") or {}).items():
        if fqn.endswith(f"{prefix}.0") or f"{prefix}.0." in fqn:
            break
        keep[key] = (fqn, cls)
    return keep


def _annotate(n: fx.Node, prefix: str, module_stack: dict, fake_mode) -> None:
    """``val`` and the ``autopar.*`` metas of a node the rewrite inserted (as ``trace`` sets them)."""
    args, kwargs = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
    with fake_mode:
        val = n.target(*args, **kwargs)
    n.meta["val"] = val
    n.meta["nn_module_stack"] = dict(module_stack)
    n.meta["autopar.outputs"] = (TensorMeta(tuple(int(s) for s in val.shape), val.dtype),)
    n.meta["autopar.kind"] = "op"
    n.meta["autopar.module"] = prefix
    n.meta["autopar.needs_grad"] = val.is_floating_point() and any(
        a.meta.get("autopar.needs_grad", False) for a in tensor_inputs(n))
