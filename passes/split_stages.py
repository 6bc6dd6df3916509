"""Cut a rank's sharded program into pipeline stage programs (``Plan.stages``).

Hand-written rather than ``torch.fx.passes.split_module``: that splitter hands every submodule
its inputs straight from the root graph, while a pipeline stage can only receive from the stage
before it. Here a value produced in stage ``i`` and used in stage ``j > i + 1`` is passed through
every stage in between (as ``torch.distributed.pipelining`` needs: one send, one receive per
boundary).

Invariants of the result (``split_stages``):

* stage ``s``'s graph takes, in order, its own parameters and buffers (the placeholders the plan
  puts in stage ``s``, and the shared ones it uses), then what it receives: for stage 0 the program's batch inputs (and
  target), for ``s > 0`` exactly the values stage ``s - 1`` returns, in the same order, then
  the batch inputs it uses itself (``fed_names``: every rank holds the batch, so a later stage
  takes what it uses of it directly rather than through the stages before it);
* a stage other than the last returns the values live across its end boundary (produced in a
  stage ``<= s`` and used in a stage ``> s``, batch inputs excepted), in program order; the last
  returns what the program returns;
* every node runs in exactly one stage, at or after the stage of each of its inputs; parameter
  and buffer placeholders keep their names (checkpoints and the store find them by name); only
  a shared parameter appears in several stages.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

__all__ = ["StageProgram", "split_stages", "stage_of_nodes", "shared_state", "StageSplitError"]


class StageSplitError(RuntimeError):
    """A program that cannot be cut where the plan says (an internal error: the planner only cuts
    where every value crossing a boundary is a tensor and no parameter is used on both sides)."""


@dataclass(frozen=True)
class StageProgram:
    index: int
    gm: fx.GraphModule
    state_names: tuple[str, ...]  # parameter / buffer placeholders this stage owns, in order
    input_names: tuple[str, ...]  # what it receives (stage 0: the program's batch inputs)
    output_names: tuple[str, ...]  # what it sends on (the last stage: the program's outputs)
    fed_names: tuple[str, ...] = ()  # batch inputs a later stage takes directly, after what it receives


def shared_state(plan) -> frozenset[str]:
    """The parameter placeholders a pipeline plan puts in several stages (tied weights)."""
    seen: dict[str, int] = {}
    for s in plan.stages:
        for p in s.params:
            seen[p.node] = seen.get(p.node, 0) + 1
    return frozenset(n for n, k in seen.items() if k > 1)


def stage_of_nodes(program: fx.GraphModule, planned: dict[str, int], state: set[str],
                   shared: frozenset[str] = frozenset()) -> dict[str, int]:
    """Each program node's stage: the plan's where it names the node; a ``getitem`` runs with
    what it indexes; a node the passes inserted (a collective, a cast, an outlined recompute
    block) runs with its earliest user, so what crosses a boundary is a value the plan placed
    (in its planned layout). State placeholders (``state``) go to the stage of their first user,
    other placeholders (the batch) to stage 0. A state placeholder may be used in later stages
    only if it is ``shared`` (a tied parameter: each of those stages holds a copy)."""
    nodes = list(program.graph.nodes)
    last = max(planned.values(), default=0)
    stage: dict[str, int] = {}
    for n in nodes:
        if n.op == "output":
            stage[n.name] = last
        elif n.op == "call_function" and n.target is operator.getitem and n.args and isinstance(n.args[0], fx.Node) \
                and n.args[0].name in stage:
            stage[n.name] = stage[n.args[0].name]
        elif n.name in planned and n.op not in ("placeholder", "get_attr"):  # a constant: with its users
            stage[n.name] = planned[n.name]
        elif n.op == "call_module" and (inside := _planned_inside(program, n, planned)) is not None:
            stage[n.name] = inside
    for n in reversed(nodes):  # inserted nodes: with their earliest user
        if n.op == "placeholder" or n.name in stage:
            continue
        users = [stage[u.name] for u in n.users if u.name in stage]
        stage[n.name] = min(users) if users else max((stage.get(a.name, 0) for a in n.all_input_nodes), default=0)
    for n in nodes:
        if n.op == "placeholder":
            users = [stage[u.name] for u in n.users if u.op != "output"]
            stage[n.name] = min(users) if n.name in state and users else 0
    for n in nodes:
        for a in n.all_input_nodes:
            if stage[a.name] > stage[n.name]:
                raise StageSplitError(f"node '{n.name}' runs in stage {stage[n.name]} but uses '{a.name}' from the later "
                                      f"stage {stage[a.name]}")
    for n in nodes:
        if n.op == "placeholder" and n.name in state and n.name not in shared:
            late = [u.name for u in n.users if u.op != "output" and stage[u.name] != stage[n.name]]
            if late:
                raise StageSplitError(f"'{n.name}' is used in stage {stage[n.name]} and by '{late[0]}' in stage "
                                      f"{stage[late[0]]}: a parameter belongs to one stage")
    return stage


def _planned_inside(program: fx.GraphModule, n: fx.Node, planned: dict[str, int]) -> int | None:
    """The stage of an outlined submodule (``outline_recompute``: its nodes keep their names and
    never span stages): that of the planned nodes it runs, None if it runs none."""
    from autopar.passes.analysis import outlined_graph

    graph = outlined_graph(program, n)
    stages = {planned[m.name] for m in graph.nodes if m.name in planned and m.op != "placeholder"} if graph else set()
    if len(stages) > 1:
        raise StageSplitError(f"the outlined submodule '{n.target}' runs nodes of stages {sorted(stages)}")
    return stages.pop() if stages else None


def split_stages(program: fx.GraphModule, planned: dict[str, int], state: set[str], stages: int,
                 shared: frozenset[str] = frozenset()) -> list[StageProgram]:
    """``program`` cut into ``stages`` stage programs (see the module docstring). ``planned``:
    the plan's stage of each traced node; ``state``: the names of parameter and buffer
    placeholders; ``shared``: those of them every stage that uses them holds (tied parameters)."""
    stage = stage_of_nodes(program, planned, state, shared)
    nodes = list(program.graph.nodes)
    out_node = next(n for n in nodes if n.op == "output")
    position = {n.name: i for i, n in enumerate(nodes)}
    last_use: dict[str, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            last_use[a.name] = max(last_use.get(a.name, -1), stage[n.name])
    batch = [n for n in nodes if n.op == "placeholder" and n.name not in state]
    # values live across boundary b (between stages b and b + 1); the batch is fed, not sent
    crossing: list[list[fx.Node]] = []
    for b in range(stages - 1):
        live = [n for n in nodes if n.op not in ("output", "placeholder") and stage[n.name] <= b
                and last_use.get(n.name, -1) > b]
        for n in live:
            if _is_container(n):
                raise StageSplitError(f"'{n.name}' crosses the boundary after stage {b} but is not a tensor")
        crossing.append(sorted(live, key=lambda n: position[n.name]))
    result = []
    for s in range(stages):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        own = [n for n in nodes if n.op == "placeholder" and n.name in state
               and (stage[n.name] == s or n.name in shared and any(stage[u.name] == s for u in n.users))]
        received = batch if s == 0 else crossing[s - 1]
        fed = [] if s == 0 else [n for n in batch if any(stage[u.name] == s for u in n.users)]
        for n in own + received + fed:
            ph = g.placeholder(n.name)
            ph.meta = dict(n.meta)
            env[n] = ph
        for n in nodes:
            if n.op in ("placeholder", "output") or stage[n.name] != s:
                continue
            env[n] = g.node_copy(n, lambda a: env[a])
        if s == stages - 1:
            g.output(fx.map_arg(out_node.args[0], lambda a: env[a]))
            outputs = tuple(a.name for a in out_node.all_input_nodes)
        else:
            g.output(tuple(env[n] for n in crossing[s]))
            outputs = tuple(n.name for n in crossing[s])
        gm = fx.GraphModule(program, g)
        gm.meta.update(program.meta)
        result.append(StageProgram(s, gm, tuple(n.name for n in own), tuple(n.name for n in received), outputs,
                                   tuple(n.name for n in fed)))
    return result


def _is_container(n: fx.Node) -> bool:
    val = n.meta.get("val")
    return isinstance(val, (tuple, list))
