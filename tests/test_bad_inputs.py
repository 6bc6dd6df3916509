"""Every bad input a user can give is refused with an autopar error that names what is wrong and
what fixes it: never a raw error from torch, OR-Tools or Python, never silently accepted (issue 8).

All single-process: ``autopar.plan`` needs no process group; ``autopar.compile`` runs on a
one-process cluster (the ``world1`` fixture). Checks that fire before the search keep these fast.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import Cluster, Constraints, LinkSpec, PeakFlops
from autopar.cli import main
from autopar.errors import (
    AutoparError,
    ClusterSpecError,
    ConstraintError,
    PlanFormatError,
    PlanMismatchError,
    TraceError,
)


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


X = torch.randn(8, 8)


def _plan(model=None, cluster=None, x=X, **kw):
    return autopar.plan(model if model is not None else _mlp(), cluster or Cluster.local(2), x, **kw)


# ----------------------------------------------------------------------------- placements and axes


def test_annotate_output_on_unknown_axis_names_the_axes_and_pp():
    # before: accepted, then "tuple.index(x): x not in tuple" from inside the planner
    with pytest.raises(ConstraintError, match=r"mesh axis 'pp'.*the mesh axes are 'dp', 'tp', 'ep', 'dp_shard' and 'cp'.*Constraints\(pp=\.\.\.\)"):
        autopar.annotate(_mlp()[0], output={"pp": "S(0)"})


def test_annotate_parameter_on_unknown_axis():
    with pytest.raises(ConstraintError, match=r"Linear\.weight names mesh axis 'xp'.*'dp', 'tp', 'ep', 'dp_shard' and 'cp'"):
        autopar.annotate(nn.Linear(2, 2), weight={"xp": "S(0)"})


def test_constraints_placement_on_unknown_axis():
    with pytest.raises(ConstraintError, match=r"placement pin 'fc1\.weight' names mesh axis 'pp'.*'dp', 'tp', 'ep', 'dp_shard' and 'cp'.*Constraints\(pp="):
        Constraints(placements={"fc1.weight": {"pp": "S(0)"}})
    # 'ep' is an axis of ('dp', 'ep') meshes only: checked when planning (test_experts)
    Constraints(placements={"fc1.weight": {"ep": "S(0)"}})


def test_mesh_axes_match_the_planner():
    from autopar.constraints import MESH_AXES
    from autopar.planner.constraint_filter import AXES

    assert MESH_AXES == AXES


def test_schedules_match_the_planner_and_the_runtime():
    # Constraints(schedule=) accepts exactly the schedules the planner prices and the runtime runs
    from autopar.constraints import SCHEDULES
    from autopar.planner.stages import PIPELINE_SCHEDULES
    from autopar.runtime.pipeline import SCHEDULE_CLASSES

    assert set(SCHEDULES) == set(PIPELINE_SCHEDULES) == set(SCHEDULE_CLASSES)


@pytest.mark.parametrize("text, hint", [
    ("S(x)", r"bad placement 'S\(x\)'"),
    ("Shard(0)", r"bad placement 'Shard\(0\)' \(did you mean 'S\(0\)'\?\)"),
    ("Replicate()", r"bad placement 'Replicate\(\)' \(did you mean 'R'\?\)"),
    ("Q", r"bad placement 'Q'"),
])
def test_bad_placement_strings_name_the_accepted_forms(text, hint):
    with pytest.raises(ConstraintError, match=hint + r".*accepted forms are 'R'.*'S\(<dim>\)'.*'P\(sum\)'"):
        Constraints(placements={"0.weight": {"tp": text}})
    with pytest.raises(ConstraintError, match=hint):
        autopar.annotate(nn.Linear(2, 2), weight={"tp": text})


def test_placement_of_a_wrong_type():
    # before: TypeError "unknown placement 3"
    with pytest.raises(ConstraintError, match=r"on axis 'tp': a placement must be a string such as 'S\(0\)'.*got int 3"):
        Constraints(placements={"0.weight": {"tp": 3}})
    with pytest.raises(ConstraintError, match=r"Constraints\.placements must be a dict"):
        Constraints(placements=["0.weight"])
    with pytest.raises(ConstraintError, match=r"must map mesh axis names to placements, e\.g\. \{'tp': 'S\(0\)'\}"):
        Constraints(placements={"0.weight": "S(0)"})


def test_torch_placement_objects_are_accepted():
    from torch.distributed.tensor import Shard

    assert Constraints(placements={"0.weight": {"tp": Shard(1)}}).placements == (("0.weight", (("tp", "S(1)"),)),)


def test_negative_dim_and_partial_parameter_pins():
    # before: accepted, then "no plan satisfies the constraints" from the solver
    with pytest.raises(ConstraintError, match=r"'S\(-1\)' counts dims from the end; write the dim counted from 0.*S\(1\)"):
        Constraints(placements={"0.weight": {"tp": "S(-1)"}})
    with pytest.raises(ConstraintError, match=r"a parameter cannot be 'P\(sum\)'.*pin a parameter 'R'.*'S\(<dim>\)'"):
        Constraints(placements={"0.weight": {"tp": "P(sum)"}})
    assert Constraints(outputs={"0": {"tp": "P(sum)"}}).outputs  # an output may be partial


def test_pin_on_a_dim_the_parameter_does_not_have():
    # before: "no plan satisfies the constraints (one-strategy)", after a search
    with pytest.raises(ConstraintError, match=r"'0\.weight' shards dim 5 on axis 'tp', but parameter '0\.weight' has "
                                              r"shape \(16, 8\) \(dims 0 to 1\); pin 'S\(0\)', 'S\(1\)' or 'R'"):
        _plan(constraints=Constraints(tp=2, placements={"0.weight": {"tp": "S(5)"}}))


def test_output_pin_on_a_dim_the_output_does_not_have():
    model = _mlp()
    autopar.annotate(model[0], output={"tp": "S(7)"})
    with pytest.raises(ConstraintError, match=r"output pin '0' shards dim 7 on axis 'tp'.*shape \(8, 16\).*'S\(0\)', 'S\(1\)' or 'R'"):
        _plan(model, constraints=Constraints(tp=2))


def test_output_pin_on_the_top_level_model_is_refused_not_ignored():
    # before: accepted and silently ignored (no module output matched the root)
    with pytest.raises(ConstraintError, match=r"output pin on the top-level model.*not supported.*annotate\(model\.head, output="):
        _plan(autopar.annotate(_mlp(), output={"tp": "S(1)"}), constraints=Constraints(tp=2))


# ----------------------------------------------------------------------------- degrees and settings


@pytest.mark.parametrize("kw, match", [
    ({"data_parallel": 2}, r"unknown setting 'data_parallel'; the settings are dp, tp, pp"),
    ({"microbatch": 2}, r"unknown setting 'microbatch'; did you mean 'microbatches'\?"),
])
def test_unknown_constraint_keyword(kw, match):
    # before: TypeError "__init__() got an unexpected keyword argument"
    with pytest.raises(ConstraintError, match=match):
        Constraints(**kw)


@pytest.mark.parametrize("kw, match", [
    ({"dp": 0}, r"Constraints\.dp must be a positive integer or None, got 0"),
    ({"tp": -2}, r"Constraints\.tp must be a positive integer or None, got -2"),
    ({"dp": 2.0}, r"Constraints\.dp must be a positive integer or None, got 2\.0"),
    ({"microbatches": 0}, r"Constraints\.microbatches must be a positive integer or None, got 0"),
    ({"zero": 5}, r"Constraints\.zero must be 0, 1, 2 or 3 \(ZeRO stage\), got 5"),
    ({"recompute": "yes"}, r"Constraints\.recompute must be True, False or None"),
    ({"schedule": "zigzag"}, r"unknown schedule 'zigzag'; known schedules: gpipe, 1f1b"),
])
def test_bad_degrees(kw, match):
    with pytest.raises(ConstraintError, match=match):
        Constraints(**kw)


def test_degrees_that_do_not_fit_the_cluster():
    with pytest.raises(ConstraintError, match=r"dp=3 does not divide the 4 devices of the cluster; choose a divisor of 4"):
        _plan(cluster=Cluster.local(4), constraints=Constraints(dp=3))
    with pytest.raises(ConstraintError, match=r"dp=2 x tp=4 = 8 but the cluster has 4 devices; the product must equal"):
        _plan(cluster=Cluster.local(4), constraints=Constraints(dp=2, tp=4))


def test_microbatches_and_dp_that_do_not_divide_the_batch():
    # before: microbatches=3 on a batch of 8 was planned (compile failed later); dp=4 on 6 ran the search to "no plan"
    with pytest.raises(ConstraintError, match=r"microbatches=3 does not divide the batch of 8.*microbatches in \{1, 2, 4, 8\}"):
        _plan(constraints=Constraints(microbatches=3))
    with pytest.raises(ConstraintError, match=r"dp=4 cannot split the batch of 6 evenly.*multiple of 4.*dp in \{1, 2, 3, 6\}"):
        _plan(cluster=Cluster.local(4), x=torch.randn(6, 8), constraints=Constraints(dp=4))
    with pytest.raises(ConstraintError, match=r"microbatches=2 with dp=4: each microbatch of 2 samples.*multiple of microbatches x dp = 8"):
        _plan(cluster=Cluster.local(4), x=torch.randn(4, 8), constraints=Constraints(dp=4, microbatches=2))


def test_unknown_optimizer_and_precision_name_the_known_ones():
    with pytest.raises(ConstraintError, match=r"unknown optimizer 'adamx'; known optimizers: sgd, sgd-momentum, adam, adamw"):
        _plan(optimizer="adamx")
    with pytest.raises(ConstraintError, match=r"unknown precision policy 'fp16'; known policies: fp32, bf16-mixed"):
        _plan(precision="fp16")


def test_bad_solver_and_device_type():
    with pytest.raises(ConstraintError, match=r"solver must be an autopar\.SolverConfig.*got str"):
        _plan(solver="fast")
    with pytest.raises(ConstraintError, match=r"SolverConfig\.time_limit_s must be a positive number of seconds, got -1"):
        _plan(solver=autopar.SolverConfig(time_limit_s=-1))
    with pytest.raises(ConstraintError, match=r"SolverConfig\.proof_gap must be a relative gap in \[0, 1\).*got 5"):
        _plan(solver=autopar.SolverConfig(proof_gap=5))
    with pytest.raises(ConstraintError, match=r"device_type must be 'cpu', 'cuda' or None.*'tpu'"):
        _plan(device_type="tpu")


# ----------------------------------------------------------------------------- model, inputs, loss


def test_example_inputs_that_are_not_tensors():
    with pytest.raises(TraceError, match=r"got a dict with keys \['x'\]\. Pass a tuple in forward's argument order"):
        _plan(x={"x": X})
    with pytest.raises(TraceError, match=r"example_inputs must be a tensor or a tuple of tensors.*got str 'hello'"):
        _plan(x="hello")


def test_model_that_is_not_a_module():
    # before: AttributeError "'function' object has no attribute 'named_modules'"
    with pytest.raises(TraceError, match=r"model must be a torch\.nn\.Module, got function"):
        _plan(model=lambda x: x)


def test_model_without_parameters():
    # before: planned (and compile failed in torch: "optimizer got an empty parameter list")
    with pytest.raises(TraceError, match=r"model \(GELU\) has no parameters.*nn\.ModuleList"):
        _plan(model=nn.GELU())


def test_model_with_every_parameter_frozen():
    model = _mlp().requires_grad_(False)
    with pytest.raises(TraceError, match=r"none of the 4 parameters .* requires a gradient.*requires_grad_\(True\)"):
        _plan(model)


def test_loss_fn_returning_a_non_scalar():
    # before: planned as if it were a loss
    per_sample = lambda out, tgt: (out - tgt).pow(2).mean(1)  # noqa: E731
    with pytest.raises(TraceError, match=r"loss_fn must return a scalar.*<lambda> returned a tensor of shape \[8\]\. "
                                         r"Reduce it over the batch with \.mean\(\) or \.sum\(\)"):
        _plan(loss_fn=per_sample, example_target=torch.randn(8, 8))
    with pytest.raises(TraceError, match=r"returned 2 values"):
        _plan(loss_fn=lambda o, t: (o.sum(), t.sum()), example_target=torch.randn(8, 8))
    with pytest.raises(TraceError, match=r"returned int 3, not a tensor"):
        _plan(loss_fn=lambda o, t: 3, example_target=torch.randn(8, 8))


def test_target_of_the_wrong_shape_names_the_loss_function():
    # before: "autopar could not trace the model's top-level forward (model)"
    with pytest.raises(TraceError, match=r"the loss function cross_entropy failed: ValueError: Expected input batch_size "
                                         r"\(8\) to match target batch_size \(3\)\. The model traced fine.*"
                                         r"an int64 tensor of shape \(3,\)"):
        _plan(loss_fn=F.cross_entropy, example_target=torch.zeros(3, dtype=torch.long))


def test_target_without_loss_and_target_not_a_tensor():
    with pytest.raises(TraceError, match=r"example_target was given without loss_fn.*pass loss_fn="):
        _plan(example_target=X)
    with pytest.raises(TraceError, match=r"example_target must be a tensor.*got int 3"):
        _plan(loss_fn=lambda o, t: o.sum(), example_target=3)
    with pytest.raises(TraceError, match=r"loss_fn must be a function.*got str"):
        _plan(loss_fn="mse", example_target=X)


# ----------------------------------------------------------------------------- clusters


def test_cluster_too_large_for_the_batch_is_refused_before_searching():
    # before: planned dp=1,000,000 x tp=8 for a batch of 64 (after a 50 s search)
    big = Cluster.preset("dgx-h100", nodes=1_000_000)
    with pytest.raises(ClusterSpecError, match=r"a batch of 64 cannot keep 8,000,000 devices busy.*at most 64 ways.*at most "
                                               r"16 ways.*'0\.weight' of shape \(16, 8\).*64 x 16 = 1,024 devices.*"
                                               r"Cluster\.preset\('dgx-h100', nodes=128\).*batch of at least 500,000"):
        _plan(cluster=big, x=torch.randn(64, 8))


def test_cluster_that_is_not_a_cluster():
    with pytest.raises(ClusterSpecError, match=r"cluster must be an autopar\.Cluster \(e\.g\. Cluster\.preset"):
        _plan(cluster="dgx-h100")


_DEVICE = Cluster.preset("dgx-h100").device


@pytest.mark.parametrize("make, match", [
    (lambda: Cluster.preset("dgx-h100", nodes=0), r"Cluster\.nodes must be an integer >= 1, got 0; a cluster needs at least one node"),
    (lambda: Cluster.preset("dgx-h100", nodes=2.5), r"Cluster\.nodes must be an integer >= 1, got 2\.5"),
    (lambda: Cluster.preset("dgx-h100", nodes="8"), r"Cluster\.nodes must be an integer >= 1, got '8'"),
    (lambda: Cluster.local(0), r"Cluster\.local\.n must be an integer >= 1, got 0; pass the number of CPU processes"),
    (lambda: Cluster.local(-2), r"Cluster\.local\.n must be an integer >= 1, got -2"),
    (lambda: dataclasses.replace(Cluster.preset("dgx-h100"), devices_per_node=0), r"devices_per_node.*got 0.*e\.g\. 8"),
    (lambda: dataclasses.replace(Cluster.preset("dgx-h100"), devices_per_node=math.nan), r"devices_per_node.*got nan"),
    (lambda: dataclasses.replace(_DEVICE, memory_bytes=0), r"DeviceSpec\.memory_bytes must be an integer >= 1, got 0; .*80 \* 10\*\*9"),
    (lambda: dataclasses.replace(_DEVICE, memory_bandwidth=math.nan), r"DeviceSpec\.memory_bandwidth must be a positive finite number, got nan"),
    (lambda: dataclasses.replace(_DEVICE, matmul_efficiency="high"), r"DeviceSpec\.matmul_efficiency must be in \(0, 1\], got 'high'"),
    (lambda: dataclasses.replace(_DEVICE, matmul_efficiency=True), r"DeviceSpec\.matmul_efficiency must be in \(0, 1\], got True"),
    (lambda: LinkSpec(bandwidth=0, latency=1e-6), r"LinkSpec\.bandwidth must be a positive finite number, got 0; pass bytes/s"),
    (lambda: LinkSpec(bandwidth=-1e9, latency=1e-6), r"LinkSpec\.bandwidth must be a positive finite number, got -1000000000\.0"),
    (lambda: LinkSpec(bandwidth=math.nan, latency=1e-6), r"LinkSpec\.bandwidth must be a positive finite number, got nan"),
    (lambda: LinkSpec(bandwidth=1e9, latency=math.inf), r"LinkSpec\.latency must be a positive finite number, got inf"),
    (lambda: LinkSpec(bandwidth=1e9, latency=1e-6, efficiency=True), r"LinkSpec\.efficiency must be in \(0, 1\] or None, got True"),
    (lambda: PeakFlops(math.nan, 1.0, 1.0, 1.0), r"PeakFlops\.fp32 must be a positive finite number, got nan; use the dense"),
])
def test_bad_cluster_numbers(make, match):
    with pytest.raises(ClusterSpecError, match=match):
        make()


# ----------------------------------------------------------------------------- compile


def _opt(ps):
    return torch.optim.SGD(ps, lr=0.1)


def _mse(out, tgt):
    return F.mse_loss(out, tgt)


class _Other(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x)


def _compile(model=None, cluster=None, **kw):
    kw.setdefault("loss_fn", _mse)
    kw.setdefault("optimizer", _opt)
    kw.setdefault("example_target", torch.randn(8, 8))
    return autopar.compile(model if model is not None else _mlp(), cluster, (X,), **kw)


def test_compile_with_the_plan_of_another_model(world1):
    # before: PassError "pass localize_shapes_pass failed: KeyError: 'gelu'"
    other = autopar.plan(_Other(), world1, X, loss_fn=_mse, example_target=torch.randn(8, 8))
    with pytest.raises(PlanMismatchError, match=r"plan was made for a model of class _Other, but this model is of class "
                                                r"Sequential: 4 parameters of this model are not in the plan \('0\.weight'.*"
                                                r"2 planned parameters are not in this model \('a\.weight', 'a\.bias'\)\. "
                                                r"Re-plan for this model"):
        _compile(cluster=world1, plan=other)
    assert issubclass(PlanMismatchError, PlanFormatError)


def test_compile_with_the_plan_of_a_narrower_model(world1):
    # before: accepted silently (the plan's shapes and costs were another model's)
    narrow = nn.Sequential(nn.Linear(8, 4), nn.GELU(), nn.Linear(4, 8))
    plan = autopar.plan(narrow, world1, X, loss_fn=_mse, example_target=torch.randn(8, 8))
    with pytest.raises(PlanMismatchError, match=r"a different Sequential: 3 parameters changed shape \('0\.weight' is "
                                                r"\(16, 8\) here but \(4, 8\) in the plan"):
        _compile(cluster=world1, plan=plan)


def test_compile_with_the_plan_of_another_forward(world1):
    plan = autopar.plan(_mlp(), world1, X, loss_fn=_mse, example_target=torch.randn(8, 8))
    relu = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    with pytest.raises(PlanMismatchError, match=r"steps the plan does not place \('relu'\): the forward pass or the loss differs"):
        _compile(relu, cluster=world1, plan=plan)


def test_compile_settings_a_plan_already_fixes(world1):
    plan = autopar.plan(_mlp(), world1, X, loss_fn=_mse, example_target=torch.randn(8, 8))
    with pytest.raises(PlanFormatError, match=r"plan= must be an autopar\.Plan, got str.*Plan\.from_json\(text\)"):
        _compile(cluster=world1, plan=plan.to_json())
    with pytest.raises(ConstraintError, match=r"both plan= and constraints=Constraints\(dp=1\).*Re-plan with autopar\.plan"):
        _compile(cluster=world1, plan=plan, constraints=Constraints(dp=1))
    with pytest.raises(ConstraintError, match=r"precision='bf16-mixed' but the plan was made for 'fp32'"):
        _compile(cluster=world1, plan=plan, precision="bf16-mixed")
    with pytest.raises(ConstraintError, match=r"unknown precision policy 'fp16'"):
        _compile(cluster=world1, plan=plan, precision="fp16")


def test_compile_bad_arguments(world1):
    with pytest.raises(ClusterSpecError, match=r"cluster must be an autopar\.Cluster.*got NoneType"):
        _compile(cluster=None)
    with pytest.raises(TraceError, match=r"example_target was given without loss_fn, so nothing would read it"):
        _compile(cluster=world1, loss_fn=None)
    # train_step without loss_fn trains the loss the model returns; this one returns activations
    with pytest.raises(TraceError, match=r"Sequential returned a tensor of shape \(8, 8\), not a loss: train_step "
                                         r"without loss_fn needs a model that returns a scalar loss, or an output with \.loss"):
        _compile(cluster=world1, loss_fn=None, example_target=None)
    with pytest.raises(AutoparError, match=r"loss_fn= and example_target= are for train_step, which also needs "
                                           r"optimizer=.*compute the loss on pm\(x\)'s output yourself"):
        _compile(cluster=world1, optimizer=None)
    with pytest.raises(ConstraintError, match=r"optimizer= must be a factory, e\.g\. optimizer=lambda ps.*not the name 'adamw'"):
        _compile(cluster=world1, optimizer="adamw")
    with pytest.raises(ConstraintError, match=r"collective_timeout_s must be a positive number of seconds or None, got -5"):
        _compile(cluster=world1, collective_timeout_s=-5)
    with pytest.raises(TraceError, match=r"loss_fn must return a scalar.*returned a tensor of shape \[8\]"):
        _compile(cluster=world1, loss_fn=lambda o, t: (o - t).pow(2).mean(1))
    with pytest.raises(TraceError, match=r"model \(GELU\) has no parameters"):
        _compile(nn.GELU(), cluster=world1)


# ----------------------------------------------------------------------------- command line


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "bad_inputs_factory.py").write_text(
        "import torch\n"
        "def small():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)), torch.randn(8, 8)\n"
    )
    monkeypatch.chdir(tmp_path)
    return "bad_inputs_factory:small"


@pytest.mark.parametrize("argv, match", [
    (["--cluster", "local", "--nproc", "2", "--explain", "nosuch"], "--explain 'nosuch': no node in module 'nosuch'; modules look like"),
    (["--cluster", "local", "--nproc", "2", "-o", "/nonexistent/dir/p.json"], "cannot write there.*does not exist or is not writable"),
    (["--nproc", "2"], "--nproc applies to --cluster local; a dgx-h100 cluster is sized with --nodes N"),
    (["--cluster", "local", "--nodes", "2"], "--nodes applies to preset clusters; size --cluster local with --nproc N"),
    (["--nodes", "0"], r"Cluster\.nodes must be an integer >= 1, got 0"),
    (["--nodes", "1000000"], "cannot keep 8,000,000 devices busy"),
])
def test_cli_plan_bad_flags(factory, capsys, argv, match):
    import re

    assert main(["plan", factory] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: ") and re.search(match, err), err


def test_cli_run_bad_flags(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nosuch.py"), "--nproc", "2"]) == 2
    assert "no training script" in capsys.readouterr().err
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["run", str(script), "--nproc", "0"]) == 2
    assert "--nproc must be at least 1" in capsys.readouterr().err
    assert main(["demo", "--nproc", "0"]) == 2
    assert "--nproc must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("constraints", [{"microbatches": 2}, {"pp": 2}])
def test_microbatches_over_a_training_batch_norm_are_refused(constraints):
    """Microbatches would give each batch norm a microbatch's statistics (and count its batches
    once per microbatch): a different model, so refused, naming the module; data parallelism
    keeps the batch's statistics and plans."""
    from autopar.testing.zoo import SmallCNN

    x = torch.randn(8, 3, 16, 16)
    with pytest.raises(ConstraintError, match=r"batch norm of module '[\w.]+'.*microbatch.*GroupNorm"):
        autopar.plan(SmallCNN(), Cluster.local(2), x, loss_fn=F.cross_entropy, example_target=torch.randint(0, 10, (8,)),
                     constraints=Constraints(**constraints))
    plan = autopar.plan(SmallCNN(), Cluster.local(2), x, loss_fn=F.cross_entropy,
                        example_target=torch.randint(0, 10, (8,)), constraints=Constraints(dp=2))
    assert plan.microbatches == 1


def test_a_pipeline_rank_holding_only_frozen_parameters_is_refused():
    """A rank whose stages hold only frozen parameters would reach an optimizer with nothing to
    update: refused, naming the rank and the way out."""
    class HalfFrozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(16, 16)
            self.rest = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]).requires_grad_(False)

        def forward(self, x):
            return self.rest(self.first(x))

    x = torch.randn(8, 16)
    with pytest.raises(ConstraintError, match=r"pipeline rank 1 without trainable parameters.*fewer stages"):
        autopar.plan(HalfFrozen(), Cluster.local(2), x, loss_fn=lambda out, y: F.mse_loss(out, y), example_target=x,
                     constraints=Constraints(pp=2))


def test_every_error_here_is_an_autopar_value_error():
    for kind in (ClusterSpecError, ConstraintError, PlanFormatError, PlanMismatchError, TraceError):
        assert issubclass(kind, AutoparError) and issubclass(kind, ValueError)


def test_a_batch_norm_model_that_fits_only_microbatched_gets_no_microbatched_plan():
    """The planner's own gradient accumulation (tried when no plan fits whole) leaves out a model
    with a training batch norm: no plan, with the memory it needs at one microbatch."""
    from autopar.testing.zoo import SmallCNN

    x, y = torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,))
    whole = autopar.plan(SmallCNN(), Cluster.local(1), x, loss_fn=F.cross_entropy, example_target=y)
    tight = dataclasses.replace(Cluster.local(1), device=dataclasses.replace(
        Cluster.local(1).device, memory_bytes=int(whole.predicted.peak_memory_bytes * 0.8)))
    with pytest.raises(autopar.NoFeasiblePlanError, match="no plan fits in memory"):
        autopar.plan(SmallCNN(), tight, x, loss_fn=F.cross_entropy, example_target=y)
