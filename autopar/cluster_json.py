"""Reading a cluster spec's JSON (``Cluster.from_json``) back into its frozen dataclasses.

Fields added after a spec was written take the value that spec meant (the default here: no
measurement); any other missing, unknown or bad field is a ClusterSpecError naming its JSON path.
``calibrated_local`` reads the spec ``autopar calibrate`` wrote for ``Cluster.local(n)``.
"""
from __future__ import annotations

import dataclasses
import json
import re

from autopar.cluster import SCHEMA_VERSION, Cluster, DeviceSpec, LinkSpec, PeakFlops, calibration_path
from autopar.errors import ClusterSpecError
from autopar.spec_fields import json_build, json_fields, json_rows

__all__ = ["cluster_from_json", "calibrated_local", "check_calibrated_world"]

# the first source line ``autopar calibrate`` writes: how many processes it measured together
_CALIBRATED = re.compile(r"^autopar calibrate\b.*?: (\d+) cpu process\(es\) measured together")


def cluster_from_json(s: str) -> Cluster:
    """``Cluster.from_json``: any bad, missing or unknown field raises ClusterSpecError."""
    try:
        d = json.loads(s)
    except (TypeError, json.JSONDecodeError) as e:
        raise ClusterSpecError(f"cluster JSON cannot be parsed: {e}") from None
    if isinstance(d, dict):
        d.setdefault("exposed_comm_share", None)  # specs written before they existed
        d.setdefault("exposed_latency_share", None)
        d.setdefault("expert_imbalance", 1.0)
        d.setdefault("collective_skew_s", 0.0)
        d.setdefault("pipeline_microbatch_s", 0.0)
    top = json_fields(d, "", [f.name for f in dataclasses.fields(Cluster)] + ["schema_version"])
    version = top["schema_version"]
    if type(version) is not int or version != SCHEMA_VERSION:
        raise ClusterSpecError(
            f"cluster JSON field 'schema_version' is {version!r}, but this "
            f"autopar reads version {SCHEMA_VERSION}; re-export the spec with this version"
        )
    if isinstance(top["device"], dict):
        for key in ("matmul_efficiency", "attention_efficiency", "attention_costs", "op_overhead", "update_op_overhead",
                    "update_element_s", "grad_buffer_element_s", "warm_elements", "shared_cache_bytes"):
            top["device"].setdefault(key, None)  # specs written before they existed
        top["device"].setdefault("op_costs", [])
        top["device"].setdefault("matmul_table", [])
        top["device"].setdefault("linear_table", [])
        top["device"].setdefault("conv_table", [])
        top["device"].setdefault("collective_host_s", 0.0)
        top["device"].setdefault("collective_host_byte_s", 0.0)
    dev = json_fields(top["device"], "device.", ["name", "peak_flops", "memory_bytes", "memory_bandwidth",
                                             "matmul_efficiency", "attention_efficiency", "attention_costs", "op_overhead",
                                             "update_op_overhead", "update_element_s", "grad_buffer_element_s",
                                             "warm_elements", "shared_cache_bytes", "op_costs", "matmul_table", "linear_table", "conv_table",
                                             "collective_host_s", "collective_host_byte_s"])
    for key in ("op_costs", "matmul_table", "linear_table", "conv_table", "update_element_s", "grad_buffer_element_s",
                "warm_elements", "attention_costs"):
        dev[key] = json_rows(dev[key])
    flops = json_fields(dev["peak_flops"], "device.peak_flops.", ["fp32", "tf32", "bf16", "fp16"])
    dev["peak_flops"] = json_build(PeakFlops, flops, "device.peak_flops")
    top["device"] = json_build(DeviceSpec, dev, "device")
    for link in ("intra_node", "inter_node"):
        if isinstance(top[link], dict):
            top[link].setdefault("efficiency", None)  # specs written before they existed
            top[link].setdefault("rails", None)
            top[link].setdefault("collectives", [])
            top[link].setdefault("collective_table", [])
        fields = json_fields(top[link], link + ".", ["bandwidth", "latency", "efficiency", "rails", "collectives",
                                                 "collective_table"])
        fields["collectives"] = json_rows(fields["collectives"])
        fields["collective_table"] = json_rows(fields["collective_table"])
        top[link] = json_build(LinkSpec, fields, link)
    if not isinstance(top["sources"], list):
        raise ClusterSpecError(
            f"cluster JSON field 'sources' must be a list of strings, got {top['sources']!r}"
        )
    top["sources"] = tuple(top["sources"])
    del top["schema_version"]
    return json_build(Cluster, top, "<top level>")


def calibrated_local(n: int, ram_share: int) -> Cluster | None:
    """The spec ``autopar calibrate`` wrote for ``n`` processes, with this machine's RAM / n
    (None: not calibrated). A file that cannot be read is an error naming it, not ignored."""
    path = calibration_path(n)
    if not path.is_file():
        return None
    try:
        spec = Cluster.from_json(path.read_text())
    except (OSError, ClusterSpecError) as e:
        raise ClusterSpecError(
            f"the calibrated spec {path} cannot be used: {e}; re-run `autopar calibrate --nproc {n}` or delete the "
            "file to use the uncalibrated local model") from None
    if spec.world_size != n or spec.device_type != "cpu":
        raise ClusterSpecError(
            f"the calibrated spec {path} describes {spec.world_size} {spec.device_type} device(s), not {n} local "
            f"CPU processes; re-run `autopar calibrate --nproc {n}` or delete the file")
    device = dataclasses.replace(spec.device, memory_bytes=ram_share)
    return dataclasses.replace(spec, device=device)


def check_calibrated_world(cluster: Cluster) -> None:
    """A CPU spec ``autopar calibrate`` measured with another number of processes than the cluster
    has (its ``sources`` say how many; else its collective table's largest group, where larger) is
    refused: its per-process rates were measured with that many processes sharing the cores."""
    if cluster.device_type != "cpu":
        return  # a GPU's rates do not depend on how many GPUs were measured together
    world = cluster.nodes * cluster.devices_per_node
    said = next((int(m.group(1)) for m in map(_CALIBRATED.match, cluster.sources) if m), None)
    grouped = max((row[1] for link in (cluster.intra_node, cluster.inter_node) for row in link.collective_table),
                  default=0)
    measured = said if said is not None else (grouped if grouped > world else None)
    if measured is not None and measured != world:
        how = "its sources say so" if said is not None else f"LinkSpec.collective_table measures groups of {measured}"
        raise ClusterSpecError(
            f"Cluster: this CPU spec was calibrated with {measured} processes sharing the machine ({how}) but "
            f"describes {world}: its per-process compute and memory rates hold only for {measured}. Run `autopar "
            f"calibrate --nproc {world}` (Cluster.local({world}) then reads it), or use Cluster.local({world}, "
            "calibrated=False)")
