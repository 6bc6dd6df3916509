"""Torch's collective timeouts and lost peers, turned into a ``CollectiveError`` that says which
rank waited, for how long, and the likely cause (a rank skipped a step or died).
"""
from __future__ import annotations

import contextlib
import os
import re

import torch.distributed as dist

from autopar.errors import AutoparError, CollectiveError
from autopar.runtime.comm import CollectiveLog

__all__ = ["collective_failures", "raise_if_collective_failure"]

_COLLECTIVE_FAILURE = re.compile(r"timed out|timeout|connection (?:closed|reset)|closed by peer|reset by peer|"
                                 r"broken pipe", re.IGNORECASE)
_LOST_PEER = re.compile(r"connection|peer|broken pipe", re.IGNORECASE)


@contextlib.contextmanager
def collective_failures(where: str, log: CollectiveLog | None = None):
    """Torch's collective timeouts and lost peers inside the block become ``CollectiveError``
    (naming ``log``'s last collective: the model's, ``MeshComm.log``)."""
    try:
        yield
    except RuntimeError as exc:
        raise_if_collective_failure(exc, where, log)
        raise


def raise_if_collective_failure(exc: RuntimeError, where: str, log: CollectiveLog | None = None) -> None:
    """Raise ``CollectiveError`` (from ``exc``) when ``exc`` is torch reporting that a collective
    timed out or lost a peer: the ranks did not all run this step. Otherwise return. ``log``:
    the model's record of its collectives, whose last one the error names."""
    if isinstance(exc, AutoparError):
        return
    text = str(exc)
    dist_error = getattr(dist, "DistError", None)
    if not (_COLLECTIVE_FAILURE.search(text) or (dist_error is not None and isinstance(exc, dist_error))):
        return
    from autopar.runtime.launch import COLLECTIVE_TIMEOUT_ENV, group_timeout_s

    rank = dist.get_rank() if dist.is_initialized() else 0
    t = group_timeout_s()
    if _LOST_PEER.search(text) and not re.search(r"timed out|timeout", text, re.IGNORECASE):
        head = f"{where} on rank {rank} lost the connection to another rank in a collective (that rank stopped or died)"
    else:
        waited = f"more than {t:g} s" if t else "longer than the process group's timeout"
        head = f"{where} on rank {rank} waited {waited} for the other ranks in a collective"
    said = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
    last = log.describe() if log is not None else None
    was = f" This rank was in: {last}." if last else ""
    from autopar.runtime.comm import runs_nccl

    if runs_nccl() and os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT") == "1":  # (NCCL beside gloo: "cpu:gloo,cuda:nccl")
        from autopar.runtime.launch import FLIGHT_RECORDER_PREFIX, flight_recorder_dir

        was += (f" NCCL's flight recorder dumped every rank's last collectives to {flight_recorder_dir()}: "
                f"python -m torch.distributed.flight_recorder.fr_trace {flight_recorder_dir()} -p {FLIGHT_RECORDER_PREFIX} "
                "names the rank and collective that diverged.")
    raise CollectiveError(
        f"{head}: every rank must call {where} the same number of times with its batch (did one rank skip a step, "
        f"or die?).{was} The wait is compile's collective_timeout_s (or ${COLLECTIVE_TIMEOUT_ENV}). torch said: {said}"
    ) from exc
