"""Hardware preset data: vendor datasheet numbers, each with its source next to it.

This module is data only (read-only mappings of plain numbers);
:meth:`autopar.cluster.Cluster.preset` turns it into specs. Units and conventions:

* FLOP/s are *dense* peaks (NVIDIA quotes tensor-core figures "with sparsity"; we halve those).
* ``memory_bytes`` uses the marketing decimal gigabyte: "80 GB" -> ``80 * 10**9`` bytes, "141 GB"
  -> ``141 * 10**9`` (the usable capacity after the driver and CUDA context is smaller; the
  planner subtracts a reserve, not this table).
* Link bandwidths are bytes/s *per device, per direction*, i.e. what one GPU can push into the
  fabric: NVLink "600 GB/s" (A100) is the bidirectional total, so 300e9 per direction; a
  200 Gb/s NIC is 25e9 bytes/s per direction, and a DGX has one compute NIC per GPU.
* Latencies are seconds per message hop (the alpha of the alpha-beta model).

Example:
    >>> from autopar.cost_models.hardware import PRESETS
    >>> PRESETS["dgx-h100"]["device"]["bf16"]
    989400000000000.0
"""

from types import MappingProxyType as _ReadOnly

__all__ = [
    "A100_SXM4_80GB",
    "H100_SXM5_80GB",
    "H200_SXM_141GB",
    "NVLINK3",
    "NVLINK4",
    "IB_HDR_200G_PER_GPU",
    "IB_NDR_400G_PER_GPU",
    "PRESETS",
    "SOURCES",
]

SOURCES = _ReadOnly(
    {
        "a100": "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/"
        "en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        "dgx-a100": "NVIDIA DGX A100 datasheet (8x single-port ConnectX-6 200 Gb/s HDR "
        "InfiniBand), https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
        "nvidia-dgx-a100-datasheet.pdf",
        "h100": "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column), "
        "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
        "dgx-h100": "NVIDIA DGX H100/H200 user guide, introduction (8x ConnectX-7 400 Gb/s for "
        "the compute fabric), "
        "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html",
        "h200": "NVIDIA H200 Tensor Core GPU product page / datasheet (H200 SXM column), "
        "https://www.nvidia.com/en-us/data-center/h200/",
        "dgx-h200": "NVIDIA DGX H200 product page (8x ConnectX-7 400 Gb/s compute NICs), "
        "https://www.nvidia.com/en-us/data-center/dgx-h200/",
        "nccl-latency": "Engineering estimate from NCCL's tuning model, src/graph/tuning.cc hwLat "
        "table, Ring/Simple per-step latency: NVLink 3.4 us, network 9.6 us (newer releases list "
        "5.7 / 6.6 us), https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc",
    }
)

# --- GPUs -----------------------------------------------------------------------------------

A100_SXM4_80GB = _ReadOnly(
    {
        "name": "A100-SXM4-80GB",
        "fp32": 19.5e12,  # A100 datasheet: FP32 19.5 TFLOPS
        "tf32": 156e12,  # A100 datasheet: TF32 Tensor Core 156 TFLOPS (312 with sparsity)
        "bf16": 312e12,  # A100 datasheet: BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity)
        "fp16": 312e12,  # A100 datasheet: FP16 Tensor Core 312 TFLOPS (624 with sparsity)
        "memory_bytes": 80 * 10**9,  # A100 datasheet: 80GB HBM2e (marketing GB)
        "memory_bandwidth": 2.039e12,  # A100 datasheet: 2,039 GB/s (80GB SXM)
        # achieved fraction of bf16 peak in large GEMMs with a 2023 software stack (flash
        # attention, FSDP): calibrated on MosaicML's published MPT runs on A100 (see
        # benchmarks/README.md); Megatron-LM's 2021 stack (unfused attention) calibrates to 0.445
        "matmul_efficiency": 0.67,
    }
)

H100_SXM5_80GB = _ReadOnly(
    {
        "name": "H100-SXM5-80GB",
        "fp32": 67e12,  # H100 datasheet: FP32 67 TFLOPS
        "tf32": 494.7e12,  # H100 datasheet: TF32 Tensor Core 989 TFLOPS with sparsity -> dense half
        "bf16": 989.4e12,  # H100 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity -> dense
        "fp16": 989.4e12,  # H100 datasheet: FP16 Tensor Core 1,979 TFLOPS with sparsity -> dense
        "memory_bytes": 80 * 10**9,  # H100 datasheet: 80GB HBM3
        "memory_bandwidth": 3.35e12,  # H100 datasheet: 3.35 TB/s
        # calibrated on MosaicML's published MPT runs on H100 (benchmarks/README.md): H100 software
        # of 2023 reached a lower fraction of its (much higher) peak than A100
        "matmul_efficiency": 0.55,
    }
)

H200_SXM_141GB = _ReadOnly(
    {
        "name": "H200-SXM-141GB",
        "fp32": 67e12,  # H200 datasheet: FP32 67 TFLOPS (same compute as H100 SXM)
        "tf32": 494.7e12,  # H200 datasheet: TF32 Tensor Core 989 TFLOPS with sparsity -> dense
        "bf16": 989.4e12,  # H200 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity -> dense
        "fp16": 989.4e12,  # H200 datasheet: FP16 Tensor Core 1,979 TFLOPS with sparsity -> dense
        "memory_bytes": 141 * 10**9,  # H200 datasheet: 141GB HBM3e
        "memory_bandwidth": 4.8e12,  # H200 datasheet: 4.8 TB/s
        "matmul_efficiency": 0.55,  # as H100 (same compute); no published H200 run calibrated yet
    }
)

# --- Links (per GPU, per direction) ---------------------------------------------------------

NVLINK3 = _ReadOnly(
    {
        "bandwidth": 300e9,  # A100 datasheet: NVLink 600 GB/s total bidirectional per GPU
        "latency": 3.4e-6,  # engineering estimate, see SOURCES["nccl-latency"]
    }
)

NVLINK4 = _ReadOnly(
    {
        "bandwidth": 450e9,  # H100/H200 datasheets: NVLink 900 GB/s total bidirectional per GPU
        "latency": 3.4e-6,  # engineering estimate, see SOURCES["nccl-latency"]
    }
)

IB_HDR_200G_PER_GPU = _ReadOnly(
    {
        "bandwidth": 25e9,  # DGX A100 datasheet: one 200 Gb/s HDR NIC per GPU = 25 GB/s/direction
        "latency": 9.6e-6,  # engineering estimate, see SOURCES["nccl-latency"]
    }
)

IB_NDR_400G_PER_GPU = _ReadOnly(
    {
        "bandwidth": 50e9,  # DGX H100/H200: one 400 Gb/s ConnectX-7 per GPU = 50 GB/s/direction
        "latency": 9.6e-6,  # engineering estimate, see SOURCES["nccl-latency"]
    }
)

# --- Systems --------------------------------------------------------------------------------

PRESETS = _ReadOnly(
    {
        "dgx-a100": _ReadOnly(
            {
                "device": A100_SXM4_80GB,
                "devices_per_node": 8,
                "intra_node": NVLINK3,
                "inter_node": IB_HDR_200G_PER_GPU,
                "sources": (SOURCES["a100"], SOURCES["dgx-a100"], SOURCES["nccl-latency"]),
            }
        ),
        "dgx-h100": _ReadOnly(
            {
                "device": H100_SXM5_80GB,
                "devices_per_node": 8,
                "intra_node": NVLINK4,
                "inter_node": IB_NDR_400G_PER_GPU,
                "sources": (SOURCES["h100"], SOURCES["dgx-h100"], SOURCES["nccl-latency"]),
            }
        ),
        "dgx-h200": _ReadOnly(
            {
                "device": H200_SXM_141GB,
                "devices_per_node": 8,
                "intra_node": NVLINK4,
                "inter_node": IB_NDR_400G_PER_GPU,
                "sources": (SOURCES["h200"], SOURCES["dgx-h200"], SOURCES["nccl-latency"]),
            }
        ),
    }
)
