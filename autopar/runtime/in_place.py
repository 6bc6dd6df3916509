"""The user's module sharded in place (FSDP2's convention): after ``autopar.compile(model, ...)``
``model`` holds the plan's DTensors and ``model(x)`` runs the sharded program.

Invariants:
* the user's module tree holds the SAME parameter and buffer objects as the ``ParallelModel``
  (under the same names, tied ones stay tied): placeholders until the plan exists, then the
  plan's DTensors (``runtime.dtensor_params``; placeholders are swapped in place, so an optimizer
  built over ``model.parameters()`` before the first call holds the planned parameters). So
  ``model.state_dict()`` is ``pm.state_dict()`` (DCP-ready DTensors) and an optimizer over
  ``model.parameters()`` trains what the plan trains. A pipeline stage holds only its own
  parameters (as ``pm`` does); experts the plan stacks leave the module tree (its loop still
  iterates the expert modules) and ``model.state_dict()`` holds their stacked DTensors under the
  stacked keys ``P.*.suffix``, as ``pm.state_dict()`` does (``_save_with_stacked``; per-expert
  keys: ``autopar.save_weights`` or ``export_module``);
* the original full tensors live only in the compile builder's ``source`` (a shallow copy of the
  module tree, what ``ParamStore`` takes its shards from), released once the plan is attached:
  afterwards no full copy of a sharded parameter is left in the process;
* the module's class becomes ``Autopar<Class>`` (a subclass, as ``fully_shard`` does) whose
  ``forward`` runs ``pm`` where the module holds DTensors, and the original ``forward`` where it
  does not (tracing: ``functional_call`` with fake tensors, or the builder's plain stand-ins,
  ``plain_state``), so nothing recurses;
* under ``torch.no_grad()``, a batch of shapes no program was compiled for runs the original
  ``forward`` eagerly, each module's parameters gathered whole while it runs (``_eager``), and
  returns plain full tensors:
  a ``generate()`` helper calling ``self(idx)`` with growing ``idx`` works. Whether the batch has
  the compiled shapes is agreed over the ranks (``agreement.every_rank``) unless
  ``check_inputs="never"``.

``export_module`` is the way back to one device.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import weakref

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError

__all__ = ["shard_in_place", "plain_state", "export_module", "parallel_model_of", "is_sharded_in_place"]

_PM = "_autopar_parallel_model"  # the model's __dict__ entry holding its ParallelModel (not a submodule)


def is_sharded_in_place(model: torch.nn.Module) -> bool:
    """Whether ``autopar.compile`` already sharded ``model`` in place."""
    return isinstance(model, torch.nn.Module) and _PM in model.__dict__


def parallel_model_of(model: torch.nn.Module):
    """The ``ParallelModel`` that ``model`` (sharded in place by ``autopar.compile``) runs."""
    if not is_sharded_in_place(model):
        raise AutoparError(f"{type(model).__name__} was not compiled by autopar.compile: nothing is sharded in place")
    return model.__dict__[_PM]


def _shadow(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s module tree (each module shallow-copied, shared modules shared) holding
    the ORIGINAL parameters and buffers: what the plan's shards are cut from once it exists."""
    memo: dict[int, torch.nn.Module] = {}

    def one(m: torch.nn.Module) -> torch.nn.Module:
        if id(m) not in memo:
            c = copy.copy(m)
            memo[id(m)] = c
            c._parameters = dict(m._parameters)
            c._buffers = dict(m._buffers)
            c._non_persistent_buffers_set = set(m._non_persistent_buffers_set)
            c._modules = {k: one(v) if v is not None else None for k, v in m._modules.items()}
        return memo[id(m)]

    return one(model)


def adopt(model: torch.nn.Module, pm: torch.nn.Module) -> None:
    """Make ``model``'s tree hold ``pm``'s parameter and buffer objects under the same names;
    an entry ``pm`` does not hold (another pipeline stage's, a stacked expert's) leaves ``model``."""
    for path, mod in model.named_modules(remove_duplicate=False):
        holder = pm.get_submodule(path) if path else pm
        for own, theirs in ((mod._parameters, holder._parameters), (mod._buffers, holder._buffers)):
            for leaf in [k for k, v in own.items() if v is not None]:
                if leaf in theirs:
                    own[leaf] = theirs[leaf]
                else:
                    del own[leaf]


def shard_in_place(model: torch.nn.Module, pm: torch.nn.Module, builder) -> None:
    """At compile: ``builder.source`` takes the original tensors, ``model`` takes ``pm``'s
    placeholders and becomes ``Autopar<Class>`` (see the module docstring)."""
    from autopar.runtime.copyable_state import copyable_state_dict_hook

    builder.source = _shadow(model)
    adopt(model, pm)
    model.__class__ = _in_place_class(type(model))
    model.__dict__[_PM] = pm
    model.register_state_dict_post_hook(copyable_state_dict_hook)  # deepcopy(model.state_dict()) on every rank


def attached(model: torch.nn.Module, pm: torch.nn.Module, builder) -> None:
    """Once the plan is attached: the model follows ``pm``'s tree (stages, stacked experts) and the
    original tensors are released."""
    if is_sharded_in_place(model):
        adopt(model, pm)
    builder.source = None


@contextlib.contextmanager
def plain_state(model: torch.nn.Module):
    """While tracing: every DTensor parameter and buffer of ``model`` replaced by a plain meta
    tensor of its global shape and dtype (ties kept), so that the original ``forward`` runs and
    any capture (make_fx, torch.export) sees an ordinary module; restored on exit."""
    if not is_sharded_in_place(model):
        yield
        return
    made: dict[int, torch.Tensor] = {}
    saved = []
    for _, mod in model.named_modules(remove_duplicate=False):
        for is_param, own in ((True, mod._parameters), (False, mod._buffers)):
            for leaf, t in list(own.items()):
                if not isinstance(t, DTensor):
                    continue
                if id(t) not in made:
                    meta = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                    made[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if is_param else meta
                saved.append((own, leaf, t))
                own[leaf] = made[id(t)]
    try:
        yield
    finally:
        for own, leaf, t in saved:
            own[leaf] = t


# ---------------------------------------------------------------------------- the swapped class
@functools.lru_cache(maxsize=None)
def _in_place_class(cls: type) -> type:
    """``Autopar<cls>``: ``cls`` with a ``forward`` that runs the compiled model (one class per
    ``cls``, as FSDP2 makes them)."""
    original = cls.forward

    @functools.wraps(original)  # the signature stays the model's (keyword inputs are bound by it)
    def forward(self, *args, **kwargs):
        pm = self.__dict__.get(_PM)
        if pm is None or not _holds_dtensors(self):  # traced (fake or plain stand-ins): the model's own code
            return original(self, *args, **kwargs)
        return _run(self, pm, original, args, kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``ParallelModel.load_state_dict``: DTensors, or one device's plain full tensors (each rank
        copies its shard out of them)."""
        return self.__dict__[_PM].load_state_dict(state_dict, strict=strict, assign=assign)

    return type("Autopar" + cls.__name__, (cls,), {"forward": forward, "load_state_dict": load_state_dict,
                                                   "_save_to_state_dict": _save_with_stacked,
                                                   "__module__": cls.__module__, "_autopar_original_class": cls})


def _save_with_stacked(self, destination, prefix, keep_vars):
    """The root's own entries, then the experts the plan stacks, under their stacked keys
    (``P.*.suffix``, as ``pm.state_dict()`` holds them: DCP-ready DTensors, loadable back through
    ``load_state_dict`` and ``autopar.load_weights``): the module tree holds no per-expert
    parameter any more, and none is silently missing from ``model.state_dict()``."""
    super(type(self), self)._save_to_state_dict(destination, prefix, keep_vars)
    pm = self.__dict__.get(_PM)
    state = getattr(pm, "_state", None) if pm is not None else None  # None until the plan's shards exist
    if state is None or not _holds_dtensors(self):
        return
    for fqn in pm._traced.stacked:
        if state.holds(fqn):
            t = state.params[fqn]
            destination[prefix + fqn] = t if keep_vars else t.detach()


def _holds_dtensors(model: torch.nn.Module) -> bool:
    t = next(iter(model.parameters()), None)
    if t is None:
        t = next(iter(model.buffers()), None)
    return isinstance(t, DTensor)


def _run(model: torch.nn.Module, pm, original, args: tuple, kwargs: dict):
    """``model(*args, **kwargs)`` of a model sharded in place: the compiled program where the batch
    has the compiled shapes (or grad is enabled, where pm refuses other shapes with its error), else
    the original forward eagerly on the DTensors (``_eager``). Every rank calls it together."""
    from autopar.runtime.agreement import every_rank
    from autopar.runtime.input_checks import mismatch

    if pm.training != model.training:
        pm.train(model.training)
    if pm.plan is None or pm._local or torch.is_grad_enabled():
        return pm(*args, **kwargs)
    try:
        inputs = pm._builder.bind(args, kwargs)
    except AutoparError:  # keywords the compiled program cannot take (a generation cache): the model's own code
        inputs = None
    want = pm._primary.example.inputs
    compiled = inputs is not None and len(inputs) == len(want) and all(mismatch(x, w) is None for x, w in zip(inputs, want))
    if pm._check_mode != "never":  # the branch gates collectives: every rank takes the same one
        compiled = every_rank(compiled)
    if compiled:
        return pm(*args, **kwargs)
    return _eager(model, pm, original, args, kwargs)


def _eager(model: torch.nn.Module, pm, original, args: tuple, kwargs: dict):
    """The original forward, eagerly, under ``no_grad``: each module's own DTensors are gathered
    whole as it is called and put back when it returns (as FSDP unshards one module at a time: at
    most one module's parameters whole beyond the shards), so every op runs on plain tensors; a
    DTensor used outside its module meets plain tensors as replicated (``implicit_replication``).
    DTensor outputs come back as plain full tensors. Gathers are collectives: every rank calls.
    A buffer the forward writes (BatchNorm's statistics in train mode) is written to the gathered
    copy only: evaluate in ``eval()`` mode."""
    from torch.distributed.tensor.experimental import implicit_replication

    from autopar.runtime.collective_errors import collective_failures

    if pm._pipeline is not None:
        raise AutoparError(
            f"the plan pipelines the model over {len(pm.plan.stages)} stages, so this rank holds only its stage's "
            "parameters and cannot run the whole forward for a batch of other shapes than compiled: export the model "
            "(autopar.export_module(model)) and run it on one device, or plan without pp")
    gathered: dict[int, list] = {}  # module id -> a stack of (dict, name, DTensor) it put back on return

    def whole(mod, *_):
        put = []
        for own in (mod._parameters, mod._buffers):
            for leaf, t in list(own.items()):
                if isinstance(t, DTensor):
                    put.append((own, leaf, t))
                    own[leaf] = t.full_tensor()
        gathered.setdefault(id(mod), []).append(put)

    def back(mod, *_):
        for own, leaf, t in gathered[id(mod)].pop():
            own[leaf] = t

    handles = []
    mixed = pm._policy.mixed
    try:
        with collective_failures("forward"), implicit_replication(), torch.no_grad(), \
                torch.autocast(pm._device.type, dtype=pm._policy.torch_compute_dtype) if mixed else contextlib.nullcontext():
            for mod in model.modules():
                if mod is not model:  # the root's forward is called directly, below
                    handles += [mod.register_forward_pre_hook(whole), mod.register_forward_hook(back, always_call=True)]
            whole(model)
            out = original(model, *args, **kwargs)
            return pytree.tree_map_only(DTensor, lambda t: t.full_tensor(), out)
    finally:
        for h in handles:
            h.remove()
        for stack in gathered.values():  # what a failure left whole
            while stack:
                for own, leaf, t in stack.pop():
                    own[leaf] = t


# ---------------------------------------------------------------------------- back to one device
def export_module(model) -> torch.nn.Module:
    """A plain single-device module of the model's class with the full trained weights, for
    evaluation, generation or ``torch.save``: ``model`` is the module ``autopar.compile`` sharded
    in place, or its ``ParallelModel``.

    Every rank must call it (each parameter is gathered with a collective, one parameter at a time,
    in the same order everywhere), and every rank gets the module (on the device the shards live
    on). Ties (a shared embedding and head) stay tied. Pipeline plans are refused: a rank holds one
    stage's parameters only.

    >>> # pm = autopar.compile(model, cluster); ... train ...
    >>> # plain = autopar.export_module(model)   # on every rank
    >>> # if rank == 0: torch.save(plain.state_dict(), "model.pt")
    """
    from autopar.runtime.collective_errors import collective_failures
    from autopar.runtime.parallel_model import ParallelModel

    if isinstance(model, ParallelModel):
        model = model._builder.model
    pm = parallel_model_of(model)
    pm._require_plan("export_module")
    if pm._pipeline is not None:
        raise AutoparError(
            f"export_module: the plan pipelines the model over {len(pm.plan.stages)} stages and each rank holds only its "
            "stage's parameters; save a checkpoint (pm.save) and load its full state dict on one device, or plan without pp")
    memo: dict[int, object] = {id(pm): None}
    with collective_failures("export_module"), torch.no_grad():
        pm._sync_zero_params()  # ZeRO-1/2: the whole parameters the user's optimizer updated
        for _, mod in model.named_modules(remove_duplicate=False):
            for is_param, own in ((True, mod._parameters), (False, mod._buffers)):
                for t in own.values():
                    if t is None or id(t) in memo:
                        continue
                    full = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
                    memo[id(t)] = torch.nn.Parameter(full, requires_grad=t.requires_grad) if is_param else full
        stacked = {fqn: (pm._state.params[fqn].full_tensor(), pm._state.params[fqn].requires_grad)
                   for fqn in pm._traced.stacked if pm._state.holds(fqn)}
    out = copy.deepcopy(model, memo)
    out.__class__ = type(model)._autopar_original_class
    del out.__dict__[_PM]
    for fqn, members in pm._traced.stacked.items():  # experts the plan stacked: each member its row
        for i, member in enumerate(members):
            path, _, leaf = member.rpartition(".")
            owner = out.get_submodule(path) if path else out
            full, grad = stacked[fqn]
            owner._parameters[leaf] = torch.nn.Parameter(full[i].clone(), requires_grad=grad)
    return out
