"""Packed pretraining batches: samples, the global sample order, rank slices and prefetch.

A *sample* is `seq_len + 1` consecutive tokens of a split's token stream (inputs and the targets
shifted by one); sample i starts at token i * seq_len, so every token is a target exactly once.
Document boundaries inside a sample are kept as `doc_ids` (for the document-aware attention mask)
and `positions` (RoPE positions that restart at each document), unless `document_mask=False`
(`data.document_mask`): then a sample is one causal sequence, as in many pretraining setups.

The order is a function of (seed, epoch, global sample index) alone: global index g is sample
`perm(seed, g // n)[g % n]`. Step s of training consumes global indices [s * G, (s + 1) * G) with G
the global batch (micro_batch_size * grad_accum_steps * dp_world). Each data-parallel rank takes a
contiguous slice of that range, so the ranks' union is the whole batch with no overlap, and the
samples a step sees do not depend on how it is split into ranks or microbatches. The loader's
state is just the number of global samples consumed: a resumed (or re-sharded) run continues with
exactly the next ones.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ladle.errors import DataError


class PackedSamples:
    """Fixed-length samples over a TokenStream (`num_tokens`, `doc_starts`, `read(start, stop)`)."""

    unit = "documents"  # what `documents(i)` counts, in a report

    def __init__(self, stream, seq_len: int, name: str = "train", document_mask: bool = True):
        self.stream, self.name = stream, name
        self.document_mask = document_mask
        self.seq_len = seq_len
        self.doc_starts = np.asarray(stream.doc_starts, dtype=np.int64)
        self.num_samples = max(0, (int(stream.num_tokens) - 1) // seq_len)
        if self.num_samples == 0 and name == "train":
            raise DataError(
                f"the {name} split has {stream.num_tokens} tokens, fewer than one sample of "
                f"data.seq_len + 1 = {seq_len + 1}; prepare more data or lower data.seq_len"
            )

    def __len__(self) -> int:
        return self.num_samples

    def documents(self, i: int) -> range:
        """The split's documents sample i holds some tokens of."""
        start = i * self.seq_len
        first, last = np.searchsorted(self.doc_starts, [start, start + self.seq_len], side="right") - 1
        return range(int(first), int(last) + 1)

    def get(self, i: int) -> dict[str, np.ndarray]:
        start = i * self.seq_len
        chunk = self.stream.read(start, start + self.seq_len + 1).astype(np.int64)  # (T + 1,)
        if not self.document_mask:
            return {"tokens": chunk[:-1], "targets": chunk[1:]}
        pos = np.arange(start, start + self.seq_len, dtype=np.int64)  # stream offsets of the inputs
        doc = np.searchsorted(self.doc_starts, pos, side="right") - 1  # (T,) document of each input
        return {
            "tokens": chunk[:-1],
            "targets": chunk[1:],
            "positions": pos - self.doc_starts[doc],
            # Renumbered from 0 per sample: only equality matters to the mask.
            "doc_ids": doc - doc[0],
        }


class SampleOrder:
    """Global sample index -> sample index, reshuffled each epoch from (seed, epoch) alone."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = num_samples, seed, shuffle
        self._epoch, self._perm = -1, None

    def __call__(self, g: int) -> int:
        epoch, k = divmod(g, self.n)
        if not self.shuffle:
            return k
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch = epoch
        return int(self._perm[k])


@dataclass(frozen=True)
class BatchLayout:
    micro_batch_size: int
    grad_accum_steps: int
    dp_rank: int = 0
    dp_world: int = 1

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.dp_world

    def rank_indices(self, step_start: int) -> list[list[int]]:
        """Global sample indices of this rank's microbatches for the step starting at `step_start`."""
        per_rank = self.micro_batch_size * self.grad_accum_steps
        first = step_start + self.dp_rank * per_rank
        return [
            list(range(first + m * self.micro_batch_size, first + (m + 1) * self.micro_batch_size))
            for m in range(self.grad_accum_steps)
        ]


def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}  # each (B, T)


class PretrainLoader:
    """Yields, step after step, this rank's list of microbatches (dicts of (B, T) long tensors).

    A background thread builds the next `prefetch` steps; tensors are pinned when the device is an
    accelerator so the copy to it can be non-blocking. `data_s` of the last step is the time the
    training loop waited for its batch.
    """

    def __init__(
        self,
        samples: PackedSamples,
        layout: BatchLayout,
        *,
        seed: int,
        device: torch.device,
        consumed_samples: int = 0,
        prefetch: int = 2,
    ):
        self.samples, self.layout, self.device = samples, layout, device
        self.order = SampleOrder(len(samples), seed)
        self.consumed_samples = consumed_samples
        self.prefetch = prefetch
        self.data_s = 0.0
        self._pin = device.type != "cpu"
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_start: int | None = None  # the global index of the last step's first sample

    @property
    def global_batch(self) -> int:
        """Samples a step over every data-parallel rank (as SharedLoader's)."""
        return self.layout.global_batch

    def batch_samples(self) -> dict | None:
        """What this rank's last step held, for a bad step's report: the split's sample indices
        (in the order read) and the documents they hold (what `ladle data show` takes)."""
        if self.last_start is None:
            return None
        ids = [self.order(g) for idx in self.layout.rank_indices(self.last_start) for g in idx]
        of = getattr(self.samples, "documents", lambda i: [])
        docs = sorted({d for i in ids for d in of(i)})
        what = getattr(self.samples, "unit", "records")
        return {
            "split": getattr(self.samples, "name", "train"),
            "samples": ids,
            "documents": docs,
            "what": what,
        }

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.consumed_samples = int(state["consumed_samples"])

    def step_batches(self, step_start: int) -> list[dict[str, torch.Tensor]]:
        out = []
        for batch in self.microbatches(step_start):
            if self._pin:
                batch = {k: v.pin_memory() for k, v in batch.items()}
            out.append(batch)
        return out

    def microbatches(self, step_start: int):
        """This rank's microbatches of the step starting at `step_start`, collated."""
        for idx in self.layout.rank_indices(step_start):
            yield collate([self.samples.get(self.order(g)) for g in idx])

    def _produce(self, start: int) -> None:
        g = start
        while not self._stop.is_set():
            try:
                item = (g, self.step_batches(g))
            except BaseException as e:  # handed to the training thread, raised there
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            g += self.layout.global_batch

    def next(self) -> list[dict[str, torch.Tensor]]:
        if self._thread is None:
            self._stop.clear()
            self._queue = queue.Queue(maxsize=self.prefetch)
            self._thread = threading.Thread(
                target=self._produce, args=(self.consumed_samples,), daemon=True, name="ladle-prefetch"
            )
            self._thread.start()
        t0 = time.perf_counter()
        while True:
            try:
                host = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the data prefetch thread stopped without a batch") from None
        if isinstance(host, BaseException):
            self.close()
            raise host
        self.last_start, host = host
        batches = [{k: v.to(self.device, non_blocking=self._pin) for k, v in b.items()} for b in host]
        self.data_s = time.perf_counter() - t0
        self.consumed_samples += self.layout.global_batch
        return batches

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            if self._thread.is_alive():  # still reading: the state it would change is not ours yet
                raise RuntimeError("the data prefetch thread did not stop within 5 s (a read that hangs?)")
            self._thread = None


def eval_batches(samples: PackedSamples, layout: BatchLayout, steps: int, device: torch.device):
    """Up to `steps` batches of micro_batch_size samples per rank, from the start of the split in
    stream order: the same samples at every evaluation, whatever the training position."""
    one = BatchLayout(layout.micro_batch_size, 1, layout.dp_rank, layout.dp_world)
    for s in range(eval_batch_count(samples, layout, steps)):
        (idx,) = one.rank_indices(s * one.global_batch)
        yield {k: v.to(device) for k, v in collate([samples.get(g) for g in idx]).items()}


def eval_batch_count(samples: PackedSamples, layout: BatchLayout, steps: int) -> int:
    return min(steps, len(samples) // (layout.micro_batch_size * layout.dp_world))


class SharedLoader:
    """The loader of a group of ranks that train on the same samples (the ranks of one TP, CP or
    PP group): its first rank reads and broadcasts each step's microbatches, the others receive
    them (as Megatron-LM's `broadcast_data`), so storage is read once per data-parallel rank.

    `loader` is the group leader's PretrainLoader (None elsewhere); `spec` gives each key's
    microbatch shape and dtype, so that the receivers can allocate it.
    """

    def __init__(self, loader, *, group, leader: int, spec: dict, n_micro: int, global_batch: int, device):
        self.loader, self.group, self.leader = loader, group, leader
        self.spec, self.n_micro = spec, n_micro
        self.global_batch, self.device = global_batch, device
        self.consumed_samples = 0
        self.data_s = 0.0

    def state_dict(self) -> dict:
        inner = self.loader.state_dict() if self.loader is not None else {}  # a mixture's positions
        return {**inner, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        if self.loader is not None:
            self.loader.load_state_dict(state)

    def step_metrics(self) -> dict:
        return self.loader.step_metrics() if hasattr(self.loader, "step_metrics") else {}

    def batch_samples(self) -> dict | None:
        return self.loader.batch_samples() if self.loader is not None else None

    def next(self) -> list[dict[str, torch.Tensor]]:
        t0 = time.perf_counter()
        if self.loader is not None:
            batches = self.loader.next()
        else:
            batches = [
                {k: torch.empty(shape, dtype=dt, device=self.device) for k, (shape, dt) in self.spec.items()}
                for _ in range(self.n_micro)
            ]
        # One collective per key for the whole step: the microbatches stacked, then split again.
        out = [{} for _ in range(self.n_micro)]
        for k in self.spec:
            flat = torch.stack([b[k] for b in batches])
            torch.distributed.broadcast(flat, src=self.leader, group=self.group)
            for b, t in zip(out, flat.unbind(0), strict=True):
                b[k] = t
        self.data_s = time.perf_counter() - t0
        self.consumed_samples += self.global_batch
        return out

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
