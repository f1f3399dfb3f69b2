"""ladle's model as an lm-evaluation-harness model (`LadleLM`, registered as "ladle").

It answers the harness's three kinds of request the way its `hf` model (`HFLM`) does, so that a
checkpoint scored here and its exported folder scored by `hf` get the same per-document
log-likelihoods (fp32) and the same scores (tests/test_harness.py):

- the text is encoded as `transformers` encodes it by default: tokenizer.json's post-processor
  adds what it adds (a Llama 3 BOS; nothing for ladle's own tokenizers); the context and
  continuation are split as `TemplateLM._encode_pair` splits them (trailing spaces of the context
  move to the continuation, the pair is encoded whole and cut at the context's length), and an
  empty context is the BOS (else EOS) token;
- log-likelihoods: requests sorted longest first and batched with right padding (lm-eval's
  `Collator`), one-token continuations of a shared context scored from one row; only the
  continuation's positions go through the head;
- rolling log-likelihoods: the document cut into disjoint windows of the model's max length
  (`get_rolling_token_windows`, one token of context), the windows' sums added;
- generation: greedy (or sampled, with the request's temperature / top_p / top_k) with ladle's
  batched KV-cache generation, rows of like length together, until a stop string of `until`, EOS
  or `max_gen_toks`; the text is cut at the first stop string.

This module imports lm_eval at the top: ladle/ops/harness.py imports it once lm-eval is known to
be installed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ladle.models.generation import generate, stop_strings, truncate_at_stop
from ladle.models.prepack import prepacked

MAX_GEN_TOKS = 256  # HFLM's default when a task does not say


@register_model("ladle")
class LadleLM(TemplateLM):
    def __init__(
        self,
        model=None,
        tokenizer=None,
        *,
        pretrained: str | None = None,  # lm-eval's own CLI: --model ladle --model_args pretrained=PATH
        batch_size: int | str = 8,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        device: str | None = None,
        dtype: str = "float32",
        seed: int = 1234,
        **_,
    ):
        super().__init__()
        if model is None:
            from ladle.ops.export import load_any_model

            model, tokenizer = load_any_model(pretrained, device=device or "cpu", dtype=getattr(torch, dtype))
        self.model, self.tok = model.eval(), tokenizer
        self.batch_size_per_gpu = int(batch_size) if str(batch_size) != "auto" else 8
        self._max_length = max_length or model.cfg.max_seq_len  # HFLM: max_position_embeddings
        self.add_bos_token = add_bos_token  # None: as the tokenizer's post-processor does
        # on the model's device: torch.multinomial takes a generator of its probabilities' device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.batches = 0  # batches run (forward passes, or generations)
        self.on_batch = None  # called after each batch: a training run's watchdog sees progress

    # -- the tokenizer, as HFLM uses transformers' ----------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kw):
        special = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if add_special_tokens is None and self.tok.bos_id is not None:
            if string.startswith(self.tok.decode([self.tok.bos_id], skip_special_tokens=False)):
                special = False  # the text already holds its BOS
        ids = self.tok.encode(string, add_special_tokens=True if special is None else special)
        if special and self.tok.bos_id is not None and ids[:1] != [self.tok.bos_id]:
            ids = [self.tok.bos_id, *ids]  # add_bos_token=True on a tokenizer that adds none
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- log-likelihoods -----------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether it is the greedy continuation) per
        (key, context ids, continuation ids); batched as HFLM batches them."""
        collator = Collator(
            requests,
            sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
            group_by="contexts",
            group_fn=lambda r: r[-2] + r[-1][:-1],
        )
        res = []
        for chunk in collator.get_batched(n=self.batch_size_per_gpu):
            # each row: (context + continuation)[-(max_length + 1):][:-1]; the last token is only predicted
            inps = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in chunk]
            width = max(len(x) for x in inps)
            tokens = torch.zeros((len(inps), width), dtype=torch.long)
            keep = torch.zeros((len(inps), width), dtype=torch.bool)
            for i, (x, (_, _, cont)) in enumerate(zip(inps, chunk, strict=True)):
                if len(cont) > self.max_length:  # as HFLM: a continuation must fit the model
                    raise ValueError(
                        f"a continuation of {len(cont)} tokens is longer than the model's "
                        f"{self.max_length} positions (max_seq_len)"
                    )
                tokens[i, : len(x)] = torch.tensor(x)
                keep[i, len(x) - len(cont) : len(x)] = True  # the positions that predict the continuation
            logits = self.model(tokens.to(self.device), keep=keep.to(self.device))  # (N, vocab)
            self._batch_done()
            logps = F.log_softmax(logits.float(), dim=-1).split([len(c) for _, _, c in chunk])
            for (key, ctx, cont), row in zip(chunk, logps, strict=True):
                greedy = row.argmax(-1)
                # a group of one-token continuations of one context shares this row's logits
                for k, c, lp in collator.get_cache(
                    req_str=key, cxt_toks=ctx, cont_toks=cont, logits=row[None]
                ):
                    target = torch.tensor(c, device=lp.device)
                    score = lp[0, -len(c) :].gather(-1, target[:, None]).sum()
                    res.append((float(score), bool((greedy[-len(c) :] == target).all())))
                    if k is not None:
                        self.cache_hook.add_partial("loglikelihood", k, res[-1])
        return collator.get_original(res)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, req in enumerate(requests):
            (string,) = req.args
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(self.tok_encode(string), self.prefix_token_id, self.max_length, 1),
            ):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += lp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ----------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        collator = Collator(
            [r.args for r in requests],
            sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
            group_by="gen_kwargs",
            group_fn=lambda r: r[1],
        )
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        res = []
        with prepacked(self.model, batch=self.batch_size_per_gpu):  # the weights packed once (CPU)
            for chunk in collator.get_batched(n=self.batch_size_per_gpu):
                contexts, kwargs = zip(*chunk, strict=True)
                kw = dict(kwargs[0])
                until = kw.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                until += [eos] if eos not in until else []
                max_new = int(kw.pop("max_gen_toks", kw.pop("max_new_tokens", MAX_GEN_TOKS)))
                sampled = kw.get("do_sample", False) or float(kw.get("temperature", 0.0)) > 0
                if self.max_length - max_new <= 0:
                    raise ValueError(f"max_gen_toks {max_new} leaves no room in max_length {self.max_length}")
                prompts = [self.tok_encode(c, left_truncate_len=self.max_length - max_new) for c in contexts]
                outs = generate(
                    self.model,
                    prompts,
                    max_new_tokens=max_new,
                    temperature=float(kw.get("temperature", 1.0) or 1.0) if sampled else 0.0,
                    top_k=int(kw.get("top_k") or 0),
                    top_p=float(kw.get("top_p") or 1.0),
                    eos_id=self.eot_token_id,
                    pad_id=self.tok.pad_id or 0,
                    generator=self.generator,
                    stop=stop_strings(self.tok.decode, until),
                    prepack=False,
                )
                self._batch_done()
                for (context, gen_kwargs), new in zip(chunk, outs, strict=True):
                    res.append(truncate_at_stop(self.tok_decode(new), until))
                    self.cache_hook.add_partial("generate_until", (context, gen_kwargs), res[-1])
        return collator.get_original(res)

    def _batch_done(self) -> None:
        self.batches += 1
        if self.on_batch is not None:
            self.on_batch(self.batches)

    def get_model_info(self) -> dict:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters())}
