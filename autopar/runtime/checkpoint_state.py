"""What a checkpoint holds of a ParallelModel, as torch.distributed.checkpoint state dicts.

Invariants:

* the tensors are keyed by the model's parameter and buffer names, not by plan or rank:
  ``model/<fqn>`` and ``optim/<fqn>/<state key>``; each is a DTensor over the plan's mesh with
  the placements it is stored in (a ZeRO-1/2 parameter and its optimizer state: ``Shard`` of
  the state dim on the zero axes), so DCP reshards them on load into any other plan or world
  size, and the entries built for loading are views of the live tensors (filled in place);
* a scalar optimizer state (Adam's ``step``) is a plain tensor, the same on every rank;
* what is not a tensor over a parameter (step, RNG states, optimizer hyperparameters, tracked
  objects' ``state_dict()``) is a rank's *extras*, which must load with
  ``torch.load(weights_only=True)`` (``check_weights_only`` refuses anything else at save time).
"""
from __future__ import annotations

import io
import random

import torch
from torch.distributed.tensor import DTensor

from autopar.runtime.checkpoint_files import CheckpointError
from autopar.runtime.dtensor_params import make_dtensor

__all__ = ["model_entries", "optimizer_entries", "ensure_optimizer_state", "param_groups_of", "restore_param_groups",
           "rng_states", "restore_rng", "param_index", "check_weights_only", "model_identity", "optimizer_state_fqns"]


def model_entries(state) -> dict[str, torch.Tensor]:
    """``model/<fqn>`` -> this rank's DTensor of every parameter and buffer it holds
    (``state``: the model's ``dtensor_params.StateView``)."""
    out = {f"model/{fqn}": p.detach() if isinstance(p, torch.nn.Parameter) else p for fqn, p in state.params.items()}
    out.update({f"model/{fqn}": b for fqn, b in state.buffers.items()})
    return out


def param_index(pm) -> dict[int, tuple[str, object]]:
    """id(optimizer parameter) -> (fqn, slot or None): the store's optimizer views (train_step's
    optimizer) or the model's DTensor parameters (an optimizer of the torch-native loop)."""
    out = {}
    for s in pm.store.slots.values():
        if s.opt is not None:
            out[id(s.opt)] = (s.fqn, s)
    for fqn, p in pm._state.params.items():
        out.setdefault(id(p), (fqn, None))
    return out


def optimizer_entries(pm, optimizer, only: set[str] | None = None, cache: dict | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict]:
    """(``optim/<fqn>/<key>`` -> tensor entries, ``{fqn: {key: value}}`` of the non-tensor states).
    ``only``: the parameters to include (default: every parameter with state). ``cache``: entry
    name -> (state tensor, the DTensor made for it), reused while the optimizer holds that same tensor (it
    updates its state in place, so each save would otherwise wrap every tensor again)."""
    cache = {} if cache is None else cache
    index = param_index(pm)
    tensors, scalars = {}, {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in index:
                raise CheckpointError("the optimizer holds a tensor that is not one of the model's parameters; autopar "
                                      "checkpoints optimizers over pm.parameters() (or train_step's)")
            fqn, slot = index[id(p)]
            if only is not None and fqn not in only:
                continue
            for key, value in optimizer.state.get(p, {}).items():
                name = f"optim/{fqn}/{key}"
                if not isinstance(value, torch.Tensor):
                    scalars.setdefault(fqn, {})[key] = value
                elif isinstance(value, DTensor) or value.dim() == 0:
                    tensors[name] = value
                elif slot is not None and tuple(value.shape) == tuple(slot.opt.shape):
                    hit = cache.get(name)
                    if hit is None or hit[0] is not value:
                        hit = cache[name] = (value, make_dtensor(value, pm._state.mesh, pm._state.placements_of(slot.ph),
                                                                       slot.shape, False))
                    tensors[name] = hit[1]
                else:
                    raise CheckpointError(
                        f"optimizer state {key!r} of {fqn} has shape {tuple(value.shape)}, not the parameter's "
                        f"{tuple(slot.opt.shape) if slot is not None else '?'}: autopar checkpoints optimizers whose "
                        "per-parameter state is elementwise or scalar (SGD, Adam, AdamW, Adagrad, RMSprop, ...)")
    return tensors, scalars


def optimizer_state_fqns(keys) -> set[str]:
    """The parameters with optimizer state among checkpoint keys ``optim/<fqn>/<key>``."""
    return {k[len("optim/"):].rpartition("/")[0] for k in keys if k.startswith("optim/")}


@torch.no_grad()
def ensure_optimizer_state(pm, optimizer, fqns: set[str]) -> None:
    """Create the optimizer's state for the parameters ``fqns`` where it has none yet (optimizers
    create it at their first step), so that loading can fill it in place: one step with zero
    gradients and every learning rate 0 (the parameters do not move), as
    ``torch.distributed.checkpoint.state_dict`` does."""
    index = param_index(pm)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = {id(p) for p in params if index.get(id(p), ("",))[0] in fqns and not optimizer.state.get(p)}
    if not missing:
        return
    saved_grads = [p.grad for p in params]  # train_step's are views of the store's buffers: kept as they are
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        for p in params:  # zeros of the same layout (a DTensor's: its shard); the others step nothing
            p.grad = torch.zeros_like(p) if id(p) in missing else None
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lrs):
            g["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def param_groups_of(optimizer) -> list[dict]:
    """Each parameter group's hyperparameters (what a scheduler changes), without the parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def restore_param_groups(optimizer, saved: list[dict]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
                              f"{len(optimizer.param_groups)}: build the optimizer as the saved run did")
    for g, hyper in zip(optimizer.param_groups, saved):
        for k, v in hyper.items():
            if isinstance(g.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                g[k].copy_(v)
            else:
                g[k] = v


def rng_states(device: torch.device) -> dict:
    """This process's random number generators: torch (CPU, and CUDA on a GPU rank), Python's,
    and numpy's when numpy is loaded (its key array as a tensor: weights-only loadable)."""
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    import sys

    if "numpy" in sys.modules:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return out


def restore_rng(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(_tuples(states["python"]))
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
    if "numpy" in states:
        import numpy as np

        name, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _tuples(x):
    """Python's random state as ``random.setstate`` wants it (tuples, not lists)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def check_weights_only(extras: dict, what: str) -> bytes:
    """``extras`` serialised; refused (naming ``what``) unless it loads with weights_only=True."""
    buf = io.BytesIO()
    torch.save(extras, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler's refusal, re-raised with its cause named
        raise CheckpointError(
            f"{what} holds a value a checkpoint cannot load safely (only tensors, numbers, strings, lists, tuples and "
            f"dicts load without running pickled code): {str(exc).splitlines()[0]}") from None
    return data


def model_identity(traced) -> dict[str, list]:
    """fqn -> [shape, dtype] of every parameter and buffer: what a checkpoint must match."""
    out = {}
    for ph, fqn in list(traced.param_fqns.items()) + list(traced.buffer_fqns.items()):
        meta = traced.node(ph).meta["autopar.outputs"][0]
        out[fqn] = [list(meta.shape), str(meta.dtype).replace("torch.", "")]
    return out
