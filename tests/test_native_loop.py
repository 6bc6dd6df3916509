"""The torch-native training loop on a compiled model, against one device (issue 9).

``pm = autopar.compile(model, cluster)`` with nothing else; then the loop people write:
``loss_fn(pm(x), y).backward()``, ``clip_grad_norm_`` (a true global norm over DTensor
gradients), SGD with momentum and a ``StepLR`` built over ``pm.parameters()`` before the first
call. On 4 gloo processes, every step's loss and gradient norm and the final parameters (and
buffers: BatchNorm's running statistics) agree with single-device training within 1e-5
relative; ``torch.distributed.checkpoint.state_dict.get_model_state_dict(pm, full_state_dict=True)``
returns the user's keys with the full tensors. With ``batch="local"`` each rank reads only its
shard of the data (``DistributedSampler``), and the same holds against one device on the global batch.
"""
from __future__ import annotations

import pytest

import autopar
from autopar.runtime.parity import native_loop_suite

TOL = 1e-5
CASES = [
    ("gpt", {}),
    ("gpt", {"dp": 2, "tp": 2}),
    ("gpt", {"dp": 2, "tp": 2, "zero": 3}),
    ("gpt", {"dp": 4, "zero": 1}),  # the user's optimizer updates Shard(state_dim) views; gathered back
    ("gpt", {"dp": 4, "zero": 2}),
    ("cnn", {}),  # BatchNorm
    ("cnn", {"dp": 2, "tp": 2}),
    ("real:gpt2", {}),
    ("real:gpt2", {"dp": 2, "tp": 2, "zero": 3}),
    ("real:llama", {}),
    ("real:llama", {"dp": 2, "tp": 2}),
    # local batches: each rank reads its shard through DistributedSampler(num_replicas=pm.data_parallel_size,
    # rank=pm.data_parallel_rank); the reference reads the same samples as global batches
    ("gpt", {}, "local"),
    ("gpt", {"dp": 2, "tp": 2, "zero": 3}, "local"),
    ("cnn", {"dp": 2, "tp": 2}, "local"),
    ("real:gpt2", {}, "local"),
    ("real:llama", {"dp": 2, "tp": 2}, "local"),
]


@pytest.fixture(scope="module")
def results():
    return autopar.launch(native_loop_suite, 4, CASES, timeout_s=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c}-{k or 'free'}-{(m or ['global'])[0]}" for c, k, *m in CASES])
def test_native_loop_matches_one_device(results, index):
    r = results[index]
    label = f"{r['case']} {r['constraints'] or 'free plan'} ({r['batch']} batches) on {r['mesh']}"
    assert r["dtensor_params"], f"{label}: pm.parameters() are not all DTensors"
    assert r["loss_err"] <= TOL and r["norm_err"] <= TOL, f"{label}: loss err {r['loss_err']:.2e}, grad norm err {r['norm_err']:.2e}"
    assert r["param_err"] <= TOL, f"{label}: param err {r['param_err']:.2e} (worst {r['worst']})"
    assert r["dcp_keys_match"] and r["dcp_err"] <= TOL, f"{label}: get_model_state_dict keys/values differ ({r['dcp_err']})"
