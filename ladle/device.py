"""The one place that knows CUDA, Ascend NPU and CPU: device choice, backend, memory, peak FLOPS.

Everything else asks this module instead of calling `torch.cuda` or `torch.npu` directly.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

from ladle.errors import ConfigError

# Dense peak TFLOP/s (no sparsity) by device-name substring, per compute dtype. The first match
# wins, so more specific names come first. Sources: vendor datasheets (SXM / OAM parts).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H800", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H20", {"bf16": 148.0, "fp16": 148.0, "fp32": 44.0}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2}),
    ("V100", {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7}),
    ("RTX 4090", {"bf16": 165.0, "fp16": 165.0, "fp32": 82.6}),
    # Ascend (torch_npu reports names such as "Ascend910B2")
    ("Ascend910B1", {"bf16": 414.0, "fp16": 414.0, "fp32": 103.0}),
    ("Ascend910B2", {"bf16": 376.0, "fp16": 376.0, "fp32": 94.0}),
    ("Ascend910B3", {"bf16": 313.0, "fp16": 313.0, "fp32": 78.0}),
    ("Ascend910B4", {"bf16": 280.0, "fp16": 280.0, "fp32": 70.0}),
    ("Ascend910", {"bf16": 256.0, "fp16": 256.0, "fp32": 64.0}),
]


def _has_npu() -> bool:
    if "torch_npu" not in sys.modules:
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return False
    return hasattr(torch, "npu") and torch.npu.is_available()


def pick_device(pref: str = "auto", local_rank: int = 0, field: str = "train.device") -> torch.device:
    """`auto` takes the accelerator when there is one (CUDA, then NPU), else the CPU. `field` is
    where the choice came from, for the error message."""
    if pref == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        if _has_npu():
            return torch.device("npu", local_rank % torch.npu.device_count())
        return torch.device("cpu")
    try:
        dev = torch.device(pref)
    except RuntimeError:
        raise ConfigError(f"{field}: unknown device '{pref}'; use auto, cpu, cuda or npu") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{field}=cuda but no CUDA device is visible; use {field}=auto or cpu")
    if dev.type == "npu" and not _has_npu():
        raise ConfigError(f"{field}=npu but torch_npu finds no NPU; use {field}=auto or cpu")
    if dev.type in ("cuda", "npu") and dev.index is None:
        dev = torch.device(dev.type, local_rank)
    return dev


def backend_for(device: torch.device) -> str:
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def set_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "cpu"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "npu":
        torch.npu.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Accelerator allocator peak since the last reset; on CPU the process's peak RSS (never reset)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "npu":
        return int(torch.npu.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def peak_reserved_bytes(device: torch.device) -> int | None:
    """The caching allocator's reserved peak (what the device really gave the process; beside the
    allocated peak it shows fragmentation); None on a CPU, which has no such allocator."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    if device.type == "npu":
        return int(torch.npu.max_memory_reserved(device))
    return None


def memory_now(device: torch.device) -> tuple[int, int | None]:
    """(allocated, reserved) bytes now: the caching allocator's on an accelerator; the process's
    resident set and None on a CPU."""
    if device.type in ("cuda", "npu"):
        mod = getattr(torch, device.type)
        return int(mod.memory_allocated(device)), int(mod.memory_reserved(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), None
    except (OSError, ValueError):
        return peak_memory_bytes(device), None


def total_memory(device: torch.device) -> int | None:
    """One accelerator's memory in bytes; None on a CPU (its processes share the host's)."""
    if device.type in ("cuda", "npu"):
        mod = getattr(torch, device.type)
        return int(mod.get_device_properties(device.index or 0).total_memory)
    return None


ALLOC_CONF_VARS = {"cuda": "PYTORCH_CUDA_ALLOC_CONF", "npu": "PYTORCH_NPU_ALLOC_CONF"}


def apply_alloc_conf(device_type: str, conf: str) -> str | None:
    """The config's allocator setting (`device.alloc_conf`, e.g. `expandable_segments:True`) in
    the variable the device's caching allocator reads (before its first allocation); returns the
    variable set, or None (a CPU has no such allocator)."""
    var = ALLOC_CONF_VARS.get(device_type)
    if not conf or var is None:
        return None
    os.environ[var] = conf
    return var


def supports_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True


def fused_adamw_available(device: torch.device) -> bool:
    """torch's fused AdamW kernel exists for CUDA and CPU (torch >= 2.4); elsewhere use foreach."""
    return device.type in ("cuda", "cpu")


def compute_dtype_name(precision_mode: str) -> str:
    return {"fp32": "fp32", "bf16-mixed": "bf16", "bf16": "bf16", "fp16-mixed": "fp16"}[precision_mode]


_measured: dict[tuple[str, str], float] = {}


def measure_gemm_tflops(
    device: torch.device, dtype_name: str, sizes=(1024, 2048), seconds: float = 0.3
) -> float:
    """Measured dense GEMM throughput (TFLOP/s): the best of square matmuls of a few sizes, each
    timed for `seconds`. This is the CPU's 'peak' for MFU, measured once per process."""
    key = (str(device), dtype_name)
    if key in _measured:
        return _measured[key]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    best = 0.0
    for n in (256, *sizes):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        a @ b  # warm-up: first-call kernel selection and allocation (slow once, not a measure)
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        if time.perf_counter() - t0 > seconds / 4:  # a slow kernel (fp16 on most CPUs): stop growing
            best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e12)
            break
        iters, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            iters += 1
        synchronize(device)
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12)
    _measured[key] = best
    return best


def peak_tflops(device: torch.device, dtype_name: str) -> tuple[float, str]:
    """(dense peak TFLOP/s, where it came from). Known accelerators from the table; the CPU and any
    unknown device by a GEMM measured once."""
    if device.type in ("cuda", "npu"):
        name = device_name(device)
        for pattern, peaks in PEAK_TFLOPS:
            if pattern.lower() in name.lower() and peaks.get(dtype_name):
                return peaks[dtype_name], f"datasheet ({pattern}, {dtype_name})"
    return measure_gemm_tflops(device, dtype_name), f"measured {dtype_name} GEMM on {device_name(device)}"
