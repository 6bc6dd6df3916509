"""Keys of the metadata a token-wise region's node carries (``regions`` outlines it; the sharding
rules, the IR helpers and the cost model read it): one vocabulary below all of them."""
from __future__ import annotations

__all__ = ["REGION_FLOPS_KEY", "REGION_EXPERTS_KEY", "REGION_GROUPED_KEY"]

REGION_FLOPS_KEY = "autopar.region_flops"  # its ops' forward FLOPs
REGION_EXPERTS_KEY = "autopar.region_experts"  # its expert weights (parameter node names): split over experts
# its grouped matmuls: (rows, k, n, bytes per element, whether its row counts are new) each
REGION_GROUPED_KEY = "autopar.region_grouped"
