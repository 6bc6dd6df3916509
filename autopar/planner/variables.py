"""The planning problem's per-node variable (``NodeVar``): a representative node's strategies
with their seconds and bytes. ``planner.problem`` builds them, ``planner.edge_tables`` prices the
edges between them, the ILP reads them."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

from autopar.strategies import Strategy

__all__ = ["NodeVar"]


@dataclass
class NodeVar:
    name: str
    node: fx.Node
    count: int
    strategies: list[Strategy]
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    static_bytes: np.ndarray  # parameters, grads, optimizer state (already x count)
    saved_bytes: np.ndarray  # activations kept for backward (x count, or x1 under recompute)
    in_block: bool
    excluded: list[tuple[str, str]] = field(default_factory=list)
    fallback: bool = False
    root: str | None = None  # set for followers: strategy i is paired with strategy i of ``root``
    transient_bytes: np.ndarray | None = None  # the op's working set while it runs (not x count: one runs at a time)
    # blocking communication of the strategy itself, seconds per collective kind (ZeRO-1/2's
    # post-step all-gather, a batch norm's statistics sync); None: none
    comm_kinds: dict[str, np.ndarray] | None = None

    @property
    def comm_s(self) -> np.ndarray | None:
        """``comm_kinds`` summed over the kinds: per strategy, seconds (None: none)."""
        return None if self.comm_kinds is None else sum(self.comm_kinds.values())
