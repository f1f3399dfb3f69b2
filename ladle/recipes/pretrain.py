"""Pretraining: next-token prediction on packed, document-aware sequences of prepared data."""

from __future__ import annotations

import time

import torch

from ladle import device as dev
from ladle import distributed as dist
from ladle.config import LadleConfig
from ladle.config.checks import check_all
from ladle.data.loader import (
    BatchLayout,
    PackedSamples,
    PretrainLoader,
    SharedLoader,
    eval_batch_count,
    eval_batches,
)
from ladle.data.prepare import open_split
from ladle.models.hf import is_hf_folder, load_hf_weights, resolve_config
from ladle.models.llama import Llama, build_model, count_params
from ladle.models.lora import apply_lora, init_adapters
from ladle.models.nf4 import quantize_linears
from ladle.parallel.compile import eager
from ladle.parallel.init import materialize
from ladle.parallel.mesh import Layout, Parallel, check_layout
from ladle.parallel.parallelize import build_pipeline, gather_model, parallelize
from ladle.train.checkpoint import load_model_weights, resolve_checkpoint, verify_on_all_ranks
from ladle.train.loop import Trainer
from ladle.train.metrics import flops_per_token
from ladle.train.precision import resolve_mode
from ladle.train.run import Resume, RunDir, resolve_resume, restart_reason, throughput_summary


def packed_samples(cfg: LadleConfig, split: str, found: dict) -> PackedSamples:
    """Pretraining rows: `seq_len + 1` consecutive tokens of the split's token stream."""
    return PackedSamples(open_split(cfg.data.path, split), cfg.data.seq_len, split, cfg.data.document_mask)


def build_trainer(
    cfg: LadleConfig,
    device: torch.device,
    found: dict,
    resume: Resume | None,
    par: Parallel | None = None,
    recipe: str = "pretrain",
    samples=packed_samples,  # (cfg, split, found) -> rows with len() and get(i), as PackedSamples
) -> Trainer:
    par = par or Parallel(Layout(), device)
    resume = resume or Resume(None)
    run = RunDir(cfg, device, recipe=recipe, resume=resume)
    t = cfg.train
    # Each data-parallel rank reads its own slice of every global batch; a TP group shares one.
    layout = BatchLayout(t.micro_batch_size, t.grad_accum_steps, par.dp_rank, par.dp_size)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    param_dtype = torch.bfloat16 if cfg.precision.mode == "bf16" else torch.float32
    # A resumed run's weights come from its checkpoint; an adapter run's checkpoints hold only the
    # adapters, so its frozen base is loaded from init_from (or the seeded init) every time.
    init = cfg.model.init_from if resume.path is None or cfg.lora else None
    fresh = resume.path is None or cfg.lora is not None
    hf = init if init and is_hf_folder(init) else None
    ckpt = resolve_checkpoint(init) if init and not hf else None  # a ladle checkpoint's weights only
    pipeline = None
    if par.layout.sharded:
        # Laid out on the meta device, then each rank allocates and fills only its shards.
        with torch.device("meta"):
            model = Llama(cfg.model)
        model.to(dtype=param_dtype)
        if par.layout.pp > 1:  # this rank's stages, each laid out like a model of its own
            model, pipeline = build_pipeline(model, par, cfg, device)
        else:
            model = parallelize(model, par, cfg, device)
        materialize(model, cfg.model, device, param_dtype, hf_path=hf, fill=fresh and ckpt is None)
        if ckpt:  # DCP reshards any layout's checkpoint into this one
            load_model_weights(ckpt, model, base_only=cfg.lora is not None)
        if cfg.lora is not None:  # the adapters' init needs the base in place (DoRA: |W|)
            for part in getattr(model, "parts", [model]):
                init_adapters(part, cfg.seed)
    else:
        # From init_from (or a checkpoint) every tensor is overwritten: skip the random init then.
        model = build_model(cfg.model, device=device, dtype=param_dtype, init=not init)
        if hf:
            load_hf_weights(model, hf)
        elif ckpt:
            load_model_weights(ckpt, model)
        if cfg.lora is not None and cfg.lora.quantize_base == "nf4":
            nf4, full = quantize_linears(model)
            run.events(
                f"QLoRA: the frozen base's block linears take {nf4 / 2**20:,.2f} MiB in NF4, "
                f"{full / 2**20:,.2f} MiB in {param_dtype} ({full / nf4:.1f}x less)"
            )
        model = parallelize(model, par, cfg, device)  # adapters added (and initialised) here
    if init:
        run.events(f"weights from {ckpt or hf}")
    n_params = count_params(cfg.model)
    n_no_embed = count_params(cfg.model, exclude_embeddings=True, active=True)
    m = cfg.model
    fpt = flops_per_token(n_no_embed, m.n_layers, m.n_heads, m.head_size, cfg.data.seq_len)
    trained = ""
    if cfg.lora is not None:
        n_trained, n_adapters, frozen = adapter_counts(cfg, n_no_embed)
        fpt += 6 * n_adapters - 2 * frozen
        saved = f" and {', '.join(cfg.lora.modules_to_save)} in full" if cfg.lora.modules_to_save else ""
        trained = f", {n_trained:,} trained (adapters{saved}; MFU counts 4 FLOPs a token for a frozen weight)"

    train = samples(cfg, "train", found)
    loader = None
    if par.shared_rank == 0 or not cfg.data.shared_read:
        loader = PretrainLoader(train, layout, seed=cfg.seed, device=device, prefetch=cfg.data.prefetch)
    if par.shared and cfg.data.shared_read:  # one read per TP/CP/PP group, broadcast to the rest
        loader = SharedLoader(
            loader,
            group=par.shared_group,
            leader=par.shared_leader,
            keys=tuple(train.get(0)),
            shape=(t.micro_batch_size, cfg.data.seq_len),
            n_micro=t.grad_accum_steps,
            global_batch=layout.global_batch,
            device=device,
        )
        run.events(f"batches read by the first rank of each {par.shared} group and broadcast to the others")
    val = samples(cfg, "val", found)
    n_eval = eval_batch_count(val, layout, t.eval_steps)
    evaluate = (lambda: eval_batches(val, layout, t.eval_steps, device)) if n_eval else None

    trainer = Trainer(
        cfg, run, model, loader, flops_per_token=fpt, eval_batches=evaluate, parallel=par, pipeline=pipeline
    )
    run.events(
        f"model: {n_params:,} parameters (N = {n_no_embed:,} for MFU: all but the input embedding"
        f"{', experts a token uses' if cfg.model.moe else ''}){trained}; "
        f"{len(train):,} train samples of {cfg.data.seq_len} tokens, {len(val):,} validation samples; "
        f"device {device} ({dev.device_name(device)}), world size {dist.world_size()}, "
        f"layout {par.layout.describe()}"
    )
    if t.eval_steps and not n_eval:
        run.events(
            f"no validation: the val split has {len(val)} samples, fewer than one batch of "
            f"{t.micro_batch_size * par.dp_size}; prepare with --val-fraction to hold some out",
            level="warning",
        )
    run.write_card(
        status="running",
        parameters=n_params,
        parameters_without_embedding=n_no_embed,
        flops_per_token=fpt,
        mfu_peak_tflops=trainer.peak_tflops,
        mfu_peak_source=trainer.peak_source,
        tokenizer_hash=found["tokenizer"].hash,
        data={"path": cfg.data.path, "train_samples": len(train), "val_samples": len(val)},
    )
    if resume.path is not None:
        trainer.resume_from(resume.path)
    return trainer


def sample_text(cfg: LadleConfig, model, tok, device) -> str | None:
    """A generated continuation of `sample.prompt`: the demo's proof that the model learned."""
    from ladle.generation import generate

    s = cfg.sample
    if not s.prompt or s.max_new_tokens == 0:
        return None
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    ids = tok.encode(s.prompt)
    out = generate(
        model,
        [ids],
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        eos_id=tok.eos_id,
        generator=g,
    )[0]
    return s.prompt + tok.decode(out)


def adapter_counts(cfg: LadleConfig, n_no_embed: int) -> tuple[int, int, int]:
    """(trained parameters, adapter parameters, frozen weights among MFU's N = n_no_embed) of an
    adapter run, counted on a meta-device copy (so for any layout). A frozen weight costs no
    weight gradient: 4 FLOPs a token instead of 6; the adapters are matmul weights of their own."""
    with torch.device("meta"):
        meta = Llama(cfg.model)
    apply_lora(meta, cfg.lora)
    trained = sum(p.numel() for p in meta.parameters() if p.requires_grad)
    adapters = sum(p.numel() for n, p in meta.named_parameters() if ".lora_A." in n or ".lora_B." in n)
    head = meta.embed_tokens.weight if cfg.model.tie_embeddings else meta.lm_head.weight
    return trained, adapters, n_no_embed - (head.numel() if head.requires_grad else 0)


def run(cfg: LadleConfig, recipe: str = "pretrain", samples=packed_samples) -> str:
    """Trains a causal LM on `samples` (pretraining rows by default; the SFT recipe passes its
    own) and writes the run card; returns the loop's status."""
    cfg = resolve_config(cfg)  # model.init_from: the shape comes from the checkpoint
    found = check_all(cfg, recipe)  # tokenizer and data, before anything is written
    device = dev.pick_device(cfg.train.device, dist.local_rank())
    dev.set_device(device)
    dist.init(device)
    try:
        status = _train(cfg, recipe, samples, found, device)
        # Every rank waits for rank 0's sample and run card, then all leave the process group
        # together: a rank whose process exits with its group alive can abort in gloo's threads
        # ("terminate called without an active exception") while rank 0 still works, and torchrun
        # then reports the finished run as failed.
        dist.barrier()
    finally:
        dist.shutdown()
    return status


def _train(cfg: LadleConfig, recipe: str, samples, found: dict, device: torch.device) -> str:
    cfg, precision_note = resolve_mode(cfg, device)  # config.yaml records the mode that ran
    # A restart on one rank is one on all (a replaced node's own attempt count starts at 0); the
    # ranks share out the checksums of the checkpoints they consider.
    restart = restart_reason(cfg.output_dir)
    if dist.any_rank(restart is not None, device):
        restart = restart or "another rank's attempt is a restart of this job"
    resume = resolve_resume(cfg, restart, check=verify_on_all_ranks)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    par = Parallel(check_layout(cfg, dist.world_size()), device, cfg.parallel.cp_attention)
    trainer = build_trainer(cfg, device, found, resume, par, recipe, samples)
    run_dir = trainer.run
    if precision_note:
        run_dir.events(precision_note, level="warning" if "emulates" in precision_note else "info")
    status = trainer.fit()
    final = {"status": status, "step": trainer.step, "tokens_seen": trainer.tokens_seen}
    if trainer.last_record:
        final["train_loss"] = trainer.last_record["loss"]
    if trainer.last_val:
        final["val_loss"] = trainer.last_val["val_loss"]
        final["val_ppl"] = trainer.last_val["val_ppl"]
    if status == "completed" and cfg.sample.prompt and cfg.sample.max_new_tokens:
        model = gather_model(trainer.model, cfg, par)  # every rank takes part; rank 0 gets it
        text = None
        if model is not None:
            with eager():
                text = sample_text(cfg, model, found["tokenizer"], device)
        if text is not None:
            final["sample"] = text
            run_dir.console.rule("sample")
            run_dir.console.print(text, markup=False, highlight=False)
            run_dir.console.rule()
    run_dir.write_card(
        status=status,
        final=final,
        throughput=throughput_summary(run_dir.dir),
        ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    run_dir.events(f"run {status} at step {trainer.step}; results in {run_dir.dir}")
    return status
