"""Every plan of a fixed list of cases, as (fingerprint, sha256 of ``to_json()``): a refactor of the
planner must leave each line unchanged (issue 45: "plans byte-identical before and after").

Cases: the example GPT and MLP (``autopar.testing.parity.build_case``) on ``Cluster.local(2)`` and
``local(4)`` (uncalibrated) under several constraints (free, dp, tp, dp x tp, ZeRO-3, recompute,
pipelines, context parallel, HSDP), every model of ``examples/real_models.py`` on ``local(4)``
free and dp=2 x tp=2 (``--small``), and the large shapes of ``plan_speed.py`` (GPT-3 175B on
1,024 A100, single-stage and free; 1T on 3,072; Llama-3.1-8B on 16 x 8 H100; Mixtral-8x7B on 64
H100), each in a fresh subprocess (``--large``). A case with no plan prints the error's hash.

Usage::

    python benchmarks/plan_fingerprints.py --small > before_small.txt
    python benchmarks/plan_fingerprints.py --large > before_large.txt
    diff before_small.txt after_small.txt
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXAMPLE_CONSTRAINTS = {
    2: ["", "dp=2", "tp=2", "zero=3", "recompute=True", "pp=2", "pp=2,microbatches=4", "cp=2"],
    4: ["", "dp=2,tp=2", "dp=4", "tp=4", "pp=2", "pp=2,dp=2,recompute=False", "pp=4,microbatches=4",
        "zero=3,dp=4", "hsdp=2", "cp=2", "cp=2,dp=2"],
}
LARGE = ["gpt96-n128", "gpt96-n128-pp1", "gpt1t-n384", "llama3-8b-n16", "mixtral-8x7b-n8", "llama3-8b-s8192"]


def _constraints(text: str):
    import autopar

    kw = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        kw[k] = {"True": True, "False": False}.get(v, None) if v in ("True", "False") else int(v)
    return autopar.Constraints(**kw)


def _line(name: str, plan_or_exc) -> str:
    if isinstance(plan_or_exc, Exception):
        h = hashlib.sha256(f"{type(plan_or_exc).__name__}: {plan_or_exc}".encode()).hexdigest()[:16]
        return f"{name:<48} error {type(plan_or_exc).__name__} {h}"
    p = plan_or_exc
    return f"{name:<48} {p.fingerprint} {hashlib.sha256(p.to_json().encode()).hexdigest()[:16]}"


def _plan(model, cluster, x, loss, y, constraints):
    import autopar

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.plan(model, cluster, x, loss_fn=loss, example_target=y, constraints=constraints)
    except autopar.AutoparError as exc:
        return exc


def small() -> None:
    import autopar
    from autopar.testing.parity import build_case
    from examples.real_models import REAL_MODELS

    for case in ("gpt", "mlp"):
        model, batches, loss = build_case(case)
        x, y = batches[0]
        x = x if isinstance(x, tuple) else (x,)
        for n, cs in EXAMPLE_CONSTRAINTS.items():
            for c in cs:
                if case == "mlp" and "cp" in c:
                    continue
                plan = _plan(model, autopar.Cluster.local(n, calibrated=False), x, loss, y, _constraints(c))
                print(_line(f"{case} local({n}) {c or 'free'}", plan), flush=True)
    for name in REAL_MODELS:
        model, batches, loss = build_case("real:" + name)
        x, y = batches[0]
        x = x if isinstance(x, tuple) else (x,)
        for c in ("", "dp=2,tp=2"):
            plan = _plan(model, autopar.Cluster.local(4), x, loss, y, _constraints(c))
            print(_line(f"real:{name} local(4) {c or 'free'}", plan), flush=True)


def large(names: list[str]) -> None:
    for name in names:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plan_speed.py"), "--worker", name],
                              capture_output=True, text=True, cwd=ROOT)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            print(f"{name:<48} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:100]}", flush=True)
            continue
        r = json.loads(lines[-1])
        what = f"{r.get('fingerprint')} {r.get('json_sha256')}" if r.get("ok") else \
            "error " + hashlib.sha256(r.get("detail", "").encode()).hexdigest()[:16]
        print(f"{name:<48} {what}   (cpu {r['cpu_s']:.2f} s, wall {r['total_s']:.2f} s, {r.get('outcome')})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--only", help="comma-separated large configuration names")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    if args.small:
        small()
    if args.large:
        large(args.only.split(",") if args.only else LARGE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
