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

    @classmethod
    def for_plan(cls, plan: Plan) -> "PassContext":
        """Every stage's nodes at once (the passes rewrite the whole program; ``split_stages`` cuts
        it afterwards). Requires every stage to have the same submesh."""
        if len(plan.stages) == 1:
            return cls.for_stage(plan, 0)
        meshes = {s.mesh for s in plan.stages}
        if len(meshes) != 1:
            raise ValueError(f"stages with different submeshes ({sorted(meshes)}) need per-stage passes")
        first = plan.stages[0]
        whole = Stage(0, first.mesh, 0, tuple(n for s in plan.stages for n in s.nodes),
                      tuple(p for s in plan.stages for p in s.params))
        return cls(plan, whole, tuple(size for _, size in first.mesh))

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
