"""Weighted data mixtures (`data.mix`, `data.mix_schedule`): several prepared folders read as one
stream of samples.

Each source keeps its own sample order (ladle/data/loader.py `SampleOrder`, seeded by the run's
seed and the source's name, so adding a source leaves the others' orders alone) and starts its
next epoch on its own when it runs out. Which source each global sample comes from is fixed
without randomness, by stride scheduling: within a stretch of constant weights (normalised to
w_k), source k's j-th sample is due at time (j + 1/2) / w_k, and the samples are drawn in the
order they fall due (ties to the earlier source). At every point of a stretch each source's count
is within two samples of its share (within half a sample for two sources), and the order is a
function of the seed, the weights and the global sample index alone, so any data-parallel size
and a resume give the same samples. The loader draws 16 steps at once: a few vectorised operations.

The weights change at the steps `data.mix_schedule` names, or on a resume whose config gives other
weights or other sources: a new stretch starts there, from every source's position (a source
added on resume starts at its first sample). The state a checkpoint keeps is every source's
position (samples drawn) and where the current stretch started.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from ladle.data.loader import (
    BatchLayout,
    PackedSamples,
    PretrainLoader,
    SampleOrder,
    collate,
    eval_batch_count,
    eval_batches,
)


def source_seed(seed: int, name: str) -> int:
    """A source's own order seed: a hash of the run's seed and its name."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little")


def stages(mix, schedule) -> list[tuple[int, dict[str, float]]]:
    """[(first step, {name: weight})] of `data.mix` and `data.mix_schedule`, each whole (a source a
    stage does not name keeps its weight)."""
    weights = {s.name: float(s.weight) for s in mix}
    out = [(0, dict(weights))]
    for st in schedule:
        weights.update(st.weights)
        if st.step == 0:
            out[0] = (0, dict(weights))
        else:
            out.append((st.step, dict(weights)))
    return out


def weights_at(plan: list[tuple[int, dict[str, float]]], step: int) -> dict[str, float]:
    return next(w for s, w in reversed(plan) if s <= step)


class MixedSamples:
    """The samples of a split of every source, numbered one source after the other (sample i of
    source k is `offsets[k] + i`); `get` adds its `source` (the source's index; a batch's is one
    per row), which the loss reads for `loss/<name>`."""

    def __init__(self, sources: list[PackedSamples], names: list[str], paths: list[str], name: str = "train"):
        self.sources, self.names, self.paths, self.name = sources, names, paths, name
        self.sizes = [len(s) for s in sources]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, i: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return k, i - int(self.offsets[k])

    def get(self, i: int) -> dict[str, np.ndarray]:
        k, j = self.locate(i)
        sample = self.sources[k].get(j)
        sample["source"] = np.array(k, dtype=np.int64)
        return sample


@dataclass
class MixState:
    """Where the mixture stands at global sample `g`: samples drawn from each source, the stretch
    of the current weights (its first sample g0, the samples drawn before it n0), and the
    positions of sources a resume dropped (`retired`: kept, should one come back)."""

    g: int
    drawn: dict[str, int]
    g0: int
    n0: dict[str, int]
    weights: dict[str, float]
    retired: dict[str, int] = field(default_factory=dict)


class MixOrder:
    """Global sample index -> (source, its sample), drawn block after block from a `MixState`
    (the producer of each step's batches calls `steps` in order). Steps are `global_batch`
    samples from (g_base, step_base): a resume with another global batch starts a new count."""

    def __init__(self, samples: MixedSamples, plan, seed: int, global_batch: int):
        self.samples, self.plan, self.global_batch = samples, plan, global_batch
        self.names = samples.names
        self.orders = [
            SampleOrder(n, source_seed(seed, name)) for n, name in zip(samples.sizes, self.names, strict=True)
        ]
        zero = dict.fromkeys(self.names, 0)
        self.state = MixState(0, dict(zero), 0, dict(zero), weights_at(plan, 0))
        self.g_base = self.step_base = 0
        self.changes: list[str] = []  # what a resume changed, for events.log

    def step_of(self, g: int) -> int:
        return self.step_base + (g - self.g_base) // self.global_batch

    def start_of(self, step: int) -> int:
        return self.g_base + (step - self.step_base) * self.global_batch

    def restore(self, consumed: int, saved: dict | None) -> None:
        """Continues at global sample `consumed` (the start of step `saved["step"]`) from a
        checkpoint's state (None: a run that read one folder, or none): the same stretch when the
        weights and sources are those the config gives that point, else a new one from every
        source's position."""
        saved = saved or {}
        step = int(saved.get("step", consumed // self.global_batch))
        self.g_base, self.step_base = consumed, step
        want = weights_at(self.plan, step)
        old = {n: int(v) for n, v in saved.get("drawn", {}).items()}
        retired = {n: int(v) for n, v in saved.get("retired", {}).items()}
        gone = [n for n in old if n not in self.names]
        retired.update({n: old[n] for n in gone})
        drawn = {n: old.get(n, retired.pop(n, 0)) for n in self.names}
        self.changes = []
        if not saved:
            if consumed:
                self.changes.append(
                    f"data.mix begins at sample {consumed:,} (the checkpoint read no mixture)"
                )
        else:
            for n in (n for n in self.names if n not in old):
                again = f"again, at its sample {drawn[n]:,}" if drawn[n] else "from its first sample"
                self.changes.append(f"data.mix adds {n} ({again})")
            if gone:
                self.changes.append(f"data.mix no longer draws from {', '.join(gone)} (its position kept)")
            # the weights of the last step drawn, as this config gives them: a schedule's stage
            # that begins at this step is no change
            then = weights_at(self.plan, max(step - 1, 0))
            if saved["weights"] != then:
                self.changes.append(f"data.mix weights {_shares(saved['weights'])} -> {_shares(want)}")
        if saved and not self.changes and int(saved["g"]) == consumed:
            g0, n0, w = int(saved["g0"]), {n: int(v) for n, v in saved["n0"].items()}, saved["weights"]
            self.state = MixState(consumed, drawn, g0, n0, w, retired)
        else:
            self.state = MixState(consumed, drawn, consumed, dict(drawn), want, retired)

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next n samples as (source index, position in that source's order) arrays,
        advancing the state."""
        src, pos = [], []
        while n > 0:
            st = self.state
            step = self.step_of(st.g)
            want = weights_at(self.plan, step)
            if want != st.weights:  # the schedule's next stage starts here
                st.g0, st.n0, st.weights = st.g, dict(st.drawn), want
            later = [s for s, _ in self.plan if s > step]  # draw up to the next stage: one set of weights
            m = min(n, self.start_of(later[0]) - st.g) if later else n
            k, p = self._draw(m)
            src.append(k)
            pos.append(p)
            n -= m
        return np.concatenate(src), np.concatenate(pos)

    def steps(self, n: int) -> list[tuple[np.ndarray, np.ndarray, dict]]:
        """The next n steps' global batches, drawn at once (the draw's cost is mostly fixed), each
        as (source, position) arrays with the state after it, which that step's checkpoint keeps."""
        G, names, st = self.global_batch, self.names, self.state
        if (st.g - self.g_base) % G:
            raise RuntimeError(f"mixture at sample {st.g}, not at a step's start")
        drawn, g0, n0, w = np.array([st.drawn[x] for x in names]), st.g0, dict(st.n0), st.weights
        start, retired = st.g, dict(st.retired)
        k, pos = self.take(n * G)
        out = []
        for i in range(n):  # each step's state, as `take` moved through it
            at = start + i * G
            if (want := weights_at(self.plan, self.step_of(at))) != w:
                g0, n0, w = at, dict(zip(names, drawn.tolist(), strict=True)), want
            part = slice(i * G, (i + 1) * G)
            drawn = drawn + np.bincount(k[part], minlength=len(names))
            after = {
                "g": at + G,
                "step": self.step_of(at) + 1,
                "drawn": dict(zip(names, drawn.tolist(), strict=True)),
            }
            out.append((k[part], pos[part], {**after, "g0": g0, "n0": n0, "weights": w, "retired": retired}))
        return out

    def _draw(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        st, names = self.state, self.names
        w = np.array([st.weights.get(name, 0.0) for name in names])
        w = w / w.sum()
        n0 = np.array([st.n0[name] for name in names])
        since = np.array([st.drawn[name] for name in names]) - n0
        live = np.flatnonzero(w > 0)
        # a source's count stays within 2 of its share, so m samples hold at most share + 4 of it
        cap = np.minimum(np.ceil(w[live] * m).astype(np.int64) + 4, m)
        while True:
            who = np.repeat(live, cap)
            j = np.concatenate([since[s] + np.arange(c) for s, c in zip(live, cap, strict=True)])
            first = np.lexsort((who, (j + 0.5) / w[who]))[:m]  # by due time, ties to the earlier source
            k = who[first]
            counts = np.bincount(k, minlength=len(names))
            if (counts[live] < cap).all() or (cap == m).all():
                break
            cap = np.full_like(cap, m)  # never needed by the bound; kept exact all the same
        for s, name in enumerate(names):
            st.drawn[name] += int(counts[s])
        st.g += m
        return k, n0[k] + j[first]  # the source, and the sample's position in its order

    def sample(self, k: int, position: int) -> int:
        """The `MixedSamples` index of source k's sample at `position` of its order."""
        return int(self.samples.offsets[k]) + self.orders[k](int(position))

    def snapshot(self) -> dict:
        """The state at a step's start, as a checkpoint keeps it."""
        st = self.state
        return {
            "g": st.g,
            "step": self.step_of(st.g),
            "drawn": dict(st.drawn),
            "g0": st.g0,
            "n0": dict(st.n0),
            "weights": dict(st.weights),
            "retired": dict(st.retired),
        }


def _shares(w: dict[str, float]) -> str:
    total = sum(w.values()) or 1.0
    return "{" + ", ".join(f"{k} {v / total:.0%}" for k, v in w.items()) + "}"


AHEAD = 16  # steps a mixture's loader draws at once


class MixLoader(PretrainLoader):
    """PretrainLoader over a mixture: each step's global batch is drawn from the `MixOrder`, and
    every rank draws the whole batch (cheap arithmetic) and takes its slice. Logs every source's
    samples drawn and epochs seen (`samples/<name>`, `epochs/<name>`)."""

    def __init__(
        self, samples: MixedSamples, layout: BatchLayout, plan, *, seed: int, device, prefetch: int = 2
    ):
        super().__init__(samples, layout, seed=seed, device=device, prefetch=prefetch)
        self.mix = MixOrder(samples, plan, seed, layout.global_batch)
        # step start -> ((source, position) arrays of its global batch, the state after it)
        self._steps: dict[int, tuple[tuple[np.ndarray, np.ndarray], dict]] = {}
        self.mix_state = self.mix.snapshot()
        self.note = lambda text: None  # events.log (the run's), for a resume's changes and new epochs

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "mix": self.mix_state}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.mix.restore(self.consumed_samples, state.get("mix"))
        for change in self.mix.changes:
            self.note(f"resumed with a changed mixture: {change}; every source continues from its position")
        self._steps.clear()
        self.mix_state = self.mix.snapshot()

    def _global(self, step_start: int) -> tuple[np.ndarray, np.ndarray]:
        """The step's whole global batch as (source, position) arrays. The producer draws them in
        order, AHEAD steps at a time, each kept with the state after it (for its checkpoint)."""
        if step_start not in self._steps:
            if step_start != self.mix.state.g:
                raise RuntimeError(
                    f"mixture drawn out of order: step at {step_start}, order at {self.mix.state.g}"
                )
            for k, pos, after in self.mix.steps(AHEAD):
                self._steps[after["g"] - self.layout.global_batch] = ((k, pos), after)
        return self._steps[step_start][0]

    def _mine(self, step_start: int) -> list[tuple[int, int]]:
        """This rank's samples of the step as (source, its sample index), in order."""
        k, pos = self._global(step_start)
        orders = self.mix.orders
        return [
            (int(k[g - step_start]), orders[k[g - step_start]](int(pos[g - step_start])))
            for idx in self.layout.rank_indices(step_start)
            for g in idx
        ]

    def microbatches(self, step_start: int):
        refs, b = self._mine(step_start), self.layout.micro_batch_size
        sources = self.samples.sources
        for m in range(self.layout.grad_accum_steps):
            chunk = refs[m * b : (m + 1) * b]
            batch = collate([sources[k].get(j) for k, j in chunk])
            batch["source"] = torch.tensor([k for k, _ in chunk])  # (B,): each row's source
            yield batch

    def next(self):
        batches = super().next()
        before, self.mix_state = self.mix_state["drawn"], self._steps[self.last_start][1]
        for name, n in zip(self.samples.names, self.samples.sizes, strict=True):
            last = (self.mix_state["drawn"][name] - 1) // n  # the epoch of its last sample drawn
            if last >= 1 and last > (before.get(name, 0) - 1) // n:
                self.note(f"data.mix source {name} starts epoch {last + 1} in step {self.mix_state['step']}")
        for s in list(self._steps):  # the producer adds steps ahead; those behind are done
            if s < self.last_start:
                self._steps.pop(s, None)
        return batches

    def batch_samples(self) -> dict | None:
        """The last step's samples on this rank, per source (its folder, sample and document
        indices), for a bad step's report."""
        if self.last_start is None:
            return None
        mine = self._mine(self.last_start)
        per: dict[str, dict] = {}
        for k, j in mine:
            d = per.setdefault(
                self.samples.names[k], {"path": self.samples.paths[k], "samples": [], "documents": set()}
            )
            d["samples"].append(j)
            d["documents"].update(self.samples.sources[k].documents(j))
        for d in per.values():
            d["documents"] = sorted(d["documents"])
        ids = [int(self.samples.offsets[k]) + j for k, j in mine]
        return {"split": "train", "samples": ids, "documents": [], "what": "documents", "sources": per}

    def step_metrics(self) -> dict:
        drawn = self.mix_state["drawn"]
        out = {}
        for name, n in zip(self.samples.names, self.samples.sizes, strict=True):
            out[f"samples/{name}"] = drawn[name]
            out[f"epochs/{name}"] = drawn[name] / n if n else 0.0
        return out


def mix_eval_batches(val: MixedSamples, layout: BatchLayout, steps: int, device):
    """Up to `steps` batches of each source's val split, one source after the other (the same
    samples at every evaluation): `val_loss/<name>` each, `val_loss` over all their tokens."""
    for k, src in enumerate(val.sources):
        for b in eval_batches(src, layout, steps, device):
            b["source"] = torch.full(b["tokens"].shape[:1], k, device=b["tokens"].device)
            yield b


def mix_eval_count(val: MixedSamples, layout: BatchLayout, steps: int) -> int:
    return sum(eval_batch_count(s, layout, steps) for s in val.sources)
