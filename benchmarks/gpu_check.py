"""CUDA / NCCL check at world size 1: parity with eager training, and step time vs eager.

    python benchmarks/gpu_check.py            # on a machine with a CUDA GPU (NCCL), then the GPU suite
    python benchmarks/gpu_check.py --device cpu   # the same code path on CPU / gloo
    python benchmarks/gpu_check.py --spec ~/.cache/autopar/calibration/local-cuda-1.json
                                              # and price the speed model with `autopar calibrate`'s spec

1. Parity: the example GPT compiled by autopar (fp32, TF32 off) and the same model trained eagerly,
   5 AdamW steps: loss per step and parameters after the last step, relative error (per tensor).
2. Speed: a GPT-2-small-sized model (bf16-mixed on CUDA), autopar's program vs plain eager training
   of the same model and batch, median step time and the ratio; predicted by the datasheet preset
   and (``--spec``) by a calibrated spec.
3. Checkpoint: an asynchronous save of the parity model (staged to host memory, written in the
   background), loaded into a fresh compile: parameters and optimizer state bit for bit.
4. The GPU test suite (``python -m pytest -m gpu``, ``tests/test_gpu.py``) in a child process: a
   table of its tests, each passed / failed / skipped with its seconds and the first line of a
   failure (``--no-suite`` leaves it out).
Exits non-zero if parity fails (> 1e-5), the checkpoint does not round-trip or a suite test fails.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time

import torch


def _cluster(device: str):
    import autopar

    if device == "cuda":
        base = autopar.Cluster.preset("dgx-h100")
        return dataclasses.replace(base, name="one-gpu", devices_per_node=1)
    return autopar.Cluster.local(1)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def parity(device: str, steps: int = 5) -> float:
    import autopar
    from autopar.testing.parity import relative_error
    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    ref = copy.deepcopy(model).to(device)
    batches = [tuple(t.to(device) for t in example_batch(cfg, 8, seed=s)) for s in range(steps)]
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    pm = autopar.compile(model, _cluster(device), (batches[0][0],), example_target=batches[0][1],
                         loss_fn=gpt_loss, optimizer=make_opt)
    opt = make_opt(list(ref.parameters()))
    worst = 0.0
    for x, t in batches:
        got = float(pm.train_step(x, target=t))
        opt.zero_grad()
        want = gpt_loss(ref(x), t)
        want.backward()
        opt.step()
        worst = max(worst, abs(got - float(want)) / abs(float(want)))
    full = pm.full_state_dict()
    worst = max([worst] + [relative_error(full[k], v) for k, v in ref.state_dict().items()])
    print(f"parity on {device} ({pm.plan.cluster.backend}), {steps} AdamW steps: max relative error {worst:.2e}")
    return worst, pm, batches


def checkpoint_roundtrip(pm, batches, device: str) -> bool:
    """Save ``pm`` asynchronously (host staging of device shards), load it into a fresh compile of the
    same model: every parameter and optimizer state equal."""
    import tempfile

    import autopar
    from examples.gpt import GPT, GPTConfig, gpt_loss

    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        folder = pm.save(root, asynchronous=True)
        staged_s = time.perf_counter() - t0
        pm.wait_saved()
        want = (pm.full_state_dict(), pm.full_optimizer_state_dict())
        fresh = autopar.compile(GPT(GPTConfig()), _cluster(device), (batches[0][0],), example_target=batches[0][1],
                                loss_fn=gpt_loss, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        fresh.load(folder)
        got = (fresh.full_state_dict(), fresh.full_optimizer_state_dict())
    same = all(torch.equal(got[i][k].cpu(), v.cpu()) for i in range(2) for k, v in want[i].items())
    print(f"checkpoint on {device}: asynchronous save returned in {staged_s * 1e3:.0f} ms; reload "
          f"{'bit for bit' if same else 'DIFFERS'} ({len(want[0])} tensors, {len(want[1])} optimizer states)")
    fresh.close()
    return same


def speed(device: str, steps: int, spec: str | None = None) -> None:
    import autopar
    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    cfg = GPTConfig(50304, 1024, 12, 12, 768) if device == "cuda" else GPTConfig(256, 64, 2, 4, 128)
    batch = 8 if device == "cuda" else 8
    precision = "bf16-mixed" if device == "cuda" else "fp32"
    torch.manual_seed(0)
    model = GPT(cfg)
    eager = copy.deepcopy(model).to(device)
    x, t = (v.to(device) for v in example_batch(cfg, batch))
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    pm = autopar.compile(model, _cluster(device), (x,), example_target=t, loss_fn=gpt_loss, optimizer=make_opt,
                         precision=precision)
    opt = make_opt(list(eager.parameters()))

    def eager_step():
        opt.zero_grad(set_to_none=True)
        if precision == "bf16-mixed":
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = gpt_loss(eager(x), t)
        else:
            loss = gpt_loss(eager(x), t)
        loss.backward()
        opt.step()
        return float(loss)

    def timed(fn):
        out = []
        for i in range(steps + 3):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if i >= 3:
                out.append(time.perf_counter() - t0)
        return statistics.median(out)

    ta, tb = [], []
    for _ in range(2):
        ta.append(timed(lambda: pm.train_step(x, target=t)))
        tb.append(timed(eager_step))
    a, b = min(ta), min(tb)
    print(f"speed on {device}: GPT {cfg.n_layer}x{cfg.n_embd} batch {batch} seq {cfg.block_size} {precision}: "
          f"autopar {a * 1e3:.2f} ms/step, eager {b * 1e3:.2f} ms/step, ratio {a / b:.3f}; "
          f"predicted {pm.plan.predicted.step_time_s * 1e3:.2f} ms ({pm.plan.cluster.name})")
    if spec is not None:
        with open(spec) as f:
            calibrated = autopar.Cluster.from_json(f.read())
        priced = autopar.plan(GPT(cfg), calibrated, (x,), example_target=t, loss_fn=gpt_loss, optimizer="adamw",
                              precision=precision)
        p = priced.predicted.step_time_s
        print(f"  with the calibrated spec {spec}: predicted {p * 1e3:.2f} ms, measured / predicted {a / p:.2f}")


def gpu_suite(timeout_s: float = 600.0) -> bool:
    """Run ``python -m pytest -m gpu tests/test_gpu.py`` in a child process (its own CUDA context
    and process groups) and print one row per test; True when none failed."""
    import os
    import pathlib
    import subprocess
    import tempfile
    import xml.etree.ElementTree as ET

    repo = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo)] + [p for p in [env.get("PYTHONPATH")] if p])
    with tempfile.TemporaryDirectory() as folder:
        report = os.path.join(folder, "gpu.xml")
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", str(repo / "tests" / "test_gpu.py"), "-q",
               "-p", "no:cacheprovider", f"--junitxml={report}"]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s)
            code, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            code, tail = None, f"the suite ran past {timeout_s:g} s"
        wall = time.perf_counter() - t0
        rows = []
        if os.path.exists(report):
            for case in ET.parse(report).getroot().iter("testcase"):
                outcome, detail = "passed", ""
                for child in case:
                    if child.tag in ("failure", "error", "skipped"):
                        outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[child.tag]
                        detail = (child.get("message") or child.text or "").strip().splitlines()[0][:100] \
                            if (child.get("message") or child.text or "").strip() else ""
                rows.append((case.get("name", "?"), outcome, float(case.get("time", 0.0)), detail))
    print(f"\nGPU suite: {' '.join(cmd[1:5])} tests/test_gpu.py ({wall:.0f} s)")
    width = max([len(r[0]) for r in rows] + [4])
    print(f"  {'test':<{width}}  {'result':<7}  {'s':>6}  detail")
    for name, outcome, seconds, detail in rows:
        print(f"  {name:<{width}}  {outcome:<7}  {seconds:>6.1f}  {detail}")
    if not rows or code not in (0, 5) and not any(r[1] in ("FAILED", "ERROR") for r in rows):
        print(tail)
    return code == 0 and all(r[1] not in ("FAILED", "ERROR") for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--spec", default=None, help="a cluster spec JSON (autopar calibrate's) to price the speed model with")
    ap.add_argument("--no-suite", action="store_true", help="leave out the GPU test suite (python -m pytest -m gpu)")
    a = ap.parse_args()
    if a.device is None:
        print("gpu_check: no CUDA device here; run it on a GPU machine (or --device cpu for the CPU path); "
              "the GPU suite (python -m pytest -m gpu) skips itself without CUDA")
        return 0
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'}")
    err, pm, batches = parity(a.device)
    saved_ok = checkpoint_roundtrip(pm, batches, a.device)
    pm.close()
    speed(a.device, a.steps, a.spec)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    suite_ok = a.no_suite or gpu_suite()
    return 0 if err <= 1e-5 and saved_ok and suite_ok else 1


if __name__ == "__main__":
    sys.exit(main())
