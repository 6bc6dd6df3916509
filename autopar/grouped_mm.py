"""``autopar::grouped_mm``: the grouped matrix product of dropless mixture-of-experts layers, as an
op autopar can trace, plan and run on every backend.

Dropless MoE code (Hugging Face's Mixtral, DeepSeek and Qwen MoE in transformers 5; torchtitan)
sorts the (token, expert) pairs by expert and multiplies each expert's rows by that expert's
weights with ``torch.nn.functional.grouped_mm(x [rows, k], w [experts, k, n], offs)``, where
``offs`` holds the cumulative row count per expert: every shape is static, only ``offs`` depends
on the routing. torch's kernel has narrow preconditions (bfloat16 on CUDA; 16-byte aligned strides
on CPU) and its meta function refuses float32, so tracing a float32 model on fake tensors fails.
While autopar traces, ``redirect_grouped_mm`` sends ``grouped_mm`` / ``torch._grouped_mm`` calls to
this op instead: its fake implementation only checks shapes, and at run time it uses torch's
kernel where that kernel runs and one matmul per expert otherwise (written here because torch has
no portable grouped matmul; the same fallback Hugging Face registers for itself).
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["grouped_mm", "redirect_grouped_mm"]


def _groups(offs: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) row range of each group (one host sync)."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def _kernel_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row group ``g`` of ``x`` (rows ``offs[g-1]:offs[g]``) times ``w[g]``; rows past ``offs[-1]``
    are zero. ``x`` [rows, k], ``w`` [groups, k, n], ``offs`` [groups] (int32 or int64)."""
    if _kernel_runs(x, w):
        return torch.nn.functional.grouped_mm(x, w, offs=offs.to(torch.int32))
    out = x.new_zeros(x.shape[0], w.shape[2])
    for g, (start, end) in enumerate(_groups(offs)):
        if end > start:
            torch.mm(x[start:end], w[g], out=out[start:end])
    return out


@grouped_mm.register_fake
def _(x, w, offs):
    torch._check(x.dim() == 2 and w.dim() == 3 and offs.dim() == 1, lambda: "grouped_mm: x [rows, k], w [groups, k, n], offs [groups]")
    torch._check(x.shape[1] == w.shape[1], lambda: f"grouped_mm: x has k={x.shape[1]}, w has k={w.shape[1]}")
    torch._check(offs.shape[0] == w.shape[0], lambda: "grouped_mm: one offset per group")
    return x.new_empty(x.shape[0], w.shape[2])


def _setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    grad_x = grouped_mm(grad, w.transpose(1, 2).contiguous(), offs) if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = torch.zeros_like(w)
        for g, (start, end) in enumerate(_groups(offs)):
            if end > start:
                grad_w[g] = x[start:end].transpose(0, 1) @ grad[start:end]
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


class _Redirect(TorchFunctionMode):
    def __init__(self, expert_axis: int | None):
        super().__init__()
        self.rows = None  # expert parallel: runtime.expert_dispatch.ExpertRows of this call
        if expert_axis is not None:
            from autopar.runtime.expert_dispatch import ExpertRows

            self.rows = ExpertRows(expert_axis)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TARGETS or func is torch.ops.autopar.grouped_mm.default:
            x, w = args[0], args[1]
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            if offs is not None and x.dim() == 2 and w.dim() == 3 and kwargs.get("bias") is None \
                    and kwargs.get("out_dtype") in (None, x.dtype):
                if self.rows is not None and w.shape[0] != offs.shape[0]:
                    return self.rows.grouped_mm(x, w, offs)
                func, args, kwargs = grouped_mm, (x, w, offs), {}
        elif self.rows is not None:
            from autopar.runtime.expert_dispatch import NOT_ROW_LOCAL

            out = self.rows.row_local(func, args, kwargs)
            if out is not NOT_ROW_LOCAL:
                return out
        if self.rows is not None:  # anything else takes held expert rows back as token rows
            args, kwargs = self.rows.bring_back_all((args, kwargs))
        return func(*args, **kwargs)

    def finish(self, out):
        """The region's output as token rows (held expert rows brought back); call it after the
        mode is exited."""
        return self.rows.bring_back_all(out) if self.rows is not None else out


_TARGETS = {f for f in (getattr(torch.nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f}


@contextlib.contextmanager
def redirect_grouped_mm(expert_axis: int | None = None):
    """While active, 2-D x 3-D ``grouped_mm`` calls (no bias) run ``autopar::grouped_mm``; with
    ``expert_axis``, those whose weight holds fewer experts than ``offs`` counts run
    ``runtime.expert_dispatch.ExpertRows.grouped_mm`` over that mesh axis (expert parallelism), the
    rows staying there through row-local ops; the yielded mode's ``finish`` brings them back."""
    with _Redirect(expert_axis) as mode:
        yield mode
