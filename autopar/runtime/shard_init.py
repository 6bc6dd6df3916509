"""Deferred initialisation: a model built on ``torch.device("meta")`` initialised by its own code,
each rank writing only its shards (no rank-0 broadcast).

How: the store allocated each meta parameter and buffer as an empty local shard
(``ParamStore.deferred``). ``initialise_deferred`` installs, for the time of the init, one handle per
tensor in the user's module tree (a DTensor of the *global* shape over the local shard, so the
init code sees the real shapes: fan-in, std), runs the model's own init once over the whole tree
(``choose_init``), and puts the module's own tensors back. Under ``_ShardInitMode`` (a
``TorchDispatchMode``) the handles are stand-ins:

* the first op touching a tensor that holds no value yet (or a random op overwriting one whole)
  *activates* it: its full value is made on CPU and every op on the tensor runs on that full
  value, exactly as on one device; activating the next tensor *flushes* this one (this rank's
  slice is copied into its shard, the full value freed): one full tensor at a time, so the
  start-up peak is the shards plus the largest single tensor (and the init code's temporaries);
* a random op (any op tagged ``nondeterministic_seeded``: ``uniform_``, ``normal_``, ``randperm``,
  ...) draws from a generator seeded by ``derived_seed(base, owner, n)``: ``base`` agreed from rank
  0's ``torch.initial_seed()``, ``owner`` the fully qualified name of the tensor it writes (for a
  temporary, the tensor that last received a random op directly: ``trunc_normal_``'s rejection
  redraws, ``orthogonal_``'s Gaussian), ``n`` how many such ops that owner received so far. Every
  rank runs the same ops on the same full values, so the full state is bitwise the same on one
  process and under any plan or world size; the user's RNG state is restored afterwards;
* a tensor already written (flushed) is touched through its DTensor: elementwise ops run on the
  shards; ``copy_`` of a full (plain) tensor into it copies this rank's slice;
* a tensor this rank does not hold (another pipeline stage's) is activated the same way and its
  full value discarded: all ranks run the same ops, so no rank's control flow differs;
* a buffer or parameter the init code reassigns (torchtitan's ``self.freqs_cis = ...``) is taken
  whole after the init and its slice copied into the shard.

Which init runs (``choose_init``): ``init=`` given to ``autopar.compile`` (a callable taking the
model); else Hugging Face's ``initialize_weights()`` (``_init_weights`` per module); else the
model's ``init_weights()`` (torchtitan's convention, given ``buffer_device`` where it takes one);
else each module's ``reset_parameters()`` in module order. A meta tensor that no init wrote is
refused on every rank (``DeferredInitError``), naming it and the fix. Ops reading a tensor's *full*
value after it was flushed while writing another's (``q.copy_(p)`` with ``p`` done) are refused too:
the full value is gone.

``init="skip"`` (a loader fills the state dict: ``autopar.load_weights``): the same init runs, with
only the tensors no state dict carries as its *targets*: the meta non-persistent buffers (Hugging
Face's rotary ``inv_freq``, torchtitan's ``freqs_cis``), agreed from rank 0's model. Every other
tensor (parameters, persistent buffers) is *skipped*: the init sees a meta tensor of its full
shape, so its ops make no value and draw no random number (``trunc_normal_`` of a meta tensor
returns at once) and its shard is left as allocated, for the loader. A target's own values and
random ops are the full init's (its seed depends on its name and its own count only), so it gets
exactly the value the full init gives it; a target computed from a skipped tensor's value is
refused, naming both. A target the init does not write stays deferred (``ParamStore.deferred``)
and ``load_weights`` warns of it. Without a target (no such buffer) nothing runs.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.errors import DeferredInitError
from autopar.runtime.agreement import decided_by_rank0, gathered
from autopar.runtime.collectives import shard_tensor
from autopar.runtime.dtensor_params import make_dtensor

__all__ = ["SKIP", "initialise_deferred", "choose_init", "derived_seed", "check_init_arg", "unsaved_buffers"]

SKIP = "skip"  # compile(init="skip"): only the buffers no state dict holds are initialised (a loader fills the rest)


def check_init_arg(init: Any) -> None:
    """``compile(init=...)``: None (the model's own init), a callable ``init(model)``, or "skip"."""
    if init is None or init == SKIP or callable(init):
        return
    raise DeferredInitError(f"compile's init= takes a callable init(model), 'skip' or None (the model's own init), "
                            f"got {init!r}")


def derived_seed(base: int, owner: str, count: int) -> int:
    """The seed of the ``count``-th random op of ``owner`` (a fully qualified name): the same on
    every process and platform (not Python's salted ``hash``)."""
    digest = hashlib.sha256(f"{base}:{owner}:{count}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def choose_init(model: torch.nn.Module, init: Any, buffer_device: torch.device) -> tuple[str, Callable[[], None]]:
    """(what runs, in words; the call) of the init for ``model`` (see the module docstring)."""
    if callable(init):
        return f"init={getattr(init, '__name__', type(init).__name__)}", lambda: init(model)
    if callable(getattr(model, "initialize_weights", None)) and hasattr(model, "_init_weights"):
        return f"{type(model).__name__}.initialize_weights() (Hugging Face's _init_weights)", model.initialize_weights
    if callable(getattr(model, "_init_weights", None)) and hasattr(model, "config"):  # transformers 4
        return f"{type(model).__name__}._init_weights per module", lambda: model.apply(model._init_weights)
    if callable(getattr(model, "init_weights", None)):
        fn = model.init_weights
        try:
            takes = "buffer_device" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            takes = False
        return (f"{type(model).__name__}.init_weights()",
                (lambda: fn(buffer_device=buffer_device)) if takes else fn)
    owners = [m for m in model.modules() if callable(getattr(m, "reset_parameters", None))]
    return "each module's reset_parameters()", lambda: [m.reset_parameters() for m in owners]


@dataclass(eq=False)
class _Entry:
    """One parameter or buffer of the plan during the init."""

    fqn: str
    shape: torch.Size
    dtype: torch.dtype
    write: Callable[[torch.Tensor], None] | None  # copy this rank's slice of a full value in; None: not held
    written: bool  # holds its value (a real tensor the store was given, or written by the init)
    always_full: bool = False  # its handle is no shard (another stage's, a stacked expert): every op runs on a full value
    handle: torch.Tensor | None = None  # what the module tree holds during the init
    full: torch.Tensor | None = None  # while active: the full value every op runs on
    dirty: bool = False  # the full value was written while active
    random_ops: int = 0
    skipped: bool = False  # init="skip" and a state dict carries it: its handle is a meta tensor
    ph: str = ""  # its placeholder in the program


def _key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (shared by its views); a DTensor's: its local tensor's.
    -1 for a tensor without one (sparse, nested): never a handle."""
    if isinstance(t, DTensor):
        t = t._local_tensor  # to_local() would record autograd; copyable_state reads it so too
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return -1


def _whole(t: torch.Tensor, e: _Entry) -> bool:
    return tuple(t.shape) == tuple(e.shape)


class _ShardInitMode(TorchDispatchMode):
    """Runs the init's ops on full values one tensor at a time (see the module docstring)."""

    def __init__(self, entries: list[_Entry], base_seed: int, skip: bool = False):
        super().__init__()
        self.base = base_seed
        self.skip = skip  # init="skip": some entries are skipped (run on meta values)
        self.by_key: dict[int, _Entry] = {}
        for e in entries:
            self.by_key.setdefault(_key(e.handle), e)
        self.active: _Entry | None = None
        self.owner: _Entry | None = None  # the tensor that last received a random op directly
        self.loose_random_ops = 0  # random ops before any tensor received one

    # ------------------------------------------------------------------ activation
    def activate(self, e: _Entry) -> torch.Tensor:
        if self.active is not e:
            self.flush()
            e.full = torch.empty(e.shape, dtype=e.dtype, device="cpu")
            e.dirty = False
            self.by_key[_key(e.full)] = e
            self.active = e
        return e.full

    def flush(self) -> None:
        e, self.active = self.active, None
        if e is None:
            return
        if e.dirty:
            e.written = True
            if e.write is not None:
                e.write(e.full)
        self.by_key.pop(_key(e.full), None)
        e.full = None

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        random = torch.Tag.nondeterministic_seeded in func.tags
        written = {id(x) for x in _written_args(func._schema, args, kwargs)}
        flat, spec = pytree.tree_flatten((args, kwargs))
        subs: dict[int, torch.Tensor] = {}  # position -> full value put in place of a handle
        entries: dict[int, _Entry] = {}
        for i, a in enumerate(flat):
            e = self.by_key.get(_key(a)) if isinstance(a, torch.Tensor) else None
            if e is None:
                continue
            entries[i] = e
            if e.skipped:
                continue  # its handle is a meta tensor: the op runs on it as is
            if not isinstance(a, DTensor):
                continue  # a view of the active full value: the op runs on it as is
            overwrite = random and id(a) in written and _whole(a, e) and torch.Tag.inplace in func.tags
            if e is self.active or e.always_full or not e.written or overwrite:
                if not _whole(a, e):
                    raise DeferredInitError(
                        f"deferred init: {func} on a part ({tuple(a.shape)}) of {e.fqn} {tuple(e.shape)} through a DTensor; "
                        "write the whole tensor (or initialise it in the module's own init before slicing it)")
                if e is not self.active and any(subs.get(j) is not None and entries[j] is not e for j in subs):
                    raise DeferredInitError(
                        f"deferred init: {func} reads {entries[next(iter(subs))].fqn} and {e.fqn} before either holds a "
                        "value; the init makes one full tensor at a time: initialise each from random ops and constants")
                if e.always_full and e.write is not None and e.written and not overwrite and e is not self.active:
                    raise DeferredInitError(
                        f"deferred init: {func} on {e.fqn} (an expert stacked into one parameter) after its init: "
                        "initialise each expert's tensors in one go")
                subs[i] = self.activate(e)
        if self.skip and any(isinstance(a, torch.Tensor) and a.is_meta for a in flat):
            _refuse_from_skipped(func, flat, entries, written)
        generator = self._seed(func, flat, entries, written, kwargs) if random else None
        for i, e in entries.items():
            if e.skipped:
                continue  # left for the loader: still deferred
            if id(flat[i]) in written:
                if e is self.active:
                    e.dirty = True
                else:
                    e.written = True
        mixed = bool(subs) and any(isinstance(a, DTensor) and i not in subs for i, a in enumerate(flat))
        if mixed and func is torch.ops.aten.copy_.default and 0 in subs:
            raise DeferredInitError(_read_after_flush(entries, flat, subs, func))
        new_args, new_kwargs = pytree.tree_unflatten([subs.get(i, a) for i, a in enumerate(flat)], spec)
        if generator is not None:
            new_kwargs["generator"] = generator
        if func is torch.ops.aten.copy_.default and 0 in entries and 0 not in subs and not isinstance(new_args[1], DTensor):
            e = entries[0]  # a full value into a tensor already held as shards: this rank's slice
            if e.write is not None and _broadcasts(new_args[1].shape, e.shape):
                e.write(new_args[1].expand(e.shape))
                return args[0]
        try:
            out = func(*new_args, **new_kwargs)
        except DeferredInitError:
            raise
        except Exception as exc:
            if not mixed:
                raise
            names = sorted({e.fqn for e in entries.values()})
            raise DeferredInitError(
                f"deferred init: {func} on {', '.join(names)} failed ({exc}); the init code combines a tensor already "
                "initialised (now held only as shards) with another: initialise each tensor from random ops and "
                "constants, or build the model on CPU") from exc
        # an in-place op returns its argument: the handle, not the full value put in its place
        back = {id(v): flat[i] for i, v in subs.items()}
        return pytree.tree_map(lambda o: back.get(id(o), o) if isinstance(o, torch.Tensor) else o, out)

    def _seed(self, func, flat, entries, written, kwargs) -> torch.Generator | None:
        """The random op's generator, seeded by the tensor it writes (else the last owner); for an
        overload without a generator argument the default generator is seeded instead (the
        caller restores the user's RNG state afterwards)."""
        direct = next((e for i, e in entries.items() if id(flat[i]) in written), None)
        if direct is not None:
            self.owner = direct
        owner = direct or self.owner
        if owner is None:
            seed = derived_seed(self.base, "", self.loose_random_ops)
            self.loose_random_ops += 1
        else:
            seed = derived_seed(self.base, owner.fqn, owner.random_ops)
            owner.random_ops += 1
        device = kwargs.get("device") or next(
            (torch.device("meta" if entries[i].skipped else "cpu") if i in entries else a.device
             for i, a in enumerate(flat) if isinstance(a, torch.Tensor)),
            torch.device("cpu"))  # a handle's op runs on its full value, on CPU (a skipped one's on meta)
        device = torch.device(device)
        if device.type == "meta":
            return None
        if any(a.name == "generator" for a in func._schema.arguments):
            return torch.Generator(device=device).manual_seed(seed)
        torch.manual_seed(seed)
        return None


def _written_args(schema, args, kwargs) -> list[torch.Tensor]:
    """The tensors the op writes (in place or ``out=``)."""
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def _refuse_from_skipped(func, flat, entries, written) -> None:
    """init="skip": an op writing a target (a buffer no state dict holds) from a skipped tensor's
    value (a parameter or persistent buffer, here a meta tensor) cannot compute it: refused."""
    targets = [e.fqn for i, e in entries.items() if id(flat[i]) in written and not e.skipped]
    if not targets:
        return
    sources = sorted({e.fqn for i, e in entries.items() if e.skipped} - set(targets)) or [
        "a value computed from a parameter or persistent buffer (a meta tensor here)"]
    if any(a.is_meta for a in flat if isinstance(a, torch.Tensor) and id(a) not in written):
        raise DeferredInitError(
            f"init='skip': the model's init computes {', '.join(targets)} (a buffer no state dict holds, so initialised "
            f"here) from {', '.join(sources)} ({func}), which the loader fills later and has no value yet: compute the "
            "buffer from constants in the init, or compile without init='skip' (the model's own init, then load)")


def _read_after_flush(entries, flat, subs, func) -> str:
    dst = entries[0].fqn
    src = [entries[i].fqn for i, a in enumerate(flat) if isinstance(a, DTensor) and i not in subs and i in entries]
    return (f"deferred init: {func} writes {dst} from {', '.join(src) or 'a sharded tensor'}, initialised earlier and "
            "now held only as shards; initialise each tensor from random ops and constants (tie parameters by "
            "assignment, not by copying), or build the model on CPU")


# ---------------------------------------------------------------------------- the init
@dataclass
class _Installed:
    module: torch.nn.Module
    leaf: str
    is_param: bool
    original: torch.Tensor
    entry: _Entry


def _slot_writer(local: torch.Tensor, layout, comm) -> Callable[[torch.Tensor], None]:
    def write(full: torch.Tensor) -> None:
        with torch.no_grad():
            local.copy_(shard_tensor(full, layout, comm))
    return write


def _member_writer(local: torch.Tensor, layout, comm, index: int, stacked_shape) -> Callable[[torch.Tensor], None]:
    """Write expert ``index``'s full value into its rows of a stacked slot's shard (any layout)."""
    def write(full: torch.Tensor) -> None:
        ids = torch.arange(stacked_shape[0]).view(-1, *[1] * (len(stacked_shape) - 1)).expand(stacked_shape)
        mine = shard_tensor(ids, layout, comm).to(local.device) == index
        if mine.any():
            with torch.no_grad():
                src = shard_tensor(full.unsqueeze(0).expand(stacked_shape), layout, comm).to(local.device)
                local[mine] = src[mine].to(local.dtype)
    return write


def _entries(store, traced, mesh, targets: frozenset[str] | None = None) -> dict[str, _Entry]:
    """fqn -> entry for every parameter and buffer of the plan (this rank's, and the others'),
    each with its handle: a DTensor of the global shape over this rank's shard, or for a tensor
    with no shard of its own shape here (another stage's, a stacked expert) over an empty tensor.
    ``targets`` (init="skip"): the only tensors the init writes; every other entry is skipped."""
    comm = store.comm
    out: dict[str, _Entry] = {}
    held = {s.fqn: s for s in store.slots.values()}
    meta = {n.name: n.meta["autopar.outputs"][0] for n in traced.graph.nodes
            if n.op == "placeholder" and (n.meta.get("autopar.outputs") or (None,))[0] is not None}

    def entry(fqn, shape, dtype, write, deferred, local=None, layout=None, ph=""):
        e = _Entry(fqn, torch.Size(shape), dtype, write, written=not deferred, always_full=local is None,
                   skipped=targets is not None and fqn not in targets, ph=ph)
        if e.skipped:  # left for the loader: the init sees a meta tensor of its shape (sampling it is a no-op)
            e.handle = torch.empty(e.shape, dtype=dtype, device="meta")
            out[fqn] = e
            return
        if local is None:
            local, layout = torch.empty(0, dtype=dtype, device=store.device), [Replicate()] * mesh.ndim
        e.handle = make_dtensor(local, mesh, layout, e.shape, False)
        out[fqn] = e

    for ph, fqn in traced.param_fqns.items():
        shape, dtype, s = tuple(meta[ph].shape), meta[ph].dtype, held.get(fqn)
        if fqn in traced.stacked:  # experts stacked on dim 0: each member writes its rows
            for k, member in enumerate(traced.stacked[fqn]):
                write = _member_writer(s.local, s.layout, comm, k, shape) if s is not None else None
                entry(member, shape[1:], dtype, write, ph in store.deferred or s is None, ph=ph)
        elif s is not None:
            entry(fqn, shape, dtype, _slot_writer(s.local, s.layout, comm), ph in store.deferred, s.local, s.layout, ph)
        else:
            entry(fqn, shape, dtype, None, True, ph=ph)
    for ph, fqn in traced.buffer_fqns.items():
        shape, dtype = tuple(meta[ph].shape), meta[ph].dtype
        if ph in store.buffers:
            local, layout = store.buffers[ph], store.layouts[ph]
            entry(fqn, shape, dtype, _slot_writer(local, layout, comm), ph in store.deferred, local, layout, ph)
        else:
            entry(fqn, shape, dtype, None, True, ph=ph)
    return out


def _install(model: torch.nn.Module, entries: dict[str, _Entry]) -> list[_Installed]:
    """Put each entry's handle in the module tree under every name of its tensor (ties too)."""
    canonical: dict[int, str] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        canonical.setdefault(id(t), name)
    done: list[_Installed] = []
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
            for leaf, t in list(table.items()):
                if t is None:
                    continue
                e = entries.get(canonical.get(id(t), f"{mod_name}.{leaf}" if mod_name else leaf))
                if e is None:
                    continue  # not in the program (unused): left as it is
                if is_param and not isinstance(e.handle, torch.nn.Parameter):  # one object per tie
                    e.handle = torch.nn.Parameter(e.handle, requires_grad=t.requires_grad)
                table[leaf] = e.handle
                done.append(_Installed(mod, leaf, is_param, t, e))
    return done


def _take_reassigned(installed: list[_Installed]) -> list[str]:
    """Tensors the init reassigned (``self.freqs_cis = ...``): their slices go into the shards.
    Returns the names it could not take."""
    bad = []
    for it in installed:
        now = (it.module._parameters if it.is_param else it.module._buffers).get(it.leaf)
        if now is it.entry.handle or now is None or it.entry.skipped:
            continue  # a skipped tensor's reassignment is dropped with the rest of its init
        e = it.entry
        if isinstance(now, DTensor) or now.is_meta or not _broadcasts(now.shape, e.shape):
            bad.append(f"{e.fqn} (reassigned to a {type(now).__name__} {tuple(now.shape)} on {now.device})")
            continue
        if e.write is not None:
            e.write(now.detach().expand(e.shape))
        e.written = True
    return bad


def _broadcasts(shape, to) -> bool:
    try:
        return torch.broadcast_shapes(tuple(shape), tuple(to)) == tuple(to)
    except RuntimeError:
        return False


@contextlib.contextmanager
def _flags_kept(model: torch.nn.Module):
    """Hugging Face marks each module it initialised (``_is_hf_initialized``); put the marks back
    as they were, so a second compile of the same model initialises it again."""
    before = {m: m.__dict__.get("_is_hf_initialized", _MISSING) for m in model.modules()}
    try:
        yield
    finally:
        for m, v in before.items():
            if v is _MISSING:
                m.__dict__.pop("_is_hf_initialized", None)
            else:
                m.__dict__["_is_hf_initialized"] = v


_MISSING = object()


def unsaved_buffers(model: torch.nn.Module) -> frozenset[str]:
    """The names of ``model``'s buffers that no state dict carries (non-persistent under each of
    their names): what a loader cannot fill, so what ``init="skip"`` initialises."""
    saved = set(model.state_dict(keep_vars=True))
    names: dict[int, list[str]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for leaf, t in mod._buffers.items():
            if t is not None:
                names.setdefault(id(t), []).append(f"{mod_name}.{leaf}" if mod_name else leaf)
    return frozenset(n for group in names.values() if not saved.intersection(group) for n in group)


def initialise_deferred(store, traced, model: torch.nn.Module, mesh, init: Any = None) -> str | None:
    """Initialise every deferred (meta) tensor of ``store`` by ``model``'s own init (module
    docstring); with ``init == "skip"`` only the meta buffers no state dict holds (the rest stays
    deferred for a loader). Call on every rank after the store exists; a no-op where the store
    defers nothing (the set is agreed), or under "skip" where no such buffer is deferred. Works
    whether the module tree holds its original (meta) tensors or the plan's DTensors: they are put
    back as they were. The placeholders written leave ``store.deferred``. Returns what ran."""
    if not store.meta_fqns and callable(init):
        raise DeferredInitError(
            f"compile got init= but {type(model).__name__} holds no tensor on the meta device (it is initialised "
            "already, and rank 0's values are broadcast): build it under torch.device('meta') for init= to run, or drop init=")
    if not store.meta_fqns:
        return None
    skip = init == SKIP
    targets = None
    if skip:  # agreed: whether the init runs at all decides whether the verdict's collective runs
        targets = decided_by_rank0(lambda: frozenset(traced.buffer_fqns.values()) & store.meta_fqns & unsaved_buffers(model))
        if not targets:
            return None
    entries = _entries(store, traced, mesh, targets)
    what, run = choose_init(model, None if skip else init, torch.device("cpu"))
    if skip:
        what = f"{what} for the buffers no state dict holds ({', '.join(sorted(targets))}), init='skip'"
    failure = None
    installed = _install(model, entries)
    try:
        cuda = [torch.cuda.current_device()] if store.device.type == "cuda" else []
        with _flags_kept(model), torch.random.fork_rng(devices=cuda), torch.no_grad():
            mode = _ShardInitMode([it.entry for it in installed] or list(entries.values()), store.init_seed, skip)
            try:
                with mode:
                    run()
            finally:
                mode.flush()
        failure = _take_reassigned(installed)
        failure = f"the init reassigned {', '.join(failure)}, not a full tensor of its shape" if failure else None
    except Exception as exc:  # noqa: BLE001 - every rank must learn that one failed
        failure = exc
    finally:
        for it in installed:
            (it.module._parameters if it.is_param else it.module._buffers)[it.leaf] = it.original
    missing = sorted(e.fqn for e in entries.values() if e.write is not None and not e.written and not e.skipped)
    verdicts = gathered((None if failure is None else f"{type(failure).__name__}: {failure}"
                         if isinstance(failure, BaseException) else failure, missing))
    if isinstance(failure, DeferredInitError):
        raise failure
    if failure is not None:
        raise DeferredInitError(f"deferred init of {type(model).__name__} ({what}) failed: {failure}") from (
            failure if isinstance(failure, BaseException) else None)
    others = next((f for f, _ in verdicts if f is not None), None)
    if others is not None:
        raise DeferredInitError(f"deferred init of {type(model).__name__} ({what}) failed on another rank: {others}")
    for ph in {e.ph for e in entries.values()} & store.deferred:  # written: no longer awaits an init (or a loader)
        if all(e.written for e in entries.values() if e.ph == ph):
            store.deferred.discard(ph)
    unset = sorted({n for _, names in verdicts for n in names})
    if unset and not skip:  # under "skip" they stay deferred: load_weights names them (the user may write them)
        raise DeferredInitError(
            f"{type(model).__name__} was built on the meta device and {what} did not initialise {len(unset)} of its "
            f"tensors: {', '.join(unset[:6])}{' ...' if len(unset) > 6 else ''}. Give the model an init_weights() "
            "(torchtitan's convention) or its modules a reset_parameters() that writes them, pass "
            "autopar.compile(..., init=fn) (fn(model) initialises it in place), or build the model on CPU")
    return what
