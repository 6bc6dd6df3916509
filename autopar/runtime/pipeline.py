"""A pipeline plan's training step on this rank: its stage program under a
``torch.distributed.pipelining`` schedule.

Invariants:

* a rank runs the stages whose ``Stage.first_rank`` falls in its group of the pipeline axis
  (``local_stages``: one for GPipe and 1F1B, ``virtual_stages`` looped or in a V otherwise;
  stages outermost in the ``("pp", "dp", "tp")`` mesh); inside a stage it is the rank of the
  submesh the per-operator plan was made for, and the stage programs' collectives run there;
* the batch enters at stage 0: each input is cut into the plan's microbatches, each microbatch
  sharded by the input's layout, and the shards joined again so that the schedule's even split
  along dim 0 hands microbatch ``i`` its shard; a later stage that uses a batch input (the last
  one, the target) takes it the same way from the batch every rank holds, through the
  schedule's keyword inputs (``FED_PREFIX``), rather than through the stages before it;
* one protocol on every torch version (2.11's ``PipelineStage`` makes every receive buffer
  require a gradient and sends one back for each): every value crossing a boundary travels as a
  floating tensor that takes a gradient, an integer or boolean value in a floating carrier
  (``to_carrier``, restored on arrival); a value without a gradient of its own gets zeros back
  (``_with_zero_grads_for``; dense only where nothing else reaches it), which its sender drops
  (``_DependOn``);
* the last stage's loss for microbatch ``i`` is the program's (partial over the submesh, as
  without pipelining); the schedule backpropagates it scaled by ``d(global loss)/d(its loss)``,
  so the gradients equal one device's; gradient sync over the submesh runs once per step: a
  bucket is all-reduced as soon as its gradients hold every microbatch, overlapping the rest of
  the schedule, and whatever is left after it (``GradSync.hold(rounds=)``);
* every rank returns the same global loss (broadcast from the last stage as a tensor on the
  stage's device: the pipeline group may be NCCL-only); CUDA stages need NCCL (gloo sends CPU
  tensors only: ``refuse_host_only_sends``);
* under the split-backward schedules (zero-bubble, zbv, dualpipev) ZeRO-2 gradients accumulate
  whole over the step and are reduce-scattered once after it, and a ZeRO-3 parameter's shard
  takes a zero gradient from its gather (its real one arrives by the gather's reduce-scatter).
"""
from __future__ import annotations

import collections
import functools
import inspect
import operator
import weakref
from types import MappingProxyType
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.errors import AutoparError
from autopar.layouts import Layout
from autopar.planner.stages import SPLIT_BACKWARD_SCHEDULES, carrier_dtype
from autopar.passes.analysis import outlined_graph
from autopar.passes.boundary_sends import insert_boundary_sends
from autopar.passes.split_stages import StageProgram, shared_state, split_stages
from autopar.runtime.collectives import shard_tensor
from autopar.runtime.comm import MeshComm, collective_site

__all__ = ["PipelineRunner", "SCHEDULE_CLASSES", "stage_state_names", "local_stages", "refuse_host_only_sends"]

SCHEDULE_CLASSES = MappingProxyType({"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                                     "zero-bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                                     "dualpipev": "ScheduleDualPipeV"})


def local_stages(plan, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs."""
    return [s.index for s in plan.stages if plan.pipeline_rank(s.index) == pp_rank]


def stage_state_names(plan, traced, pp_rank: int) -> set[str]:
    """The parameter and buffer placeholders pipeline rank ``pp_rank``'s stages hold (a tied
    parameter: every stage that uses it, ``Stage.params``)."""
    state = set(traced.param_fqns) | set(traced.buffer_fqns)
    mine = set(local_stages(plan, pp_rank))
    return ({n.name for s in plan.stages if s.index in mine for n in s.nodes if n.name in state}
            | {p.node for s in plan.stages if s.index in mine for p in s.params})


class _DenseGrad(torch.autograd.Function):
    """Identity whose gradient is laid out densely: a stage sends its inputs' gradients back, and
    torch's send needs a contiguous tensor (the first op a received value meets may be a view)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


FED_PREFIX = "autopar_fed_"  # the schedule's keyword inputs: batch inputs a later stage takes directly


def to_carrier(t: torch.Tensor) -> torch.Tensor:
    carrier = carrier_dtype(t.dtype)
    if carrier is t.dtype:
        return t
    return t.contiguous().view(carrier) if carrier.itemsize == t.dtype.itemsize else t.to(carrier)


def from_carrier(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype is dtype:
        return t
    return t.view(dtype) if t.dtype.itemsize == dtype.itemsize else t.to(dtype)


def _with_zero_grads_for(out: torch.Tensor, received: list, flows) -> torch.Tensor:
    """``out`` (a new tensor, not a view: split-backward schedules detach a stage's outputs in
    place) that also sends a zero gradient to each received value, added to whatever else they
    get (see the module docstring). Every output of a stage passes through one, with the received
    values: torch's split backward reaches a stage's parameters only through paths that meet its
    received inputs, which here meet every output. Built of torch's own ops: torch 2.11's weight
    pass cannot start from a custom Function's node. ``flows``: per received value, whether a
    dense gradient reaches it otherwise (its zeros are then an expanded scalar, no memory; else
    dense, as torch sends them). ``where`` keeps the forward value exact, whatever was received."""
    never = torch.zeros((), dtype=torch.bool, device=out.device)
    zero = out.new_zeros(())
    for r, flows_r in zip(received, flows):
        dropped = torch.where(never, r.sum(), 0) if flows_r else torch.where(never, r, 0).sum()
        zero = zero + dropped.to(out.dtype)
    return out + zero


def _reached(outputs, nodes: list) -> tuple[bool, ...]:
    """Per autograd node in ``nodes`` (None: none), whether backward from ``outputs`` reaches it."""
    seen, todo = set(), [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(nxt for nxt, _ in node.next_functions)
    return tuple(n is not None and n in seen for n in nodes)


class _DependOn(torch.autograd.Function):
    """``sent`` (a value without a gradient of its own) as a copy that takes one, through
    ``anchor``: the zeros the receiving stage returns for it go to ``anchor`` and add nothing."""

    @staticmethod
    def forward(ctx, sent, anchor):
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        return sent.clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.anchor
        return None, torch.zeros(shape, dtype=dtype, device=device)


class _StageModule(torch.nn.Module):
    """What ``PipelineStage`` runs: the stage program fed this rank's state and what it receives.
    Stage 0 receives the batch's tensors; its constant (non-tensor) inputs are bound here. A later
    stage also takes the batch inputs it uses (``prog.fed_names``) from the schedule's keyword
    inputs, or from ``fed_constants`` for those that are not split by microbatch."""

    def __init__(self, prog: StageProgram, state: Callable[[], list], run, constants: dict[int, object], last: bool,
                 params: list[torch.nn.Parameter], copy_outputs: bool = False, received=(), sent=(),
                 fed_constants: dict | None = None):
        """``received`` / ``sent``: per tensor crossing in / out, ``(dtype, whether a gradient
        flows)`` as the program has it (the boundary carries it in ``carrier_dtype``)."""
        super().__init__()
        self._copy_outputs = copy_outputs
        self._flows: tuple[bool, ...] | None = None  # per received value: its own gradient reaches it
        self.prog = prog.gm
        self._state = state
        self._run = run
        self._constants = constants
        self._last = last
        self._received = tuple(received)
        self._sent_dtypes = tuple(d for d, _ in sent)
        self._fed = prog.fed_names
        self._fed_constants = fed_constants if fed_constants is not None else {}
        # the stage's parameters (the store's, not copies): zero-bubble schedules take the weight
        # gradients of ``parameters()`` apart from the input gradients
        for i, p in enumerate(params):
            self.register_parameter(f"param{i}", p)

    def forward(self, *received, **fed):
        # every received value takes a gradient back, zeros at least (see the module docstring):
        # one that has none of its own, or whose uses do not reach the outputs (a value passed on
        # detached), would otherwise leave torch without the gradient it sends
        args, anchored, own_grad = [], [], []  # own_grad: per anchored value, its _DenseGrad node (None: none)
        for i, t in enumerate(received):
            if isinstance(t, torch.Tensor) and i < len(self._received):
                dtype, wants_grad = self._received[i]
                anchor = t.requires_grad
                if anchor:
                    anchored.append(t)
                    if not (wants_grad and t.dtype is dtype):
                        t = t.detach()
                t = from_carrier(t, dtype)
                if t.requires_grad:
                    t = _DenseGrad.apply(t)
                if anchor:
                    own_grad.append(t.grad_fn if t.requires_grad else None)
            args.append(t)
        for i in sorted(self._constants):
            args.insert(i, self._constants[i])
        args += [fed[FED_PREFIX + n] if FED_PREFIX + n in fed else self._fed_constants[n] for n in self._fed]
        out = self._run()(self._state() + args, self.prog)
        if anchored and self._flows is None and torch.is_grad_enabled():  # the same paths every microbatch
            self._flows = _reached(out if isinstance(out, (tuple, list)) else (out,), own_grad)
        flows = self._flows or (False,) * len(anchored)  # not known yet: dense zeros
        if self._last:  # as (1,): the schedule concatenates the microbatches' outputs
            loss = (out[0] if isinstance(out, (tuple, list)) else out).reshape(1)
            return _with_zero_grads_for(loss, anchored, flows) if anchored else loss
        # sent as is: a view (a transpose, a slice) must first be laid out densely. Zero-bubble
        # schedules detach the outputs in place after the input gradients, while the weight
        # gradients may still need them (a value the stage also saved): those get a copy
        outs = out if isinstance(out, (tuple, list)) else (out,)
        outs = [to_carrier(t.clone(memory_format=torch.contiguous_format) if self._copy_outputs else t.contiguous())
                for t in outs]
        anchor = next((t for t in outs if t.requires_grad), None)
        if anchor is None:
            anchor = next((t for t in list(received) + self._state() if isinstance(t, torch.Tensor) and t.requires_grad),
                          None)
        if anchor is not None:
            outs = [t if t.requires_grad else _DependOn.apply(t, anchor) for t in outs]
        if anchored:
            # the first output's zeros are dense where no gradient of its own reaches a received
            # value (torch sends them); the other outputs' add nothing and cost nothing
            ks = [j for j, t in enumerate(outs) if t.requires_grad] or [0]
            for n, j in enumerate(ks):
                outs[j] = _with_zero_grads_for(outs[j], anchored, flows if n == 0 else (True,) * len(anchored))
        return tuple(outs) if isinstance(out, (tuple, list)) else outs[0]


@functools.cache
def _stage_class():
    """torch's ``PipelineStage``, less two 2.11 failures. Its warm-up exchanges a message with
    each neighbouring stage, the neighbour on the same rank included (V schedules run stages
    ``p-1`` and ``p`` on one rank), which gloo cannot send to itself; later versions warm up
    otherwise and never call this method for a ``PipelineStage``. And its weight pass runs one
    ``autograd.grad`` per parameter group, through each group's intermediates: groups sharing an
    intermediate (parameters whose paths meet the received values only where a stage output
    joins them) went through it twice, the second time freed. Those groups are merged after the
    input pass (``_merge_param_groups``), which later versions' weight pass takes alike."""
    from torch.distributed import pipelining

    class Stage(pipelining.PipelineStage):
        def _get_init_p2p_neighbors_ops(self):
            me = dist.get_rank()
            return [op for op in super()._get_init_p2p_neighbors_ops() if getattr(op, "peer", None) != me]

        def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
            state = getattr(self, "backward_state", {}).get(bwd_chunk_id)
            if state is not None and state[1]:
                self.backward_state[bwd_chunk_id] = (state[0], _merge_param_groups(state[1]), *state[2:])
            return out

    return Stage


def _merge_param_groups(groups: list[dict]) -> list[dict]:
    """torch's split-backward parameter groups (``params``, ``intermediates``, their captured
    ``grads``), those sharing an intermediate autograd node merged into one (union-find), so the
    weight pass goes through each intermediate once."""
    parent = list(range(len(groups)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict = {}
    for i, g in enumerate(groups):
        for node in g.get("intermediates", ()):
            j = owner.setdefault(node, i)
            parent[root(i)] = root(j)
    if len({root(i) for i in range(len(groups))}) == len(groups):
        return groups
    merged: dict[int, dict] = {}
    for i, g in enumerate(groups):
        m = merged.setdefault(root(i), {"params": [], "intermediates": [], "grads": []})
        grads = g.get("grads") or [(None,)] * len(g["intermediates"])  # no gradient reached them
        for node, grad in zip(g["intermediates"], grads):
            if node not in m["intermediates"]:
                m["intermediates"].append(node)
                m["grads"].append(grad)
        m["params"] += [p for p in g["params"] if p not in m["params"]]
    return list(merged.values())


class PipelineRunner:
    """Build once per compiled pipeline plan; ``step`` runs one optimizer step's forward and backward."""

    def __init__(self, *, plan, traced, program, pp_rank: int, pp_group, store, comm, device, run,
                 input_layouts: dict[str, Layout], loss_scale: float, stage_ranks: list[list[int]] | None = None):
        """``stage_ranks[p]``: the global ranks of pipeline rank ``p``'s submesh, in one order for
        every ``p`` (the groups that sum a tied parameter's copies join the same position)."""
        from torch.distributed import pipelining

        refuse_host_only_sends(torch.device(device), pp_group)
        self.plan = plan
        self.ranks = plan.pipeline_degree
        self.n_stages = len(plan.stages)
        self.mine = local_stages(plan, pp_rank)
        self.microbatches = plan.microbatches
        self.comm = comm
        # torch's weight pass (split-backward schedules) asks autograd for each parameter's own
        # gradient: ZeRO-3 gathers then hand their shard one (runtime.prefetch), and ZeRO-2
        # gradients are reduce-scattered once, after the schedule (GradSync.hold)
        self.split_backward = plan.schedule in SPLIT_BACKWARD_SCHEDULES
        comm.shard_grad_edges = self.split_backward
        self.device = device
        self.pp_group = pp_group
        self.store = store
        self.input_layouts = input_layouts
        self.loss_scale = loss_scale
        state_names = set(traced.param_fqns) | set(traced.buffer_fqns)
        planned = {n.name: s.index for s in plan.stages for n in s.nodes}
        planned = insert_boundary_sends(program, plan, planned, state_names)  # values sent in pieces
        shared = shared_state(plan)
        self.programs = split_stages(program, planned, state_names, self.n_stages, shared)
        self._tied = _tied_groups(plan, shared, stage_ranks, pp_rank, store, comm.stats, comm.log)
        # a tied weight in two of this rank's stages (V schedules) accumulates twice per microbatch
        counts = collections.Counter(n for i in self.mine for n in self.programs[i].state_names)
        self.local_uses = {n: k for n, k in counts.items() if k > 1}
        self.batch_names = list(self.programs[0].input_names)
        self._values: list[torch.Tensor] = []
        self.constants: dict[int, object] = {}  # stage 0: the batch's non-tensor inputs, by position
        # the boundary shapes are known from the plan: given here, so a stage never runs the
        # program on placeholder values to infer them (torch's dynamic inference would: a real
        # forward and backward on uninitialised buffers, collectives and buffer updates included)
        batch_metas, metas = _boundary_metas(self.programs, program, plan, comm, input_layouts)
        self.fed_constants: dict[str, object] = {}  # batch inputs fed whole to a later stage (not split)
        self.fed_names = sorted({n for i in self.mine for n in self.programs[i].fed_names})
        self.pipe_stages = []
        for index in self.mine:
            prog = self.programs[index]
            last = index == self.n_stages - 1
            crossing_in = [] if index == 0 else [(t.dtype, t.requires_grad) for t in metas[index - 1]]
            crossing_out = [] if last else [(t.dtype, t.requires_grad) for t in metas[index]]
            module = _StageModule(prog, _state_of(store, prog.state_names), run, self.constants, last,
                                  [store.slots[n].local for n in prog.state_names if n in store.slots],
                                  copy_outputs=plan.schedule in SPLIT_BACKWARD_SCHEDULES, received=crossing_in,
                                  sent=crossing_out, fed_constants=self.fed_constants)
            ins = batch_metas if index == 0 else [_as_carried(t) for t in metas[index - 1]]
            outs = [torch.empty((1,), device="meta", requires_grad=True)] if last else [_as_carried(t) for t in metas[index]]
            self.pipe_stages.append(_stage_class()(module, index, self.n_stages, device, input_args=tuple(ins),
                                                             output_args=tuple(outs), group=pp_group))
        cls = getattr(pipelining, SCHEDULE_CLASSES[plan.schedule])
        options = {}
        if "scale_grads" in inspect.signature(cls.__init__).parameters:
            options["scale_grads"] = False  # the loss is scaled here (``loss_scale``), as without pipelining
        me = weakref.ref(self)

        def loss_fn(out, weight):
            # ``weight``: the microbatch's share of the step's loss, its piece of the schedule's
            # target (``step``); the loss value kept is the weighted one
            runner = me()
            weighted = out * weight.reshape(())
            runner._values.append(weighted.detach())
            return (weighted * runner.loss_scale).sum()

        single = len(self.pipe_stages) == 1 and plan.schedule in ("gpipe", "1f1b")
        self.schedule = cls(self.pipe_stages[0] if single else self.pipe_stages, self.microbatches, loss_fn=loss_fn,
                            **options)
        self._last_rank = dist.get_global_rank(pp_group, plan.pipeline_rank(self.n_stages - 1))
        self.first = 0 in self.mine
        self.last = self.n_stages - 1 in self.mine

    def _local_batch(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Batch input ``x`` cut into microbatches, each sharded by the input's layout, joined
        again so the schedule's even split along dim 0 hands microbatch ``i`` its shard."""
        m = self.microbatches
        x = x.to(self.device)
        layout = self.input_layouts.get(name)
        parts = x.chunk(m, dim=0) if x.dim() else [x] * m
        if len(parts) != m:
            raise AutoparError(f"input '{name}' of batch {x.shape[0]} cannot be cut into {m} microbatches")
        local = [shard_tensor(p, layout, self.comm) if layout is not None else p for p in parts]
        return torch.cat(local, dim=0) if x.dim() else local[0]

    def _stage0_inputs(self, feed: dict) -> list[torch.Tensor]:
        """The batch as stage 0 hands it to the schedule (see the module docstring)."""
        out = []
        self.constants.clear()
        for i, name in enumerate(self.batch_names):
            x = feed[name]
            if not isinstance(x, torch.Tensor):
                self.constants[i] = x
                continue
            out.append(self._local_batch(name, x))
        return out

    def _fed_inputs(self, feed: dict) -> dict[str, torch.Tensor]:
        """The batch inputs this rank's later stages take directly, as the schedule's keyword
        inputs (split by microbatch as stage 0's are); others (not tensors, or 0-d) whole."""
        kwargs = {}
        self.fed_constants.clear()
        for name in self.fed_names:
            x = feed[name]
            if isinstance(x, torch.Tensor) and x.dim():
                kwargs[FED_PREFIX + name] = self._local_batch(name, x)
            else:
                self.fed_constants[name] = x.to(self.device) if isinstance(x, torch.Tensor) else x
        return kwargs

    def step(self, feed: dict, weights: list) -> list[torch.Tensor]:
        """Forward and backward of every microbatch. ``feed``: batch placeholder name -> value
        (used where stage 0 runs); ``weights``: per microbatch, its loss's weight in the step's
        (``LossValue.microbatch_weights``). Returns the last stage's per-microbatch local
        losses, weighted (empty on the ranks that do not run it)."""
        self._values = []
        kwargs = self._fed_inputs(feed)
        if self.last:
            # the schedule splits its target by microbatch: here, the weights (the program holds the real target)
            # (floats or 0-dim tensors: stacked on the device, never read on the host)
            kwargs["target"] = torch.stack([torch.as_tensor(w, dtype=torch.float32).to(self.device) for w in weights])
            kwargs["losses"] = []
        if self.first:
            self.schedule.step(*self._stage0_inputs(feed), **kwargs)
        else:
            self.schedule.step(**kwargs)
        return list(self._values)

    def sum_tied_grads(self) -> None:
        """Sum the gradients of a tied parameter's copies between the ranks holding them, once
        per step, after gradient sync over the stage's submesh: every copy then takes the whole
        gradient, and their optimizer steps keep them equal. Counted and named like every other
        collective (``MeshComm``); a copy's gradient is a view into the store's flat buffer."""
        for tied_comm, slots in self._tied:
            for slot in slots:
                with collective_site(tied_comm, f"the gradient sum of tied parameter '{slot.fqn}' between pipeline stages"):
                    # ZeRO-2: the copies' reduced shards (each copy's slot is laid out alike)
                    tied_comm.all_reduce(slot.opt.grad if slot.zero_stage == 2 else slot.local.grad, 0)

    def close(self) -> None:
        """Release the tied-gradient groups (the stage submesh's are released by its ``MeshComm``)."""
        for tied_comm, _ in self._tied:
            tied_comm.close()

    def broadcast_loss(self, value: torch.Tensor | float) -> torch.Tensor:
        """The last stage's loss value on every rank of this pipeline, as a tensor on the stage's
        device: the pipeline group is a device group (NCCL carries no host tensor)."""
        value = torch.as_tensor(value).detach().reshape(1).to(self.device, torch.float32, copy=True)
        dist.broadcast(value, src=self._last_rank, group=self.pp_group)
        return value


def refuse_host_only_sends(device: torch.device, pp_group) -> None:
    """Pipeline stages send activations and gradients with torch's point-to-point ops, which gloo
    runs on CPU tensors only (its send hands the tensor's memory to a socket: a CUDA pointer there
    fails or corrupts). A pipeline of CUDA devices needs NCCL; refused before any send."""
    from autopar.runtime.comm import backend_for

    if device.type != "cpu" and backend_for(device.type, pp_group) == "gloo":
        raise AutoparError(
            f"a pipeline plan on {device.type} devices over gloo: gloo's send and recv take CPU tensors only, "
            f"and pipeline stages send {device.type} activations; use backend='nccl' (one GPU per rank), or plan "
            "without pipelining: Constraints(pp=1)")


def _tied_groups(plan, shared: frozenset[str], stage_ranks, pp_rank: int, store, stats, log) -> list:
    """(one-axis ``MeshComm``, store slots) per set of pipeline ranks holding tied parameters'
    copies that this rank is in. Every rank creates every group, in one order (torch requires it)."""
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name in sorted(shared):
        ranks = tuple(sorted({plan.pipeline_rank(s.index) for s in plan.stages if any(p.node == name for p in s.params)}))
        if len(ranks) > 1:
            by_ranks.setdefault(ranks, []).append(name)
    tied = []
    for ranks, names in sorted(by_ranks.items()):
        group, _ = dist.new_subgroups_by_enumeration([[stage_ranks[r][i] for r in ranks]
                                                       for i in range(len(stage_ranks[0]))])
        if pp_rank in ranks:
            slots = [store.slots[n] for n in names if n in store.slots and store.slots[n].local.requires_grad]
            tied.append((MeshComm((group,), (len(ranks),), (ranks.index(pp_rank),), stats, log), slots))
    return tied


def _meta_of(node, plan, comm, input_layouts: dict) -> torch.Tensor | None:
    """A meta tensor of this rank's local value of program node ``node`` (its planned layout; a
    batch input's layout for placeholders), cut by ``shard_tensor`` as the runtime cuts it, with
    whether a gradient flows back into it."""
    from autopar.layouts import parse_layout

    metas = node.meta.get("autopar.outputs") or ()
    meta = metas[0] if metas else None
    if meta is None:
        return None  # not a tensor (an optional input left None)
    if node.op == "placeholder":
        layout = input_layouts.get(node.name)
    elif "autopar.boundary_layout" in node.meta:  # sent in pieces (passes.boundary_sends)
        layout = parse_layout(node.meta["autopar.boundary_layout"])
    else:
        placed = plan.nodes.get(node.name)
        if placed is None or not placed.outs or placed.outs[0] == "-":
            raise AutoparError(f"internal: '{node.name}' crosses a pipeline stage boundary without a planned layout")
        layout = parse_layout(placed.outs[0])
    full = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    local = shard_tensor(full, layout, comm) if layout is not None else full
    grad = bool(node.meta.get("autopar.needs_grad", False)) and meta.dtype.is_floating_point
    return torch.empty(local.shape, dtype=meta.dtype, device="meta", requires_grad=grad)


def _as_carried(t: torch.Tensor) -> torch.Tensor:
    """The meta tensor torch's stage sends or receives for ``t``: in its ``carrier_dtype``, with
    a gradient (see the module docstring)."""
    return torch.empty(t.shape, dtype=carrier_dtype(t.dtype), device="meta", requires_grad=True)


def _boundary_metas(programs, program, plan, comm, input_layouts) -> tuple[list, list[list[torch.Tensor]]]:
    """(what stage 0 receives, and per boundary what crosses it), as meta tensors in the order
    the stages take and send them; non-tensor batch inputs are left out."""
    nodes = {n.name: n for n in program.graph.nodes}
    first = [_meta_of(nodes[n], plan, comm, input_layouts) for n in programs[0].input_names]
    return ([t for t in first if t is not None],
            [[_meta_of(_producer(program, nodes[n]), plan, comm, input_layouts) for n in p.output_names]
             for p in programs[:-1]])


def _producer(program: fx.GraphModule, node: fx.Node) -> fx.Node:
    """The traced node whose value ``node`` is: itself, or where ``outline_recompute`` moved the
    computation into a submodule (node names kept), the node inside it that returns the value."""
    index = None
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and node.args[0].op == "call_module":
        node, index = node.args[0], node.args[1]
    if node.op != "call_module":
        return node
    value = next(n for n in outlined_graph(program, node).nodes if n.op == "output").args[0]
    if isinstance(value, (tuple, list)) and (index is not None or len(value) == 1):
        value = value[index or 0]
    if not isinstance(value, fx.Node):
        raise AutoparError(f"internal: the outlined submodule '{node.target}' sends a non-tensor across a stage boundary")
    return value


def _state_of(store, names: tuple[str, ...]) -> Callable[[], list]:
    """What a stage program takes first: its parameters' and buffers' local tensors, in order."""
    slots, buffers = store.slots, store.buffers
    missing = [n for n in names if n not in slots and n not in buffers]
    if missing:
        raise AutoparError(f"internal: a stage runs '{missing[0]}', which this rank's store does not hold")

    def state() -> list:
        return [slots[n].local if n in slots else buffers[n] for n in names]
    return state

