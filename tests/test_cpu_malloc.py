"""glibc's malloc set for CPU training (``runtime.cpu_malloc``): large tensors stop page-faulting."""
import os
import subprocess
import sys

import pytest

from autopar.runtime.cpu_malloc import why_untuned

# in a fresh process, after 3 warm-up steps: the median page faults of 11 steps that each allocate,
# touch and free a 40 MiB tensor
# (above glibc's own 32 MiB ceiling for its dynamic threshold: mmapped every time by default)
_PROBE = """
import resource, sys, torch
from autopar.runtime.cpu_malloc import tune_cpu_malloc
from autopar.runtime.launch import init_distributed
if sys.argv[1] == "tune":
    init_distributed("gloo", 1)  # what compile, bench and calibrate call first
tuned = tune_cpu_malloc() if sys.argv[1] == "tune" else False
for _ in range(3):
    torch.empty(10 << 20).fill_(1.0)
faults = []
for _ in range(11):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(10 << 20).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(tuned, sorted(faults)[5])
"""


def _faults(mode: str, **env) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "AUTOPAR_CPU_MALLOC"}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                         env={**clean, **env}).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_tuned_malloc_reuses_large_blocks_instead_of_faulting_fresh_pages():
    tuned, tuned_faults = _faults("tune")
    _, default_faults = _faults("default")
    refused, refused_faults = _faults("tune", AUTOPAR_CPU_MALLOC="system")
    pages = (40 << 20) // 4096
    assert default_faults > pages // 2  # glibc's default maps (and faults) every 40 MiB block
    assert tuned and tuned_faults < pages // 20  # reused from the heap (this VM reclaims some now and then)
    assert not refused and refused_faults > pages // 2


def test_user_choices_leave_malloc_alone():
    assert why_untuned({}) is None
    assert why_untuned({"AUTOPAR_CPU_MALLOC": "system"}) == "AUTOPAR_CPU_MALLOC=system"
    assert why_untuned({"MALLOC_TRIM_THRESHOLD_": "0"}) == "MALLOC_TRIM_THRESHOLD_ is set"
    assert why_untuned({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"}) == "GLIBC_TUNABLES sets malloc"
    assert why_untuned({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "jemalloc is preloaded"
