"""Parity of the sharded program with single-device training, on real gloo processes.

Each rank compiles the model under a forced plan family and trains 5 steps on the global batches,
with SGD with momentum or AdamW by turns (``parity_suite``: each list holds both for every model
and most families; SGD only for the nanoGPT-style model); rank 0 also trains a single-device
reference; the loss at every step and every parameter after the last step must agree within 1e-5
relative (per tensor, see ``relative_error``). All families of one world size share one launch to
keep CI time down.
"""
from __future__ import annotations

import pytest

import autopar
from autopar.testing.parity import parity_failures, parity_suite

TOL = 1e-5
MEGATRON_MLP = {"layers.*.up.weight": {"tp": "S(0)"}, "layers.*.down.weight": {"tp": "S(1)"}}
SEQUENCE_PARALLEL = {"blocks.*.ln_1": {"tp": "S(1)"}, "blocks.*.ln_2": {"tp": "S(1)"}}

CASES_2 = [
    ("gpt", {"dp": 2, "tp": 1, "zero": 0}),
    ("gpt", {"dp": 1, "tp": 2}),
    ("gpt", {"dp": 2, "tp": 1, "zero": 3}),
    ("gpt", {"tp": 2, "outputs": SEQUENCE_PARALLEL}),
    ("gpt", {}),
    ("gpt_tuple", {"dp": 2, "tp": 1}),
    ("gpt", {"dp": 2, "tp": 1, "microbatches": 2}),
    ("gpt_padded", {"dp": 2, "tp": 1, "zero": 0, "microbatches": 4}),
    ("mlp", {"dp": 2, "tp": 1, "zero": 0}),
    ("mlp", {"tp": 2, "placements": MEGATRON_MLP}),
    ("mlp", {"dp": 2, "zero": 3}),
    ("mlp", {"dp": 2, "zero": 2}),
    # the biases' gradients bucketed together across the ZeRO-2 weights between them
    ("mlp", {"dp": 2, "zero": 0, "zero_params": {"layers.*.weight": 2}}),
    ("odd_mlp", {"dp": 2, "zero": 3}),
    ("mlp", {}),
    ("tiny_llama", {"dp": 2, "tp": 1}),
    ("tiny_llama", {"tp": 2}),
    ("manual_gpt", {"dp": 2, "tp": 1}, "sgd"),
    ("manual_gpt", {"tp": 2}, "sgd"),
    ("cnn", {"dp": 2, "tp": 1}),
    ("cnn", {"tp": 2}),
]
CASES_4 = [
    ("gpt", {"dp": 4, "tp": 1, "zero": 0}),
    ("gpt", {"dp": 1, "tp": 4}),
    ("gpt", {"dp": 2, "tp": 2}),
    ("gpt", {"dp": 4, "zero": 3}),
    ("gpt", {"dp": 2, "tp": 2, "outputs": SEQUENCE_PARALLEL}),
    ("gpt", {"dp": 2, "tp": 2, "microbatches": 2, "zero": 3}),
    ("gpt_padded", {"dp": 2, "tp": 2, "microbatches": 2}),
    ("gpt", {}),
    ("mlp", {"dp": 2, "tp": 2}),
    ("mlp", {"tp": 4, "placements": MEGATRON_MLP}),
    ("mlp", {"dp": 4, "zero": 3}),
    ("odd_mlp", {"dp": 4, "zero": 3}),
    ("odd_mlp", {"dp": 2, "tp": 2, "zero": 3}),
    ("mlp", {}),
    ("tiny_llama", {"dp": 2, "tp": 2}),
    ("tiny_llama", {"dp": 4, "zero": 3}),
    ("manual_gpt", {"dp": 2, "tp": 2}, "sgd"),
    ("cnn", {"dp": 2, "tp": 2}),
    ("write_view", {}),
    ("write_view", {"dp": 4, "zero": 3}),
]


def _check(results):
    failures = [line for r in results for line in parity_failures(r, TOL)]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_parity_two_ranks():
    results = autopar.launch(parity_suite, 2, CASES_2)
    _check(results[0])
    # every rank reports the same losses (the loss is global)
    assert [r["losses"] for r in results[0]] == [r["losses"] for r in results[1]]


@pytest.mark.slow
def test_parity_four_ranks():
    results = autopar.launch(parity_suite, 4, CASES_4)
    _check(results[0])
    meshes = {(r["case"], str(r["constraints"])): r["mesh"] for r in results[0]}
    assert {r["optimizer"] for r in results[0]} == {"adamw", "sgd"}
    assert meshes[("gpt", str({"dp": 2, "tp": 2}))] == {"dp": 2, "tp": 2}
