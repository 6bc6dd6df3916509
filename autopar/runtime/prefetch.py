"""Parameter gathers issued ahead of their use; their gradients reduced asynchronously (ZeRO-3).

``gather_param_start(x, ...)`` starts the all-gather of a parameter shard and returns the buffer
it lands in; ``gather_param_finish(buf, ...)`` waits for it and returns the gathered parameter
(a view of the buffer). The passes (``prefetch_param_gathers_pass``) put each start right after
the previous gather's finish, so one gather is in flight while the op before its use computes:
FSDP's forward prefetch. In backward the gradient of the gathered parameter is reduce-scattered
asynchronously (at most ``MAX_INFLIGHT`` pending, each keeping its full gradient alive) and added
to the shard's gradient buffer when it completes; under HSDP the shard is then all-reduced across
the replicas, asynchronously, started when the next reduce-scatter has been issued; ``drain_gradient_reductions`` finishes them all
before the optimizer step. Only public c10d calls with ``async_op=True`` are used (gloo and NCCL).
"""
from __future__ import annotations

import torch

from autopar.runtime.collectives import current_mesh
from autopar.runtime.comm import MeshComm, collective_site
from autopar.sync_settings import ZERO3_MAX_INFLIGHT as MAX_INFLIGHT

__all__ = ["gather_param_start", "gather_param_finish", "start_gather", "drain_gradient_reductions", "MAX_INFLIGHT"]


class PendingGather:
    """An all-gather under way: ``out`` is the receive buffer (the gathered dim first, padded)."""

    __slots__ = ("out", "work", "send")

    def __init__(self, out, work, send):
        self.out, self.work, self.send = out, work, send

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.send = None
        return self.out


def start_gather(x: torch.Tensor, dim: int, comm: MeshComm, axis: int, size: int | None,
                 async_op: bool = True) -> PendingGather:
    """Start gathering ``dim`` of ``x`` over ``axis`` (each shard padded to ``ceil(size / n)``
    rows when ``size``, the gathered length, does not divide evenly)."""
    n = comm.sizes[axis]
    front = x.movedim(dim, 0).contiguous()
    rows = front.shape[0] if size is None else -(-size // n)
    if front.shape[0] != rows:
        front = torch.cat([front, front.new_zeros((rows - front.shape[0],) + tuple(front.shape[1:]))])
    out = torch.empty((n * rows,) + tuple(front.shape[1:]), dtype=x.dtype, device=x.device)
    return PendingGather(out, comm.all_gather(out, front, axis, async_op=async_op), front)


def _cast(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(dtype) if dtype is not None else x


def _start_registered(x: torch.Tensor, axis: int, dim: int, size: int | None, dtype, comm: MeshComm) -> torch.Tensor:
    """Start the gather of ``x`` (cast to ``dtype``) and register it for ``gather_param_finish``,
    keyed by its receive buffer's storage; returns the buffer."""
    pend = start_gather(_cast(x, dtype), dim, comm, axis, size)
    comm.pending_gathers[pend.out.untyped_storage()._cdata] = pend
    return pend.out


def _view(buf: torch.Tensor, dim: int, size: int | None) -> torch.Tensor:
    return (buf[:size] if size is not None else buf).movedim(0, dim)


class _PendingGrad:
    """A gradient reduction under way: the reduce-scatter into ``out``, then (HSDP) all-reduces
    of ``out`` over ``axes``, each started only once the one before it was waited for (so every
    rank issues them in the same order); ``complete`` adds the result to ``grad``."""

    __slots__ = ("work", "out", "send", "grad", "dim", "length", "axes", "comm", "site")

    def __init__(self, work, out, send, grad, dim, length, axes=(), comm=None, site=None):
        self.work, self.out, self.send, self.grad, self.dim, self.length = work, out, send, grad, dim, length
        self.axes, self.comm, self.site = tuple(axes), comm, site

    def reduced_scattered(self) -> bool:
        """Whether the reduce-scatter was waited for (the all-reduces, if any, are started)."""
        return self.send is None

    def advance(self) -> bool:
        """Wait for the collective under way; start the next all-reduce (asynchronously) and
        return False, or add the reduced shard to ``grad`` and return True."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.send = None
        if self.axes:
            a, self.axes = self.axes[0], self.axes[1:]
            with collective_site(self.comm, f"the gradient all-reduce of {self.site}" if self.site else "a gradient all-reduce"):
                self.work = self.comm.all_reduce(self.out, a, async_op=True)
            return False
        self.grad.movedim(self.dim, 0).add_(self.out[: self.length])
        self.out = None
        return True

    def complete(self) -> None:
        while not self.advance():
            pass


def _bound(pending: list) -> None:
    """At most ``MAX_INFLIGHT`` reduce-scatters (each holding a whole gradient) and as many
    all-reduces of shards (HSDP) under way: the oldest over the limit goes on (its reduce-scatter
    waited, its all-reduce started) or completes. Which one depends only on the order backward
    issued them, the same on every rank."""
    while True:
        scattering = [p for p in pending if not p.reduced_scattered()]
        reducing = [p for p in pending if p.reduced_scattered()]
        if len(scattering) > MAX_INFLIGHT:
            p = scattering[0]
        elif len(reducing) > MAX_INFLIGHT:
            p = reducing[0]
        else:
            return
        if p.advance():
            pending.remove(p)


class _GatherStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, size, dtype, reduce_dtype, comm, site=None, then=()):
        ctx.param, ctx.axis, ctx.dim, ctx.reduce_dtype, ctx.comm, ctx.site = x, axis, dim, reduce_dtype, comm, site
        ctx.then = then
        return _start_registered(x, axis, dim, size, dtype, comm)

    @staticmethod
    def backward(ctx, g):
        # the gradient of the padded, gathered buffer: every rank sums it and keeps its block
        comm, param = ctx.comm, ctx.param
        send = g.contiguous()
        if ctx.reduce_dtype is not None:
            send = send.to(ctx.reduce_dtype)
        n = comm.sizes[ctx.axis]
        out = torch.empty((send.shape[0] // n,) + tuple(send.shape[1:]), dtype=send.dtype, device=send.device)
        with collective_site(comm, f"the gradient reduce-scatter of {ctx.site}" if ctx.site else "a gradient reduce-scatter"):
            work = comm.reduce_scatter(out, send, ctx.axis, async_op=True)
        comm.pending_grads.append(_PendingGrad(work, out, send, param.grad, ctx.dim, param.shape[ctx.dim],
                                               ctx.then, comm, ctx.site))
        _bound(comm.pending_grads)
        # the reduced gradient is added to the parameter's gradient buffer when the reduction
        # completes; a split-backward schedule's weight pass asks autograd for the shard's own
        # gradient (and refuses a None): it gets zeros, which it adds to that buffer
        shard_grad = param.new_zeros(()).expand_as(param) if comm.shard_grad_edges else None
        return (shard_grad,) + (None,) * 8


def gather_param_start(x: torch.Tensor, axis: int, dim: int, size: int | None = None, dtype=None,
                       reduce_dtype=None, grad: bool = True, site: str | None = None,
                       grad_all_reduce: tuple[int, ...] = ()) -> torch.Tensor:
    """Start gathering parameter shard ``x`` (cast to ``dtype`` first); returns the receive buffer
    for ``gather_param_finish``. With ``grad`` the gradient is reduce-scattered asynchronously into
    ``x.grad`` (a persistent buffer, see ``ParamStore``) in ``reduce_dtype``, its shard then summed
    over the mesh axes ``grad_all_reduce`` (HSDP's replicas), asynchronously too."""
    from autopar.runtime.param_regather import remember_gathered_param

    comm = current_mesh()
    with collective_site(comm, f"the parameter gather of {site}" if site else "a parameter gather"):
        if grad and x.requires_grad and torch.is_grad_enabled():
            buf = _GatherStart.apply(x, axis, dim, size, dtype, reduce_dtype, comm, site, tuple(grad_all_reduce))
        else:
            buf = _start_registered(x, axis, dim, size, dtype, comm)

    def replay(local, async_op=False, dim=dim, comm=comm, axis=axis, size=size, dtype=dtype):
        pend = start_gather(_cast(local, dtype), dim, comm, axis, size, async_op)
        return pend if async_op else pend.wait()

    remember_gathered_param(buf, x.detach(), replay)
    return buf


def gather_param_finish(buf: torch.Tensor, dim: int, size: int | None = None) -> torch.Tensor:
    """Wait for the gather that fills ``buf``; the gathered parameter (a view of ``buf``)."""
    pend = current_mesh().pending_gathers.pop(buf.untyped_storage()._cdata, None)
    if pend is not None:
        pend.wait()
    return _view(buf, dim, size)


def drain_gradient_reductions(comm: MeshComm) -> None:
    """Finish every pending gradient reduction (before the optimizer reads the gradients)."""
    while comm.pending_grads:
        comm.pending_grads.pop(0).complete()
