"""Start-up of a pretrained decoder on 4 gloo processes: memory, bytes read, first-step loss, time.

    python benchmarks/start_up.py [--sizes 100M,200M,400M] [--family depth,width] [--nproc 1,2,4]
                                  [--optimizer adamw,sgd] [--batch 4] [--seq 32] [--json out.json] [--full-trace]
    python benchmarks/start_up.py --from-json a.json b.json   # the summary tables of saved runs

For each size, a Hugging Face ``LlamaForCausalLM`` (vocab 32000) is written once by this process
with ``save_pretrained(max_shard_size="200MB")`` (cached under ``$TMPDIR/autopar-start-up/<size>``,
``<size>-wide`` for the width family). Two families (``--family``): "depth" (hidden 1024, 3/10/26
layers for 100M/200M/400M: the number of ops grows with the size) and "width" (3 layers, hidden
1024/1600/2560 with heads of 64 and an MLP of 2.75x the hidden size: the same ops at every size, only
the bytes grow; its 100M is the depth family's 100M model). What grows with the bytes (load, gradient
buffers) must scale with size / world size; what grows with the number of ops (tracing, the
passes) shows in the depth family only. Then every rank builds it on ``torch.device("meta")``, compiles
it planned ``dp=nproc, zero=3`` with ``init="skip"`` (the model's own ``_init_weights`` computes the
rotary ``inv_freq`` buffers no checkpoint holds; nothing else is initialised), loads the folder with ``autopar.load_weights``
and runs one step (``measure_step``) of AdamW or SGD (``--optimizer``), for each world size of
``--nproc``. Per rank:

* peak of every live tensor storage in the process during compile + load (``MemoryTracker`` entered
  before ``compile``, the whole process registered before and after each phase), and during the first
  step (``measure_step``), beside the plan's per-rank peak prediction (goal: within 15%) and the model's
  full fp32 size (goal: below it);
* the bytes each rank read beside its slices' bytes (goal: at most +10%);
* the first-step loss beside the one-device ``from_pretrained`` model's, computed in this process
  with the same batch and loss (goal: 1e-5 relative);
* wall seconds (``time.perf_counter``) and this process's CPU seconds (``time.process_time``) for
  compile + load and for the first step, and compile's CPU seconds by phase (``plan.timings``):
  tracing, planning (rank 0 solves, the others wait), building the program (graph copy and passes),
  and the rest (the shards, gradient buffers and buffer init: bytes). The summary gives, per size and world size, the slowest
  rank's wall seconds and the largest per-rank CPU seconds, each as a ratio to the first (smallest)
  row's beside the ratio of the work per rank (parameters / world size): issue 43 wants start-up
  to grow with size / world size. On a machine with fewer cores than processes the ranks share the
  cores, so wall time cannot fall with the world size; the CPU seconds show what each rank did.

Limit of the memory count off CUDA: a storage made outside torch's dispatch is seen only if it is
still alive when the whole process is registered; ``load_weights`` makes none (each slice is read
from the file into its shard, through one slice-sized temporary only for a dtype conversion).
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
VOCAB = 32000
# family -> size -> (layers, hidden, MLP width, heads)
FAMILIES = {
    "depth": {"100M": (3, 1024, 2816, 16), "200M": (10, 1024, 2816, 16), "400M": (26, 1024, 2816, 16)},  # 104M, 194M, 400M
    "width": {"100M": (3, 1024, 2816, 16), "200M": (3, 1600, 4416, 25), "400M": (3, 2560, 7040, 40)},  # 104M, 197M, 405M
}


def llama_config(size: str, family: str = "depth"):
    import transformers

    layers, hidden, mlp, heads = FAMILIES[family][size]
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                    max_position_embeddings=256, use_cache=False, tie_word_embeddings=False)


def lm_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-4)


def sgd(ps):
    return torch.optim.SGD(ps, lr=1e-4)


OPTIMIZERS = {"adamw": adamw, "sgd": sgd}


def batch(b: int, s: int):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (b, s), generator=g), torch.randint(0, VOCAB, (b, s), generator=g)


def pretrained_folder(size: str, family: str = "depth") -> str:
    """Write the size's model once with ``save_pretrained`` (sharded safetensors); return its folder
    (a width model of the same shape as the depth model shares its folder)."""
    import transformers

    same = FAMILIES[family][size] == FAMILIES["depth"][size]
    folder = os.path.join(tempfile.gettempdir(), "autopar-start-up", size if same else f"{size}-wide")
    if not os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config(size, family))
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


def worker(size: str, folder: str, nproc: int, b: int, s: int, optimizer: str = "adamw", family: str = "depth",
           regional: bool = True) -> dict:
    """One rank: meta build, compile (zero=3, init="skip") + load under the whole-process storage
    tracker, then one measured step of ``optimizer``. ``regional=False``: every instance of a
    repeated block traced (``autopar.stamp`` off in this process), the baseline of regional tracing."""
    import transformers

    import autopar
    if not regional:
        import autopar.trace
        from autopar.stamp import stamp_repeated_blocks

        autopar.trace.stamp_repeated_blocks = lambda model, enabled=True: stamp_repeated_blocks(model, False)
    from autopar.api import cyclic_gc_paused
    PeakWhere = _peak_tracker_class()
    x, t = batch(b, s)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(size, family))
    tracker = PeakWhere(count_unallocated=False)
    gc.collect()
    with cyclic_gc_paused(), tracker:
        tracker.register_process("cpu", {"the step's batch": _batch_module(x, t)})
        t0, c0 = time.perf_counter(), time.process_time()
        pm = autopar.compile(model, autopar.Cluster.local(nproc), (x,), example_target=t, loss_fn=lm_loss,
                             optimizer=OPTIMIZERS[optimizer], constraints=autopar.Constraints(dp=nproc, zero=3),
                             init="skip")
        t_compile, c_compile = time.perf_counter() - t0, time.process_time() - c0
        tracker.register_process("cpu", {"the user's model": model, "the step's batch": _batch_module(x, t)})
        with warnings.catch_warnings(record=True) as caught:  # init="skip" initialises the rotary buffers itself
            warnings.simplefilter("always")
            report = autopar.load_weights(pm, folder)
        t_load, c_load = time.perf_counter() - t0 - t_compile, time.process_time() - c0 - c_compile
        tracker.register_process("cpu", {"the user's model": model, "the step's batch": _batch_module(x, t)})
    start = tracker.report()
    t1, c1 = time.perf_counter(), time.process_time()
    step = pm.measure_step(x, target=t)
    t_step, c_step = time.perf_counter() - t1, time.process_time() - c1
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
        "step_only_s": step.step_time_s, "compile_cpu_s": c_compile, "load_cpu_s": c_load, "step_cpu_s": c_step,
        "compile_phases_cpu_s": {k: pm.plan.timings.get(f"{k}_cpu_s") for k in ("trace", "plan", "build")},
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
    ap.add_argument("--family", default="depth", help="depth (layers grow), width (hidden grows), or both: depth,width")
    ap.add_argument("--nproc", default="4", help="world sizes, e.g. 1,2,4")
    ap.add_argument("--optimizer", default="adamw", help=f"one or more of {','.join(OPTIMIZERS)}")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--full-trace", action="store_true", help="trace every instance of a repeated block (the baseline)")
    ap.add_argument("--from-json", nargs="+", metavar="JSON", help="print the summary of saved runs; run nothing")
    a = ap.parse_args()
    if a.from_json:
        rows = [row for path in a.from_json for row in json.load(open(path))]
        summary(rows)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worlds = [int(n) for n in a.nproc.split(",")]
    optimizers = a.optimizer.split(",")
    if unknown := [o for o in optimizers if o not in OPTIMIZERS]:
        ap.error(f"--optimizer {','.join(unknown)}: the optimizers are {','.join(OPTIMIZERS)}")
    families = a.family.split(",")
    if unknown := [f for f in families if f not in FAMILIES]:
        ap.error(f"--family {','.join(unknown)}: the families are {','.join(FAMILIES)}")
    rows = []
    for family in families:
        for size in a.sizes.split(","):
            folder = pretrained_folder(size, family)
            ref, n_params = reference_loss(folder, a.batch, a.seq)
            layers, hidden = FAMILIES[family][size][:2]
            for nproc in worlds:
                for opt in optimizers:
                    ranks = autopar.launch(worker, nproc, size, folder, nproc, a.batch, a.seq, opt, family,
                                           not a.full_trace, timeout_s=3000)
                    rows.append({"size": size, "family": family, "layers": layers, "hidden": hidden, "params": n_params,
                                 "full_fp32": 4 * n_params, "ref_loss": ref, "nproc": nproc, "optimizer": opt, "ranks": ranks,
                                 "regional": not a.full_trace})
                    report(rows[-1], a.batch, a.seq)
                    if a.json:
                        with open(a.json, "w") as f:
                            json.dump(rows, f, indent=1, default=str)
    summary(rows)
    return 0


def report(row: dict, b: int, s: int) -> None:
    """One run's per-rank table and where its memory went."""
    ranks, ref, full = row["ranks"], row["ref_loss"], row["full_fp32"]
    print(f"\n== {row['size']} ({row.get('family', 'depth')}: {row.get('layers', '?')} layers, hidden {row.get('hidden', '?')}): "
          f"{row['params'] / 1e6:.1f}M parameters, full fp32 {full / MIB:.0f} MiB, "
          f"{row['nproc']} gloo processes, {row['optimizer']}, plan mesh {ranks[0]['mesh']}, batch {b}x{s}")
    print(f"{'rank':>4} {'start peak':>10} {'step peak':>9} {'pred':>7} {'start/pred':>10} {'step/pred':>9} "
          f"{'read MiB':>8} {'slices':>7} {'read/sl':>7} {'loss rel err':>12} {'compile s':>9} {'load s':>6} "
          f"{'step s':>6} {'cpu c+l s':>9}")
    for r, x in enumerate(ranks):
        err = abs(x["loss"] - ref) / abs(ref)
        print(f"{r:>4} {x['start_peak'] / MIB:>10.1f} {x['step_peak'] / MIB:>9.1f} {x['predicted_peak'] / MIB:>7.1f} "
              f"{x['start_peak'] / x['predicted_peak']:>10.3f} {x['step_peak'] / x['predicted_peak']:>9.3f} "
              f"{x['bytes_read'] / MIB:>8.1f} {x['slice_bytes'] / MIB:>7.1f} "
              f"{x['bytes_read'] / max(x['slice_bytes'], 1):>7.3f} {err:>12.2e} {x['compile_s']:>9.1f} "
              f"{x['load_s']:>6.1f} {x['step_s']:>6.1f} {x['compile_cpu_s'] + x['load_cpu_s']:>9.1f}")
    w = max(ranks, key=lambda x: x["step_peak"])
    print("  predicted by category (MiB):", {k: round(v / MIB, 1) for k, v in w["predicted"].items()})
    print("  start-up at its peak (MiB):", {k: round(v / MIB, 1) for k, v in w["start_at_peak"].items()})
    print("  first step at its peak (MiB):", {k: round(v / MIB, 1) for k, v in w["step_at_peak"].items()})
    print("  start-up unaccounted (largest):", w["start_unaccounted"])
    print("  step unaccounted (largest):", w["step_unaccounted"])
    print("  start-up peak made at:", " <- ".join(reversed(w["start_peak_where"])))
    print("  buffers load_weights left uninitialised (init='skip' initialises the rotary ones):",
          w["uninitialised"] or "none")


def summary(rows: list[dict]) -> None:
    """Memory and time per family, size, world size and optimizer; times as ratios to the family's
    first row beside the ratio of the work per rank (parameters / world size)."""
    print(f"\n{'family':>6} {'size':>5} {'world':>5} {'opt':>5} {'full MiB':>8} {'start pk':>8} {'step pk':>8} "
          f"{'plan pk':>8} {'step/plan':>9} {'step/full':>9}")
    for row in rows:
        w = max(row["ranks"], key=lambda x: x["step_peak"])
        print(f"{row.get('family', 'depth'):>6} {row['size']:>5} {row['nproc']:>5} {row['optimizer']:>5} "
              f"{row['full_fp32'] / MIB:>8.0f} {max(x['start_peak'] for x in row['ranks']) / MIB:>8.1f} "
              f"{w['step_peak'] / MIB:>8.1f} {w['predicted_peak'] / MIB:>8.1f} {w['step_peak'] / w['predicted_peak']:>9.3f} "
              f"{w['step_peak'] / row['full_fp32']:>9.3f}")

    def most(row, keys):
        return max(sum(x[k] for k in keys) for x in row["ranks"])

    def phase(row, name):
        """The largest per-rank CPU seconds of one compile phase; "rest": compile less the phases."""
        def one(x):
            ph = x.get("compile_phases_cpu_s") or {}
            if name != "rest":
                return ph.get(name)
            return x["compile_cpu_s"] - sum(v for v in ph.values() if v is not None) if ph else None
        got = [one(x) for x in row["ranks"]]
        return max(got) if all(v is not None for v in got) else float("nan")

    def work(row):
        return row["params"] / row["nproc"]

    cl, cl_cpu = ("compile_s", "load_s"), ("compile_cpu_s", "load_cpu_s")
    for family in dict.fromkeys(row.get("family", "depth") for row in rows):
        mine = [row for row in rows if row.get("family", "depth") == family]
        base = mine[0]
        print(f"\n{family} family: start-up (compile + load) and first step; ratios to {base['size']} on {base['nproc']} "
              "process(es); wall: the slowest rank, cpu: the largest per-rank process_time (each column its own largest rank)")
        print(f"{'size':>5} {'world':>5} {'opt':>5} {'work ratio':>10} {'c+l wall s':>10} {'ratio':>6} {'c+l cpu s':>9} "
              f"{'ratio':>6} {'compile cpu':>11} {'trace':>6} {'plan':>6} {'build':>6} {'rest':>6} {'load cpu':>8} "
              f"{'step wall s':>11} {'step cpu s':>10}")
        for row in mine:
            print(f"{row['size']:>5} {row['nproc']:>5} {row['optimizer']:>5} {work(row) / work(base):>10.2f} "
                  f"{most(row, cl):>10.2f} {most(row, cl) / most(base, cl):>6.2f} {most(row, cl_cpu):>9.2f} "
                  f"{most(row, cl_cpu) / most(base, cl_cpu):>6.2f} {most(row, ('compile_cpu_s',)):>11.2f} "
                  f"{phase(row, 'trace'):>6.2f} {phase(row, 'plan'):>6.2f} {phase(row, 'build'):>6.2f} {phase(row, 'rest'):>6.2f} "
                  f"{most(row, ('load_cpu_s',)):>8.2f} {most(row, ('step_s',)):>11.1f} {most(row, ('step_cpu_s',)):>10.1f}")

if __name__ == "__main__":
    sys.exit(main())
