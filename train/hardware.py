"""Peak dense matmul throughput of common accelerators, for MFU.

MFU = model FLOPs per token x tokens/s per device / the device's peak. Peaks
are the vendors' dense (no sparsity) tensor-core figures for the precision
trained in. `STRATA_PEAK_TFLOPS` overrides the table (for a GPU not listed,
or to get an MFU on CPU); with neither, MFU is not reported.
"""

from __future__ import annotations

import os

import torch

# Name fragment (as in torch.cuda.get_device_name) -> (bf16/fp16 TFLOPS, fp32 TFLOPS); first match wins.
PEAK_TFLOPS = [
    ("GB200", 2500.0, 80.0),
    ("B200", 2250.0, 80.0),
    ("H200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100", 989.0, 67.0),  # SXM and NVL
    ("H800", 989.0, 67.0),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 30.3),
    ("A10G", 70.0, 31.2),
    ("A10", 125.0, 31.2),
    ("V100", 125.0, 15.7),  # fp16: V100 has no bf16
    ("T4", 65.0, 8.1),  # fp16
]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def peak_flops(device: torch.device, bf16: bool) -> float | None:
    """Peak FLOP/s of one device in the precision trained in, or None when unknown."""
    if override := os.environ.get("STRATA_PEAK_TFLOPS"):
        return float(override) * 1e12
    if device.type != "cuda":
        return None
    name = device_name(device)
    for fragment, half, single in PEAK_TFLOPS:
        if fragment in name:
            return (half if bf16 else single) * 1e12
    return None
