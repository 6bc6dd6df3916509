"""``GradBuffers``, a part of ``ParallelModel`` (held by its ``ParamStore`` as ``store.grads``):
the persistent flat gradient buffers of one rank, and each parameter's ``.grad`` as a view of them.

Invariants (as DDP's ``gradient_as_bucket_view``):
* one flat buffer per dtype; a trainable parameter's ``local.grad`` is a view of it, in the
  backward order the store gives, so backward accumulates in place and data-parallel buckets are
  contiguous ranges of it: nothing holds a second copy. Each buffer ends with one rider element
  (``GradSync.carry``: the loss value rides the last bucket's all-reduce);
* a ZeRO-1 parameter's ``opt.grad`` is its ``Shard(state_dim)`` piece of ``local.grad``; a
  ZeRO-2 parameter accumulates a full gradient only until it is reduce-scattered into its shard of
  a flat *shard* buffer, of which ``opt.grad`` is a view;
* the buffers own ``.grad``: where the user's ``zero_grad(set_to_none=True)`` (or an assignment)
  took a view away, ``own`` puts it back (zeroed, or holding what was assigned) before the next
  backward.
"""
from __future__ import annotations

import torch

__all__ = ["GradBuffers"]


class GradBuffers:
    """The gradient buffers of a ``ParamStore``'s trainable slots (see the module docstring)."""

    def __init__(self, slots: dict, order: list[str], device: torch.device, shard_range):
        """``slots``: the store's ``ParamSlot``s, each trainable one's ``opt`` already set; ``order``:
        the trainable placeholders in backward order; ``shard_range(slot)``: (start, length) of this
        rank's ZeRO piece of the slot's ``state_dim``."""
        self.device = device
        self._flat: dict[torch.dtype, torch.Tensor] = {}
        self._shard_flat: dict[torch.dtype, torch.Tensor] = {}
        self._views: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}  # ph -> (local.grad, opt.grad)
        self._all = slots
        self._slots = {ph: slots[ph] for ph in order}
        full_sizes: dict[torch.dtype, int] = {}
        shard_sizes: dict[torch.dtype, int] = {}
        for s in self._slots.values():
            dt = s.local.dtype
            if s.zero_stage == 2:
                shard_sizes[dt] = shard_sizes.get(dt, 0) + s.opt.numel()
            else:
                full_sizes[dt] = full_sizes.get(dt, 0) + s.local.numel()
        for dt, n in full_sizes.items():
            self._flat[dt] = torch.zeros(n + 1, dtype=dt, device=device)  # the gradients, then the rider
        for dt, n in shard_sizes.items():
            self._shard_flat[dt] = torch.zeros(n, dtype=dt, device=device)
        offsets = dict.fromkeys(full_sizes, 0)
        shard_offsets = dict.fromkeys(shard_sizes, 0)
        for ph, s in self._slots.items():
            dt = s.local.dtype
            if s.zero_stage == 2:
                n = s.opt.numel()
                o = shard_offsets[dt]
                region = self._shard_flat[dt][o: o + n]
                moved = list(s.opt.shape)
                moved.insert(0, moved.pop(s.state_dim))
                s.opt.grad = region.view(moved).movedim(0, s.state_dim)
                shard_offsets[dt] = o + n
                self._views[ph] = (None, s.opt.grad)
            else:
                n = s.local.numel()
                o = offsets[dt]
                s.local.grad = self._flat[dt][o: o + n].view_as(s.local)
                offsets[dt] = o + n
                if s.zero_stage == 1:
                    start, length = shard_range(s)
                    s.opt.grad = s.local.grad.narrow(s.state_dim, start, length)
                self._views[ph] = (s.local.grad, s.opt.grad if s.zero_stage == 1 else None)

    def own(self) -> None:
        """Put every gradient view of the buffers back where ``.grad`` lost it: a torch loop's
        ``optimizer.zero_grad()`` sets ``.grad`` to None (the view then starts from zero), an
        assignment puts another tensor there (its values are copied in). Call before a backward:
        the bucketed all-reduce and the reduce-scatters read and write the buffers, so a ``.grad``
        cut off them would be neither reduced nor reach the optimizer."""
        for ph, (local_view, opt_view) in self._views.items():
            s = self._slots[ph]
            if local_view is not None:
                _own(s.local, local_view)
            if opt_view is not None:
                _own(s.opt, opt_view)

    def flat(self, dtype: torch.dtype) -> torch.Tensor:
        """The flat gradient buffer of ``dtype``: the gradients, then one rider element."""
        return self._flat[dtype]

    def rider(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The rider element of the flat gradient buffer of ``dtype`` (a one-element view), or
        None where no parameter's gradient has that dtype."""
        flat = self._flat.get(dtype)
        return None if flat is None else flat[-1:]

    def range_of(self, ph: str) -> tuple[torch.dtype, int, int]:
        """(dtype, offset, numel) of a parameter's gradient in its flat buffer (not ZeRO-2)."""
        s = self._slots[ph]
        flat = self._flat[s.local.dtype]
        off = (s.local.grad.data_ptr() - flat.data_ptr()) // flat.element_size()
        return s.local.dtype, off, s.local.numel()

    def zero(self) -> None:
        """Zero every buffer (the rider included)."""
        for flat in list(self._flat.values()) + list(self._shard_flat.values()):
            flat.zero_()

    def zero_of(self, ph: str) -> None:
        """Zero one parameter's gradient views (the rest keep accumulating)."""
        s = self._all[ph]
        for g in (s.local.grad, s.opt.grad if s.opt is not None else None):
            if g is not None:
                g.zero_()

    def tensors(self) -> list[torch.Tensor]:
        """The buffers (what stays allocated for gradients across steps)."""
        return list(self._flat.values()) + list(self._shard_flat.values())


def _own(param: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``view`` (a gradient buffer's) ``param.grad`` again, holding what ``.grad`` held."""
    g = param.grad
    if g is view:
        return
    with torch.no_grad():
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr() or g.shape != view.shape or g.stride() != view.stride():
            view.copy_(g)
    param.grad = view
