"""Repeated-block detection: nodes of identical layers share one set of solver variables.

A *block instance* is a child of a container module addressed by an integer segment of the
module path (``blocks.7`` in ``blocks.7.attn.qkv``; the outermost such segment wins). Instances of
one container whose node sequences are structurally identical (same ops, shapes, internal wiring
and relative parameter names) form a class: node ``j`` of every instance maps to node ``j`` of
the first. Everything else maps to itself. The planner then solves over representatives only,
multiplying each representative's costs by its instance count.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch.fx as fx

from autopar.trace import tensor_inputs

__all__ = ["BlockInfo", "find_repeated_blocks", "MIN_INSTANCES_RENAMED_CONSTANTS"]

# Instances that differ only in the names of their graph constants (get_attr targets such as
# ``_tensor_constant0`` / ``_tensor_constant2``: Hugging Face decoders' per-layer KV-cache
# tensors) share decisions from this many instances on. With two, each instance is a boundary
# of the stack (the first follows the embedding, the last feeds the head) and often wants
# other layouts: sharing the two layers of the two-layer decoders of examples/real_models.py
# made their plans up to 6% slower (Phi, Gemma), for at most half the variables. Instances
# identical including those names share from two, as always.
MIN_INSTANCES_RENAMED_CONSTANTS = 3


@dataclass(frozen=True)
class BlockInfo:
    """``rep[name]``: the representative node name; ``count[rep]``: instances sharing it.

    ``blocks``: container-prefix -> list of instance prefixes that share decisions.
    ``instance_of[name]``: the block instance prefix a node belongs to (absent: not in a block).
    """

    rep: dict[str, str]
    count: dict[str, int]
    blocks: dict[str, list[str]]
    instance_of: dict[str, str]


def _instance_prefix(path: str) -> str | None:
    parts = path.split(".") if path else []
    for i, seg in enumerate(parts):
        if seg.isdigit() and i > 0:
            return ".".join(parts[: i + 1])
    return None


def _node_path(node: fx.Node) -> str:
    if node.op == "placeholder":
        return node.meta.get("autopar.fqn", "") or ""
    return node.meta.get("autopar.module", "") or ""


def _signature(nodes: list[fx.Node], prefix: str, extra=None, constant_names: bool = True) -> tuple:
    """``constant_names=False``: a graph constant (get_attr) counts by shape and dtype only."""
    index = {n: i for i, n in enumerate(nodes)}
    sig = [tuple(extra(n) for n in nodes)] if extra is not None else []
    for n in nodes:
        if n.op == "placeholder":
            rel = n.meta.get("autopar.fqn", "")[len(prefix):]
            sig.append(("ph", rel, n.meta["autopar.outputs"]))
            continue
        if n.op == "get_attr" and not constant_names:
            sig.append(("get_attr", n.meta.get("autopar.outputs")))
            continue
        ins = tuple(("in", index[a]) if a in index else ("ext",) for a in tensor_inputs(n))
        consts = tuple(
            a for a in n.args if not isinstance(a, (fx.Node, list, tuple))
        )
        sig.append((str(n.target), n.meta["autopar.outputs"], ins, repr(consts)))
    return tuple(sig)


def find_repeated_blocks(graph: fx.Graph, node_key=None) -> BlockInfo:
    """``node_key(node)``, when given, must also agree between instances that share decisions
    (the planner passes the user pins that apply to each node). Without one, kept per graph and
    its node names (``bounded_memo.memo_of``): a search asks once per mesh, stage count and
    baseline; callers must not change what they get."""
    from autopar.planner.bounded_memo import memo_of

    store = memo_of(graph) if node_key is None else None
    key = ("repeated_blocks", hash(tuple(n.name for n in graph.nodes)))
    if store is not None and key in store:
        return store[key]
    info = _find_repeated_blocks(graph, node_key)
    if store is not None:
        store[key] = info
    return info


def _find_repeated_blocks(graph: fx.Graph, node_key=None) -> BlockInfo:
    by_container: dict[str, dict[str, list[fx.Node]]] = defaultdict(lambda: defaultdict(list))
    instance_of: dict[str, str] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        prefix = _instance_prefix(_node_path(node))
        if prefix is None:
            continue
        container = prefix.rpartition(".")[0]
        by_container[container][prefix].append(node)
        instance_of[node.name] = prefix

    rep = {n.name: n.name for n in graph.nodes}
    count: dict[str, int] = defaultdict(int)
    blocks: dict[str, list[str]] = {}
    for container, instances in by_container.items():
        groups: dict[tuple, list[str]] = defaultdict(list)
        for prefix, nodes in instances.items():
            groups[_signature(nodes, prefix + ".", node_key)].append(prefix)
        # instances left alone, grouped again with constants by shape only
        renamed: dict[tuple, list[str]] = defaultdict(list)
        for sig, prefixes in list(groups.items()):
            if len(prefixes) == 1:
                del groups[sig]
                p = prefixes[0]
                renamed[_signature(instances[p], p + ".", node_key, constant_names=False)].append(p)
        classes = [ps for ps in groups.values()]
        classes += [ps for ps in renamed.values() if len(ps) >= MIN_INSTANCES_RENAMED_CONSTANTS]
        for prefixes in sorted(classes, key=lambda ps: list(instances).index(ps[0])):
            if len(prefixes) < 2:
                continue
            first = instances[prefixes[0]]
            blocks[f"{container}[{prefixes[0]}..{prefixes[-1]}]"] = prefixes
            for p in prefixes[1:]:
                for a, b in zip(instances[p], first):
                    rep[a.name] = b.name
    for name, r in rep.items():
        count[r] += 1
    return BlockInfo(rep=rep, count=dict(count), blocks=blocks, instance_of=instance_of)
