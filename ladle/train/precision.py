"""The four precision modes.

| mode       | parameters, grads, optimizer state | forward / backward math | loss scaling |
| ---------- | ---------------------------------- | ----------------------- | ------------ |
| fp32       | fp32                               | fp32                    | no           |
| bf16-mixed | fp32                               | bf16 autocast           | no           |
| fp16-mixed | fp32                               | fp16 autocast           | dynamic      |
| bf16       | bf16                               | bf16                    | no           |

The loss itself is always computed in fp32 (logits are upcast before the cross-entropy).
"""

from __future__ import annotations

import contextlib

import torch

from ladle import device as dev
from ladle.config import PrecisionConfig
from ladle.errors import ConfigError


class Precision:
    def __init__(self, cfg: PrecisionConfig, device: torch.device):
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
