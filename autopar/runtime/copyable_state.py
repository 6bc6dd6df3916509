"""State-dict values that ``copy.deepcopy`` and ``torch.save`` take like any tensor.

A DTensor whose local shard starts inside a larger storage (a ZeRO-1/2 parameter's ``Shard`` view
of the whole parameter, a stage's parameter inside a packed buffer) gets a wrapper with that
storage offset over no storage of its own. torch's ``Tensor.__deepcopy__`` tells a storage-less
wrapper by ``data_ptr() == 0``, which the offset defeats, and then copies the wrapper's (null)
storage: "Attempted to call copy_() on an invalid python storage", on every rank but the one
whose shard starts at offset 0, so the ranks split at their next collective (torch 2.11-2.13).

``copyable(t)`` returns the same shard over a storage that starts where it starts (a slice of
the storage: shared memory, no copy), so its wrapper's offset is 0. The parameters themselves
keep their views (the program, the optimizer and the memory accounting key on their storages);
only the values ``state_dict()`` hands out are re-wrapped.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["copyable", "copyable_state_dict_hook"]


def copyable(t: torch.Tensor) -> torch.Tensor:
    """``t`` unchanged unless it is a DTensor whose local tensor has a storage offset: then a
    DTensor over the same memory whose local tensor starts its own (sliced) storage."""
    if not isinstance(t, DTensor):
        return t
    local = t._local_tensor  # public to_local() would record autograd; state-dict values are detached
    if local.storage_offset() == 0 or local.device.type == "meta" or local.numel() == 0:
        return t
    item = local.element_size()
    start = local.storage_offset() * item
    extent = (1 + sum((n - 1) * s for n, s in zip(local.shape, local.stride()))) * item
    sliced = local.untyped_storage()[start:start + extent]
    own = torch.empty(0, dtype=local.dtype, device=local.device).set_(sliced, 0, local.shape, local.stride())
    return DTensor.from_local(own, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def copyable_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    """``register_state_dict_post_hook`` hook: every detached DTensor value made ``copyable``
    (values kept as variables, ``keep_vars=True``, are the parameters themselves: left as they are)."""
    for key, value in list(state_dict.items()):
        if key.startswith(prefix) and isinstance(value, DTensor) and not isinstance(value, torch.nn.Parameter):
            state_dict[key] = copyable(value)
