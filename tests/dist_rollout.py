"""Run by test_rollout.py under torchrun (2 processes, gloo): rollouts of an FSDP-sharded policy,
each rank sampling a share of the prompts (`balance`), against one process sampling them all."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from ladle.config.schema import ModelConfig
from ladle.models.llama import build_model
from ladle.rl.rollout import Sampling, balance, rollout

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
model = build_model(cfg)
g = torch.Generator().manual_seed(1)
prompts = [
    torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (7,), generator=g)
]
sampling = Sampling(n=3, temperature=1.0, top_p=0.95, max_new_tokens=12)
one = rollout(model, prompts, list(range(7)), sampling, seed=5, step=2, end_ids={0}, batch_size=4)

for block in model.layers:
    fully_shard(block)
fully_shard(model)
mine = balance([len(p) for p in prompts], world)[rank]  # rank 1 gets fewer rows: uneven batch counts
got = rollout(model, [prompts[i] for i in mine], mine, sampling, seed=5, step=2, end_ids={0}, batch_size=4)
rows = [None] * world
dist.all_gather_object(
    rows, {(i, s): r for i, s, r in zip(got.prompt_index, got.sample_index, got.response_ids, strict=True)}
)
merged = {k: v for part in rows for k, v in part.items()}
want = {(i, s): r for i, s, r in zip(one.prompt_index, one.sample_index, one.response_ids, strict=True)}
assert merged == want, (merged, want)
print(f"rank {rank}: FSDP rollouts equal one process's ({len(want)} responses)", file=sys.stdout)
dist.barrier()  # gloo aborts a rank that tears down while its peer still talks to it
dist.destroy_process_group()
# Skip the interpreter's teardown: gloo's threads can abort it ("terminate called without an
# active exception", about one run in three on this machine) after everything above succeeded.
sys.stdout.flush()
os._exit(0)
