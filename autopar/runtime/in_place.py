"""The user's module sharded in place (FSDP2's convention): after ``autopar.compile(model, ...)``
``model`` holds the plan's DTensors and ``model(x)`` runs the sharded program.

Invariants:
* the user's module tree holds the SAME parameter and buffer objects as the ``ParallelModel``
  (under the same names, tied ones stay tied): placeholders until the plan exists, then the
  plan's DTensors (``runtime.dtensor_params``; placeholders are swapped in place, so an optimizer
  built over ``model.parameters()`` before the first call holds the planned parameters). So
  ``model.state_dict()`` is ``pm.state_dict()`` (DCP-ready DTensors) and an optimizer over
  ``model.parameters()`` trains what the plan trains. Under a pipeline plan a rank's module holds
  only its stage's parameters and buffers (as ``pm`` does, torchtitan's and
  ``torch.distributed.pipelining``'s convention): ``model.state_dict()`` is this stage's DTensors,
  the union over the stages is the whole model (a tied parameter in each stage using it), and
  ``load_weights(model, ...)`` fills each stage's; the names the module had are kept (``_Tree``),
  for ``_eager`` and ``export_module``. Experts the plan stacks leave the module tree (its loop
  still iterates the expert modules) and ``model.state_dict()`` holds their stacked DTensors under
  the stacked keys ``P.*.suffix``, as ``pm.state_dict()`` does (``_save_with_stacked``; per-expert
  keys: ``autopar.save_weights`` or ``export_module``);
* the original full tensors live only in the compile builder's ``source`` (a shallow copy of the
  module tree, what ``ParamStore`` takes its shards from), released once the plan is attached:
  afterwards no full copy of a sharded parameter is left in the process;
* the module's class becomes ``Autopar<Class>`` (a subclass, as ``fully_shard`` does) whose
  ``forward`` runs ``pm`` where the module holds DTensors, and the original ``forward`` where it
  does not (tracing: ``functional_call`` with fake tensors, or the builder's plain stand-ins,
  ``plain_state``), so nothing recurses;
* under ``torch.no_grad()``, a batch of shapes no program was compiled for runs the original
  ``forward`` eagerly, each module's parameters gathered whole while it runs (``_eager``; under a
  pipeline plan fetched from the stage holding them), and returns plain full tensors on every
  rank: a ``generate()`` helper calling ``self(idx)`` with growing ``idx`` works. Whether the
  batch has the compiled shapes is agreed over the ranks (``agreement.every_rank``) unless
  ``check_inputs="never"``. A pipeline plan's program is its training step (the last stage
  returns the loss, no logits): under ``no_grad`` every batch runs eagerly, so ``model(x)`` gives
  the trained model's outputs on every rank.

``model.to(...)``, ``.half()``, ``.cuda()``... (``nn.Module._apply``) are no-ops where they change
nothing and refused where they would (``runtime.module_moves``): the program reads the plan's
shards as they are; on a submodule too (``model.h[0].half()``: each submodule of ``model`` and
``pm`` holds a move guard as its own ``_apply``). ``export_module`` is the way back to one device (every stage's weights, on
every rank).
"""
from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError

__all__ = ["shard_in_place", "plain_state", "export_module", "parallel_model_of", "is_sharded_in_place"]

_PM = "_autopar_parallel_model"  # the model's __dict__ entry holding its ParallelModel (not a submodule)
_TREE = "_autopar_tree"  # the model's __dict__ entry holding its ``_Tree`` (the names it had before compile)


@dataclass(frozen=True)
class _Leaf:
    """One entry of a module's ``_parameters`` or ``_buffers`` as the model had it before compile."""

    leaf: str
    is_param: bool
    name: str | None  # the tensor's name (a tie's first name, ``dtensor_params.tied_keys``); None: registered as None


@dataclass(frozen=True)
class _Tree:
    """Per module path (``named_modules(remove_duplicate=False)`` order), its entries in order: what
    ``adopt`` may delete on a pipeline rank (another stage's, a stacked expert's), restored by name
    while a module runs eagerly (``_eager``) and in ``export_module``."""

    leaves: dict[str, tuple[_Leaf, ...]]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "_Tree":
        from autopar.runtime.dtensor_params import tied_keys

        canon = tied_keys(model)
        out = {}
        for path, mod in model.named_modules(remove_duplicate=False):
            pre = f"{path}." if path else ""
            out[path] = tuple(_Leaf(leaf, is_param, canon.get(pre + leaf, pre + leaf) if t is not None else None)
                              for is_param, own in ((True, mod._parameters), (False, mod._buffers))
                              for leaf, t in own.items())
        return cls(out)


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
    an entry ``pm`` does not hold (another pipeline stage's, a stacked expert's) leaves ``model``
    (``_Tree`` remembers it)."""
    for path, mod in model.named_modules(remove_duplicate=False):
        holder = pm.get_submodule(path) if path else pm
        for own, theirs in ((mod._parameters, holder._parameters), (mod._buffers, holder._buffers)):
            for leaf in [k for k, v in own.items() if v is not None]:
                if leaf in theirs:
                    own[leaf] = theirs[leaf]
                else:
                    del own[leaf]


def shard_in_place(model: torch.nn.Module, pm: torch.nn.Module, builder) -> None:
    """At compile: ``builder.source`` takes the original tensors, ``model`` records its names
    (``_Tree``), takes ``pm``'s placeholders and becomes ``Autopar<Class>`` (see the module docstring)."""
    from autopar.runtime.copyable_state import copyable_state_dict_hook
    from autopar.runtime.module_moves import guard_children

    builder.source = _shadow(model)
    model.__dict__[_TREE] = _Tree.of(model)
    adopt(model, pm)
    guard_children(model, builder.device, "model")  # model.h[0].half(): refused as model.half() is
    guard_children(pm, builder.device, "pm")
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

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.half()``, ``.cuda()``...: a no-op where nothing changes, else refused
        (``runtime.module_moves``: the program keeps reading the plan's shards as they are)."""
        from autopar.runtime.module_moves import apply_or_refuse

        return apply_or_refuse(self, fn, self.__dict__[_PM]._builder.device, "this " + cls.__name__)

    return type("Autopar" + cls.__name__, (cls,), {"forward": forward, "load_state_dict": load_state_dict,
                                                   "_apply": _apply,
                                                   "_save_to_state_dict": _save_with_stacked,
                                                   "named_parameters": _named_parameters_with_stacked,
                                                   "__module__": cls.__module__, "_autopar_original_class": cls})


def _save_with_stacked(self, destination, prefix, keep_vars):
    """The root's own entries, then the experts the plan stacks, under their stacked keys
    (``P.*.suffix``, as ``pm.state_dict()`` holds them: DCP-ready DTensors, loadable back through
    ``load_state_dict`` and ``autopar.load_weights``): the module tree holds no per-expert
    parameter any more, and none is silently missing from ``model.state_dict()``."""
    super(type(self), self)._save_to_state_dict(destination, prefix, keep_vars)
    for fqn, t in _stacked_held(self):
        destination[prefix + fqn] = t if keep_vars else t.detach()


def _stacked_held(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(stacked key, DTensor) of the experts the plan stacks that this rank holds; none until the
    plan's shards exist."""
    pm = model.__dict__.get(_PM)
    state = getattr(pm, "_state", None) if pm is not None else None
    if state is None or not pm._traced.stacked or not _holds_dtensors(model):
        return []
    return [(fqn, state.params[fqn]) for fqn in pm._traced.stacked if state.holds(fqn)]


def _named_parameters_with_stacked(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
    """The module's parameters, then the experts the plan stacks (``P.*.suffix``, as
    ``pm.named_parameters()`` names them): ``model.parameters()`` feeds an optimizer that trains
    every parameter the plan trains (the module tree holds no per-expert parameter any more)."""
    yield from super(type(self), self).named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)
    if recurse:
        for fqn, t in _stacked_held(self):
            yield (f"{prefix}.{fqn}" if prefix else fqn), t


def _holds_dtensors(model: torch.nn.Module) -> bool:
    t = next(iter(model.parameters()), None)
    if t is None:
        t = next(iter(model.buffers()), None)
    return isinstance(t, DTensor)


def _run(model: torch.nn.Module, pm, original, args: tuple, kwargs: dict):
    """``model(*args, **kwargs)`` of a model sharded in place: the compiled program where the batch
    has the compiled shapes (or grad is enabled, where pm refuses other shapes with its error), else
    the original forward eagerly on the DTensors (``_eager``). A pipeline plan's program is its
    training step only (it returns the loss, on the last stage): under ``no_grad`` every batch runs
    eagerly. Every rank calls it together."""
    from autopar.runtime.agreement import every_rank
    from autopar.runtime.input_checks import mismatch

    if pm.training != model.training:
        pm.train(model.training)
    if pm.plan is None or pm._local or torch.is_grad_enabled():
        return pm(*args, **kwargs)
    if pm._pipeline is not None:  # the plan's, so the same branch on every rank
        return _eager(model, pm, original, args, kwargs)
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


class _Whole:
    """Any parameter or buffer of the model, whole, by name (a tie's first name), on every rank:
    ``DTensor.full_tensor()`` where every rank holds it; under a pipeline plan gathered by the
    stage holding it and broadcast from there (``weight_export.fetch_whole``); a stacked expert's
    row of its stacked tensor. Every rank fetches the same names in the same order."""

    def __init__(self, pm):
        self.pm = pm
        canon = pm._param_of_key
        self.held = {canon.get(n, n): t for n, t in [*pm.named_parameters(remove_duplicate=False),
                                                     *pm.named_buffers(remove_duplicate=False)]}
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.owners = None
        if pm._pipeline is not None:
            from autopar.runtime.weight_export import owners

            self.owners = owners(pm, self.held)  # one all-gather of what each rank holds
        self.row_of = {m: (fqn, i) for fqn, members in pm._traced.stacked.items() for i, m in enumerate(members)}
        # stacked parameters fetched whole, kept for their other rows until a name that is no expert's
        # row is fetched (the experts of one layer run, and are listed, together): one gather per
        # stacked parameter, not one per row; the same names in the same order on every rank, so the
        # same fetches
        self._stacked: dict[str, tuple[torch.Tensor | None, bool]] = {}

    def fetch(self, name: str) -> tuple[torch.Tensor | None, bool]:
        """(the full tensor, whether it trains); it may share storage with this rank's shard. None
        for a name no rank holds (the plan dropped it: the model had it, its traced program did not)."""
        if name in self.row_of:
            fqn, i = self.row_of[name]
            if fqn not in self._stacked:
                self._stacked[fqn] = self._fetch(fqn)
            full, grad = self._stacked[fqn]
            return (full[i].clone() if full is not None else None), grad
        self._stacked.clear()
        return self._fetch(name)

    def _fetch(self, name: str) -> tuple[torch.Tensor | None, bool]:
        t = self.held.get(name)
        if self.owners is None:
            if t is None:
                return None, False
            return (t.full_tensor() if isinstance(t, DTensor) else t.detach()), t.requires_grad
        from autopar.runtime.weight_export import fetch_whole

        owner = self.owners.get(name)
        if owner is None:
            return None, False
        return fetch_whole(t, owner, self.rank, self.pm._device), owner.requires_grad

    def has(self, name: str) -> bool:
        """Whether some rank holds ``name`` (``fetch`` gives a tensor)."""
        if name in self.row_of:
            return True
        return name in (self.owners if self.owners is not None else self.held)

    def shares_storage(self, full: torch.Tensor, name: str) -> bool:
        """Whether ``full`` is this rank's own shard's storage (a replicated DTensor's local tensor)."""
        t = self.held.get(name)
        local = t._local_tensor if isinstance(t, DTensor) else t
        return local is not None and full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()


def _eager(model: torch.nn.Module, pm, original, args: tuple, kwargs: dict):
    """The original forward, eagerly, under ``no_grad``: each module's own parameters and buffers
    are gathered whole as it is called and put back when it returns (as FSDP unshards one module at
    a time: at most one module's parameters whole beyond the shards; experts the plan stacks: their
    layer's stacked tensors, while its experts run), so every op runs on plain tensors. A parameter
    or buffer read outside its own module's forward (a tied head's ``F.linear(x, self.wte.weight)``
    in the root, module A's weight read in module B) is fetched whole where it is read
    (``_Fetching``: each module's ``_parameters`` and ``_buffers`` while this runs) and put back
    when the module running then returns: at most one module's weights whole at a time plus the
    parameters read outside their module. Under a pipeline plan a module's entries another stage
    holds (which this rank's tree lacks, ``adopt``) are fetched from that stage the same way (by
    the names ``_Tree`` kept) and removed again on return, so every rank runs the whole forward.
    What is whole is the same on every rank at every read (every rank runs the same code on the
    same batch), so every rank fetches the same names in the same order. A DTensor met otherwise
    (``model.parameters()`` iterated in the forward) meets plain tensors as replicated
    (``implicit_replication``). DTensor outputs come back as plain full tensors. Gathers are
    collectives: every rank calls. A buffer the forward writes (BatchNorm's running
    statistics in train mode) is updated as on one device: every rank runs the whole batch, so
    every rank computes the same new value, and this rank's shard of it takes that value (a
    replicated buffer's gathered tensor is its local tensor already; any other is copied back
    into the shard when its module returns, ``_put_back``)."""
    from torch.distributed.tensor.experimental import implicit_replication

    from autopar.runtime.collective_errors import collective_failures

    tree: _Tree = model.__dict__[_TREE]
    entries = {}  # module id -> its leaves (a module shared under several paths: its first)
    modules = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        entries.setdefault(id(mod), tree.leaves.get(path, ()))
        modules.setdefault(id(mod), mod)
    gathered: dict[int, list] = {}  # module id -> a stack of (dict, name, what it held: a DTensor or None)
    running: list[list] = []  # the put-back lists of the modules running now, innermost last
    whole_of = _Whole(pm)  # on every rank before any fetch (a pipeline plan's: an all-gather)

    def fetch(own: dict, e: _Leaf, put: list) -> torch.Tensor | None:
        t = dict.get(own, e.leaf)
        full = whole_of.fetch(e.name)[0]
        if full is not None:
            put.append((own, e.leaf, t, None if e.is_param else (full, full._version)))
            dict.__setitem__(own, e.leaf, full)
        return full

    def whole(mod, *_):
        put = []
        for e in entries.get(id(mod), ()):
            own = mod._parameters if e.is_param else mod._buffers
            t = dict.get(own, e.leaf)
            if e.name is None or not (isinstance(t, DTensor) or not dict.__contains__(own, e.leaf)):
                continue  # registered as None, or plain already
            fetch(own, e, put)
        gathered.setdefault(id(mod), []).append(put)
        running.append(put)

    def back(mod, *_):
        running.pop()
        _put_back(gathered[id(mod)].pop())

    def read(own: dict, e: _Leaf) -> torch.Tensor | None:  # an entry read while not whole: for the running module
        return fetch(own, e, running[-1])

    handles = []
    swapped = []  # (module, attribute, its own dict) while the forward runs
    mixed = pm._policy.mixed
    try:
        for mid, mod in modules.items():
            for attr, is_param in (("_parameters", True), ("_buffers", False)):
                own = mod.__dict__[attr]
                leaves = {e.leaf: e for e in entries.get(mid, ()) if e.is_param == is_param and e.name is not None
                          and whole_of.has(e.name)}
                if leaves:
                    swapped.append((mod, attr, own))
                    mod.__dict__[attr] = _Fetching(own, leaves, read)
        with collective_failures("forward", pm.collective_log), implicit_replication(), torch.no_grad(), \
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
                _put_back(stack.pop())
        for mod, attr, own in swapped:  # the module's own dict again, with what the forward left in it
            now = mod.__dict__[attr]
            own.clear()
            own.update(dict.items(now))
            mod.__dict__[attr] = own


class _Fetching(dict):
    """A module's ``_parameters`` or ``_buffers`` while ``_eager`` runs: reading (``[]``, ``in``:
    what ``nn.Module.__getattr__`` does) one of ``leaves`` while it is not whole (a DTensor, or
    another stage's entry this rank's tree lacks) returns ``read(self, leaf)``, the entry fetched
    whole for the module running now. Other reads (``get``, iteration) see what the dict holds."""

    def __init__(self, own: dict, leaves: dict, read):
        super().__init__(own)
        self._leaves = leaves
        self._read = read

    def __contains__(self, leaf) -> bool:
        return dict.__contains__(self, leaf) or leaf in self._leaves

    def __getitem__(self, leaf):
        t = dict.get(self, leaf)
        if leaf in self._leaves and (t is None or isinstance(t, DTensor)):
            full = self._read(self, self._leaves[leaf])
            if full is not None:
                return full
        return dict.__getitem__(self, leaf)


def _put_back(put: list) -> None:
    """Each entry back as it was; a buffer the module wrote in place (its version moved) writes
    this rank's part of the new value into its shard unless the shard is that very storage."""
    for own, leaf, t, written in put:
        if t is None:  # another stage's: this rank's tree does not hold it
            del own[leaf]
            continue
        own[leaf] = t
        if written is not None and written[0]._version != written[1] and isinstance(t, DTensor):
            full, local = written[0], t._local_tensor
            if local.numel() and full.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
                (chunk,) = t.__create_chunk_list__()
                local.copy_(full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))])


# ---------------------------------------------------------------------------- back to one device
def export_module(model) -> torch.nn.Module:
    """A plain single-device module of the model's class with the full trained weights, for
    evaluation, generation or ``torch.save``: ``model`` is the module ``autopar.compile`` sharded
    in place, or its ``ParallelModel``.

    Every rank must call it (each parameter is gathered with a collective, one parameter at a time,
    in the same order everywhere), and every rank gets the module (on the device the shards live
    on), with every parameter and buffer the model had before compile, in their order. Ties (a
    shared embedding and head) stay tied; experts the plan stacked are unstacked. Pipeline plans:
    each tensor is gathered by the stage holding it and broadcast to every rank
    (``weight_export.fetch_whole``), so every rank gets all stages.

    >>> # pm = autopar.compile(model, cluster); ... train ...
    >>> # plain = autopar.export_module(model)   # on every rank
    >>> # if rank == 0: torch.save(plain.state_dict(), "model.pt")
    """
    from autopar.runtime.collective_errors import collective_failures
    from autopar.runtime.module_moves import unguard
    from autopar.runtime.parallel_model import ParallelModel

    if isinstance(model, ParallelModel):
        model = model._builder.model
    pm = parallel_model_of(model)
    pm._require_plan("export_module")
    tree: _Tree = model.__dict__[_TREE]
    fulls: dict[str, torch.Tensor] = {}  # name -> its plain tensor in the copy (a Parameter for parameters)
    with collective_failures("export_module", pm.collective_log), torch.no_grad():
        pm._sync_zero_params()  # ZeRO-1/2: the whole parameters the user's optimizer updated
        whole = _Whole(pm)
        for leaves in tree.leaves.values():
            for e in leaves:
                if e.name is None or e.name in fulls:
                    continue
                full, grad = whole.fetch(e.name)
                if full is None:
                    continue
                if whole.shares_storage(full, e.name):
                    full = full.clone()  # a replicated shard's own storage: the copy must not alias it
                fulls[e.name] = torch.nn.Parameter(full, requires_grad=grad) if e.is_param else full
    memo: dict[int, object] = {id(pm): None, id(tree): None}
    for path, mod in model.named_modules(remove_duplicate=False):  # what the tree holds now: not deep-copied
        for e in tree.leaves.get(path, ()):
            t = (mod._parameters if e.is_param else mod._buffers).get(e.leaf)
            if t is not None:
                memo[id(t)] = fulls[e.name]
    out = copy.deepcopy(model, memo)
    out.__class__ = type(model)._autopar_original_class
    del out.__dict__[_PM], out.__dict__[_TREE]
    unguard(out)  # a plain module: its submodules convert and move as any
    for path, mod in out.named_modules(remove_duplicate=False):  # each module's entries, in the order it had them
        leaves = tree.leaves.get(path, ())
        kept = [e for e in leaves if e.name is None or e.name in fulls]
        mod._parameters = {e.leaf: fulls.get(e.name) for e in kept if e.is_param}
        mod._buffers = {e.leaf: fulls.get(e.name) for e in kept if not e.is_param}
    return out
