"""Start-up of a pretrained decoder on 4 gloo processes: memory, bytes read, first-step loss, time.

    python benchmarks/start_up.py [--sizes 100M,200M,400M] [--nproc 4] [--batch 4] [--seq 32] [--json out.json]

For each size, a Hugging Face ``LlamaForCausalLM`` (hidden 1024, vocab 32000, layers chosen for the
size) is written once by this process with ``save_pretrained(max_shard_size="200MB")`` (cached under
``$TMPDIR/autopar-start-up/<size>``). Then every rank builds it on ``torch.device("meta")``, compiles
it planned ``dp=nproc, zero=3`` with ``init="skip"`` (the model's own ``_init_weights`` computes the
rotary ``inv_freq`` buffers no checkpoint holds; nothing else is initialised), loads the folder with
``autopar.load_weights`` and runs one AdamW step (``measure_step``). Per rank:

* peak of every live tensor storage in the process during compile + load (``MemoryTracker`` entered
  before ``compile``, the whole process registered before and after each phase), and during the first
  step (``measure_step``), beside the plan's per-rank peak prediction (goal: within 15%) and the model's
  full fp32 size (goal: below it);
* the bytes each rank read beside its slices' bytes (goal: at most +10%);
* the first-step loss beside the one-device ``from_pretrained`` model's, computed in this process
  with the same batch and loss (goal: 1e-5 relative);
* seconds for compile + load and for the first step, and their ratio to the smallest size's
  (issue 43: start-up should grow with size / world size).

Limit of the memory count off CUDA: a storage made outside torch's dispatch (the tensor safetensors
returns for a slice before it is copied into the shard) is seen only if it is still alive when the
whole process is registered; the largest such transient is one slice.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.nn.functional as F

MIB = 2**20
HIDDEN, VOCAB = 1024, 32000
LAYERS = {"100M": 3, "200M": 10, "400M": 26}  # about 104M, 194M, 400M parameters at hidden 1024


def llama_config(size: str):
    import transformers

    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2816,
                                    num_hidden_layers=LAYERS[size], num_attention_heads=16, num_key_value_heads=16,
                                    max_position_embeddings=256, use_cache=False, tie_word_embeddings=False)


def lm_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-4)


def batch(b: int, s: int):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (b, s), generator=g), torch.randint(0, VOCAB, (b, s), generator=g)


def pretrained_folder(size: str) -> str:
    """Write the size's model once with ``save_pretrained`` (sharded safetensors); return its folder."""
    import transformers

    folder = os.path.join(tempfile.gettempdir(), "autopar-start-up", size)
    if not os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config(size))
        model.save_pretrained(folder, max_shard_size="200MB")
        del model
        gc.collect()
    return folder


def reference_loss(folder: str, b: int, s: int) -> tuple[float, int]:
    """The one-device model's loss on the benchmark's batch, and its parameter count."""
    import transformers

    ref = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    x, t = batch(b, s)
    with torch.no_grad():
        loss = float(lm_loss(ref(x), t))
    n = sum(p.numel() for p in ref.parameters())
    del ref
    gc.collect()
    return loss, n


def worker(size: str, folder: str, nproc: int, b: int, s: int) -> dict:
    """One rank: meta build, compile (zero=3, init="skip") + load under the whole-process storage
    tracker, then one measured AdamW step."""
    import transformers

    import autopar
    from autopar.api import cyclic_gc_paused
    PeakWhere = _peak_tracker_class()
    x, t = batch(b, s)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(size))
    tracker = PeakWhere(count_unallocated=False)
    gc.collect()
    with cyclic_gc_paused(), tracker:
        tracker.register_process("cpu", {"the step's batch": _batch_module(x, t)})
        t0 = time.perf_counter()
        pm = autopar.compile(model, autopar.Cluster.local(nproc), (x,), example_target=t, loss_fn=lm_loss,
                             optimizer=adamw, constraints=autopar.Constraints(dp=nproc, zero=3), init="skip")
        t_compile = time.perf_counter() - t0
        tracker.register_process("cpu", {"the user's model": model, "the step's batch": _batch_module(x, t)})
        with warnings.catch_warnings(record=True) as caught:  # init="skip" initialises the rotary buffers itself
            warnings.simplefilter("always")
            report = autopar.load_weights(pm, folder)
        t_load = time.perf_counter() - t0 - t_compile
        tracker.register_process("cpu", {"the user's model": model, "the step's batch": _batch_module(x, t)})
    start = tracker.report()
    t1 = time.perf_counter()
    step = pm.measure_step(x, target=t)
    t_step = time.perf_counter() - t1
    return {
        "mesh": dict(pm.plan.mesh), "predicted_peak": float(step.predicted_peak_bytes),
        "predicted": {k: float(v) for k, v in step.predicted_memory.items()},
        "start_peak": start.peak_bytes, "start_at_peak": start.at_peak,
        "start_unaccounted": [r.describe() for r in start.unaccounted[:5]],
        "step_peak": step.memory.peak_bytes, "step_at_peak": step.memory.at_peak,
        "step_unaccounted": [r.describe() for r in step.memory.unaccounted[:5]],
        "start_peak_where": tracker.where,
        "uninitialised": [str(w.message) for w in caught if type(w.message).__name__ == "UninitialisedBufferWarning"],
        "bytes_read": report.bytes_read, "slice_bytes": report.slice_bytes,
        "loss": step.loss, "compile_s": t_compile, "load_s": t_load, "step_s": t_step,
        "step_only_s": step.step_time_s,
    }


def _peak_tracker_class():
    from autopar.runtime.memory import MemoryTracker

    class PeakWhere(MemoryTracker):
        """The storage tracker, remembering the autopar / safetensors frames that made its peak."""

        where: list = []

        def _add(self, t, category, *, retag=False):
            before = self._peak
            super()._add(t, category, retag=retag)
            if self._peak > before and self._peak - before > 2**20:
                import traceback

                self.where = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                              if "autopar" in f.filename or "safetensors" in f.filename][-8:]

    return PeakWhere


def _batch_module(x, t) -> torch.nn.Module:
    m = torch.nn.Module()
    m.register_buffer("input0", x, persistent=False)
    m.register_buffer("target", t, persistent=False)
    return m


def main() -> int:
    import autopar

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100M,200M,400M")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for size in a.sizes.split(","):
        folder = pretrained_folder(size)
        ref, n_params = reference_loss(folder, a.batch, a.seq)
        ranks = autopar.launch(worker, a.nproc, size, folder, a.nproc, a.batch, a.seq, timeout_s=3000)
        full = 4 * n_params
        rows.append({"size": size, "params": n_params, "full_fp32": full, "ref_loss": ref, "ranks": ranks})
        print(f"\n== {size}: {n_params / 1e6:.1f}M parameters, full fp32 {full / MIB:.0f} MiB, "
              f"{a.nproc} gloo processes, plan mesh {ranks[0]['mesh']}, batch {a.batch}x{a.seq}")
        print(f"{'rank':>4} {'start peak':>10} {'step peak':>9} {'pred':>7} {'start/pred':>10} {'step/pred':>9} "
              f"{'read MiB':>8} {'slices':>7} {'read/sl':>7} {'loss rel err':>12} {'compile s':>9} {'load s':>6} "
              f"{'step s':>6}")
        for r, x in enumerate(ranks):
            err = abs(x["loss"] - ref) / abs(ref)
            print(f"{r:>4} {x['start_peak'] / MIB:>10.1f} {x['step_peak'] / MIB:>9.1f} {x['predicted_peak'] / MIB:>7.1f} "
                  f"{x['start_peak'] / x['predicted_peak']:>10.3f} {x['step_peak'] / x['predicted_peak']:>9.3f} "
                  f"{x['bytes_read'] / MIB:>8.1f} {x['slice_bytes'] / MIB:>7.1f} "
                  f"{x['bytes_read'] / max(x['slice_bytes'], 1):>7.3f} {err:>12.2e} {x['compile_s']:>9.1f} "
                  f"{x['load_s']:>6.1f} {x['step_s']:>6.1f}")
        w = max(ranks, key=lambda x: x["step_peak"])
        print("  predicted by category (MiB):", {k: round(v / MIB, 1) for k, v in w["predicted"].items()})
        print("  start-up at its peak (MiB):", {k: round(v / MIB, 1) for k, v in w["start_at_peak"].items()})
        print("  first step at its peak (MiB):", {k: round(v / MIB, 1) for k, v in w["step_at_peak"].items()})
        print("  start-up unaccounted (largest):", w["start_unaccounted"])
        print("  step unaccounted (largest):", w["step_unaccounted"])
        print("  start-up peak made at:", " <- ".join(reversed(w["start_peak_where"])))
        print("  buffers load_weights left uninitialised (init='skip' initialises the rotary ones):",
              w["uninitialised"] or "none")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1, default=str)
    base = min(rows, key=lambda r: r["params"])
    print(f"\nstart-up time on {a.nproc} processes (slowest rank), ratio to {base['size']}:")
    print(f"{'size':>5} {'params':>8} {'compile+load s':>14} {'ratio':>6} {'first step s':>12} {'ratio':>6} {'size ratio':>10}")

    def slowest(row, key):
        return max(sum(x[k] for k in key) for x in row["ranks"])

    for row in rows:
        cl, st = slowest(row, ("compile_s", "load_s")), slowest(row, ("step_s",))
        print(f"{row['size']:>5} {row['params'] / 1e6:>7.1f}M {cl:>14.1f} {cl / slowest(base, ('compile_s', 'load_s')):>6.2f} "
              f"{st:>12.1f} {st / slowest(base, ('step_s',)):>6.2f} {row['params'] / base['params']:>10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
