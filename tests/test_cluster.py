"""Tests of autopar.cluster: presets, validation errors, JSON round trip, local clusters."""

import dataclasses
import json
import os

import pytest
import torch

from autopar.cluster import Cluster, DeviceSpec, LinkSpec, PeakFlops
from autopar.errors import AutoparError, ClusterSpecError

PRESETS = ["dgx-a100", "dgx-h100", "dgx-h200"]


def _link(**kw):
    return LinkSpec(**{"bandwidth": 1e9, "latency": 1e-6, **kw})


def _cluster(**kw):
    base = Cluster.preset("dgx-a100")
    return dataclasses.replace(base, **kw)


# --- presets ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PRESETS)
def test_presets_world_size(name):
    assert Cluster.preset(name).world_size == 8
    c = Cluster.preset(name, nodes=4)
    assert (c.nodes, c.devices_per_node, c.world_size) == (4, 8, 32)
    assert c.device_type == "cuda" and c.backend == "nccl"
    assert c.sources and all(isinstance(s, str) for s in c.sources)


def test_preset_numbers_per_direction_per_gpu():
    a100, h100, h200 = (Cluster.preset(n) for n in PRESETS)
    assert a100.device.peak_flops.bf16 == 312e12 and a100.device.peak_flops.fp32 == 19.5e12
    assert a100.device.memory_bytes == 80 * 10**9 and a100.device.memory_bandwidth == 2.039e12
    assert a100.intra_node.bandwidth == 300e9 and a100.inter_node.bandwidth == 25e9
    assert h100.device.peak_flops.tf32 == 494.7e12 and h100.device.peak_flops.bf16 == 989.4e12
    assert h100.intra_node.bandwidth == 450e9 and h100.inter_node.bandwidth == 50e9
    assert h200.device.memory_bytes == 141 * 10**9 and h200.device.memory_bandwidth == 4.8e12
    assert h200.device.peak_flops == h100.device.peak_flops
    for c in (a100, h100, h200):
        assert 1e-6 <= c.intra_node.latency < c.inter_node.latency <= 10e-6


def test_unknown_preset_lists_known():
    with pytest.raises(ClusterSpecError, match="dgx-a100, dgx-h100, dgx-h200"):
        Cluster.preset("dgx-b200")


def test_with_nodes():
    c = Cluster.preset("dgx-h100")
    c4 = c.with_nodes(4)
    assert c4.world_size == 32 and c4.name == c.name and c.world_size == 8
    with pytest.raises(ClusterSpecError, match="Cluster.nodes"):
        c.with_nodes(0)


def test_frozen_and_hashable():
    c = Cluster.preset("dgx-a100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.nodes = 2
    assert hash(c) == hash(Cluster.preset("dgx-a100"))


# --- validation ------------------------------------------------------------------------------

def test_zero_nodes():
    with pytest.raises(ClusterSpecError, match=r"Cluster.nodes must be an integer >= 1, got 0"):
        Cluster.preset("dgx-a100", nodes=0)


def test_zero_devices_per_node():
    with pytest.raises(ClusterSpecError, match=r"devices_per_node.*got 0.*zero devices"):
        _cluster(devices_per_node=0)


def test_negative_bandwidth():
    msg = r"LinkSpec.bandwidth must be a positive .* got -1000000000.0; pass bytes/s"
    with pytest.raises(ClusterSpecError, match=msg):
        _link(bandwidth=-1e9)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: _link(latency=0), "LinkSpec.latency"),
        (lambda: _link(bandwidth=float("nan")), "LinkSpec.bandwidth"),
        (lambda: LinkSpec(1e9, 1e-6, efficiency=1.5), r"LinkSpec.efficiency must be in \(0, 1\]"),
        (lambda: LinkSpec(1e9, 1e-6, efficiency=0), r"LinkSpec.efficiency"),
        (lambda: PeakFlops(1.0, 1.0, -1.0, 1.0), "PeakFlops.bf16"),
        (lambda: DeviceSpec("x", PeakFlops(1, 1, 1, 1), 0, 1e9), "DeviceSpec.memory_bytes"),
        (lambda: DeviceSpec("x", PeakFlops(1, 1, 1, 1), 2.5, 1e9), "DeviceSpec.memory_bytes"),
        (lambda: DeviceSpec("x", PeakFlops(1, 1, 1, 1), 8, 0.0), "DeviceSpec.memory_bandwidth"),
        (lambda: _cluster(device_type="tpu"), "device_type"),
        (lambda: _cluster(backend="mpi"), "backend"),
        (lambda: _cluster(device_type="cpu"), "use backend='gloo'"),
        (lambda: _cluster(nodes=True), "Cluster.nodes"),
        (lambda: _cluster(name=""), "Cluster.name"),
    ],
)
def test_bad_fields(make, match):
    with pytest.raises(ClusterSpecError, match=match):
        make()


def test_errors_are_value_errors():
    assert issubclass(ClusterSpecError, AutoparError) and issubclass(AutoparError, ValueError)


def test_int_floats_are_normalised():
    link = LinkSpec(bandwidth=10**9, latency=1e-6)
    assert isinstance(link.bandwidth, float) and link == LinkSpec(1e9, 1e-6)


def test_for_dtype_names():
    pf = Cluster.preset("dgx-h100").device.peak_flops
    assert pf.for_dtype("fp32") == pf.for_dtype("float32") == pf.for_dtype(torch.float32) == 67e12
    assert pf.for_dtype("tf32") == 494.7e12
    assert pf.for_dtype("bfloat16") == pf.for_dtype(torch.bfloat16) == pf.bf16
    assert pf.for_dtype("float16") == pf.for_dtype("fp16") == pf.fp16
    with pytest.raises(ClusterSpecError, match="int8.*known dtypes"):
        pf.for_dtype("int8")


# --- JSON ------------------------------------------------------------------------------------

@pytest.mark.parametrize("c", [Cluster.preset(n, nodes=2) for n in PRESETS] + [Cluster.local(4)])
def test_json_round_trip(c):
    s = c.to_json()
    assert json.loads(s)["schema_version"] == 1
    back = Cluster.from_json(s)
    assert back == c
    assert back.to_json() == s


def _edited_json(edit):
    d = json.loads(Cluster.preset("dgx-a100").to_json())
    edit(d)
    return json.dumps(d)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(nodes="eight"), r"Cluster.nodes.*'eight'"),
        (lambda d: d.update(nodes=0), r"Cluster.nodes"),
        (lambda d: d["device"]["peak_flops"].pop("bf16"), r"missing field 'device.peak_flops.bf16"),
        (lambda d: d["intra_node"].update(bandwidth=-5), r"intra_node.*LinkSpec.bandwidth.*-5"),
        (lambda d: d["device"].update(memory_bytes=8e10), r"device.*memory_bytes"),
        (lambda d: d.update(colour="green"), r"unknown field 'colour'"),
        (lambda d: d.update(schema_version=2), r"schema_version.*2.*version 1"),
        (lambda d: d.pop("schema_version"), r"missing field 'schema_version'"),
        (lambda d: d.update(sources="a"), r"sources"),
        (lambda d: d.update(inter_node=[1, 2]), r"inter_node.*must be an object"),
        (lambda d: d["inter_node"].update(rails=0.5), r"LinkSpec.rails must be a number >= 1"),
        (lambda d: d["intra_node"].update(rails=2), r"intra_node.rails is 2.*set inter_node.rails"),
        (lambda d: d.update(exposed_comm_share=1.5), r"exposed_comm_share must be in \[0, 1\]"),
        (lambda d: d.update(exposed_latency_share=-0.1), r"exposed_latency_share must be in \[0, 1\]"),
    ],
)
def test_bad_json_fields(edit, match):
    with pytest.raises(ClusterSpecError, match=match):
        Cluster.from_json(_edited_json(edit))


def test_link_efficiency_round_trips_and_older_specs_load():
    import dataclasses

    c = Cluster.preset("dgx-a100", nodes=2)
    slow = dataclasses.replace(c, inter_node=dataclasses.replace(c.inter_node, efficiency=0.25))
    assert slow.inter_node.effective_bandwidth == 0.25 * c.inter_node.bandwidth
    assert Cluster.from_json(slow.to_json()) == slow
    d = json.loads(c.to_json())
    for link in ("intra_node", "inter_node"):
        d[link].pop("efficiency")  # a spec written before the field existed
    assert Cluster.from_json(json.dumps(d)) == c


def test_calibrated_rails_and_exposed_share_round_trip_and_older_specs_load():
    import dataclasses

    c = Cluster.preset("dgx-a100", nodes=2)
    cal = dataclasses.replace(c, inter_node=dataclasses.replace(c.inter_node, rails=1.5), exposed_comm_share=0.3)
    assert Cluster.from_json(cal.to_json()) == cal
    d = json.loads(c.to_json())
    d.pop("exposed_comm_share")  # specs written before these fields existed
    for link in ("intra_node", "inter_node"):
        d[link].pop("rails")
    assert Cluster.from_json(json.dumps(d)) == c
    with pytest.raises(ClusterSpecError, match="rails"):
        dataclasses.replace(c.inter_node, rails=True)


def test_unparseable_json():
    with pytest.raises(ClusterSpecError, match="cannot be parsed"):
        Cluster.from_json("{not json")
    with pytest.raises(ClusterSpecError, match="top level must be an object"):
        Cluster.from_json("[1, 2]")


# --- local -----------------------------------------------------------------------------------

def test_local_explicit():
    c = Cluster.local(4)
    assert (c.nodes, c.devices_per_node, c.world_size) == (1, 4, 4)
    assert (c.device_type, c.backend) == ("cpu", "gloo")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert c.device.memory_bytes == ram // 4


def test_local_reads_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert Cluster.local().world_size == 2
    assert Cluster.local(3).world_size == 3  # explicit n wins


def test_local_without_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ClusterSpecError, match=r"pass n.*WORLD_SIZE"):
        Cluster.local()


@pytest.mark.parametrize("env, match", [("two", "WORLD_SIZE must be an integer"), ("0", "got 0")])
def test_local_bad_world_size(monkeypatch, env, match):
    monkeypatch.setenv("WORLD_SIZE", env)
    with pytest.raises(ClusterSpecError, match=match):
        Cluster.local()
