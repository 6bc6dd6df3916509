"""The test harness, out of the product's runtime: single-device parity (``parity``), memory
fidelity (``fidelity``), the small test models (``zoo``) and the hand-written baselines that
``autopar bench`` and the benchmarks run beside autopar (``baselines``).

It sits above the runtime in the layer contract (pyproject.toml), below ``bench``: it may use the
runtime, the runtime never imports it.
"""
