"""``ParallelModel``'s batch checks, apart from the step machinery: every call's batch against the
compiled example (``runtime.input_checks``: number of inputs, shapes, dtypes, constants), and on
the steps ``check_inputs`` names, the ranks' checksums compared in one small all-gather.

Invariant: a batch that does not match is refused with ``InputMismatchError`` on every rank alike:
a rank with a local problem still joins the comparison and raises after it, so no peer is left
waiting in the all-gather.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autopar.errors import InputMismatchError
from autopar.layouts import Shard, chunk_range
from autopar.runtime.input_checks import FIRST_CHECKED_STEPS, Example, checksum, mismatch
from autopar.trace import TensorMeta

if TYPE_CHECKING:
    from autopar.runtime.parallel_model import _Program

__all__ = ["InputCheckMethods"]


class InputCheckMethods:
    """Mixed into ``ParallelModel`` (which holds ``_check_mode``, ``_local``, ``_device``, ``comm``
    and ``data_parallel_size``)."""

    def _batch_problem(self, where: str, inputs: tuple, target: Any, ex: Example) -> InputMismatchError | None:
        """What is wrong with this batch against the compiled example, or None."""
        if len(inputs) != len(ex.inputs):
            return InputMismatchError(
                f"{where} got {len(inputs)} inputs; the model was compiled with {len(ex.inputs)}: pass the inputs "
                "of the compiled example, in the same order")
        if ex.has_target and target is None:
            return InputMismatchError(f"{where} needs target= (the loss_fn's second argument)")
        pairs = [(f"input {i}", x, want) for i, (x, want) in enumerate(zip(inputs, ex.inputs))]
        if ex.has_target:
            pairs.append(("target", target, ex.target))
        for label, x, want in pairs:
            problem = mismatch(x, want)
            if problem is None:
                continue
            if isinstance(want, TensorMeta):
                fix = ("compile again with an example of this shape, or pad/drop the last batch (e.g. "
                       "DataLoader(drop_last=True)) so that every batch has the compiled shape")
            else:
                fix = "compile again with this value (a non-tensor input is a constant of the compiled program)"
            return InputMismatchError(
                f"{where}: {label} {problem}. The program was traced and planned for exactly the compiled example "
                f"(a model that branches on the batch size would silently keep the compiled branch): {fix}")
        return None

    def _check_batch(self, where: str, inputs: tuple, target: Any, step: int, prog: "_Program") -> None:
        """Raise if the batch does not match the compiled example; on the steps ``check_inputs``
        names, compare every input's checksum across the ranks (one small all-gather), so that a
        rank holding a different or mis-shaped batch is reported on every rank."""
        problem = self._batch_problem(where, inputs, target, self._local_example(prog) if self._local else prog.example)
        if problem is not None and self._local:
            problem = InputMismatchError(
                f"{problem} (batch='local': each rank passes its own shard, {self.data_parallel_size} shards of the "
                "global batch planned; size the DataLoader's batch to match)")
        due = self._check_mode == "always" or (self._check_mode == "first" and step < FIRST_CHECKED_STEPS)
        # global batches: the ranks compare theirs (they must be the same); local ones differ by design
        if due and not self._local and dist.is_initialized() and dist.get_world_size() > 1:
            self._compare_across_ranks(where, inputs, target, problem, step, prog.example)
        if problem is not None:
            raise problem

    def _local_example(self, prog: "_Program") -> Example:
        """The example as this rank passes it with local batches: rows of the batch inputs on "dp"."""
        ex = prog.example
        names = prog.traced.input_names + ([prog.traced.target_name] if ex.has_target else [])
        specs = list(ex.inputs) + ([ex.target] if ex.has_target else [])
        out = []
        for name, spec in zip(names, specs):
            lay = prog.input_layouts.get(name)
            if isinstance(spec, TensorMeta) and lay is not None and lay[0] == Shard(0) and spec.shape:
                rows = chunk_range(spec.shape[0], self.comm.sizes[0], self.comm.coords[0])[1]
                spec = TensorMeta((rows,) + tuple(spec.shape[1:]), spec.dtype)
            out.append(spec)
        n = len(ex.inputs)
        return Example(tuple(out[:n]), out[n] if ex.has_target else None, ex.has_target)

    def _compare_across_ranks(self, where: str, inputs: tuple, target: Any, problem, step: int, ex: Example) -> None:
        labels = [f"input {i}" for i in range(len(ex.inputs))] + (["target"] if ex.has_target else [])
        vec = [0] * (1 + 3 * len(labels))  # [local problem?, then per input: kind/shape/dtype, sum, weighted sum]
        if problem is not None:
            vec[0] = 1
        else:
            values = list(inputs) + ([target] if ex.has_target else [])
            for j, x in enumerate(values):
                vec[1 + 3 * j: 4 + 3 * j] = checksum(x)
        mine = torch.tensor(vec, dtype=torch.int64, device=self._device)  # NCCL gathers device tensors
        world = dist.get_world_size()
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)  # the default group: every rank of the plan holds the same batch
        table = torch.stack(rows).cpu()
        if problem is not None:
            raise problem
        bad = [r for r in range(world) if int(table[r, 0]) != 0]
        if bad:
            raise InputMismatchError(
                f"{where} at step {step}: rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} got a batch that "
                "does not match the compiled example (its error names the input); every rank passes the same global "
                "batch, of the compiled shapes")
        for j, label in enumerate(labels):
            col = table[:, 1 + 3 * j: 4 + 3 * j]
            differ = [r for r in range(world) if not torch.equal(col[r], col[0])]
            if differ:
                raise InputMismatchError(
                    f"ranks hold different batches at step {step} (rank 0 vs rank {differ[0]} differ on {label}): in "
                    f"autopar every rank passes the same global batch to {where}, and the plan splits it over the "
                    "ranks; give every rank the same batches (the same data order and seed; no DistributedSampler "
                    "or per-rank sharding of the data)")
