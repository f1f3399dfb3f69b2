"""Direct preference optimisation and its family (`dpo.loss`): the policy trained on preference
pairs (`ladle data prepare --task preference`) against a reference, from an SFT model
(`model.init_from`). The losses are in ladle/preference/losses.py.

The reference is the starting policy. `dpo.reference: cached` (default) runs it once over the
data before the first step and keeps its log-probs in the run directory (ladle/preference/
reference.py), so training holds one model; `online` keeps a frozen copy beside the policy, laid
out alike (with LoRA: the policy with its adapters off, no copy). SimPO has no reference.
"""

from __future__ import annotations

import contextlib

from ladle import distributed as dist
from ladle.config import LadleConfig
from ladle.data.pairs import PairSamples
from ladle.data.preference import PreferenceSplit
from ladle.errors import ConfigError
from ladle.models.lora import adapters_disabled
from ladle.preference import reference
from ladle.preference.losses import DPOLoss, pad_multiple
from ladle.recipes.base import Recipe, Setup, Training
from ladle.train.builder import build_laid_out

SPLITS = ("train", "val")


class PairRecipe(Recipe):
    """The recipes on preference pairs (DPO and the reward model): their rows and layouts."""

    data_task = "preference"  # `ladle data prepare --task preference`

    def check_layout(self, cfg: LadleConfig, layout) -> None:
        """Pairs are scored whole: a side's log-prob sum is not split over sequence shards or stages."""
        for name, degree in (("pp", layout.pp), ("cp", layout.cp)):
            if degree > 1:
                raise ConfigError(
                    f"parallel.{name}={degree}: the preference recipes run with data parallelism, FSDP and TP "
                    f"(and their composition), not yet with {name.upper()}; set parallel.{name}: 1"
                )

    def samples(self, cfg: LadleConfig, split: str, found, ref_logps=None) -> PairSamples:
        tok = found["tokenizer"]
        pad = tok.pad_id if tok.pad_id is not None else 0
        return PairSamples(
            PreferenceSplit(cfg.data.path, split),
            cfg.data.seq_len,
            pad_id=pad,
            name=split,
            ref_logps=ref_logps,
        )


class DPO(PairRecipe):
    name = "dpo"

    def setup(self, s: Setup) -> Training:
        cfg = s.cfg
        multiple = pad_multiple(s.par.layout.tp)
        head = {"multiple": multiple, "completions_only": s.par.layout.tp == 1}  # see pair_logps
        if cfg.dpo.loss == "simpo":
            return Training(self.samples, DPOLoss(cfg.dpo, **head))
        if cfg.dpo.reference == "online":
            return Training(self.samples, DPOLoss(cfg.dpo, online_reference(s), **head))
        cached = reference.load(cfg)
        if cached is None:
            cached = self.compute_cache(s)
        else:
            s.run.events(f"reference log-probs: reused from {cfg.output_dir}/{reference.CACHE_DIR}")
        rows = lambda c, split, f: self.samples(c, split, f, cached[split])  # noqa: E731
        return Training(rows, DPOLoss(cfg.dpo, **head))

    def compute_cache(self, s: Setup) -> dict:
        """The reference log-probs of both splits: from the policy itself on a fresh start (it is
        the reference then: adapters start at zero), else from a frozen copy built for the pass."""
        cfg = s.cfg
        fresh = s.resume.path is None
        model = s.unit.model if fresh else build_laid_out(cfg, s.par, s.device, trainable=False).model

        @contextlib.contextmanager
        def context():
            with s.par.loss_context(), s.unit.precision.autocast():
                yield

        out = {}
        for split in SPLITS:
            rows = self.samples(cfg, split, s.found)
            out[split] = reference.compute(model, rows, s.par, cfg.train.micro_batch_size, s.device, context)
        if dist.is_main():
            reference.save(cfg, out)
        s.run.events(
            f"reference log-probs: computed for {sum(len(a) for a in out.values()):,} pairs "
            f"and stored in {cfg.output_dir}/{reference.CACHE_DIR}"
        )
        return out


def online_reference(s: Setup):
    """The frozen reference: with LoRA (and nothing trained in full), the policy's own base."""
    cfg, policy = s.cfg, s.unit.model
    if cfg.lora is not None and not cfg.lora.modules_to_save:
        s.run.events("reference: the policy with its adapters switched off (no second copy)")

        def base_forward(tokens, **kw):
            with adapters_disabled(policy):
                return policy(tokens, **kw)

        return base_forward
    ref = build_laid_out(cfg, s.par, s.device, trainable=False).model
    s.run.events("reference: a frozen copy of the starting weights, laid out like the policy")
    return ref


RECIPE = DPO()
run = RECIPE.run
