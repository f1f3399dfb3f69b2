"""The memory and layout planner: will a run fit on its devices, and which layout is fastest?

`estimate(cfg, recipe, layout, target)` adds up one device's memory at its peak, part by part:

- state (ladle/plan/memory.py): parameters, gradients and optimizer state of every model the recipe
  holds (the policy; DPO's online reference; GRPO's and PPO's reference, PPO's critic, a reward
  model), each as ladle lays it out, on the worst pipeline rank (and the fuller group of a
  separated placement);
- activations (ladle/plan/activations.py): one micro-batch's saved tensors times the micro-batches
  a pipeline schedule keeps in flight (GPipe all of them, 1F1B `pp` on the first rank, the
  interleaved schedules Megatron's `pp x (1 + (pp - 1) / (pp x v))`), plus one block's worth
  recomputed under checkpointing and autocast's bf16 weight copies;
- transient buffers: FSDP2's gathered blocks (this one and the prefetched next) and the block's
  unsharded gradients with their reduce-scatter input, the root's gathered embedding and head for
  the whole step; DDP's gradient buckets; the logits' gradient and the loss's fp32 chunk in
  backward; an RL recipe's generation (KV cache and last-position logits of a rollout batch);
  Muon's largest matrix gathered whole with its Newton-Schulz iterates (`optim.name: muon`,
  whose state is one momentum buffer per matrix instead of AdamW's two moments);
- the runtime (CUDA/CANN context, NCCL/HCCL buffers: `Target.runtime`, 1 GiB by default) and a
  margin for the allocator's fragmentation (`Target.margin` of the rest, 10% by default).

Step time: the training FLOPs of the step (ladle/train/metrics.py's 6N + attention) at a stated
MFU of a stated peak, the pipeline bubble, plus communication: FSDP, DDP and HSDP traffic overlaps
the compute (only what exceeds it is exposed); tensor, context, expert and pipeline parallel
traffic sits on the critical path. A collective over n ranks moves (n - 1) / n of its bytes per
rank (an all-reduce twice that), over the intra-node bandwidth when its ranks share a node, else
over the inter-node one. These are estimates for ranking layouts, not promises.

`layouts(cfg, recipe, target)` enumerates the layouts of `target.devices` (tensor parallel within
a node), `remedy(...)` finds the first change that fits in the order users should try them.

The parts: estimate.py (the estimate), search.py (layouts and remedies), report.py (the text, the
check before launch, the out-of-memory report), memory.py and activations.py (the terms),
measure.py (what a real run holds: the yardstick of the tests).
"""

from ladle.plan.estimate import Estimate, Target, estimate, in_flight, micro
from ladle.plan.report import Report, check_fits, oom_report, plan
from ladle.plan.search import layouts, remedy

__all__ = [
    "Estimate",
    "Report",
    "Target",
    "check_fits",
    "estimate",
    "in_flight",
    "layouts",
    "micro",
    "oom_report",
    "plan",
    "remedy",
]
