"""Run by test_parallel.py under torchrun (2 processes): context-parallel attention against the
whole sequence in one process. `allgather` (gloo, CPU): packed rows with many documents.
`ring` (NCCL, one CUDA device per process): PyTorch's ring attention, one document a row.
A second argument `window`: the model has a sliding window of 5 positions."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from ladle.config.schema import ModelConfig
from ladle.models.llama import build_model
from ladle.parallel.cp import ContextParallel, shard_indices

attention = sys.argv[1]
ring = attention == "ring"
device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if ring else "cpu")
if ring:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if ring else "gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
window = (
    {"sliding_window": 5, "family": "mistral"} if "window" in sys.argv[2:] else {}
)  # every layer windowed
cfg = ModelConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64, **window
)
model = build_model(cfg, device=device)
B, T = 3, 32
tokens = torch.randint(0, 64, (B, T)).to(device)
targets = torch.randint(0, 64, (B, T)).to(device)
doc_ids = (torch.rand(B, T) < 0.15).long().cumsum(1).to(device)  # about 5 documents a row
doc_ids[0] = 0  # and one row of a single document
if ring:  # no document mask there
    doc_ids.zero_()
starts = torch.stack([torch.searchsorted(d, d, right=False) for d in doc_ids])  # first slot of each doc
positions = torch.arange(T, device=device).expand(B, T) - starts

logits = model(tokens, positions=positions, doc_ids=doc_ids)
F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
ref_logits, ref_grads = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
model.zero_grad()

cp = ContextParallel(init_device_mesh(device.type, (2,), mesh_dim_names=("cp",)), attention)
batch = {"tokens": tokens, "targets": targets, "positions": positions, "doc_ids": doc_ids}
local = cp.shard(batch)
idx = shard_indices(T, 2, dist.get_rank(), device)
assert torch.equal(local["tokens"], tokens[:, idx]) and "doc_ids" not in local
logits = model(local["tokens"], positions=local["positions"], attention=local["attention"])
F.cross_entropy(logits.flatten(0, 1), local["targets"].flatten(), reduction="sum").backward()
atol = 1e-4 if ring else 1e-5  # ring: partial softmaxes merged in another order
torch.testing.assert_close(logits.detach(), ref_logits[:, idx], atol=atol, rtol=1e-5)
for n, p in model.named_parameters():  # each rank has the gradient of its tokens' loss
    dist.all_reduce(p.grad)
    torch.testing.assert_close(p.grad, ref_grads[n], atol=atol, rtol=1e-4, msg=n)
print(f"rank {dist.get_rank()}: context-parallel {attention} attention matches", flush=True)
dist.barrier()  # gloo aborts a rank that tears down while its peer still talks to it
dist.destroy_process_group()
# Skip the interpreter's teardown: gloo's threads can abort it ("terminate called without an
# active exception", about one run in three on this machine) after everything above succeeded.
sys.stdout.flush()
os._exit(0)
