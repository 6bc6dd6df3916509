"""Dimension bookkeeping for reshapes: which output dim each sharded input dim becomes."""
from __future__ import annotations

from typing import Sequence

__all__ = ["reshape_groups", "reshape_dim_map"]


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split a reshape into groups of input dims and output dims with equal products.

    Size-1 dims are left out (they are never sharded). Each group maps a run of consecutive input
    dims onto a run of consecutive output dims, e.g. ``[B, T, C] -> [B, T, H, D]`` gives
    ``([0],[0]), ([1],[1]), ([2],[2, 3])``.
    """
    ins = [i for i, s in enumerate(in_shape) if s != 1]
    outs = [j for j, s in enumerate(out_shape) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(ins) and j < len(outs):
        gi, gj = [ins[i]], [outs[j]]
        pi, pj = in_shape[ins[i]], out_shape[outs[j]]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                if i >= len(ins):
                    raise ValueError(f"reshape {tuple(in_shape)} -> {tuple(out_shape)} changes numel")
                gi.append(ins[i])
                pi *= in_shape[ins[i]]
                i += 1
            else:
                if j >= len(outs):
                    raise ValueError(f"reshape {tuple(in_shape)} -> {tuple(out_shape)} changes numel")
                gj.append(outs[j])
                pj *= out_shape[outs[j]]
                j += 1
        groups.append((gi, gj))
    return groups


def reshape_dim_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[int, int]:
    """Input dim -> output dim for every input dim a shard may pass through unchanged.

    Only the leading dim of each group can carry a shard: cutting it into contiguous blocks cuts
    the leading output dim of the group into contiguous blocks (given divisibility, which the
    caller checks on both shapes).
    """
    return {gi[0]: gj[0] for gi, gj in reshape_groups(in_shape, out_shape)}
