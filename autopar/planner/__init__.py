"""The planner: mesh search outside, ILP over per-node strategies inside (see ``search``)."""
