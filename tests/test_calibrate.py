"""`autopar calibrate`: the fits recover known parameters, the fitted spec prices what was
measured, `Cluster.local` reads the spec, bad specs are refused, and the command runs end to end."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import autopar
from autopar.calibration import combine_ranks, fit_cluster
from autopar.calibration.training_probe import probe_units
from autopar.calibration.fit import collective_skew, exposed_share, fit_collective, fit_compute, ring_terms
from autopar.cluster import Cluster, LinkSpec, calibration_path
from autopar.cost_models.communication import CommGroup, blocking_collective_time, collective_time
from autopar.cost_models.compute import MEMORY_EFFICIENCY
from autopar.errors import AutoparError, ClusterSpecError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _noisy(t: float, rng, spread: float = 0.02) -> float:
    return t * (1.0 + rng.uniform(-spread, spread))


def test_fit_compute_recovers_overhead_rate_and_bandwidth_from_noisy_timings():
    rng = np.random.default_rng(0)
    overhead, rate, bw = 4e-6, 3e10, 8e9
    mm = [(f, _noisy(overhead + f / rate, rng)) for f in np.geomspace(1e4, 1e9, 8)]
    st = [(b, _noisy(overhead + b / bw, rng)) for b in np.geomspace(1e3, 1e8, 6)]
    att = [(f, overhead + f / 1e10) for f in (1e6, 1e8)]
    fit = fit_compute(mm, st, att)
    assert fit.overhead == pytest.approx(overhead, rel=0.1)
    assert fit.matmul_rate == pytest.approx(rate, rel=0.05)
    assert fit.memory_bandwidth == pytest.approx(bw, rel=0.05)
    assert fit.attention_rate == pytest.approx(1e10, rel=0.01)  # with the fitted (noisy) overhead held


def test_fit_compute_drops_an_intercept_the_data_puts_below_zero():
    # pure throughput with a slight negative bias at small sizes: the overhead is 0, not negative
    mm = [(f, f / 1e10 * (0.9 if f < 1e6 else 1.0)) for f in (1e5, 1e6, 1e7, 1e8)]
    st = [(b, b / 1e9) for b in (1e5, 1e7)]
    fit = fit_compute(mm, st)
    assert fit.overhead == 0.0
    assert fit.matmul_rate == pytest.approx(1e10, rel=0.1)


@pytest.mark.parametrize("kind", KINDS)
def test_fitted_collective_prices_exactly_what_was_measured(kind):
    """Timings made by the ring model with a known (latency, bandwidth): the fit recovers them,
    and a cluster carrying the fit prices every measured point as measured."""
    lat, bw = 80e-6, 1.5e9
    points = []
    for p in (2, 4):
        hops, factor = ring_terms(kind, p)
        for n in (4096.0, 65536.0, 1 << 20, 1 << 23):
            points.append((p, n, hops * lat + factor * n / bw))
    fit = fit_collective(kind, points)
    assert fit.latency == pytest.approx(lat, rel=1e-6) and fit.bandwidth == pytest.approx(bw, rel=1e-6)
    link = LinkSpec(bandwidth=9e9, latency=1e-6, collectives=((kind, fit.latency, fit.bandwidth),))
    cluster = dataclasses.replace(Cluster.local(4), intra_node=link, inter_node=link)
    for p, n, t in points:
        assert collective_time(kind, n, CommGroup(p, p), cluster) == pytest.approx(t, rel=1e-6)
    other = next(k for k in KINDS if k != kind)  # an unmeasured kind keeps the link's own figures
    hops, factor = ring_terms(other, 2)
    assert collective_time(other, 1e6, CommGroup(2, 2), cluster) == pytest.approx(hops * 1e-6 + factor * 1e6 / 9e9, rel=1e-6)


def test_exposed_share_is_clipped_to_a_fraction():
    assert exposed_share(1.0, 0.5, 1.25) == 0.5
    assert exposed_share(1.0, 0.5, 0.9) == 0.0  # faster together than compute alone: noise, fully hidden
    assert exposed_share(1.0, 0.5, 2.0) == 1.0
    with pytest.raises(AutoparError, match="positive"):
        exposed_share(1.0, 0.0, 1.0)


def test_collective_skew_is_what_a_collective_waits_beyond_its_own_time():
    """The fit: the tiny collective after compute less the compute and the collective alone (at
    least 0); the price: every blocking collective call pays it once (an asynchronous one hides
    it), a group of one or zero bytes not."""
    assert collective_skew(1e-3, 2e-4, 1.5e-3) == pytest.approx(3e-4)
    assert collective_skew(1e-3, 2e-4, 1.1e-3) == 0.0  # faster than apart: noise, no skew
    base = Cluster.local(4, calibrated=False)
    skewed = dataclasses.replace(base, collective_skew_s=3e-4)
    for kind in KINDS:
        for nbytes in (4.0, 1e6):
            plain = collective_time(kind, nbytes, CommGroup(4, 4), base)
            assert blocking_collective_time(kind, nbytes, CommGroup(4, 4), skewed) == pytest.approx(plain + 3e-4)
            assert collective_time(kind, nbytes, CommGroup(4, 4), skewed) == pytest.approx(plain)
        assert blocking_collective_time(kind, 0, CommGroup(4, 4), skewed) == 0.0
        assert blocking_collective_time(kind, 1e6, CommGroup(1, 1), skewed) == 0.0
    with pytest.raises(ClusterSpecError, match="collective_skew_s"):
        dataclasses.replace(base, collective_skew_s=-1e-3)
    with pytest.raises(ClusterSpecError, match="pipeline_microbatch_s"):
        dataclasses.replace(base, pipeline_microbatch_s=float("nan"))
    assert Cluster.from_json(skewed.to_json()) == skewed


def test_measured_collective_times_are_interpolated_where_the_group_size_was_measured():
    """A kind measured at a group size is priced by its measured times: exactly at the measured
    sizes, log-log between them, the smallest size's time below, the last segment's cost per byte
    above; another group size falls back to the fitted latency and bandwidth. Bad rows are refused."""
    table = (("all_reduce", 2, 64.0, 5e-4), ("all_reduce", 2, 4096.0, 1.6e-3), ("all_reduce", 2, 4e6, 5e-3),
             ("all_reduce", 2, 16e6, 11e-3))
    link = LinkSpec(bandwidth=1e9, latency=1e-4, collectives=(("all_reduce", 1e-4, 1e9),), collective_table=table)
    base = Cluster.local(4, calibrated=False)
    c = dataclasses.replace(base, intra_node=link)
    for _, p, b, t in table:
        assert collective_time("all_reduce", b, CommGroup(2, 2), c) == pytest.approx(t)
    mid = collective_time("all_reduce", 64.0 * 8, CommGroup(2, 2), c)
    assert 5e-4 < mid < 1.6e-3 and mid == pytest.approx(math.exp((math.log(5e-4) + math.log(1.6e-3)) / 2))
    assert collective_time("all_reduce", 4.0, CommGroup(2, 2), c) == pytest.approx(5e-4)
    assert collective_time("all_reduce", 28e6, CommGroup(2, 2), c) == pytest.approx(11e-3 + 12e6 * 6e-3 / 12e6)
    fitted = 2 * 3 / 4 * 1e6 / 1e9 + 2 * 3 * 1e-4  # 4 ranks: not measured, alpha-beta
    assert collective_time("all_reduce", 1e6, CommGroup(4, 4), c) == pytest.approx(fitted)
    assert Cluster.from_json(c.to_json()) == c
    # a size measured twice counts once (its median); a last size faster than the one before gives
    # no cost per byte to extrapolate with: beyond it, the fitted latency and bandwidth
    noisy = dataclasses.replace(link, collective_table=table[:2] + (("all_reduce", 2, 4e6, 5e-3),
                                                                    ("all_reduce", 2, 4e6, 7e-3),
                                                                    ("all_reduce", 2, 16e6, 4e-3)))
    assert noisy.measured_time("all_reduce", 2, 4e6) == pytest.approx(4e-3)  # capped by the larger size
    assert noisy.measured_time("all_reduce", 2, 1e9) is None
    c2 = dataclasses.replace(base, intra_node=noisy)
    assert collective_time("all_reduce", 1e9, CommGroup(2, 2), c2) == pytest.approx(2 * 1 / 2 * 1e9 / 1e9 + 2 * 1e-4)
    with pytest.raises(ClusterSpecError, match="collective_table"):
        LinkSpec(bandwidth=1e9, latency=1e-4, collective_table=(("all_reduce", 1, 64.0, 1e-3),))


def test_only_a_collectives_waiting_hides_where_ranks_share_cores_with_it():
    """``collective_latency`` is the fabric's time for one byte (the smallest measured size where
    a table is calibrated; the latency terms of alpha-beta elsewhere), without the host's time.
    ``exposed_seconds``: the calibrated share (1.0 where CPU ranks fill the cores) stays exposed
    of what is not waiting, and the waiting hides behind compute up to the window's efficiency.
    ``bucketed_latency``: a model that fills one bucket hides none of it (the last bucket starts
    when backward ends), one of n buckets hides (n - 1) / n."""
    from torch.distributed.tensor.placement_types import Partial, Replicate

    from autopar.cost_models.communication import collective_latency
    from autopar.cost_models.memory import optimizer_spec, precision_policy
    from autopar.planner.costing import CostContext, bucketed_latency, bucketed_time
    from autopar.planner.overlap import OVERLAP_EFFICIENCY, exposed_seconds
    from autopar.runtime.grad_sync import BUCKET_BYTES
    from autopar.sync_settings import FIRST_BUCKET_BYTES
    from autopar.trace import TensorMeta

    table = (("all_reduce", 2, 64.0, 5e-4), ("all_reduce", 2, 4e6, 5e-3))
    link = LinkSpec(bandwidth=1e9, latency=1e-4, collectives=(("all_reduce", 1e-4, 1e9),), collective_table=table)
    base = Cluster.local(4, calibrated=False)
    c = dataclasses.replace(base, intra_node=link, device=dataclasses.replace(base.device, collective_host_s=2e-4))
    assert collective_latency("all_reduce", CommGroup(2, 2), c) == pytest.approx(5e-4)
    assert collective_latency("all_reduce", CommGroup(4, 4), c) == pytest.approx(2 * 3 * 1e-4, rel=1e-4)  # alpha-beta
    assert collective_latency("all_reduce", CommGroup(1, 1), c) == 0.0
    # 10 ms overlappable, 3 ms of it waiting, 20 ms of compute to hide behind
    f, b = exposed_seconds(20e-3, 20e-3, 10e-3, 10e-3, 0.0, 1, 1.0, 3e-3, 3e-3, 0.0)
    assert f == pytest.approx(7e-3) and b == pytest.approx(7e-3)
    assert exposed_seconds(2e-3, 0.0, 10e-3, 0.0, 0.0, 1, 1.0, 3e-3)[0] == pytest.approx(10e-3 - OVERLAP_EFFICIENCY * 2e-3)
    assert exposed_seconds(20e-3, 0.0, 10e-3, 0.0, 0.0, 1, 0.05, 3e-3)[0] == pytest.approx(0.05 * 7e-3)
    assert exposed_seconds(20e-3, 0.0, 10e-3, 0.0, 0.0, 1, 1.0)[0] == pytest.approx(10e-3)  # nothing waits
    meta = TensorMeta((256, 1024), torch.float32)  # 1 MiB
    summed = ((Partial(),), (Replicate(),))
    for buckets in (1, 4):
        ctx = CostContext((4,), ("dp",), c, precision_policy("fp32"), optimizer_spec("adam"),
                          grad_bytes=float(buckets * BUCKET_BYTES))
        # the runtime's buckets of these bytes: the first at FIRST_BUCKET_BYTES, then BUCKET_BYTES each
        cut = 1 + -(-(buckets * BUCKET_BYTES - FIRST_BUCKET_BYTES) // BUCKET_BYTES)
        share = meta.nbytes / (buckets * BUCKET_BYTES / cut)  # of one (mean) bucket's collective
        assert bucketed_latency(meta, *summed, ctx) == pytest.approx(
            (1 - 1 / cut) * share * collective_latency("all_reduce", CommGroup(4, 4), c))
        assert bucketed_time(meta, *summed, ctx)["all_reduce"] > bucketed_latency(meta, *summed, ctx)


def _synthetic_measurements(world: int = 4) -> dict:
    """Two ranks' measurements made by known parameters (rank 1 slower by 10% on compute)."""
    overhead, rate, bf16, bw, att = 3e-6, 4e10, 1e10, 6e9, 8e9
    ranks = []
    for slow in (1.0, 1.1):
        comp = {"matmul": {"float32": [(f, slow * (overhead + f / rate)) for f in (1e5, 1e6, 1e7, 1e8)],
                           "bfloat16": [(f, slow * (overhead + f / bf16)) for f in (1e5, 1e6, 1e7, 1e8)]},
                "attention": [(f, slow * (overhead + f / att)) for f in (1e6, 1e7)],
                "stream": [(b, slow * (overhead + b / bw)) for b in (1e4, 1e6, 1e8)],
                # the shape grid as torch.mm and as nn.Linear's forward (here twice as slow)
                "gemm": [(m, 64, 64, slow * 2.0 * m * 64 * 64 / rate) for m in (8, 64)],
                "gemm_linear": [(m, 64, 64, slow * 4.0 * m * 64 * 64 / rate) for m in (8, 64)],
                # convolutions' implicit GEMMs: forward at a tenth of the matmul rate, backward 3x it
                "conv": [(m, 36, 16, slow * 20.0 * m * 36 * 16 / rate, slow * 80.0 * m * 36 * 16 / rate)
                         for m in (256, 1024)]}
        coll = {k: [(p, n, ring_terms(k, p)[0] * 50e-6 + ring_terms(k, p)[1] * n / 2e9)
                    for p in (2, world) for n in (1e4, 1e6, 1e7)] for k in KINDS}
        fb_units, up_units = probe_units()
        flops = 1e6
        numel = 1 << 20  # SGD: 0.2 ns per element; AdamW: 0.2 + 2 x 1.5 ns
        training = {"fwd_bwd_s": slow * (fb_units * 30e-6 + flops / rate), "step_s": slow * up_units * 5e-6,
                    "matmul_flops": flops, "params": 100, "update_numel": numel,
                    "sgd_update_s": slow * (2 * 5e-6 + numel * 0.2e-9),
                    "adamw_update_s": slow * (8 * 5e-6 + numel * 3.2e-9),
                    # its gradient buffer: zeroed at 0.4 ns per element, a gradient added at 0.6
                    "grad_zero_s": slow * numel * 0.4e-9, "grad_add_s": slow * numel * 0.6e-9}
        # a stage-to-stage message: 100 us + bytes / 1 GB/s (pairs only)
        coll["send_recv"] = [(2, n, 100e-6 + n / 1e9) for n in (64.0, 1e4, 1e6)]
        ranks.append({"world": world, "device_type": "cpu", "compute": comp, "collectives": coll, "training": training,
                      # the overlap probe's median round (share 0.9) beside every round's share
                      "overlap": {"comm_s": 0.01, "compute_s": 0.02, "together_s": 0.029, "shares": [0.3, 0.9, 1.0]},
                      # the waiting probe's passes: median 0.8 (each pass's share the ranks' mean)
                      "waiting": {"comm_s": 5e-4, "compute_s": 1.5e-3, "together_s": 1.9e-3,
                                  "shares": [0.6, 0.8, 1.0 - 0.1 * len(ranks)]},
                      # the speed probe's windows: 2.0 to 2.4 ms (the slowest rank's per window)
                      "speed": [2e-3, 2.2e-3 + 2e-4 * len(ranks), 2.1e-3],
                      # per kind (alone, after 1 ms of compute): waits of 0.3, 0.5 and 0.1 ms, median 0.3;
                      # window by window (each pass's own): median 0.2 ms, what is kept
                      "skew": {"compute_s": 1e-3, "kinds": {"all_reduce": [2e-4, 1.5e-3], "all_gather": [1e-4, 1.6e-3],
                                                            "all_to_all": [1e-4, 1.2e-3]},
                               "excess": [1e-4, 4e-4, -2e-4, 3e-4, 2e-4]},
                      # 1F1B of small stages: 1 ms + 0.5 ms per microbatch, of which 0.1 ms compute, by
                      # the medians; pass by pass (each slope less its own compute), what is kept: median 0.6 ms
                      "pipeline": {"m": [2, 8], "step_s": [2e-3, 5e-3], "compute_s": 1e-4,
                                   "excess": [2e-4, 6e-4, 9e-4, 7e-4, 5e-4]},
                      # the host's time per collective: 0.1 and 0.2 ms on the two ranks, median 0.15
                      "collective_host_s": 1e-4 * (1 + len(ranks)),
                      # and per byte: 0.2 and 0.4 ns, median 0.3
                      "collective_host_byte_s": 2e-10 * (1 + len(ranks))})
    return combine_ranks(ranks)


def test_fit_cluster_holds_every_fitted_figure_and_round_trips_through_json():
    base = Cluster.local(4, calibrated=False)
    c = fit_cluster(_synthetic_measurements(), base, "test")
    d = c.device
    # the median of two ranks (1.0x and 1.1x) is their mean: 1.05x the times
    assert d.op_overhead == pytest.approx(30e-6 * 1.05, rel=1e-3)
    assert d.update_op_overhead == pytest.approx(5e-6 * 1.05, rel=1e-3)
    assert d.update_element_s == pytest.approx((0.2e-9 * 1.05, 1.5e-9 * 1.05), rel=1e-3)
    assert d.grad_buffer_element_s == pytest.approx((0.4e-9 * 1.05, 0.6e-9 * 1.05), rel=1e-3)
    assert d.peak_flops.fp32 == pytest.approx(4e10 / 1.05, rel=1e-3) and d.matmul_efficiency == 1.0
    assert d.peak_flops.bf16 == pytest.approx(1e10 / 1.05, rel=1e-3)
    assert d.memory_bandwidth * MEMORY_EFFICIENCY == pytest.approx(6e9 / 1.05, rel=1e-3)
    assert d.attention_efficiency == pytest.approx(8e9 / 4e10, rel=1e-3)
    assert c.intra_node.collective("all_to_all") == pytest.approx((50e-6, 2e9), rel=1e-6)
    assert c.exposed_comm_share == pytest.approx(0.9)
    assert c.exposed_latency_share == pytest.approx(0.8)  # the median pass of (0.6, 0.8, 0.95)
    # windows 2.0, 2.1, 2.4 ms: 20th / 80th percentiles 2.04 and 2.28 ms
    assert any(s.startswith("machine speed while calibrating") and "percentile of their times 1.12x" in s
               for s in c.sources), c.sources
    assert any("the median round of 0.30, 0.90, 1.00" in s for s in c.sources), c.sources
    assert c.collective_skew_s == pytest.approx(2e-4)  # the median of the paired windows
    before = _synthetic_measurements()
    del before["skew"]["excess"]  # measured before the paired windows: the median over kinds
    assert fit_cluster(before, base, "test").collective_skew_s == pytest.approx(3e-4)
    # per microbatch: the passes' median excess (0.6 ms) less two 64-byte messages (2 x 100.064 us)
    assert c.pipeline_microbatch_s == pytest.approx(0.6e-3 - 2 * (100e-6 + 64 / 1e9), rel=1e-6)
    assert c.intra_node.measured_time("send_recv", 2, 1e4) == pytest.approx(100e-6 + 1e4 / 1e9, rel=1e-3)
    assert any("all_reduce" in s for s in c.sources) and c.device.memory_bytes == base.device.memory_bytes
    assert [r[:3] for r in d.matmul_table] == [r[:3] for r in d.linear_table] == [(8, 64, 64), (64, 64, 64)]
    assert [b[3] / a[3] for a, b in zip(d.matmul_table, d.linear_table)] == pytest.approx([2.0, 2.0])
    assert d.collective_host_s == pytest.approx(1.5e-4) and d.collective_host_byte_s == pytest.approx(3e-10)
    # the convolutions: (m, k, n, forward s, backward s), the backward the difference of the two windows
    assert [r[:3] for r in d.conv_table] == [(256, 36, 16), (1024, 36, 16)]
    assert [r[3] for r in d.conv_table] == pytest.approx([1.05 * 20.0 * m * 36 * 16 / 4e10 for m in (256, 1024)])
    assert [r[4] / r[3] for r in d.conv_table] == pytest.approx([3.0, 3.0])
    assert any("2 fp32 convolutions" in s for s in c.sources), c.sources
    assert Cluster.from_json(c.to_json()) == c


def test_every_collective_pays_the_hosts_own_time_once():
    """``DeviceSpec.collective_host_s``: added once to every collective that moves bytes between
    ranks (blocking or not), not to a group of one or to zero bytes; ``collective_host_byte_s``
    per byte a reshard copies around its collectives (``reshard_copy_bytes``), not to a gradient
    bucket's all-reduce in place; both validated and kept in JSON."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    from autopar.cost_models.memory import optimizer_spec, precision_policy
    from autopar.planner.costing import CostContext, bucketed_time, reshard_time
    from autopar.trace import TensorMeta

    base = Cluster.local(4, calibrated=False)
    hosted = dataclasses.replace(base, device=dataclasses.replace(base.device, collective_host_s=2e-4))
    for kind in KINDS:
        for nbytes in (4.0, 1e6):
            for price in (collective_time, blocking_collective_time):
                assert price(kind, nbytes, CommGroup(4, 4), hosted) == pytest.approx(
                    price(kind, nbytes, CommGroup(4, 4), base) + 2e-4)
        assert collective_time(kind, 0, CommGroup(4, 4), hosted) == 0.0
        assert collective_time(kind, 1e6, CommGroup(1, 1), hosted) == 0.0
    copying = dataclasses.replace(base, device=dataclasses.replace(base.device, collective_host_byte_s=3e-10))
    meta = TensorMeta((64, 1024), torch.float32)
    ctx = {c: CostContext((4,), ("tp",), c, precision_policy("fp32"), optimizer_spec("adam")) for c in (base, copying)}
    # a gather of dim 1 concatenates its ranks' blocks (the output's bytes); of dim 0, nothing
    gather = {c: reshard_time(meta, (Shard(1),), (Replicate(),), ctx[c]) for c in (base, copying)}
    assert gather[copying]["all_gather"] == pytest.approx(gather[base]["all_gather"] + 3e-10 * meta.nbytes)
    front = {c: reshard_time(meta, (Shard(0),), (Replicate(),), ctx[c]) for c in (base, copying)}
    assert front[copying] == front[base]
    # an all-reduce clones its buffer to reduce it in place
    reduced = {c: reshard_time(meta, (Partial(),), (Replicate(),), ctx[c]) for c in (base, copying)}
    assert reduced[copying]["all_reduce"] == pytest.approx(reduced[base]["all_reduce"] + 3e-10 * meta.nbytes)
    summed = {c: bucketed_time(meta, (Partial(),), (Replicate(),), ctx[c]) for c in (base, copying)}
    assert summed[base]["all_reduce"] > 0 and summed[copying] == summed[base]
    with pytest.raises(ClusterSpecError, match="collective_host_s"):
        dataclasses.replace(base.device, collective_host_s=-1e-4)
    with pytest.raises(ClusterSpecError, match="collective_host_byte_s"):
        dataclasses.replace(base.device, collective_host_byte_s=1e-3)
    assert Cluster.from_json(hosted.to_json()) == hosted


def test_the_hosts_time_per_collective_is_fitted_per_byte_and_per_call():
    """``host_time_fit``: per reshard, the slope over its two sizes is the time per byte, what is
    left at the smaller size the time per call; the median of each over the reshards, and a
    reshard faster at its larger size gives a slope of 0, not a negative price."""
    from autopar.calibration.host_probe import host_time_fit

    fixed, per_byte = 50e-6, 2e-10
    exact = [(fixed + per_byte * b, fixed + per_byte * 32 * b, b, 32 * b) for b in (8e3, 16e3, 32e3)]
    fit = host_time_fit(exact)
    assert fit["collective_host_s"] == pytest.approx(fixed) and fit["collective_host_byte_s"] == pytest.approx(per_byte)
    noisy = host_time_fit([(2e-4, 1e-4, 1e3, 1e5)])
    assert noisy == {"collective_host_s": 2e-4, "collective_host_byte_s": 0.0}


def test_no_spare_cpu_core_means_no_overlap():
    """On CPU, with a process on every core, gloo's threads find no idle core to move bytes while
    the ranks compute: the exposed share is 1 whatever the short overlap probe caught; with cores
    to spare the probe's share stands."""
    measured = _synthetic_measurements()
    crowded = fit_cluster(dict(measured, cores=2, local_world=4), Cluster.local(4, calibrated=False))
    assert crowded.exposed_comm_share == 1.0
    assert any("4 processes on 2 CPU core(s)" in s for s in crowded.sources), crowded.sources
    roomy = fit_cluster(dict(measured, cores=16, local_world=4), Cluster.local(4, calibrated=False))
    assert roomy.exposed_comm_share == pytest.approx(0.9)


def test_the_planner_counts_the_ops_the_calibration_counts():
    """The training probe's measurements (made here by known constants: 30 us per op of forward
    and backward, 5 us per op of the update, plus arithmetic) fit those constants exactly; then a
    model that is not the probe (6 layers of width 32 over 16 rows, not 24 of 16 over 8) planned
    on the fitted spec pays them for exactly the ops ``probe_units``' rules count in it (a linear
    one op forward and ``BWD_OPS["matmul"]`` backward, a GELU one and ``BWD_OPS["pointwise"]``, the
    loss's sum one and one; ``update_ops(2)`` per parameter): its predicted compute less the same
    plan's with both constants at zero. A planner that charged the per-op constants for other ops
    than the calibration divided them by would miss here (the probe itself only checks the sum)."""
    from autopar.calibration.training_probe import PROBE_LAYERS, PROBE_WIDTH
    from autopar.planner.costing import BWD_OPS, update_ops

    measured = _synthetic_measurements()
    measured.pop("collectives"), measured.pop("overlap")
    one = fit_cluster(dict(measured, world=1), Cluster.local(1, calibrated=False))
    per_op, per_update_op = 1.05 * 30e-6, 1.05 * 5e-6  # the mean of the two ranks' (1.0x and 1.1x)
    assert one.device.op_overhead == pytest.approx(per_op) and one.device.update_op_overhead == pytest.approx(per_update_op)
    free = dataclasses.replace(one, device=dataclasses.replace(one.device, op_overhead=0.0, update_op_overhead=0.0))
    layers, width, rows = 6, 32, 16
    assert (layers, width) != (PROBE_LAYERS, PROBE_WIDTH)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    x = torch.randn(rows, width)
    compute = [autopar.plan(model, c, x, loss_fn=lambda out, _: out.sum(), example_target=torch.zeros(()),
                            optimizer="adamw").predicted.compute_s for c in (one, free)]
    fb_units = layers * ((1 + BWD_OPS["matmul"]) + (1 + BWD_OPS["pointwise"])) + 2
    up_units = update_ops(2) * 2 * layers
    assert compute[0] - compute[1] == pytest.approx(fb_units * per_op + up_units * per_update_op, rel=1e-6)


def test_local_reads_the_calibrated_spec_and_refuses_a_bad_one(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CALIBRATION_DIR", str(tmp_path))
    plain = Cluster.local(4)
    assert plain.device.op_overhead is None
    fitted = fit_cluster(_synthetic_measurements(), plain, "test")
    calibration_path(4).write_text(fitted.to_json())
    got = Cluster.local(4)
    assert got.device.op_overhead == fitted.device.op_overhead and got.intra_node == fitted.intra_node
    assert got.device.memory_bytes == plain.device.memory_bytes  # this machine's RAM / n, read now
    assert Cluster.local(4, calibrated=False) == plain
    assert Cluster.local(2).device.op_overhead is None  # calibrated for 4 processes only
    calibration_path(2).write_text(fitted.to_json())
    with pytest.raises(ClusterSpecError, match="4 cpu device.*not 2 local"):
        Cluster.local(2)
    calibration_path(2).write_text("{not json")
    with pytest.raises(ClusterSpecError, match=r"local-2\.json cannot be used.*autopar calibrate --nproc 2"):
        Cluster.local(2)


@pytest.mark.parametrize("rows, match", [
    ((("all_reduce", 1e-5),), "kind, latency"),
    ((("broadcastish", 1e-5, 1e9),), "kind, latency"),
    ((("all_reduce", -1.0, 1e9),), "latency s >= 0"),
    ((("all_reduce", 1e-5, 0.0),), "bandwidth"),
    ((("all_reduce", 1e-5, 1e9), ("all_reduce", 2e-5, 1e9)), "twice"),
])
def test_link_collectives_are_validated(rows, match):
    with pytest.raises(ClusterSpecError, match=match):
        LinkSpec(bandwidth=1e9, latency=1e-5, collectives=rows)


def test_device_overhead_and_attention_efficiency_are_validated():
    d = Cluster.local(1, calibrated=False).device
    with pytest.raises(ClusterSpecError, match="op_overhead"):
        dataclasses.replace(d, op_overhead=-1e-6)
    with pytest.raises(ClusterSpecError, match="attention_efficiency"):
        dataclasses.replace(d, attention_efficiency=1.5)


def test_specs_written_before_the_calibrated_fields_still_load():
    d = json.loads(Cluster.preset("dgx-h100").to_json())
    for key in ("attention_efficiency", "op_overhead", "matmul_table", "linear_table", "conv_table", "collective_host_s",
                "collective_host_byte_s", "grad_buffer_element_s", "update_element_s"):
        del d["device"][key]
    for link in ("intra_node", "inter_node"):
        del d[link]["collectives"]
    assert Cluster.from_json(json.dumps(d)) == Cluster.preset("dgx-h100")


@pytest.mark.slow
def test_autopar_calibrate_measures_fits_and_writes_the_spec(tmp_path, capsys):
    from autopar.cli import main

    out = tmp_path / "spec.json"
    assert main(["calibrate", "--nproc", "2", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    spec = Cluster.from_json(out.read_text())
    assert spec.world_size == 2 and spec.device_type == "cpu"
    d = spec.device
    assert d.op_overhead is not None and d.matmul_efficiency == 1.0 and d.peak_flops.fp32 > 1e8
    assert len(d.matmul_table) == 8 and len(d.op_costs) == 3 and d.update_element_s is not None
    assert len(d.conv_table) == 8 and all(f > 0 and b > 0 for *_, f, b in d.conv_table)  # the quick grid: 2 x 2 x 2
    assert d.attention_costs is not None and d.attention_costs[1] + d.attention_costs[3] > 0
    assert all(0.0 < t < 1e-7 for t in d.grad_buffer_element_s)  # per element: under 100 ns
    from autopar.calibration.cpu_cache import last_level_cache_bytes

    assert d.shared_cache_bytes == last_level_cache_bytes()  # what the ranks' CPUs say, or None
    # the waiting probe's share, and the speed probe's windows from the start to the end
    assert spec.exposed_latency_share is not None and 0.0 <= spec.exposed_latency_share <= 1.0
    assert any(s.startswith("machine speed while calibrating") for s in spec.sources), spec.sources
    assert {k for k, *_ in spec.intra_node.collectives} == set(KINDS) | {"send_recv"}
    assert 0.0 <= spec.exposed_comm_share <= 1.0 and spec.collective_skew_s >= 0.0
    # a reshard's autograd node and buffers cost the host something per collective
    assert 0.0 < d.collective_host_s < 0.01 and 0.0 <= d.collective_host_byte_s < 1e-6
    # a pipeline stage's message and its schedule's work per microbatch, measured on the pair
    assert spec.intra_node.measured_time("send_recv", 2, 1e4) is not None and spec.pipeline_microbatch_s >= 0.0
    assert "all_to_all" in printed and "pipeline schedule" in printed and str(out) in printed


def test_a_spread_probe_keeps_the_median_of_all_its_windows_over_the_calibration():
    """``SpreadProbe``: windows taken when a probe is added and again at each ``sample`` (between
    the calibration's later parts); its figure is the median over all of them, per call."""
    import time

    from autopar.calibration.microbench import SpreadProbe, _agreed_barrier

    pause = [1e-3]
    probe = SpreadProbe(torch.device("cpu"), _agreed_barrier(1))
    probe.add("sleep_s", lambda: time.sleep(pause[0]), repeats=2, min_s=0.005)
    early = probe.medians()["sleep_s"]
    assert 1e-3 <= early < 3e-3
    pause[0] = 6e-3  # the machine slows down for the rest of the calibration
    for _ in range(3):
        probe.sample()
    assert 6e-3 <= probe.medians()["sleep_s"] < 9e-3  # 3 of its 5 windows
    assert len(probe.runs[0]) == 5


def test_calibrate_measures_gpus_over_nccl_where_cuda_shows_enough_of_them(monkeypatch):
    """The backend: asked, else NCCL where CUDA shows a GPU per process, else gloo. A GPU spec is
    fitted onto its datasheet preset (the peaks its efficiencies are taken against) with the
    GPU's memory, and written beside the CPU one, not where ``Cluster.local`` reads."""
    from types import SimpleNamespace

    from autopar.calibration import calibration_backend, gpu_base_cluster

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert calibration_backend(2) == "nccl" and calibration_backend(4) == "gloo"
    assert calibration_backend(2, "gloo") == "gloo" and calibration_backend(1, "nccl") == "nccl"
    with pytest.raises(AutoparError, match="4 process.*need 4 GPU.*shows 2 here: use --nproc 2 or --backend gloo"):
        calibration_backend(4, "nccl")
    with pytest.raises(AutoparError, match="--backend must be gloo .* or nccl"):
        calibration_backend(2, "mpi")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert calibration_backend(1) == "gloo"
    with pytest.raises(AutoparError, match="shows 0 here: use --backend gloo"):
        calibration_backend(1, "nccl")

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: SimpleNamespace(total_memory=81559 * 2**20))
    base = gpu_base_cluster(2)
    preset = Cluster.preset("dgx-h100")
    assert base.device_type == "cuda" and base.backend == "nccl" and base.world_size == 2 and base.nodes == 1
    assert base.device.peak_flops == preset.device.peak_flops and base.device.memory_bytes == 81559 * 2**20
    assert base.intra_node == preset.intra_node
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA GeForce RTX 4090")
    with pytest.raises(AutoparError, match="no datasheet for the GPU 'NVIDIA GeForce RTX 4090'.*--backend gloo"):
        gpu_base_cluster(1)
    assert calibration_path(2, "cuda").name == "local-cuda-2.json" and calibration_path(2).name == "local-2.json"


def test_a_calibration_whose_machine_speed_moved_is_measured_again_then_refused(monkeypatch, tmp_path):
    """The speed probe's windows (the same matmul from the calibration's start to its end) differ
    by more than ``SPEED_SPREAD_LIMIT``: measured again, and after ``CALIBRATION_TRIES`` noisy
    measurements refused naming the spreads and the fix; ``allow_noisy`` keeps it; a quiet second
    try is kept."""
    import autopar.calibration as cal
    import autopar.runtime.launch as launch_mod

    quiet, noisy = _synthetic_measurements(), _synthetic_measurements()
    noisy["speed"] = [2e-3, 3.4e-3, 2.2e-3]
    # 20th / 80th percentiles of 2.0, 2.2, 3.4 ms: 2.08 and 2.92 ms
    assert cal.speed_spread(noisy["speed"]) == pytest.approx(2.92 / 2.08) and not cal.check_quiet(noisy)
    assert cal.check_quiet(noisy, allow_noisy=True) and cal.check_quiet(quiet)
    for tries, allow, fails in (([noisy, noisy], False, True), ([noisy, quiet], False, False), ([noisy], True, False)):
        runs = iter(tries)
        monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: ["unused"])
        monkeypatch.setattr(cal, "combine_ranks", lambda per_rank: next(runs))
        out = tmp_path / f"spec-{len(tries)}-{allow}.json"
        if fails:
            with pytest.raises(AutoparError, match=r"speed moved while it was measured, 2 times \(1.40x, 1.40x.*"
                                                   r"--allow-noisy"):
                cal.calibrate(4, out=out, backend="gloo", allow_noisy=allow)
            assert not out.exists()
        else:
            cluster, path = cal.calibrate(4, out=out, backend="gloo", allow_noisy=allow)
            assert path == out and out.exists() and cluster.exposed_latency_share == pytest.approx(0.8)
