"""`ladle doctor` (issue 19, part 4): the checks on this machine, and the parsers of the device
tools' text on outputs written here (no GPU or NPU in this machine); and the device settings of
part 3 (the allocator's variable, reserved memory)."""

import json
import platform
from pathlib import Path

import torch

from ladle import doctor
from ladle.cli import main

NVIDIA_TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tPXB\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tPXB\t0-47\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\t48-95\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\t48-95\t1\t\tN/A
NIC0\tPXB\tPXB\tSYS\tSYS\t X \t\t\t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  NV#  = Connection traversing a bonded set of # NVLinks
"""

PCIE_TOPO = """\
        GPU0    GPU1    GPU2    CPU Affinity    NUMA Affinity
GPU0     X      PIX     SYS     0-15            0
GPU1    PIX      X      SYS     0-15            0
GPU2    SYS     SYS      X      16-31           1
"""

NPU_TOPO = """\
           NPU0       NPU1       NPU2       NPU3       CPU Affinity
NPU0       X          HCCS       HCCS       HCCS       144-167
NPU1       HCCS       X          HCCS       HCCS       144-167
NPU2       HCCS       HCCS       X          HCCS       96-119
NPU3       HCCS       HCCS       HCCS       X          96-119

Legend:
  X    = Self
  HCCS = Connection traversing HCCS.
"""

NPU_SMI = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc3                 Version: 23.0.rc3                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B2               | OK            | 92.6        36                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3339 / 65536         |
+===========================+===============+====================================================+
| 1     910B2               | Warning       | 90.1        38                0    / 0             |
| 0                         | 0000:01:00.0  | 0           0    / 0          61234 / 65536        |
+===========================+===============+====================================================+
"""


def test_doctor_on_this_machine(tmp_path, capsys):
    assert main(["doctor", "--json", "--output-dir", str(tmp_path / "runs")]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["python"]["status"] == "pass" and checks["python"]["detail"] == platform.python_version()
    assert checks["torch"]["status"] == "pass" and checks["torch"]["detail"].startswith(torch.__version__)
    assert checks["backends"]["detail"].startswith("gloo")
    assert checks["accelerator"]["status"] == "warn"  # this machine has none
    assert "MB/s (fsync'd 64 MB)" in checks["disk write"]["detail"]
    assert "GiB free at" in checks["disk free"]["detail"] and "TFLOP/s fp32" in checks["gemm"]["detail"]
    assert not list(tmp_path.glob("**/.ladle-doctor-*"))  # the probe is gone
    assert main(["doctor", "--no-gemm", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ok    python" in out and "checks: 0 failed" in out and "gemm" not in out


def test_topology_parsers_tell_nvlink_and_hccs_from_pcie():
    links = doctor.parse_topology(NVIDIA_TOPO)
    assert len(links) == 12 and set(links.values()) == {"NV18"}  # the NIC is not a device pair
    assert doctor.check_topology(NVIDIA_TOPO, "nvidia-smi")[0].status == "pass"
    assert set(doctor.parse_topology(NPU_TOPO).values()) == {"HCCS"}
    assert doctor.check_topology(NPU_TOPO, "npu-smi")[0].detail == "6 device pairs, all NVLink/HCCS (HCCS)"
    (slow,) = doctor.check_topology(PCIE_TOPO, "nvidia-smi")
    assert slow.status == "warn" and "GPU0-GPU1 PIX, GPU0-GPU2 SYS, GPU1-GPU2 SYS" in slow.detail
    assert doctor.parse_topology("no devices here") == {}


def test_npu_and_nvidia_smi_parsers():
    rows = doctor.parse_npu_smi(NPU_SMI)
    assert rows == [
        {"id": 0, "name": "910B2", "health": "OK", "hbm_used_mb": 3339, "hbm_total_mb": 65536},
        {"id": 1, "name": "910B2", "health": "Warning", "hbm_used_mb": 61234, "hbm_total_mb": 65536},
    ]
    csv = "0, NVIDIA H100 80GB HBM3, 81559, 1\n1, NVIDIA H100 80GB HBM3, 81559, 523\n"
    assert doctor.parse_nvidia_smi(csv)[1] == {
        "id": 1,
        "name": "NVIDIA H100 80GB HBM3",
        "total_mb": 81559,
        "used_mb": 523,
    }


def test_environment_settings_that_cost_bandwidth_or_hide_devices():
    got = {c.name: c for c in doctor.check_environment({"NCCL_P2P_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""})}
    assert got["NCCL_P2P_DISABLE"].status == "warn" and "NVLink is not used" in got["NCCL_P2P_DISABLE"].detail
    assert got["CUDA_VISIBLE_DEVICES"].status == "fail"
    assert "NCCL_P2P_DISABLE=1" in got["environment"].detail
    assert [c.status for c in doctor.check_environment({"PATH": "/bin"})] == ["pass"]


def test_cann_version_from_the_toolkit(tmp_path):
    info = (
        tmp_path / "ascend-toolkit" / "latest" / f"{platform.machine()}-linux" / "ascend_toolkit_install.info"
    )
    info.parent.mkdir(parents=True)
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC2\ninnerversion=V100R001C19\n")
    assert doctor.cann_version(tmp_path) == "8.0.RC2"
    assert doctor.cann_version(tmp_path / "none") is None


def test_the_run_card_records_the_doctors_versions(tiny_config):
    from ladle.config.load import build_config
    from ladle.recipes import load

    cfg = build_config(tiny_config, ["train.max_steps=1", "train.eval_steps=0", "scheduler.warmup_steps=0"])
    assert load("pretrain").run(cfg) == "completed"
    card = json.loads((Path(cfg.output_dir) / "run_card.json").read_text())
    assert card["versions"] == doctor.versions()


def test_the_allocator_setting_goes_to_the_devices_variable(monkeypatch):
    from ladle import device as dev

    for var in dev.ALLOC_CONF_VARS.values():
        monkeypatch.delenv(var, raising=False)
    assert dev.apply_alloc_conf("cuda", "expandable_segments:True") == "PYTORCH_CUDA_ALLOC_CONF"
    assert dev.apply_alloc_conf("npu", "expandable_segments:True") == "PYTORCH_NPU_ALLOC_CONF"
    import os

    assert (
        os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        == os.environ["PYTORCH_NPU_ALLOC_CONF"]
        == "expandable_segments:True"
    )
    assert (
        dev.apply_alloc_conf("cpu", "expandable_segments:True") is None
        and dev.apply_alloc_conf("cuda", "") is None
    )
    assert dev.peak_reserved_bytes(torch.device("cpu")) is None  # so metrics.jsonl has no such key on a CPU
