"""Numeric precision of client training and evaluation (`model.precision`, `model.tf32`).

Weights stay fp32 everywhere: bf16 and fp16 run the forward pass under autocast, fp16 with a
gradient scaler (its 5-bit exponent underflows small gradients otherwise). The server never sees
low precision: it aggregates and steps fp32 tensors. TF32 (CUDA, Ampere or newer) keeps fp32 weights
and activations and rounds matmul inputs to a 10-bit mantissa, which PyTorch leaves off by default.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from fedsilo.errors import ConfigError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_bf16() -> bool:
    """Native bfloat16 (AVX512-BF16 or AMX) on this CPU: without it bf16 is emulated, slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def check_precision(precision: str, device: torch.device) -> None:
    """A precision this device cannot run well is a config error, named before any work."""
    if precision == "fp32":
        return
    if device.type == "cuda":
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"model.precision = bf16: {torch.cuda.get_device_name(device)} has no bfloat16 "
                              "support (Ampere or newer has); use fp16 or fp32")
        return
    if device.type != "cpu":
        raise ConfigError(f"model.precision = {precision}: supported on CUDA and CPU, not on {device.type}")
    if precision == "fp16":
        raise ConfigError("model.precision = fp16 needs a CUDA device (fp16 with a grad scaler is a GPU "
                          "recipe); on a CPU use bf16 (where the CPU has it) or fp32")
    if not cpu_has_bf16():
        raise ConfigError("model.precision = bf16: this CPU has no native bfloat16 (AVX512-BF16 or AMX), "
                          "so bf16 would run emulated and slower than fp32; use fp32")


def autocast(precision: str, device: torch.device):
    """The forward pass's context: autocast to bf16/fp16, nothing for fp32."""
    dtype = DTYPES[precision]
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def set_tf32(device: torch.device, enabled: bool) -> None:
    """TF32 matmuls and convolutions on CUDA (a process-wide switch, as PyTorch has it)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
