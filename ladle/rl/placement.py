"""The exchange of the RL recipes' separated placement (`ppo.placement: separated`): the actor's
group of ranks and the critic's run in one torchrun job, rank i of one paired with rank i of the
other (`Parallel.pair_group`, ladle/parallel/mesh.py). The actor's side asks and the critic's
side answers:

    actor:   values = Remote(pair, "critic")(tokens, keep=mask)   # computed on the partner
    critic:  kind, payload = serve(pair, {"critic": model, ...}, context)  # until told what next

then `pair.tell("train", batches)` hands the critic's side its training rows, and `pair.swap`
trades what both sides need after a step (the critic's metrics, whether both updates were
finite). Each group's models are laid out over that group alone, so a call runs on the partner's
whole group at once: every actor rank makes the same number of calls, as FSDP needs. Objects
travel pickled through torch.distributed point-to-point sends, tensors by way of host memory:
simple and exact; the rows of a rollout batch are small beside a forward pass.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as tdist


def to_device(obj, device: torch.device):
    """`obj` (tensors in lists, tuples and dicts) with every tensor on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


HOST = torch.device("cpu")


class Pair:
    """This rank and its partner in the other group (a pair group of two ranks)."""

    def __init__(self, group, device: torch.device):
        ranks = tdist.get_process_group_ranks(group)
        if len(ranks) != 2:
            raise ValueError(f"a pair group holds 2 ranks, this one {len(ranks)}")
        self.group, self.device = group, device
        self.partner = next(r for r in ranks if r != tdist.get_rank())
        # object sends stage through a tensor on this device (NCCL needs it on the accelerator)
        self._staging = device if device.type != "cpu" else None

    def send(self, obj) -> None:
        tdist.send_object_list([to_device(obj, HOST)], dst=self.partner, device=self._staging)

    def recv(self):
        box = [None]
        tdist.recv_object_list(box, src=self.partner, device=self._staging)
        return to_device(box[0], self.device)

    def tell(self, kind: str, payload=None) -> None:
        """A message that ends the partner's `serve` (what it does next)."""
        self.send(("tell", kind, payload))

    def swap(self, obj):
        """The partner's `obj` for this one's: both sides call it at the same point."""
        out = [None, None]
        tdist.all_gather_object(out, to_device(obj, HOST), group=self.group)
        return out[1 - tdist.get_rank(self.group)]


class Remote:
    """A model that lives on the partner's group, called like the model: the arguments go over,
    the output comes back, computed there forward only (`serve`)."""

    def __init__(self, pair: Pair, name: str):
        self.pair, self.name = pair, name

    def __call__(self, *args, **kw):
        self.pair.send(("call", self.name, args, kw))
        return self.pair.recv()


def serve(pair: Pair, models: dict, context) -> tuple[str, object]:
    """Answers the partner's calls of `models` (by name), each without gradients under
    `context()` (the training forward's numerics), until it `tell`s something else: returns
    that (kind, payload)."""
    while True:
        msg = pair.recv()
        if msg[0] == "tell":
            return msg[1], msg[2]
        _, name, args, kw = msg
        with torch.no_grad(), context():
            out = models[name](*args, **kw)
        pair.send(out)


class CriticSide:
    """The loader of the critic's group in a separated placement: while the partner (an actor
    rank) makes a rollout batch it answers its calls of the critic and the reward model
    (`serve`); then it serves that batch's training rows, `reuse` steps over `minibatches`
    slices, as the actor's rollout loader does (ladle/rl/loader.py). Validation answers the
    reward model's calls."""

    KEYS = ("tokens", "targets", "lengths", "old_values", "returns")  # what the critic trains on
    console = ()

    def __init__(self, pair: Pair, models: dict, context, reuse: int, minibatches: int):
        self.pair, self.models, self.context = pair, models, context
        self.reuse, self.minibatches = reuse, minibatches
        self.cached: list[dict] | None = None
        self.bounds: list[int] = []
        self.uses = 0
        self.data_s = 0.0  # no data of its own: the prompts are read by the actor's ranks
        self.gen_s = 0.0  # waiting for the partner's rollouts (generation, scoring)

    @staticmethod
    def hand_over(pair: Pair, batches: list[dict], bounds: list[int]) -> None:
        """The actor's side: a rollout batch's critic rows, in the same microbatches and minibatches."""
        rows = [{k: b[k] for k in CriticSide.KEYS} for b in batches]
        pair.tell("train", {"batches": rows, "bounds": bounds})

    def _until(self, want: str):
        kind, payload = serve(self.pair, self.models, self.context)
        if kind != want:
            raise RuntimeError(f"separated placement: the actor's rank said {kind!r} where {want!r} was due")
        return payload

    def next(self) -> list[dict]:
        t0 = time.perf_counter()
        if self.cached is None or self.uses >= self.reuse:
            got = self._until("train")
            self.cached, self.bounds, self.uses = got["batches"], got["bounds"], 0
        self.gen_s = time.perf_counter() - t0
        k = self.uses % self.minibatches
        self.uses += 1
        return self.cached[self.bounds[k] : self.bounds[k + 1]]

    def validate(self, batches) -> dict:
        self._until("validated")
        return {}  # the actor's ranks log validation

    def state_dict(self) -> dict:
        return {}  # the prompts' position is the actor's (rank 0 writes the trainer state)

    def load_state_dict(self, state: dict) -> None:
        self.cached, self.uses = None, 0

    def step_metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass
