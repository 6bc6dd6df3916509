"""What every pass reads: the plan's per-node layouts for one stage and the mesh shape."""
from __future__ import annotations

from dataclasses import dataclass

from autopar.plan import Plan, Stage

__all__ = ["PassContext"]


@dataclass(frozen=True)
class PassContext:
    plan: Plan
    stage: Stage
    mesh_shape: tuple[int, ...]

    @classmethod
    def for_stage(cls, plan: Plan, index: int = 0) -> "PassContext":
        stage = plan.stages[index]
        return cls(plan, stage, tuple(size for _, size in stage.mesh))

    @property
    def policy(self):
        """The plan's precision policy (``cost_models.memory.PrecisionPolicy``)."""
        from autopar.cost_models.memory import precision_policy

        return precision_policy(self.plan.precision)

    def node(self, name: str):
        return self._nodes[name]

    @property
    def _nodes(self):
        cache = self.__dict__.get("_node_cache")
        if cache is None:
            cache = {n.name: n for n in self.stage.nodes}
            object.__setattr__(self, "_node_cache", cache)
        return cache
