"""``BatchChecker``, a part of ``ParallelModel``: every call's batch checked against the
compiled example (``runtime.input_checks``: number of inputs, shapes, dtypes, constants), and on
the steps ``check_inputs`` names, the ranks' checksums compared in one small all-gather: with
global batches every rank must hold the same batch; with local ones (``batch="local"``) the ranks
of one data shard (equal ``data_parallel_rank``: the tensor, pipeline, ... ranks of one replica).

Invariant: a batch that does not match is refused with ``InputMismatchError`` on every rank alike:
a rank with a local problem still joins the comparison and raises after it, so no peer is left
waiting in the all-gather.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autopar.errors import InputMismatchError
from autopar.layouts import Shard, chunk_range
from autopar.runtime.input_checks import FIRST_CHECKED_STEPS, Example, checksum, mismatch
from autopar.trace import TensorMeta, model_class_name

if TYPE_CHECKING:
    from autopar.runtime.rank_program import RankProgram

__all__ = ["BatchChecker", "missing_target"]


class BatchChecker:
    """The batch checks of one plan on this rank; it owns the count of ``forward`` and
    ``eval_step`` calls (``train_step`` counts in ``ParallelModel.step``)."""

    def __init__(self, *, mode: str, local: bool, device: torch.device, comm, plan, data_split: tuple[int, int]):
        """``mode``: ``check_inputs`` ("first", "always", "never"); ``local``: each rank passes its
        own batch shard; ``data_split``: (``data_parallel_size``, ``data_parallel_rank``)."""
        self.mode = mode
        self.local = local
        self.device = device
        self.comm = comm
        self.plan = plan
        self.data_parallel_size, self.data_parallel_rank = data_split
        self.calls = {"eval_step": 0, "forward": 0}

    def counted(self, where: str) -> None:
        """One more call of ``where`` ran (the count ``check`` compares with ``FIRST_CHECKED_STEPS``)."""
        self.calls[where] += 1

    def _batch_problem(self, where: str, inputs: tuple, target: Any, ex: Example,
                       rows: dict[str, tuple[int, int]] | None = None) -> InputMismatchError | None:
        """What is wrong with this batch against the compiled example, or None. ``rows`` (local
        batches): label -> (global rows, this rank's rows) of each input the plan splits by rows."""
        if ex.has_target and target is None and len(inputs) == len(ex.inputs) + 1:
            return InputMismatchError(
                f"{where} got {len(inputs)} inputs and no target=: the model takes {len(ex.inputs)}, and the loss_fn's "
                f"target goes by keyword: pm.{where}(*inputs, target=y)")
        if len(inputs) != len(ex.inputs):
            return InputMismatchError(
                f"{where} got {len(inputs)} inputs; the model was compiled with {len(ex.inputs)}: pass the inputs "
                "of the compiled example, in the same order")
        if ex.has_target and target is None:
            return InputMismatchError(f"{where} needs target= (the loss_fn's second argument, by keyword: "
                                      f"pm.{where}(*inputs, target=y))")
        pairs = [(f"input {i}", x, want) for i, (x, want) in enumerate(zip(inputs, ex.inputs))]
        if ex.has_target:
            pairs.append(("target", target, ex.target))
        for label, x, want in pairs:
            if isinstance(x, torch.Tensor) and x.is_meta:
                return InputMismatchError(
                    f"{where}: {label} is a meta tensor (a shape without values), and a step computes on the batch's "
                    "values: pass real tensors (meta tensors serve example_inputs= and example_target= only, to plan "
                    "without data)")
            problem = mismatch(x, want)
            if problem is None:
                continue
            if rows is not None and label in rows and _only_rows_differ(x, want):
                whole, mine = rows[label]
                n = self.data_parallel_size
                return InputMismatchError(
                    f"{where}: {label} {problem} (batch='local': each rank passes its own shard, {n} "
                    f"shard{'s' if n > 1 else ''} of the global batch of {whole} rows planned). Each rank's batch "
                    f"must have {whole} / pm.data_parallel_size = {mine} rows: e.g. DataLoader(dataset, "
                    f"batch_size={mine}, sampler=DistributedSampler(dataset, num_replicas=pm.data_parallel_size, "
                    f"rank=pm.data_parallel_rank), drop_last=True); to train on {x.shape[0]} rows per shard, compile "
                    f"again with example_inputs= of the global batch ({x.shape[0]} x {n} = {x.shape[0] * n} rows)")
            if _only_dtype_differs(x, want):
                fix = (f"pass it as {want.dtype} (x.to({want.dtype}), e.g. in the DataLoader's collate_fn), or compile "
                       f"again with an example of dtype {x.dtype} for a model of that dtype")
            elif isinstance(want, TensorMeta):
                fix = ("compile again with an example of this shape, or pad/drop the last batch (e.g. "
                       "DataLoader(drop_last=True)) so that every batch has the compiled shape")
                if rows is not None:
                    fix = ("compile again with example_inputs= of the global batch of this shape (with batch='local' "
                           "the example is the global batch, each rank's rows times pm.data_parallel_size), or "
                           "pad/drop the last batch (DataLoader(drop_last=True)) so that every batch has the compiled shape")
            else:
                fix = "compile again with this value (a non-tensor input is a constant of the compiled program)"
            return InputMismatchError(
                f"{where}: {label} {problem}. The program was traced and planned for exactly the compiled example "
                f"(a model that branches on the batch size would silently keep the compiled branch): {fix}")
        return None

    def check(self, where: str, inputs: tuple, target: Any, prog: "RankProgram", step: int | None = None) -> None:
        """Raise if the batch does not match the compiled example; on the steps ``check_inputs``
        names, compare every input's checksum across the ranks (one small all-gather over every
        rank), so that a rank holding a different or mis-shaped batch is reported on every rank.
        Global batches: every rank must hold the same one. Local batches: the ranks of one data
        shard (equal ``data_parallel_rank``: the tensor, pipeline... ranks of one replica) must.
        ``step``: the call's number (default: the count of ``where``'s calls)."""
        step = self.calls[where] if step is None else step
        if self.local:
            ex, rows = self._local_example(prog)
        else:
            ex, rows = prog.example, None
        problem = self._batch_problem(where, inputs, target, ex, rows)
        due = self.mode == "always" or (self.mode == "first" and step < FIRST_CHECKED_STEPS)
        if due and dist.is_initialized() and dist.get_world_size() > 1:
            self._compare_across_ranks(where, inputs, target, problem, step, prog.example)
        if problem is not None:
            raise problem

    def _local_example(self, prog: "RankProgram") -> tuple[Example, dict[str, tuple[int, int]]]:
        """The example as this rank passes it with local batches (rows of the batch inputs on "dp"),
        and per label split by rows: (global rows, this rank's rows)."""
        ex = prog.example
        names = prog.traced.input_names + ([prog.traced.target_name] if ex.has_target else [])
        specs = list(ex.inputs) + ([ex.target] if ex.has_target else [])
        labels = [f"input {i}" for i in range(len(ex.inputs))] + (["target"] if ex.has_target else [])
        batch = next((sp.shape[0] for sp in ex.inputs if isinstance(sp, TensorMeta) and sp.shape), None)
        out, split = [], {}
        for name, spec, label in zip(names, specs, labels):
            lay = prog.input_layouts.get(name)
            if isinstance(spec, TensorMeta) and lay is not None and lay[0] == Shard(0) and spec.shape:
                rows = chunk_range(spec.shape[0], self.comm.sizes[0], self.comm.coords[0])[1]
                split[label] = (spec.shape[0], rows)
                spec = TensorMeta((rows,) + tuple(spec.shape[1:]), spec.dtype)
            elif isinstance(spec, TensorMeta) and spec.shape and spec.shape[0] == batch:  # one data shard: all rows
                split[label] = (batch, batch)
            out.append(spec)
        n = len(ex.inputs)
        return Example(tuple(out[:n]), out[n] if ex.has_target else None, ex.has_target), split

    def _compare_across_ranks(self, where: str, inputs: tuple, target: Any, problem, step: int, ex: Example) -> None:
        """Gather every rank's [local problem?, data shard, checksums] and raise on every rank alike
        if one rank refused its batch, or two ranks that must hold the same rows do not."""
        labels = [f"input {i}" for i in range(len(ex.inputs))] + (["target"] if ex.has_target else [])
        # [local problem?, data shard, then per input: kind/shape/dtype, sum, weighted sum]; ranks
        # of one data shard hold the same rows (global batches: one shard, every rank)
        vec = [0, self.data_parallel_rank if self.local else 0] + [0] * (3 * len(labels))
        if problem is not None:
            vec[0] = 1
        else:
            values = list(inputs) + ([target] if ex.has_target else [])
            for j, x in enumerate(values):
                vec[2 + 3 * j: 5 + 3 * j] = checksum(x)
        mine = torch.tensor(vec, dtype=torch.int64, device=self.device)  # NCCL gathers device tensors
        world = dist.get_world_size()
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)  # the default group: every rank joins, whatever its problem
        table = torch.stack(gathered).cpu()
        if problem is not None:
            raise problem
        bad = [r for r in range(world) if int(table[r, 0]) != 0]
        if bad:
            held = ("passes its own local batch (its data shard's rows)" if self.local
                    else "passes the same global batch")
            raise InputMismatchError(
                f"{where} at step {step}: rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} got a batch that "
                f"does not match the compiled example (its error names the input); every rank {held}, of the "
                "compiled shapes")
        shard = table[:, 1].tolist()
        first = {}
        for r in range(world):
            first.setdefault(shard[r], r)  # the lowest rank of each data shard
        for j, label in enumerate(labels):
            col = table[:, 2 + 3 * j: 5 + 3 * j]
            differ = [r for r in range(world) if not torch.equal(col[r], col[first[shard[r]]])]
            if not differ:
                continue
            r = differ[0]
            if self.local:
                raise InputMismatchError(
                    f"ranks {first[shard[r]]} and {r} read the same data shard ({shard[r]} of "
                    f"{self.data_parallel_size}) but hold different batches at step {step} (they differ on {label}): "
                    f"with batch='local' the ranks of one data shard compute on its rows together (the plan's mesh: "
                    f"{self._mesh_text()}), so each must be fed the same rows, or their copies of the parameters "
                    f"silently diverge. Feed the same rows to every rank of a data shard: "
                    f"DistributedSampler(dataset, num_replicas=pm.data_parallel_size, rank=pm.data_parallel_rank) "
                    f"(not num_replicas=world size, rank=rank), with the same seed and epoch on every rank")
            raise InputMismatchError(
                f"ranks hold different batches at step {step} (rank 0 vs rank {r} differ on {label}): in "
                f"autopar every rank passes the same global batch to {where}, and the plan splits it over the "
                "ranks; give every rank the same batches (the same data order and seed; no DistributedSampler "
                "or per-rank sharding of the data)")

    def _mesh_text(self) -> str:
        mesh = " x ".join(f"{a}={n}" for a, n in self.plan.mesh_axes)
        return f"pp={self.plan.pipeline_degree} x {mesh}" if len(self.plan.stages) > 1 else mesh


def missing_target(where: str, given: int, model: torch.nn.Module) -> str:
    """What to say to a step called without ``target=`` where the compiled ``loss_fn`` needs one."""
    text = f"{where} needs target= (the loss_fn's second argument), by keyword: pm.{where}(*inputs, target=y)"
    n = sum(1 for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    if given > n:
        text += f"; it got {given} inputs where {model_class_name(model)}.forward takes {n}: was the target passed positionally?"
    return text


def _only_dtype_differs(x: Any, want: Any) -> bool:
    """Whether tensor ``x`` has ``want``'s shape and another dtype."""
    return isinstance(want, TensorMeta) and isinstance(x, torch.Tensor) and tuple(x.shape) == tuple(want.shape) \
        and x.dtype != want.dtype


def _only_rows_differ(x: Any, want: TensorMeta) -> bool:
    """Whether tensor ``x`` differs from ``want`` in its number of rows (dim 0) alone."""
    return (isinstance(want, TensorMeta) and isinstance(x, torch.Tensor) and x.dtype == want.dtype
            and x.dim() == len(want.shape) and x.dim() > 0 and tuple(x.shape[1:]) == tuple(want.shape[1:]))
