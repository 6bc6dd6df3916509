"""Causal attention on a context-parallel rank: this rank's query rows against the whole keys.

Under a context-parallel strategy (``strategies.rules.sdpa``: queries split along the sequence on
a context axis, keys and values all-gathered there by ``reshard``) a rank holds query rows
``[c * L, (c + 1) * L)`` of the sequence (``c``: its coordinate on the axis, ``L``: its rows).
``is_causal`` would mask them as rows ``[0, L)``; ``context_sdpa`` masks them by their global
positions instead (query ``i`` sees keys ``j <= c * L + i``, torch's top-left causal mask), and
skips the keys no row of this rank sees. Autograd flows through ``F.scaled_dot_product_attention``;
the keys' and values' gradients come back partial and their ``reshard`` reduce-scatters them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.runtime.collectives import current_mesh

__all__ = ["context_sdpa"]


def context_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale=None, enable_gqa: bool = False, *, axis: int) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this rank's query rows (split on mesh ``axis``) over
    whole keys and values, causal by global position when ``is_causal``."""
    if not is_causal:
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, False, scale=scale, enable_gqa=enable_gqa)
    rows = q.shape[-2]
    start = current_mesh().coords[axis] * rows
    end = min(start + rows, k.shape[-2])  # keys past this rank's last row are masked for every row
    mask = torch.ones(rows, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
    return F.scaled_dot_product_attention(q, k[..., :end, :], v[..., :end, :], mask, dropout_p, False, scale=scale,
                                          enable_gqa=enable_gqa)
