"""What a sharding rule reads and returns: ``OpView`` (an fx node's schema-bound arguments and
tensor metadata, from ``autopar.node_view``) and ``AxisOption`` (placements on one mesh axis).
The rules live in ``strategies.rules`` (and ``strategies.conv_rules``); the engine in
``autopar.strategies``.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.layouts import Placement
from autopar.node_view import OpView

__all__ = ["AxisOption", "OpView"]


@dataclass(frozen=True)
class AxisOption:
    """Placements on one mesh axis: one per tensor input (``None`` = any, unused) and per output."""

    ins: tuple[Placement | None, ...]
    outs: tuple[Placement, ...]
    divides: int = 0  # when set, the option is valid only on axes whose size divides it (conv groups)
    context: bool = False  # when set, the option is valid only on a context axis (``layouts.CONTEXT_AXIS_NAMES``)
