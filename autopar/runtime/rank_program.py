"""``RankProgram``: a per-rank program with what running it needs (its plan and traced graph, the
layouts of its inputs and loss, the example every call's batch is checked against).
``ParallelModel`` holds one per kind of step; its input checks read them."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from autopar.ir import LOCAL_OUTPUTS_KEY, LOSS_LAYOUT_KEY
from autopar.layouts import parse_layout
from autopar.loss_rewrite import token_count_program
from autopar.runtime.input_checks import Example, example_spec

__all__ = ["RankProgram"]


@dataclass(frozen=True)
class RankProgram:
    """A per-rank program with what running it needs (training, or evaluation in eval mode)."""

    plan: Any
    traced: Any
    program: fx.GraphModule
    loss_reduction: str
    input_layouts: dict
    loss_layout: Any
    example: Example  # what every call's batch is checked against

    @property
    def placeholders(self) -> list[str]:
        return [n.name for n in self.program.graph.nodes if n.op == "placeholder"]

    @functools.cached_property
    def token_count(self) -> fx.GraphModule | None:
        """The count the loss's token mean divides by, as a program of a microbatch's whole batch
        tensors (``loss_rewrite.token_count_program``), where there are microbatches to weigh."""
        if self.plan.microbatches == 1 or self.loss_reduction != "mean":
            return None
        return token_count_program(self.traced.gm)

    @property
    def rows_mask(self) -> list[bool]:
        """Per returned value (the flat output list): whether it is handed over as this rank's rows
        (local batches, ``ir.LOCAL_OUTPUTS_KEY``) rather than whole."""
        out = next(n for n in self.traced.graph.nodes if n.op == "output")
        rows = out.meta.get(LOCAL_OUTPUTS_KEY, ())
        values = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
        return [isinstance(v, fx.Node) and v.name in rows for v in values]

    @classmethod
    def of(cls, plan, traced, program: fx.GraphModule, loss_reduction: str, example: tuple | None) -> "RankProgram":
        """With the layouts the plan gives the inputs and target, and the loss's layout.
        ``example``: (inputs, target) as compiled, or None (the traced shapes)."""
        layouts = {n.name: n.outs[0] for n in plan.nodes.values() if n.outs and n.outs[0] != "-"}
        inputs = {name: parse_layout(layouts[name]) for name in traced.input_names + [traced.target_name]
                  if name and name in layouts}  # not a tensor (None for an optional argument): no layout
        loss = parse_layout(program.meta[LOSS_LAYOUT_KEY]) if LOSS_LAYOUT_KEY in program.meta else None
        return cls(plan, traced, program, loss_reduction, inputs, loss, example_spec(traced, plan.microbatches, example))
