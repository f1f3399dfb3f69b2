"""The four precision modes.

| mode       | parameters, grads, optimizer state | forward / backward math | loss scaling |
| ---------- | ---------------------------------- | ----------------------- | ------------ |
| fp32       | fp32                               | fp32                    | no           |
| bf16-mixed | fp32                               | bf16 autocast           | no           |
| fp16-mixed | fp32                               | fp16 autocast           | dynamic      |
| bf16       | bf16                               | bf16                    | no           |

The loss itself is always computed in fp32 (logits are upcast before the cross-entropy).
`auto` picks bf16-mixed where the device computes bf16 natively, else fp16-mixed (a GPU without
bf16) or fp32 (a CPU without bf16 instructions, where bf16 matmuls are emulated: a GEMM 70x slower
than fp32 on an AVX2-only EPYC); `resolve_mode` decides, before anything is built.
"""

from __future__ import annotations

import contextlib

import torch

from ladle import device as dev
from ladle import distributed as dist
from ladle.config import LadleConfig, PrecisionConfig
from ladle.errors import ConfigError

# A CPU's bf16 GEMM below this share of its fp32 one is emulated (no avx512_bf16 / AMX / SVE-bf16):
# native bf16 measures at 1-2x fp32, emulated at a few percent.
NATIVE_BF16_SHARE = 0.5


def resolve_mode(cfg: LadleConfig, device: torch.device) -> tuple[LadleConfig, str | None]:
    """(the config with precision.mode=auto resolved, what to say about the precision or None).
    On a CPU both GEMMs are measured (once a process; the MFU peak reuses them) and the ranks agree
    (a rank's slow bf16 makes all use fp32). An explicit bf16 mode on an emulating CPU is kept,
    with a warning."""
    mode = cfg.precision.mode
    if device.type == "cuda" and mode == "auto":
        mode = "bf16-mixed" if dev.supports_bf16(device) else "fp16-mixed"
        note = f"precision.mode=auto: {mode} on {dev.device_name(device)}"
    elif device.type == "cpu" and mode in ("auto", "bf16-mixed", "bf16"):
        bf16, fp32 = dev.measure_gemm_tflops(device, "bf16"), dev.measure_gemm_tflops(device, "fp32")
        emulated = dist.any_rank(bf16 < NATIVE_BF16_SHARE * fp32, device)
        gemms = f"this CPU's bf16 GEMM runs at {bf16:.3f} TFLOP/s, its fp32 GEMM at {fp32:.3f}"
        if mode == "auto":
            mode = "fp32" if emulated else "bf16-mixed"
            note = f"precision.mode=auto: {mode} ({gemms}{': bf16 is emulated' if emulated else ''})"
        elif emulated:
            return cfg, (
                f"precision.mode={mode} on a CPU that emulates bf16 ({gemms}): expect steps many times "
                "slower than fp32; set precision.mode=fp32 or auto"
            )
        else:
            return cfg, None
    elif mode == "auto":
        mode, note = "bf16-mixed", f"precision.mode=auto: bf16-mixed on {dev.device_name(device)}"
    else:
        return cfg, None
    return cfg.model_copy(update={"precision": cfg.precision.model_copy(update={"mode": mode})}), note


class Precision:
    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        if cfg.mode == "auto":
            raise ValueError("precision.mode=auto is resolved first: ladle.train.precision.resolve_mode")
        self.mode = cfg.mode
        self.device = device
        self.param_dtype = torch.bfloat16 if cfg.mode == "bf16" else torch.float32
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(cfg.mode)
        if cfg.mode in ("bf16", "bf16-mixed") and not dev.supports_bf16(device):
            raise ConfigError(
                f"precision.mode={cfg.mode}: {dev.device_name(device)} has no bf16 support; "
                "use precision.mode=fp16-mixed or fp32"
            )
        self.scaler = (
            torch.amp.GradScaler(
                device.type, init_scale=cfg.init_loss_scale, growth_interval=cfg.loss_scale_window
            )
            if cfg.mode == "fp16-mixed"
            else None
        )

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def unscale(self, opt: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.unscale_(opt)

    def step(self, opt: torch.optim.Optimizer) -> bool:
        """Runs the optimizer step; False when the loss scaler skipped it (inf/nan gradients)."""
        if not self.scaler:
            opt.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(opt)
        self.scaler.update()
        return self.scaler.get_scale() >= before

    @property
    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler else None

    def state_dict(self) -> dict:
        return (
            {k: (v.item() if torch.is_tensor(v) else v) for k, v in self.scaler.state_dict().items()}
            if self.scaler
            else {}
        )

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
