"""``ParallelModel`` is composed of named parts, not mixins (issue 45 item 3, ``ARCHITECTURE.md``)."""
from __future__ import annotations

from pathlib import Path

import torch

from autopar.runtime.parallel_model import ParallelModel

RUNTIME = Path(__file__).resolve().parents[1] / "autopar" / "runtime"


def test_parallel_model_inherits_only_torch_module():
    assert ParallelModel.__mro__[1:] == torch.nn.Module.__mro__, [c.__name__ for c in ParallelModel.__mro__]


def test_no_mixin_modules_are_left_in_the_runtime():
    assert sorted(p.name for p in RUNTIME.glob("*_methods.py")) == []
