"""Data-parallel gradient synchronisation for the parameters the program left unsynchronised.

Hand-written because torch's bucketing reducer lives inside ``DistributedDataParallel`` and only
wraps whole modules; here the plan decides per parameter over which mesh axes to reduce and at
which ZeRO stage.

* ZeRO-0/1 parameters: their gradients are views into the store's flat buffer, ordered by when
  backward produces them, so a bucket is a contiguous range of that buffer: once every gradient
  of a bucket has been accumulated on the last microbatch, the range is all-reduced in place,
  asynchronously, while backward continues (DDP with ``gradient_as_bucket_view``; no copy).
* ZeRO-2 parameters: after each microbatch's gradient is accumulated it is reduce-scattered
  along the parameter's ``state_dim`` into its shard (``opt.grad``) and the full gradient is
  dropped; at most ``MAX_INFLIGHT`` reduce-scatters are pending, so at most that many full
  gradients are alive at once.

* A step that starts from cleared gradients (the native loop after ``zero_grad()``) need not
  zero the buckets first (``start_empty``): their parameters' ``.grad`` are set to None, backward
  writes each gradient as a fresh tensor (nothing to add to), and the hook copies it into its
  bucket view and makes the view ``.grad`` again, as DDP's reducer does; ``finish()`` zeroes the
  views of parameters that received no gradient. One pass over the gradients instead of a zeroing
  pass and a read-add (8 ms a step of 33 MiB zeroing on 4 gloo processes here).

* A scalar can ride the all-reduce of the bucket that ends the float32 buffer (``carry``): the
  loss value, which would otherwise take a collective of its own. On a backend whose small
  collectives cost mostly latency (gloo over a few processes: ~5 ms each here) that is one
  synchronisation fewer per step.

Invariant: after ``finish()`` every registered parameter's gradient (``local.grad`` for ZeRO-0/1,
``opt.grad`` for ZeRO-2) is the sum over its axes. Hooks hold this object through a weak
reference and are removed by ``close()``: nothing keeps process groups alive past teardown.
"""
from __future__ import annotations

import weakref

import torch

from autopar.runtime.collectives import reduce_scatter_dim, slice_dim
from autopar.runtime.comm import MeshComm, collective_site
from autopar.runtime.param_store import ParamStore
from autopar.sync_settings import BUCKET_BYTES, FIRST_BUCKET_BYTES, WIRE_BUCKETS, bucket_full
from autopar.sync_settings import ZERO2_MAX_INFLIGHT as MAX_INFLIGHT

__all__ = ["GradSync", "backward_order", "plan_buckets", "bucket_full", "BUCKET_BYTES", "FIRST_BUCKET_BYTES", "MAX_INFLIGHT", "WIRE_BUCKETS"]


class _Bucket:
    __slots__ = ("dtype", "start", "numel", "axes", "members", "ready", "work", "wire", "rider")

    def __init__(self, dtype, start, axes):
        self.dtype, self.start, self.numel, self.axes = dtype, start, 0, axes
        self.members: set[str] = set()
        self.ready = 0
        self.work = None
        self.wire = None  # the bucket cast to the reduce dtype, while it is reduced
        self.rider = 0  # 1 while the element after it (the flat buffer's rider) travels with it

    def span(self) -> slice:
        return slice(self.start, self.start + self.numel + self.rider)


def plan_buckets(store: ParamStore, deferred: dict[str, tuple[int, ...]]) -> list[_Bucket]:
    """Contiguous runs of the flat buffers holding ZeRO-0/1 parameters with the same axes, cut at
    ``FIRST_BUCKET_BYTES`` for the first bucket and ``BUCKET_BYTES`` after (in backward order).
    A ZeRO-2 parameter between two of them cuts no run (its gradient lives in the shard buffer):
    the MLP's biases between ZeRO-2 weights were eight all-reduces, 12 ms a step on 4 processes,
    where the planner priced shares of one bucket."""
    buckets: list[_Bucket] = []
    cur: _Bucket | None = None
    for ph in store.grad_order:
        s = store.slots[ph]
        if s.zero_stage == 2 and s.trainable:
            continue
        if ph not in deferred:
            cur = None
            continue
        dtype, off, n = store.grads.range_of(ph)
        axes = deferred[ph]
        if (cur is None or cur.dtype != dtype or cur.axes != axes or cur.start + cur.numel != off
                or bucket_full(cur.numel * s.local.element_size(), len(buckets))):
            cur = _Bucket(dtype, off, axes)
            buckets.append(cur)
        cur.numel += n
        cur.members.add(ph)
    return buckets


class GradSync:
    def __init__(self, store: ParamStore, deferred: dict[str, tuple[int, ...]], comm: MeshComm,
                 reduce_dtype: torch.dtype | None = None):
        self.store = store
        self.comm = comm
        self.reduce_dtype = reduce_dtype  # data-parallel sums in this dtype (None: the gradient's)
        self.buckets = plan_buckets(store, deferred)
        self._bucket_of = {ph: b for b in self.buckets for ph in b.members}
        # the bucket that ends the float32 buffer, next to its rider element (``carry``)
        flat = store.grads.flat(torch.float32) if store.grads.rider(torch.float32) is not None else None
        self._rider_bucket = next((b for b in self.buckets if flat is not None and b.dtype == torch.float32
                                   and b.start + b.numel == flat.numel() - 1), None)
        self._zero2 = {ph: deferred.get(ph, ()) for ph in store.grad_order if store.slots[ph].zero_stage == 2}
        self._last = True  # whether the running backward is the last microbatch's
        self._defer_zero2 = False  # ZeRO-2 gradients accumulate whole until finish() (see hold)
        self._rounds = 0  # hold(rounds=k): a bucket is reduced once each member accumulated k times
        self._uses: dict[str, int] = {}  # hold(uses=): members accumulated k times per microbatch
        self._pending: list[tuple] = []  # ZeRO-2: (work, out, staging, slot, length)
        # each bucketed parameter's gradient view of the flat buffer, and those started empty this
        # step (``start_empty``) whose gradient has not reached its view yet
        self._views = {ph: store.slots[ph].local.grad for ph in self._bucket_of}
        self._empty: set[str] = set()
        me = weakref.ref(self)
        self._handles = []
        for ph in list(self._bucket_of) + list(self._zero2):
            p = store.slots[ph].local
            self._handles.append(p.register_post_accumulate_grad_hook(_hook(me, ph)))

    # ------------------------------------------------------------------ called by the hooks
    def _ready(self, ph: str) -> None:
        if ph in self._zero2:
            if not self._defer_zero2:
                self._reduce_scatter(ph)
            return
        if ph in self._empty:  # backward wrote a fresh gradient: into the bucket's view
            self._empty.discard(ph)
            p, view = self.store.slots[ph].local, self._views[ph]
            g = p.grad
            if g is not view:
                with torch.no_grad():
                    view.copy_(g)
                p.grad = view
        b = self._bucket_of[ph]
        if self._rounds:  # a pipeline schedule: every microbatch's backward passes through here
            b.ready += 1
            if b.ready == sum(self._uses.get(m, 1) for m in b.members) * self._rounds:
                self._launch(b)
            return
        if not self._last:
            return
        b.ready += 1
        if b.ready == len(b.members):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        view = self.store.grads.flat(b.dtype)[b.span()]
        if self.reduce_dtype is not None and self.reduce_dtype != b.dtype:
            # as FSDP2's reduce_dtype: fewer bytes on the wire; at most WIRE_BUCKETS such copies
            # are alive (earlier ones are finished first)
            wired = [w for w in self.buckets if w.wire is not None]
            for w in wired[: max(0, len(wired) - WIRE_BUCKETS + 1)]:
                self._finish_bucket(w)
            b.wire = view.to(self.reduce_dtype)
            view = b.wire
        with collective_site(self.comm, self._bucket_site(b)):
            b.work = self.comm.all_reduce(view, b.axes[0], async_op=True)

    def _finish_bucket(self, b: _Bucket) -> None:
        if b.work is not None:
            b.work.wait()
        view = self.store.grads.flat(b.dtype)[b.span()]
        for a in b.axes[1:]:  # further axes reduce after the first (rare: 2-D data parallel)
            with collective_site(self.comm, self._bucket_site(b)):
                self.comm.all_reduce(b.wire if b.wire is not None else view, a)
        if b.wire is not None:
            view.copy_(b.wire)
        b.work, b.wire = None, None
        b.ready = -1  # done for this step

    def _bucket_site(self, b: _Bucket) -> str:
        names = sorted(self.store.slots[ph].fqn for ph in b.members)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f"the gradient sync of {len(names)} parameter(s) ({shown})"

    def _reduce_scatter(self, ph: str) -> None:
        with collective_site(self.comm, f"the ZeRO-2 gradient reduce-scatter of parameter '{self.store.slots[ph].fqn}'"):
            self._reduce_scatter_one(ph)

    def _reduce_scatter_one(self, ph: str) -> None:
        s = self.store.slots[ph]
        g = s.local.grad
        s.local.grad = None
        d, comm = s.state_dim, self.comm
        axes = self._zero2[ph]
        for a in axes:
            if a not in s.zero_axes:
                comm.all_reduce(g, a)
        reduce_on = [a for a in s.zero_axes if a in axes]
        if len(reduce_on) == 1 and all(a in axes for a in s.zero_axes):
            a = reduce_on[0]
            n = comm.sizes[a]
            front = g.movedim(d, 0).contiguous()
            rows = -(-front.shape[0] // n)
            if rows * n != front.shape[0]:
                pad = front.new_zeros((rows * n - front.shape[0],) + tuple(front.shape[1:]))
                front = torch.cat([front, pad])
            out = torch.empty((rows,) + tuple(front.shape[1:]), dtype=g.dtype, device=g.device)
            work = comm.reduce_scatter(out, front, a, async_op=True)
            self._pending.append((work, out, front, s, s.opt.shape[d]))
            while len(self._pending) > MAX_INFLIGHT:
                self._complete(self._pending.pop(0))
            return
        for a in sorted(s.zero_axes):  # several zero axes: nested, synchronously
            g = reduce_scatter_dim(g, d, comm, a) if a in axes else slice_dim(g, d, comm.sizes[a], comm.coords[a])
        s.opt.grad.add_(g)

    @staticmethod
    def _complete(item) -> None:
        work, out, _staging, s, length = item
        if work is not None:
            work.wait()
        s.opt.grad.movedim(s.state_dim, 0).add_(out[:length])

    # ------------------------------------------------------------------ called by the runtime
    def arm(self, last_microbatch: bool) -> None:
        """Before each backward: all-reduce buckets only on the last microbatch."""
        self._last = last_microbatch
        self._fill_empty()  # a backward that failed midway left some views unreached
        self._defer_zero2 = False
        self._rounds = 0
        if last_microbatch:
            for b in self.buckets:
                b.ready, b.work = 0, None

    def start_empty(self) -> set[str]:
        """Before a backward whose gradients all start from zero: the bucketed parameters' ``.grad``
        are set to None instead of their views being zeroed (the hooks copy each first gradient
        into its view; ``finish()`` zeroes the views none reached), the rider element is zeroed.
        Returns the placeholders taken; the caller zeroes every other gradient."""
        for ph in self._views:
            self.store.slots[ph].local.grad = None
        self._empty = set(self._views)
        for dtype in {b.dtype for b in self.buckets}:
            rider = self.store.grads.rider(dtype)
            if rider is not None:
                rider.zero_()
        return set(self._views)

    def _fill_empty(self) -> None:
        """Views of parameters started empty that received no gradient: zero, ``.grad`` again."""
        for ph in self._empty:
            view = self._views[ph]
            view.zero_()
            self.store.slots[ph].local.grad = view
        self._empty.clear()

    def carry(self, value: torch.Tensor, axis: int) -> bool:
        """Add scalar ``value`` to the rider element, to be summed over ``axis`` by the all-reduce
        of the bucket that ends the float32 buffer; False (nothing added) where no such bucket is
        still to be reduced this step over ``axis`` alone, in float32 on the wire. Call between a
        forward and its backward; read the sum with ``carried()`` after ``finish()``."""
        b = self._rider_bucket
        if b is None or self._rounds or self.reduce_dtype not in (None, torch.float32):
            return False
        if b.axes != (axis,) or b.work is not None or b.ready == -1:
            return False
        b.rider = 1
        rider = self.store.grads.rider(torch.float32)
        rider += value.reshape(1).to(rider.dtype)
        return True

    def carried(self) -> torch.Tensor | None:
        """The rider's sum after ``finish()`` (None: nothing rode this step); the rider is cleared."""
        b = self._rider_bucket
        if b is None or not b.rider:
            return None
        b.rider = 0
        rider = self.store.grads.rider(torch.float32)
        out = rider.clone()
        rider.zero_()
        return out

    def hold(self, whole_zero2: bool = False, rounds: int = 0, uses: dict[str, int] | None = None) -> None:
        """Before a step whose backward passes interleave (a pipeline schedule: none is known to
        be the last). With ``rounds`` (the microbatches) a bucket is all-reduced, overlapping the
        rest of the schedule, once each of its gradients has been accumulated that many times;
        ``finish()`` reduces every bucket not reduced by then (all of them without ``rounds``; a
        split-backward schedule's weight pass adds to ``.grad`` past the hooks).
        ``whole_zero2``: ZeRO-2 gradients too accumulate whole and are reduce-scattered once, in
        ``finish()`` (split-backward schedules: per-microbatch reduce-scatters could serve only
        some stages). ``uses``: parameters this rank's stages use more than once per microbatch
        (a tied weight in two of its stages) and how many times."""
        self.arm(last_microbatch=True)  # every bucket starts the step unreduced
        self._last = False
        self._defer_zero2 = whole_zero2
        self._rounds = rounds
        self._uses = dict(uses or {})

    def prepare_accumulation(self) -> None:
        """Before a backward that adds to gradients already reduced (the native loop without
        ``zero_grad()``, or with ``zero_grad(set_to_none=False)``): a bucket is all-reduced in
        place, so what it already holds is made to sum, over the ranks that reduce it, to the
        gradient so far. Where every rank holds it alike it is divided by their number. A ZeRO-1
        parameter's gradient is only its state chunk's on each rank (the chunk the user's optimizer
        sees and may have zeroed): each rank keeps its own chunk (divided by the ranks holding the
        same chunk) and zeroes the rest, so each chunk sums to what its owners hold."""
        for b in self.buckets:
            n = 1
            for a in b.axes:
                n *= self.comm.sizes[a]
            if n == 1:
                continue
            zero1 = [ph for ph in b.members if self.store.slots[ph].zero_stage == 1]
            if not zero1:
                self.store.grads.flat(b.dtype)[b.start: b.start + b.numel].div_(n)
                continue
            for ph in b.members:
                s = self.store.slots[ph]
                g = s.local.grad
                if s.zero_stage != 1:
                    g.div_(n)
                    continue
                alike = n
                for a in s.zero_axes:
                    if a in b.axes:
                        alike //= self.comm.sizes[a]
                own = s.opt.grad  # the state chunk: a view of ``g``
                kept = own.clone()
                g.zero_()
                own.copy_(kept.div_(alike) if alike > 1 else kept)

    def finish(self) -> None:
        """After the last backward: launch what never filled, reduce-scatter the ZeRO-2 gradients
        no hook saw, then wait for every reduction."""
        self._fill_empty()
        for ph in self._zero2:  # held whole (``hold(whole_zero2=True)``): reduce-scattered now
            if self.store.slots[ph].local.grad is not None:
                self._reduce_scatter(ph)
        for b in self.buckets:
            if b.work is None and b.ready != -1:
                self._launch(b)
        for b in self.buckets:
            if b.ready != -1:
                self._finish_bucket(b)
        self.drain()

    def drain(self) -> None:
        while self._pending:
            self._complete(self._pending.pop(0))

    def close(self) -> None:
        self._fill_empty()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending.clear()


def _hook(me: weakref.ref, ph: str):
    def hook(_param):
        sync = me()
        if sync is not None:
            sync._ready(ph)
    return hook


def backward_order(program: "torch.fx.GraphModule", deferred: dict) -> list[str]:
    """Parameter placeholders in the order backward produces their gradients (reverse of first
    use), the data-parallel ones last so that their buckets are contiguous and the last of them
    ends the flat buffer, next to its rider element (``GradSync.carry``, ``planner.loss_rider``)."""
    first_use: dict[str, int] = {}
    for i, n in enumerate(program.graph.nodes):
        for a in n.all_input_nodes:
            if a.op == "placeholder" and a.meta.get("autopar.kind") == "param":
                first_use.setdefault(a.name, i)
    params = [n.name for n in program.graph.nodes if n.op == "placeholder" and n.meta.get("autopar.kind") == "param"]
    order = sorted(params, key=lambda p: -first_use.get(p, -1))
    return [p for p in order if p not in deferred] + [p for p in order if p in deferred]

