"""Models out of training checkpoints: for `ladle export hf`, `ladle generate` and evaluation."""

from __future__ import annotations

from pathlib import Path

import torch

from ladle.checkpoint.catalogue import read_config
from ladle.checkpoint.dcp import load_model_weights, resolve_checkpoint
from ladle.config import ModelConfig
from ladle.errors import CheckpointError, DataError


def load_checkpoint_model(path: str | Path, device="cpu", dtype=torch.float32):
    """(model, model config, resolved run config dict) from a training checkpoint. An adapter
    run's checkpoint holds only the adapters: its base comes from the run's model.init_from (or
    the seeded init it started from), the adapters are added and read on top."""
    from ladle.models.llama import build_model

    ckpt = resolve_checkpoint(path)
    run_cfg = read_config(ckpt)
    model_dict = {k: v for k, v in run_cfg["model"].items() if k != "init_from"}
    mcfg = ModelConfig.model_validate(model_dict)
    lora = run_cfg.get("lora")
    if lora is None:
        model = build_model(mcfg, device=device, dtype=dtype, init=False)
        load_model_weights(ckpt, model)
        return model.eval(), mcfg, run_cfg
    from ladle.config.schema import LoRAConfig
    from ladle.models.lora import apply_lora

    base = run_cfg["model"].get("init_from")
    if base and (Path(base) / "config.json").is_file():
        from ladle.models.hf import load_hf

        model, _ = load_hf(base, device=device, dtype=dtype)
    elif base:
        model, _, _ = load_checkpoint_model(base, device=device, dtype=dtype)
    else:  # the run started from the seeded init, as training draws it
        torch.manual_seed(run_cfg.get("seed", 0))
        model = build_model(mcfg, device=device, dtype=dtype)
    lora = LoRAConfig.model_validate(lora)
    if lora.quantize_base == "nf4":  # the base the adapters were trained on
        from ladle.models.nf4 import quantize_linears

        quantize_linears(model)
    apply_lora(model, lora, run_cfg.get("seed", 0))
    load_model_weights(ckpt, model)
    return model.eval(), mcfg, run_cfg


def load_any_model(path: str | Path, device="cpu", dtype=torch.float32, tokenizer: str | None = None):
    """A training checkpoint (or run directory) or a Hugging Face folder -> (model, tokenizer)."""
    from ladle.data.tokenizer import load_tokenizer
    from ladle.models.hf import load_hf

    p = Path(path)
    if (p / "config.json").is_file():
        model, _ = load_hf(p, device=device, dtype=dtype)
        tok_dir = tokenizer or p
    else:
        model, _, run_cfg = load_checkpoint_model(p, device=device, dtype=dtype)
        tok_dir = tokenizer or run_cfg["tokenizer"]["path"]
    tok = load_tokenizer(tok_dir)
    if tok.vocab_size > model.cfg.vocab_size:
        raise DataError(
            f"the tokenizer at {tok_dir} has {tok.vocab_size} tokens, more than the {model.cfg.vocab_size} "
            f"embedding rows of {p}: it is not this model's tokenizer (pass the right one with --tokenizer)"
        )
    return model.eval(), tok


def export_hf(
    checkpoint: str | Path, out: str | Path, *, dtype: str = "float32", max_shard_gb: float = 5.0
) -> Path:
    from ladle.data.tokenizer import load_tokenizer
    from ladle.models.hf import save_hf

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model, mcfg, run_cfg = load_checkpoint_model(checkpoint)
    if run_cfg.get("lora"):
        from ladle.models.lora import merge_lora

        merge_lora(model)  # the base architecture with the adapters folded in
    tok_dir = run_cfg["tokenizer"]["path"]
    tok = load_tokenizer(tok_dir)
    save_hf(
        model.state_dict(),
        mcfg,
        out,
        tokenizer_dir=tok_dir,
        max_shard_bytes=int(max_shard_gb * 2**30),
        dtype=torch_dtype,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
    )
    return Path(out)


def export_peft(checkpoint: str | Path, out: str | Path) -> Path:
    """An adapter run's checkpoint as a PEFT adapter folder (adapter_config.json +
    adapter_model.safetensors), which PEFT and vLLM load on top of the base model."""
    import json

    from safetensors.torch import save_file

    from ladle.config.schema import LoRAConfig
    from ladle.models.lora import peft_config, peft_state_dict

    model, _, run_cfg = load_checkpoint_model(checkpoint)
    if not run_cfg.get("lora"):
        raise CheckpointError(
            f"{checkpoint} is not an adapter run (its config has no lora section); use `ladle export hf`"
        )
    cfg = LoRAConfig.model_validate(run_cfg["lora"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(peft_state_dict(model, cfg), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    base = run_cfg["model"].get("init_from")
    config = peft_config(cfg, base, tied=model.cfg.tie_embeddings)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
