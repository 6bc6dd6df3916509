"""Token-wise regions: dropless mixture-of-experts layers as one node of the traced graph.

A dropless MoE layer sorts its (token, expert) pairs by expert, counts the rows of each expert
and runs one grouped matmul per weight over those counts (``autopar::grouped_mm``). Read op by
op, that is a sort over *every* token of the batch: none of its ops can be split, so the planner
would gather the batch on every device. Read as a whole, the layer is token-wise: each token's
output depends on that token alone (and on the weights), so any split of the tokens computes the
same rows, each device sorting and grouping its own tokens.

``outline_token_regions`` finds each module whose ops include a grouped matmul and replaces its
nodes with one call of ``TokenRegion`` (the module's own forward on the device's tokens, with
the parameters the graph passes in), so its sharding rule (``strategies.rules.token_region``)
can split the tokens, dim 0 of every activation input and of the output, with the weights whole.
Its forward FLOPs (the grouped matmuls' and the rest's) are kept in ``REGION_FLOPS_KEY``.

A module is outlined only when this reading holds from its shapes: one output computed from its
experts (the grouped matmuls, the sizes that depend on values) whose dim 0 is the dim 0 of every
activation input (the tokens). Otherwise its ops stay in the graph (and run replicated where no
rule splits them).

A module may return more than that output (Switch / DeepSeek style: ``return y, aux_loss``, the
load-balancing loss from the router's probabilities and counts over the whole batch). Such a
*side output* is not per token: computed by each device on its own tokens it would be another
value. Where no side output depends on the experts' computation, its ops (the router, the counts,
the means over the tokens) stay in the graph as well, planned as any ops are (a mean over split
tokens is summed over the devices), so it is the global batch's value and its gradient reaches the
router exactly; the region runs the module's forward for the token output alone (the router's few
ops run twice: in the region and for the side output). A side output computed from the experts'
results is refused where the experts' sizes depend on values (``TraceError`` naming the static
form); over grouped matmuls such a module stays ops in the graph (exact, not split).

Expert parallelism runs the module with its share of the experts' weights (dim 0 split), so its
code must take the number of experts from its configuration, not from a weight's shape (as
Hugging Face's experts modules do: ``self.num_experts``).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.errors import TraceError
from autopar.grouped_mm import redirect_grouped_mm
from autopar.meta_keys import REGION_EXPERTS_KEY, REGION_FLOPS_KEY, REGION_GROUPED_KEY

__all__ = ["TokenRegion", "outline_token_regions", "grouped_exchanges", "REGION_FLOPS_KEY", "REGION_EXPERTS_KEY",
           "REGION_GROUPED_KEY", "ROW_LOCAL_OPS"]

# Ops that act on each row alone: under expert parallelism the rows of a grouped matmul's result
# stay on the experts' ranks through them, into the next grouped matmul over the same routing
# (``runtime.expert_dispatch``); the names as ``node_view.op_name`` gives them for the
# traced graph and as ``row_local_name`` gives them for torch functions. Split and chunk: along
# the last dim only. Every tensor operand must itself be such rows.
ROW_LOCAL_OPS = frozenset({"gelu", "silu", "relu", "sigmoid", "tanh", "mul", "add", "sub", "div", "neg", "to",
                           "_to_copy", "type_as", "contiguous", "clone", "chunk", "split", "getitem", "float",
                           "half", "bfloat16"})
_LAST_DIM_OPS = frozenset({"chunk", "split"})


class TokenRegion:
    """Calls ``module`` (the user's submodule at ``path``) on local tokens with the given state:
    ``TokenRegion(module, path, state_names, n_inputs, leaf)(*inputs, *state)``; its value is
    leaf ``leaf`` of the module's output (``pytree.tree_leaves``: 0 for a module returning one
    tensor; side outputs such as an auxiliary loss are computed by the graph, not taken from here)."""

    __module__ = "autopar.regions"

    def __init__(self, module: torch.nn.Module, path: str, state_names: tuple[str, ...], n_inputs: int, leaf: int = 0):
        self.module, self.path, self.state_names, self.n_inputs, self.leaf = module, path, state_names, n_inputs, leaf
        self.__name__ = "token_region"

    def __call__(self, *args, expert_axis: int | None = None):
        """``expert_axis``: the mesh axis the region's expert weights are split over (their
        grouped matmuls then exchange rows with the ranks holding the other experts)."""
        inputs, state = args[: self.n_inputs], args[self.n_inputs:]
        with redirect_grouped_mm(expert_axis) as mode:  # any dtype, any alignment (torch's kernels take neither)
            out = torch.func.functional_call(self.module, dict(zip(self.state_names, state)), inputs)
        return mode.finish(pytree.tree_leaves(out)[self.leaf])  # (outside the mode: bringing rows back runs torch functions)

    def __deepcopy__(self, memo):
        return self  # it holds no state of its own: the parameters come in as arguments

    def __repr__(self) -> str:
        return f"token_region({self.path})"


def _is_grouped_mm(n: fx.Node) -> bool:
    return n.op == "call_function" and "autopar.grouped_mm" in str(n.target)


def outline_token_regions(gm: fx.GraphModule, model: torch.nn.Module, call_args: dict, calls: dict,
                          call_outputs: dict | None = None) -> list[str]:
    """Outline every token-wise region of ``gm`` (traced from ``model``, nodes annotated); returns
    the module paths outlined. ``call_args``: module path -> its call's positional arguments
    (``trace.tensor_key`` of each tensor, else None); ``calls``: module path -> times called
    (a module called more than once is not outlined); ``call_outputs``: module path -> the keys
    of its call's output leaves (a module with side outputs is outlined only where its token
    output is found among them)."""
    from autopar.node_view import node_flops

    from autopar.data_dependent import DATA_DEPENDENT_KEY

    modules = dict(model.named_modules())
    paths = []
    for n in gm.graph.nodes:
        p = n.meta.get("autopar.module", "")
        if _is_grouped_mm(n) and p in modules and p not in paths:
            paths.append(p)
    # a module whose own ops have sizes that depend on values (``autopar.data_dependent``: experts
    # on the rows torch.where picks), where its submodules' ops are not all that do
    for n in gm.graph.nodes:
        p = n.meta.get("autopar.module", "")
        if n.meta.get(DATA_DEPENDENT_KEY) and n.op == "call_function" and p and p in modules and p not in paths and not any(
                p.startswith(q + ".") for q in paths):
            paths.append(p)
    done = []
    for path in paths:
        members = [n for n in gm.graph.nodes if n.op == "call_function"
                   and (n.meta.get("autopar.module", "") == path or n.meta.get("autopar.module", "").startswith(path + "."))]
        inside = set(members)
        inputs, state, foreign = [], [], False
        for a in dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in inside):
            if a.meta.get("autopar.kind") not in ("param", "buffer"):
                inputs.append(a)
            elif a.meta.get("autopar.fqn", "").startswith(path + "."):
                state.append(a)
            else:
                foreign = True  # reads another module's state: its own forward could not be called alone
        outputs = [n for n in members if any(u not in inside for u in n.users)]
        inputs = _in_call_order(inputs, call_args.get(path)) if calls.get(path) == 1 else None
        out, kept, side = _token_output(members, outputs)
        if side is not None and any(n.meta.get(DATA_DEPENDENT_KEY) for n in members):
            raise _side_output_error(modules[path], path, side)  # (left as ops, its sizes would stop the trace)
        if foreign or out is None or not inputs or not _token_wise(inputs, out):
            continue
        leaf = _output_leaf(out, (call_outputs or {}).get(path), single=len(outputs) == 1)
        if leaf is None:
            continue
        region = TokenRegion(modules[path], path, tuple(a.meta["autopar.fqn"][len(path) + 1:] for a in state),
                             len(inputs), leaf)
        experts = tuple(a.name for a in state if _only_grouped_weight(a, inside))
        with gm.graph.inserting_before(out):
            call = gm.graph.call_function(region, tuple(inputs) + tuple(state))
        call.meta = {k: v for k, v in out.meta.items() if k.startswith("autopar.") or k == "val"}
        call.meta[REGION_FLOPS_KEY] = sum(node_flops(n)[0] for n in members)
        call.meta[REGION_EXPERTS_KEY] = experts
        call.meta[REGION_GROUPED_KEY] = grouped_exchanges(members, out)
        call.meta["autopar.module"] = path
        out.replace_all_uses_with(call)
        for n in reversed(members):
            if n not in kept:  # (the side outputs' ops stay, for the planner to split)
                gm.graph.erase_node(n)
        # the call must come after every input (an input may be defined between the members)
        _move_after_inputs(gm.graph, call)
        done.append(path)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _token_output(members: list[fx.Node], outputs: list[fx.Node]) -> tuple[fx.Node | None, set, fx.Node | None]:
    """(the output computed from the experts, the members only the side outputs need, None) of a
    region's ``members``; (None, _, None) unless exactly one output depends on the experts'
    computation (grouped matmuls, data-dependent sizes); (None, _, that side output) where a side
    output depends on it too."""
    from autopar.data_dependent import DATA_DEPENDENT_KEY

    if len(outputs) == 1:
        return outputs[0], set(), None
    experts: set = set()  # the experts' computation and everything computed from it
    for n in members:  # (program order: producers first)
        if _is_grouped_mm(n) or n.meta.get(DATA_DEPENDENT_KEY) or any(a in experts for a in n.all_input_nodes):
            experts.add(n)
    token = [o for o in outputs if o in experts]
    if not token:
        return None, set(), None
    if len(token) > 1:
        return None, set(), min(token, key=_numel)  # (the smallest: the likelier loss)
    inside, kept, stack = set(members), set(), [o for o in outputs if o is not token[0]]
    while stack:
        n = stack.pop()
        if n in kept or n not in inside:
            continue
        assert n not in experts, "a node computed from the experts is in them or an output of its own"
        kept.add(n)
        stack.extend(n.all_input_nodes)
    return token[0], kept, None


def _numel(n: fx.Node) -> int:
    meta = n.meta.get("autopar.outputs", (None,))[0]
    return meta.numel if meta is not None else -1


def _side_output_error(module: torch.nn.Module, path: str, side: fx.Node) -> TraceError:
    meta = side.meta.get("autopar.outputs", (None,))[0]
    what = f"a value of shape {tuple(meta.shape)}" if meta is not None else "a value"
    return TraceError(
        f"autopar cannot plan module '{path}' ({type(module).__name__}): beside its output per token it returns "
        f"{what} computed from its experts' results (the rows each expert computed, or sizes that depend on the "
        "routing). autopar runs such experts whole on each device's own tokens, where that value would be each "
        "device's own, not the batch's. Compute values such as an auxiliary load-balancing loss from the router's "
        "probabilities and choices with static shapes (counts as F.one_hot(choice, num_experts).sum(0), not "
        "torch.bincount or the sizes of the rows torch.where picks), which autopar plans over the whole batch; see "
        "the README's 'Mixture of experts'.")


def _output_leaf(out: fx.Node, keys: list | None, single: bool) -> int | None:
    """Which leaf of the module's output ``out`` is (``TokenRegion.leaf``); None where it is not
    found. A module with one output node returning one tensor: leaf 0."""
    from autopar.traced_graph import tensor_key

    val = out.meta.get("val")
    if keys and isinstance(val, torch.Tensor) and tensor_key(val) in keys:
        return keys.index(tensor_key(val))
    return 0 if single and (keys is None or len(keys) == 1) else None


def _in_call_order(inputs: list[fx.Node], args: list | None) -> list[fx.Node] | None:
    """``inputs`` ordered as the module's positional arguments; None unless they are exactly the
    call's tensor arguments."""
    from autopar.traced_graph import tensor_key

    if not args or any(a is None for a in args):
        return None
    keyed = {}
    for n in inputs:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        keyed[tensor_key(val)] = n
    ordered = [keyed.get(a) for a in args]
    if any(n is None for n in ordered) or len(set(ordered)) != len(inputs):
        return None
    return ordered


def _only_grouped_weight(param: fx.Node, inside: set) -> bool:
    """Whether every use of ``param`` in the region is the weight of a grouped matmul (through
    transposes, views and casts): what expert parallelism can split over experts."""
    from autopar.node_view import op_name

    meta = param.meta["autopar.outputs"][0]
    if meta is None or len(meta.shape) != 3:
        return False
    frontier, seen = [param], False
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u not in inside:
                return False
            if _is_grouped_mm(u):
                if u.args[1] is not n:
                    return False
                seen = True
            elif op_name(u) in ("transpose", "permute", "view", "reshape", "to", "_to_copy", "contiguous"):
                frontier.append(u)
            else:
                return False
    return seen


def grouped_exchanges(members: list[fx.Node], out: fx.Node) -> tuple:
    """Per grouped matmul of a region (``REGION_GROUPED_KEY``): ``(rows, k, n, bytes per element,
    whether its routing (``offs``) is new, width of the rows sent to the experts' ranks (0: they
    are there already), widths of the values of its routing brought back (listed on the routing's
    first grouped matmul))``. Rows stay on the experts' ranks from a grouped matmul through
    ``ROW_LOCAL_OPS`` whose tensor operands are all rows of one routing, into the next grouped
    matmul over that routing; they come back where anything else (or the region's output) takes
    them, the value there being brought back. The rules of ``runtime.expert_dispatch``, on the
    traced ops."""
    from autopar.node_view import op_name

    inside = set(members)
    routing_of: dict = {}  # value -> the routing (offs node) whose rows it is, on the experts' ranks
    for n in members:  # in program order: producers first
        if _is_grouped_mm(n):
            routing_of[n] = n.args[2]
            continue
        name = op_name(n)
        if name not in ROW_LOCAL_OPS or (name in _LAST_DIM_OPS and not _splits_last_dim(n)):
            continue
        sources = {routing_of.get(a) for a in n.all_input_nodes}
        if len(sources) == 1 and None not in sources:
            routing_of[n] = sources.pop()
    back: dict = {}
    for v, offs in routing_of.items():
        kept = [u for u in v.users if u in inside and (
            (_is_grouped_mm(u) and u.args[0] is v and u.args[2] is offs) or routing_of.get(u) is offs)]
        if v is out or len(kept) < len(v.users):  # something else takes it: its rows come back
            back.setdefault(offs, []).append(v.meta["autopar.outputs"][0].shape[-1])
    entries, routings = [], set()
    for g in (n for n in members if _is_grouped_mm(n)):
        rows, k, n_out, item = _grouped_shapes(g)
        offs, new = g.args[2], g.args[2] not in routings
        chained = routing_of.get(g.args[0]) is offs
        entries.append((rows, k, n_out, item, new, 0 if chained else k, tuple(back.get(offs, ())) if new else ()))
        routings.add(offs)
    return tuple(entries)


def _splits_last_dim(n: fx.Node) -> bool:
    x = n.args[0].meta["autopar.outputs"][0]
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
    return x is not None and dim % len(x.shape) == len(x.shape) - 1


def _grouped_shapes(n: fx.Node) -> tuple[int, int, int, int]:
    """(rows, k, n, bytes per element) of a grouped matmul."""
    x = n.args[0].meta["autopar.outputs"][0]
    out = n.meta["autopar.outputs"][0]
    return (x.shape[0], x.shape[1], out.shape[1], x.itemsize)


def _token_wise(inputs: list[fx.Node], out: fx.Node) -> bool:
    metas = [a.meta.get("autopar.outputs", (None,)) for a in inputs + [out]]
    if any(len(m) != 1 or m[0] is None or not m[0].shape for m in metas):
        return False
    tokens = metas[-1][0].shape[0]
    return tokens > 1 and all(m[0].shape[0] == tokens for m in metas[:-1])


def _move_after_inputs(graph: fx.Graph, call: fx.Node) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(call.all_input_nodes, key=lambda a: order[a])
    if order[last] > order[call]:
        last.append(call)
