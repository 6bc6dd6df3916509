"""Host values never travel as host tensors on a device group (ready for NCCL), checked on CPU.

An NCCL process group carries CUDA tensors only: a loss, a count or a flag created on the host
and sent over it fails ("No backend type associated with device type cpu"). On CPU the host and
the device are the same memory, so the runtime is run here on a *simulated* accelerator:
``torch.device("cpu", 0)`` (the index marks it; tensors on it are ordinary CPU tensors). A
``TorchFunctionMode`` follows CUDA's placement rules for every op: a factory without ``device=``
(or with the string "cpu"), ``.cpu()`` and ``.to("cpu")`` make a host tensor; ``.to(device)``
onto the simulated device a device one; ``t.device`` reads ``cpu:0`` for a device tensor (so
``device=x.device`` places alike; a ``torch.device("cpu")`` object, as traced programs bake in,
counts as the device); any other op's result is on the host only if every tensor it was given is
(a device tensor with a 0-d host scalar stays on the device, as on CUDA); an in-place op keeps
its target's placement. Each collective the runtime
issues is recorded with whether its tensors are host tensors; the groups made with
``backend="gloo"`` explicitly (host groups, as the checkpoint's background group) may carry them,
no other group may (on NCCL they are CUDA-only, or the user's NCCL default group).
"""
from __future__ import annotations

import pytest

import autopar

SIMULATED = ("cpu", 0)


def _placement_mode():
    """A ``TorchFunctionMode`` marking host tensors (attribute ``_simulated_host``) by CUDA's rules."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    device = torch.device(*SIMULATED)
    factories = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
                 torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.scalar_tensor,
                 torch.empty_strided, torch.randperm}
    likes = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like}

    def on_device(d) -> bool:
        if isinstance(d, int):
            return True  # a CUDA ordinal
        if isinstance(d, torch.device) and d.type == "cpu" and d.index is None:
            return True  # a device object read from a tensor outside the mode, or baked into a traced program
        d = torch.device(d)
        return d.type == device.type and d.index == device.index

    def host(t) -> bool:
        return isinstance(t, torch.Tensor) and getattr(t, "_simulated_host", False)

    def target_of(func, args, kwargs):
        """For a move (``to``/``cpu``/``new_*``/factories): True (host), False (device), None (no explicit device)."""
        name = getattr(func, "__name__", "")
        if name == "cpu":
            return True
        if "device" in kwargs and kwargs["device"] is not None:
            return not on_device(kwargs["device"])
        if name == "to":
            for a in args[1:]:
                if isinstance(a, (str, torch.device)) or (isinstance(a, int) and not isinstance(a, bool)):
                    return not on_device(a)
                if isinstance(a, torch.Tensor):
                    return host(a)
        return None

    device_of = torch.Tensor.device.__get__

    class Placement(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is device_of:  # ``t.device``: where the tensor is on the simulated machine
                return torch.device("cpu") if host(args[0]) else device
            out = func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            if func in factories:
                data = args[0] if args else None
                explicit = target_of(func, args, kwargs)
                is_host = explicit if explicit is not None else (host(data) if isinstance(data, torch.Tensor) else True)
            elif name in ("to", "cpu", "cuda") or func in likes or name.startswith("new_"):
                explicit = target_of(func, args, kwargs)
                is_host = explicit if explicit is not None else host(args[0])
                if is_host is False and out is args[0] and host(out):
                    out = out.clone()  # on CUDA a move is a new tensor; the host original stays host
            elif name.endswith("_") and not name.startswith("_") and args and isinstance(args[0], torch.Tensor):
                return out  # in place: the target keeps its placement
            else:
                tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                is_host = bool(tensors) and all(host(t) for t in tensors)
            if is_host:
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        try:
                            t._simulated_host = True
                        except (AttributeError, RuntimeError):
                            pass
            return out

    return Placement(), host


def _caller() -> str:
    """The innermost autopar frame calling a collective ("file:line function")."""
    import traceback

    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/autopar/" in frame.filename and not frame.filename.endswith("runtime/comm.py"):
            return f"{frame.filename.rsplit('/autopar/', 1)[1]}:{frame.lineno} {frame.name}"
    return "?"


def _record_collectives(host, records: list, host_groups: set):
    """Wrap torch.distributed's public collectives (and autopar.runtime.comm's bound aliases) to
    append (kind, group, whether a host tensor was passed, the autopar caller) to ``records``; groups created with an
    explicit ``backend="gloo"`` are added to ``host_groups``. Returns an undo function."""
    import torch
    import torch.distributed as dist

    from autopar.runtime import comm

    undo = []

    def patch(owner, name, wrapper_of):
        if not hasattr(owner, name):
            return
        old = getattr(owner, name)
        setattr(owner, name, wrapper_of(old))
        undo.append((owner, name, old))

    def collective(kind):
        def wrap(fn):
            def wrapped(*args, **kwargs):
                group = kwargs.get("group")
                tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
                records.append((kind, group, any(host(t) for t in tensors), _caller()))
                return fn(*args, **kwargs)
            return wrapped
        return wrap

    for kind in ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                 "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "send", "recv", "reduce",
                 "gather", "scatter"):  # (isend/irecv: P2POp checks their identity; seen through batch_isend_irecv)
        patch(dist, kind, collective(kind))
    for alias, kind in (("_all_gather_single", "all_gather"), ("_reduce_scatter_single", "reduce_scatter")):
        patch(comm, alias, collective(kind))

    def p2p(fn):
        def wrapped(ops):
            for op in ops:
                records.append(("p2p " + op.op.__name__, op.group, host(op.tensor), _caller()))
            return fn(ops)
        return wrapped

    patch(dist, "batch_isend_irecv", p2p)

    def new_group(fn):
        def wrapped(*args, **kwargs):
            g = fn(*args, **kwargs)
            if kwargs.get("backend") == "gloo":
                host_groups.add(g)
            return g
        return wrapped

    patch(dist, "new_group", new_group)

    def restore():
        for owner, name, old in reversed(undo):
            setattr(owner, name, old)
    return restore


def host_values_worker() -> dict:
    """2 ranks on the simulated accelerator: a pipeline plan (pp=2) and a data-parallel plan with
    local batches over 2 microbatches (the targets' counts all-reduced), two steps each; and a
    control (a host tensor all-reduced on purpose) that shows the check sees one."""
    import contextlib
    import copy

    import torch
    import torch.distributed as dist

    from autopar.runtime import compile as compile_module
    from autopar.testing.parity import build_case

    records, host_groups = [], set()
    mode, host = _placement_mode()
    restore = _record_collectives(host, records, host_groups)
    builder_init = compile_module._Builder.__init__

    def on_simulated_device(self, *args, **kwargs):
        builder_init(self, *args, **kwargs)
        self.device = torch.device(*SIMULATED)  # what compile builds the model on

    compile_module._Builder.__init__ = on_simulated_device
    out = {}
    try:
        for label, case, constraints, local in (("pp", "gpt", {"pp": 2}, False),
                                                ("dp_local", "gpt_padded", {"dp": 2, "microbatches": 2}, True)):
            model, batches, loss_fn = build_case(case)
            ref = copy.deepcopy(model)
            make = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
            x0, t0 = batches[0]
            pm = autopar.compile(model, autopar.Cluster.local(), (x0,), example_target=t0, optimizer=make,
                                 loss_fn=loss_fn, constraints=autopar.Constraints(**constraints),
                                 batch="local" if local else "global")
            ref_opt = make(list(ref.parameters()))
            losses, wants = [], []
            for i, (x, t) in enumerate(batches[:3]):
                if i == 1:
                    del records[:]  # the first step traces and builds unwatched; the next two are watched
                r = dist.get_rank()
                with mode if i >= 1 else contextlib.nullcontext():
                    losses.append(pm.train_step(x[r::2], target=t[r::2]) if local else pm.train_step(x, target=t))
                ref_opt.zero_grad()
                want = loss_fn(ref(x), t)
                want.backward()
                ref_opt.step()
                wants.append(float(want.detach()))
            bad = sorted({(kind, str(dist.get_process_group_ranks(g) if g is not None else "default"), site)
                          for kind, g, is_host, site in records if is_host and g not in host_groups})
            out[label] = {"bad": bad, "kinds": sorted({r[0] for r in records}), "losses": losses, "wants": wants,
                          "mesh": pm.plan.mesh, "stages": len(pm.plan.stages)}
            pm.close()
        del records[:]
        with mode:
            flag = torch.tensor([1.0])  # the control: a host value on the default group
            dist.all_reduce(flag)
            moved = torch.tensor([1.0]).to(torch.device(*SIMULATED))
            dist.all_reduce(moved)
        out["control"] = [r[2] for r in records]
    finally:
        restore()
        compile_module._Builder.__init__ = builder_init
    return out


@pytest.mark.slow
def test_host_values_travel_as_device_tensors_on_device_groups():
    """Every collective of a pipeline step (the loss broadcast over the pipeline group among them)
    and of a data-parallel step with local batches (the targets' counts) carries tensors on the
    model's device; the training itself still matches one device."""
    for r in autopar.launch(host_values_worker, 2, timeout_s=600):
        assert r["control"] == [True, False], r["control"]  # the check sees a host value, and a moved one as moved
        assert r["pp"]["stages"] == 2 and "broadcast" in r["pp"]["kinds"], r["pp"]
        assert any(k.startswith("p2p") for k in r["pp"]["kinds"]), r["pp"]["kinds"]
        for label in ("pp", "dp_local"):
            assert r[label]["bad"] == [], (label, r[label]["bad"])
            for got, want in zip(r[label]["losses"], r[label]["wants"]):
                assert got == pytest.approx(want, rel=1e-5), (label, r[label]["losses"], r[label]["wants"])


def test_nccl_is_initialised_with_a_gloo_backend_for_host_tensors(monkeypatch):
    """autopar's NCCL default group is "cpu:gloo,cuda:nccl": host tensors (and object collectives)
    run on gloo there and in every group derived from it; gloo stays as it is."""
    import torch.distributed as dist

    from autopar.runtime import launch

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append(backend))
    monkeypatch.setattr(launch, "enable_flight_recorder", lambda: {})
    monkeypatch.setattr(launch, "_GROUP_TIMEOUT", {"group": None, "timeout_s": None})
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    launch.init_distributed("nccl", 1)
    launch.init_distributed("gloo", 1)
    assert calls == ["cpu:gloo,cuda:nccl", "gloo"]


def test_backends_are_read_per_device_and_cuda_pipelines_over_gloo_are_refused(world1, monkeypatch):
    """``backend_for`` reads a group's "device:backend" pairs (``dist.get_backend`` returns the
    whole multi-backend string, which equals neither "nccl" nor "gloo"); a pipeline of CUDA
    stages over gloo, whose sends take CPU tensors only, is refused naming the fix."""
    import torch
    import torch.distributed as dist

    from autopar.runtime import comm
    from autopar.runtime.launch import init_distributed
    from autopar.runtime.pipeline import refuse_host_only_sends

    init_distributed("gloo", 1)
    assert comm.backend_for("cpu") == "gloo" and not comm.runs_nccl()
    refuse_host_only_sends(torch.device("cpu"), dist.group.WORLD)  # CPU stages over gloo: fine
    with pytest.raises(autopar.AutoparError, match=r"gloo's send and recv take CPU tensors only.*backend='nccl'"):
        refuse_host_only_sends(torch.device("cuda", 0), dist.group.WORLD)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert comm.runs_nccl() and comm.backend_for("cpu") == "gloo" and comm.backend_for("cuda") == "nccl"
    refuse_host_only_sends(torch.device("cuda", 0), dist.group.WORLD)  # NCCL sends CUDA tensors
