"""The pipeline runtime's protocol, the same on torch 2.11 and 2.13: what crosses a stage
boundary (integer, boolean and detached values in floating carriers; batch inputs fed to the
stage that uses them rather than sent) and tied weights held by every stage that uses them.
Their parity runs in ``tests/test_pipeline.py`` (``CASES_2``, ``CASES_4``) and
``tests/test_real_models.py``."""
from __future__ import annotations

import torch

import autopar
from autopar.passes.split_stages import split_stages
from autopar.testing.parity import build_case
from autopar.trace import trace_model


def _plan(case: str, world: int = 4, **constraints):
    model, batches, loss = build_case(case)
    x, y = batches[0]
    return autopar.plan(model, autopar.Cluster.local(world), x, loss_fn=loss, example_target=y,
                        constraints=autopar.Constraints(**constraints)), model, batches, loss


def test_integer_boolean_and_detached_values_cross_a_stage_boundary():
    """The routed MLP's cut sends an int64 index, a bool mask and a detached float (in floating
    carriers, ``runtime.pipeline.to_carrier``); the target is not sent, the last stage takes it
    from the batch (``passes.split_stages``: ``fed_names``). Parity: ``CASES_2``."""
    from autopar.planner.stages import carrier_dtype
    from autopar.runtime.pipeline import from_carrier, to_carrier

    plan, model, batches, loss = _plan("routed_mlp", 2, pp=2)
    x, y = batches[0]
    traced = trace_model(model, (x,), loss_fn=loss, example_target=y)
    planned = {n.name: s.index for s in plan.stages for n in s.nodes}
    programs = split_stages(traced.gm, planned, set(traced.param_fqns) | set(traced.buffer_fqns), 2)
    nodes = {n.name: n for n in traced.graph.nodes}
    sent = [nodes[n].meta["autopar.outputs"][0].dtype for n in programs[0].output_names]
    assert torch.int64 in sent and torch.bool in sent, sent
    assert programs[1].fed_names == (traced.target_name,) and traced.target_name not in programs[0].output_names
    for t in (torch.tensor([[3], [-1]]), torch.tensor([True, False]), torch.tensor([7, 9], dtype=torch.int32)):
        carried = to_carrier(t)
        assert carried.is_floating_point() and carried.dtype == carrier_dtype(t.dtype)
        assert torch.equal(from_carrier(carried, t.dtype), t)


class _TiedLM(torch.nn.Module):
    """Input and output embeddings tied, as GPT-2, Gemma and T5 are written."""

    def __init__(self, vocab=64, d=256, layers=4, tied=True):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)])
        self.head = None if tied else torch.nn.Parameter(torch.randn(vocab, d))

    def forward(self, idx):
        return self.layers(self.embed(idx)) @ (self.embed.weight if self.head is None else self.head).t()


def test_tied_weights_get_a_copy_on_each_stage_that_uses_them():
    """A parameter used on both sides of a cut is held by every stage using it (``Stage.params``,
    each stage program's state), so the model is cut between its layers rather than after its
    head; the copies' gradient sum is priced (once per step, after the schedule): the same model
    untied is cut alike and predicted faster."""
    from autopar.passes.split_stages import shared_state

    idx = torch.randint(0, 64, (8, 32))

    def loss(out, y):
        return torch.nn.functional.cross_entropy(out.reshape(-1, 64), y.reshape(-1))

    model = _TiedLM()
    base = autopar.Cluster.local(2, calibrated=False)
    plan = autopar.plan(model, base, idx, loss_fn=loss, example_target=idx, constraints=autopar.Constraints(pp=2))
    holders = [s.index for s in plan.stages if any(p.fqn == "embed.weight" for p in s.params)]
    assert holders == [0, 1] and all(len(s.params) > 1 for s in plan.stages)
    traced = trace_model(model, (idx,), loss_fn=loss, example_target=idx)
    assert shared_state(plan) == {"p_embed_weight"}
    planned = {n.name: s.index for s in plan.stages for n in s.nodes}
    programs = split_stages(traced.gm, planned, set(traced.param_fqns), 2, shared_state(plan))
    assert all("p_embed_weight" in p.state_names for p in programs)
    # the same model with its head untied: the same cut and work, but no copies to sum
    untied = _TiedLM(tied=False)
    free = autopar.plan(untied, base, idx, loss_fn=loss, example_target=idx, constraints=autopar.Constraints(pp=2))
    assert [s.span for s in free.stages] == [s.span for s in plan.stages]
    assert plan.predicted.step_time_s > free.predicted.step_time_s
