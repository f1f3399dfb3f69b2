"""`ladle doctor`: is this machine ready to train, and if not, what to fix.

Each check passes, warns or fails with a hint: the versions (Python, torch, ladle, torch_npu,
CANN, the driver), the devices and their memory, the collective backends, the environment
variables that change how collectives behave, the links between devices (`nvidia-smi topo -m`,
`npu-smi info -t topo`: NVLink and HCCS against PCIe), free disk and write speed where
checkpoints go, and the measured GEMM peak against the device's datasheet. The parsers of the
tools' text are functions of their output, tested on outputs written by the tests.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PASS, WARN, FAIL = "pass", "warn", "fail"
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "HCCL_", "ASCEND_", "CUDA_", "PYTORCH_", "OMP_")
ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "ASCEND_RT_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "MASTER_ADDR",
    "MASTER_PORT",
)
# settings that quietly cost bandwidth or correctness, and why
ENV_WARNINGS = {
    ("NCCL_P2P_DISABLE", "1"): "peer-to-peer copies between GPUs are off: NVLink is not used",
    ("NCCL_SHM_DISABLE", "1"): "shared-memory transport off: intra-node traffic goes through the network",
    ("NCCL_IB_DISABLE", "1"): "InfiniBand off: multi-node traffic falls back to TCP sockets",
    ("NCCL_DEBUG", "TRACE"): "trace logging slows every collective",
    ("HCCL_INTRA_PCIE_ENABLE", "1"): "HCCL routes intra-node traffic over PCIe instead of HCCS",
}
CANN_INFO = (
    "ascend-toolkit/latest/{arch}-linux/ascend_toolkit_install.info",
    "ascend-toolkit/latest/version.cfg",
)


@dataclass
class Check:
    name: str
    status: str  # PASS | WARN | FAIL
    detail: str
    hint: str = ""


# -- versions ---------------------------------------------------------------------------------
def versions() -> dict:
    """The software a run depends on; run_card.json records the same."""
    import torch

    import ladle

    out = {"python": platform.python_version(), "torch": torch.__version__, "ladle": ladle.__version__}
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    try:
        import torch_npu

        out["torch_npu"] = torch_npu.__version__
    except ImportError:
        pass
    if cann := cann_version():
        out["cann"] = cann
    if driver := driver_version():
        out["driver"] = driver
    return out


def cann_version(root: Path | None = None) -> str | None:
    """CANN's version from the toolkit's install info (`version=8.0.RC2`), when installed: under
    $ASCEND_TOOLKIT_HOME, or `root` (/usr/local/Ascend)/ascend-toolkit/latest."""
    arch = f"{platform.machine()}-linux/ascend_toolkit_install.info"
    places = [Path(root or "/usr/local/Ascend") / "ascend-toolkit" / "latest" / arch]
    if root is None and os.environ.get("ASCEND_TOOLKIT_HOME"):
        places.insert(0, Path(os.environ["ASCEND_TOOLKIT_HOME"]) / arch)
    for f in places:
        if f.is_file():
            if m := re.search(r"^\s*version\s*=\s*(\S+)", f.read_text(errors="replace"), re.M | re.I):
                return m.group(1)
    return None


def driver_version() -> str | None:
    """The NVIDIA driver (nvidia-smi) or the Ascend driver (driver/version.info)."""
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if out:
        return out.splitlines()[0].strip()
    f = Path("/usr/local/Ascend/driver/version.info")
    if f.is_file() and (m := re.search(r"^\s*Version\s*=\s*(\S+)", f.read_text(errors="replace"), re.M)):
        return m.group(1)
    return None


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


# -- the tools' text --------------------------------------------------------------------------
def parse_topology(text: str) -> dict[tuple[str, str], str]:
    """The link type between each pair of devices in `nvidia-smi topo -m` or `npu-smi info -t
    topo` (`NV12`, `HCCS`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`), keyed by the two device names."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = next((ln.split() for ln in lines if re.match(r"^\s+(GPU|NPU)\d+", ln)), None)
    if header is None:
        return {}
    devices = [h for h in header if re.fullmatch(r"(GPU|NPU)\d+", h)]
    links = {}
    for ln in lines:
        cells = ln.split()
        if not cells or cells[0] not in devices:
            continue
        for other, link in zip(devices, cells[1 : 1 + len(devices)], strict=False):
            if other != cells[0]:
                links[(cells[0], other)] = link
    return links


def link_kind(link: str) -> str:
    """'fast' (NVLink, HCCS) or 'pcie' (through PCIe switches, the host bridge or the CPUs)."""
    return "fast" if link.startswith("NV") or link.upper().startswith("HCCS") else "pcie"


def parse_npu_smi(text: str) -> list[dict]:
    """The NPUs of `npu-smi info`: id, name, health and HBM used / total in MB."""
    rows, lines = [], text.splitlines()
    for i, ln in enumerate(lines):
        m = re.match(r"^\|\s*(\d+)\s+(\S+)\s*\|\s*(\S+)\s*\|", ln)
        if not m or i + 1 >= len(lines):
            continue
        hbm = re.findall(r"(\d+)\s*/\s*(\d+)", lines[i + 1])
        if not hbm:
            continue
        used, total = (int(x) for x in hbm[-1])
        rows.append(
            {
                "id": int(m.group(1)),
                "name": m.group(2),
                "health": m.group(3),
                "hbm_used_mb": used,
                "hbm_total_mb": total,
            }
        )
    return rows


def parse_nvidia_smi(text: str) -> list[dict]:
    """`nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader,nounits`."""
    rows = []
    for ln in text.splitlines():
        parts = [p.strip() for p in ln.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            rows.append(
                {"id": int(parts[0]), "name": parts[1], "total_mb": int(parts[2]), "used_mb": int(parts[3])}
            )
    return rows


# -- the checks -------------------------------------------------------------------------------
def check_versions() -> list[Check]:
    import torch

    v = versions()
    out = [
        Check(
            "python",
            PASS if sys.version_info >= (3, 11) else FAIL,
            v["python"],
            "ladle needs Python 3.11 or newer",
        )
    ]
    major, minor = (int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    out.append(
        Check(
            "torch",
            PASS if (major, minor) >= (2, 11) else FAIL,
            torch.__version__ + (f" (CUDA {v['cuda']})" if "cuda" in v else ""),
            "ladle needs torch 2.11 or newer",
        )
    )
    out.append(Check("ladle", PASS, v["ladle"]))
    if "torch_npu" in v or "cann" in v:
        ok = "torch_npu" in v and "cann" in v
        out.append(
            Check(
                "ascend",
                PASS if ok else FAIL,
                f"torch_npu {v.get('torch_npu', 'missing')}, CANN {v.get('cann', 'not found')}",
                ""
                if ok
                else "install torch_npu matching this torch and CANN, and source set_env.sh (docs/ascend.md)",
            )
        )
    if "driver" in v:
        out.append(Check("driver", PASS, v["driver"]))
    return out


def check_devices() -> list[Check]:
    import torch

    from ladle import device as dev

    out = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(Check(f"cuda:{i}", PASS, f"{p.name}, {p.total_memory / 2**30:.1f} GiB"))
    elif dev._has_npu():
        for i in range(torch.npu.device_count()):
            free, total = torch.npu.mem_get_info(i)
            out.append(Check(f"npu:{i}", PASS, f"{torch.npu.get_device_name(i)}, {total / 2**30:.1f} GiB"))
    else:
        out.append(
            Check("accelerator", WARN, "none: training runs on the CPU", "fine for tests and tiny models")
        )
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    out.append(Check("cpu", PASS, f"{os.cpu_count()} cores, {ram:.1f} GiB memory, {platform.machine()}"))
    return out


def check_backends() -> list[Check]:
    import torch
    import torch.distributed as dist

    from ladle import device as dev

    have = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    if dev._has_npu():
        have.append("hccl")
    out = [
        Check(
            "backends",
            PASS if "gloo" in have else FAIL,
            ", ".join(have) or "none",
            "torch without distributed",
        )
    ]
    if torch.cuda.is_available() and "nccl" not in have:
        out.append(Check("nccl", FAIL, "CUDA devices without NCCL", "install a CUDA build of torch"))
    return out


def check_environment(env: dict | None = None) -> list[Check]:
    env = dict(os.environ if env is None else env)
    shown = {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    out = [
        Check(
            "environment",
            PASS,
            ", ".join(f"{k}={v}" for k, v in shown.items()) or "no NCCL_*, HCCL_*, ASCEND_* set",
        )
    ]
    for (k, bad), why in ENV_WARNINGS.items():
        if env.get(k) == bad:
            out.append(Check(k, WARN, f"{k}={bad}: {why}", f"unset {k} unless you meant it"))
    for k in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"):
        if k in env and env[k].strip() in ("", "-1"):
            out.append(Check(k, FAIL, f"{k}={env[k]!r} hides every device", f"unset {k} or list the devices"))
    return out


def check_topology(text: str | None, tool: str) -> list[Check]:
    if not text:
        return []
    links = parse_topology(text)
    slow = sorted(
        {f"{a}-{b} {link}" for (a, b), link in links.items() if a < b and link_kind(link) == "pcie"}
    )
    if not links:
        return [Check("topology", WARN, f"{tool}: no device matrix found", "")]
    if slow:
        return [
            Check(
                "topology",
                WARN,
                f"{len(slow)} device pairs linked through PCIe: {', '.join(slow[:6])}"
                + (" ..." if len(slow) > 6 else ""),
                "keep tensor parallel groups within NVLink/HCCS-connected devices (parallel.tp)",
            )
        ]
    kinds = sorted({links[k] for k in links})
    return [Check("topology", PASS, f"{len(links) // 2} device pairs, all NVLink/HCCS ({', '.join(kinds)})")]


def check_disk(folder: str | os.PathLike, probe_mb: int = 64) -> list[Check]:
    """Free space and write speed (with fsync) where checkpoints go."""
    folder = Path(folder)
    where = folder
    while not where.exists():
        where = where.parent
    usage = shutil.disk_usage(where)
    free = usage.free / 2**30
    out = [
        Check(
            "disk free",
            PASS if free >= 50 else WARN,
            f"{free:.1f} GiB free at {where}",
            "checkpoints of big models need room: a 7B model with AdamW state is ~85 GB",
        )
    ]
    try:
        probe = where / f".ladle-doctor-{os.getpid()}"
        block = os.urandom(1 << 20)
        t0 = time.perf_counter()
        with open(probe, "wb") as f:
            for _ in range(probe_mb):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        rate = probe_mb / (time.perf_counter() - t0)
        probe.unlink()
    except OSError as e:
        return [
            *out,
            Check("disk write", FAIL, f"cannot write in {where}: {e}", "choose a writable output_dir"),
        ]
    out.append(
        Check(
            "disk write",
            PASS if rate >= 200 else WARN,
            f"{rate:,.0f} MB/s (fsync'd {probe_mb} MB)",
            "slow storage stalls checkpoints: checkpoint.async_save, or a faster output_dir",
        )
    )
    return out


def check_gemm() -> list[Check]:
    from ladle import device as dev

    device = dev.pick_device("auto")
    dtype = "bf16" if device.type != "cpu" else "fp32"
    measured = dev.measure_gemm_tflops(device, dtype)
    if device.type == "cpu":
        return [Check("gemm", PASS, f"{measured:.2f} TFLOP/s {dtype} measured on the CPU")]
    sheet, source = None, ""
    name = dev.device_name(device)
    for pattern, peaks in dev.PEAK_TFLOPS:
        if pattern.lower() in name.lower():
            sheet, source = peaks.get(dtype), pattern
            break
    if not sheet:
        return [
            Check("gemm", PASS, f"{measured:.1f} TFLOP/s {dtype} measured ({name} has no datasheet entry)")
        ]
    share = measured / sheet
    return [
        Check(
            "gemm",
            PASS if share >= 0.6 else WARN,
            f"{measured:.1f} TFLOP/s {dtype} measured, {100 * share:.0f}% of the datasheet's {sheet:g} ({source})",
            "below 60% of the datasheet: clocks, power capping or another process on the device",
        )
    ]


def run_checks(output_dir: str | os.PathLike = "runs", gemm: bool = True) -> list[Check]:
    checks = [*check_versions(), *check_devices(), *check_backends(), *check_environment()]
    checks += check_topology(_run(["nvidia-smi", "topo", "-m"]), "nvidia-smi topo -m")
    checks += check_topology(_run(["npu-smi", "info", "-t", "topo"]), "npu-smi info -t topo")
    if text := _run(["npu-smi", "info"]):
        for d in parse_npu_smi(text):
            ok = d["health"].upper() == "OK"
            checks.append(
                Check(
                    f"npu {d['id']} health",
                    PASS if ok else FAIL,
                    f"{d['name']} {d['health']}, HBM {d['hbm_used_mb']:,} / {d['hbm_total_mb']:,} MB in use",
                    "" if ok else "npu-smi info -t health -i ID shows why; reset or replace the device",
                )
            )
    checks += check_disk(output_dir)
    if gemm:
        checks += check_gemm()
    return checks


def format_checks(checks: list[Check]) -> str:
    mark = {PASS: "ok  ", WARN: "WARN", FAIL: "FAIL"}
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{mark[c.status]}  {c.name:<{width}}  {c.detail}")
        if c.hint and c.status != PASS:
            lines.append(f"      {'':<{width}}  -> {c.hint}")
    fails, warns = sum(c.status == FAIL for c in checks), sum(c.status == WARN for c in checks)
    lines.append(f"{len(checks)} checks: {fails} failed, {warns} warnings")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
