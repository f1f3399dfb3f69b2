"""Run by test_plan.py under torchrun (gloo): one training step of a tiny model laid out as argv[1]
(JSON: parallel degrees, precision, activation checkpointing) says what it really held on this
rank (`ladle.plan.measure`), beside what the planner says; rank 0 writes both to argv[2].

Parameters, gradients and optimizer state are the bytes of the real tensors after the step;
activations the bytes saved for backward during the forward (under PP, whose schedule runs
forward and backward interleaved, only the state is compared)."""

import json
import os
import sys

import torch
import torch.distributed as dist

from ladle.config.schema import LadleConfig
from ladle.parallel.ac import _SAVE
from ladle.parallel.mesh import Parallel, check_layout
from ladle.plan import Target, estimate, micro
from ladle.plan import activations as act
from ladle.plan import memory as mem
from ladle.plan.measure import SavedTensors, state_bytes
from ladle.train.builder import build_laid_out
from ladle.train.loss import CausalLMLoss
from ladle.train.optim import build_optimizer

spec = json.loads(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
model = {
    "vocab_size": 256,
    "dim": 64,
    "n_layers": 4,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 128,
    "max_seq_len": 256,
}
model.update(spec.get("model", {}))
cfg = LadleConfig.model_validate(
    {
        "output_dir": "/tmp/unused",
        "tokenizer": {"path": "/tmp/unused"},
        "data": {"path": "/tmp/unused", "seq_len": 256},
        "model": model,
        "train": {"micro_batch_size": 2, "grad_accum_steps": spec.get("accum", 1), "device": "cpu"},
        "precision": {"mode": spec.get("precision", "fp32")},
        "parallel": spec["parallel"],
        "activation_checkpoint": spec.get("ac", {"mode": "none"}),
        "optim": {"name": spec.get("optim", "adamw")},
    }
)
device = torch.device("cpu")
lay = check_layout(cfg, world)
par = Parallel(lay, device)
built = build_laid_out(cfg, par, device)
net = built.model
opt = build_optimizer(net, cfg.optim, device)
loss = CausalLMLoss(cfg.model.moe)
g = torch.Generator().manual_seed(1)
tokens = torch.randint(0, 256, (2, 256), generator=g)
batch = par.shard_sequence({"tokens": tokens, "targets": tokens.roll(-1, 1)})
autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision.mode == "bf16-mixed")
keep = _SAVE if cfg.activation_checkpoint.mode == "selective" else ()
saved = None
if built.pipeline is None:
    with SavedTensors(net, keep_ops=keep) as s, par.loss_context(), autocast:
        out = loss(net, batch)
        out.sum.backward()
    saved = s.bytes
else:
    whole = {**batch, "positions": torch.arange(256).expand(2, 256), "doc_ids": torch.zeros_like(tokens)}
    with par.loss_context(), autocast:
        built.pipeline.run([whole] * cfg.train.grad_accum_steps, loss, 1.0)
opt.step()
real = state_bytes(net, opt)
real["activations"] = saved
target = Target(devices=world, memory=2**40, cpu=True)
m = micro(cfg, lay, target)
param_bytes = 2 if cfg.precision.mode == "bf16" else 4
states = mem.state(
    mem.tensors(cfg.model),
    lay,
    param_bytes,
    cfg.model.n_layers,
    cfg.parallel.pp_schedule,
    None,
    cfg.optim.name,
)
mine = dict(states[rank * lay.pp // world])  # pp is the outermost mesh dimension
ac_mode = {"none": "none", "full": "full"}.get(cfg.activation_checkpoint.mode, "op")
parts = act.saved(cfg.model, m, cfg.model.n_layers, ac_mode)
parts.pop("recompute", None)
copies = estimate(cfg, "pretrain", lay, target).parts.get("autocast weight copies", 0)
mine["activations"] = sum(parts.values()) + copies
mine = {k: mine[k] for k in real}
rows = [None] * world
dist.all_gather_object(rows, {"real": real, "planned": mine})
if rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump(rows, f)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
