"""Multi-turn episodes (`grpo.env`, `ppo.env`): the model acts over several turns, with tools
(ladle/rl/tools.py) and an environment of the user's that answers each turn.

An environment is a class in a Python file the config names (never the data), one instance per
episode, built with `env.kwargs`, needing nothing from ladle:

    reset(record) -> list of messages           the first messages, from the prompt's record
    step(reply: str) -> {"messages": [...],     what follows the model's turn (a game's
                         "reward": float|None,   feedback, a user's reply), a reward for the
                         "done": bool}           turn (summed over the episode), and whether it ends

Without `env.name` the episode is the record's prompt and the tools: a turn that calls tools gets
their results and goes on; a turn that calls none is the answer, and the rewards score it.

A turn, for every episode of the batch still going at once: the engine samples one reply to each
episode's transcript (keyed by prompt, sample and turn: `row_seed`, so an episode does not depend
on its batch), of `max_response_len` tokens at most and within `max_total_tokens` for the whole
episode; the reply's tool calls run (their results the next messages), or the environment's
`step` answers it. The episode ends when the environment says so, when a turn calls no tool (no
environment), at `max_turns`, when its reply is cut by the cap, or when the next messages would
pass `max_total_tokens` (these three: truncated, `finished` false). Episodes end on their own;
a turn batches only those still going.

The transcript is kept as token ids, never re-tokenised: the model's replies exactly as sampled
(mask 1), then the tokens of the messages that follow (mask 0), rendered by the chat template
against a fixed base conversation and cut at the end of the base (as SkyRL and TRL do): the text
the template puts after an assistant's turn ("<|im_end|>\\n"), less the end token the reply already
holds, then the new messages and the next generation prompt. So what the model saw is what it is
trained on, and earlier turns are never re-rendered (a template that drops an earlier turn's
reasoning cannot change them).

Rewards: the environment's rewards of every turn summed (`reward_env`) plus the rule terms
(`rewards.terms`) on the last reply, which also get `messages` (the transcript) and `turns` in
their context. An environment that raises is a failure named like a reward's (`rewards.on_error`).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field, replace

import torch

from ladle import distributed as dist
from ladle.errors import ConfigError
from ladle.rl import tools as T
from ladle.rl.rewards import load_user_file, raised_at
from ladle.rl.rollout import Rollouts, Sampling

MARK = "LADLE_REPLY"  # the base conversation's assistant text, found in its rendering


def _takes(fn, args: tuple, where: str, shape: str) -> None:
    try:
        inspect.signature(fn).bind(*args)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be {shape}; see docs/rl.md (Environments)") from None


def env_class(env, key: str, module) -> type | None:
    """The environment class `env.name` of `module` (`env.file`'s; None: the tools alone), its
    shape checked."""
    if env.name is None:
        return None
    cls = getattr(module, env.name, None)
    if not isinstance(cls, type):
        defined = sorted(k for k, v in vars(module).items() if isinstance(v, type) and not k.startswith("_"))
        raise ConfigError(
            f"{key}.name: {env.file} defines no class {env.name!r} (its classes: {', '.join(defined) or 'none'})"
        )
    where = f"{key}: {env.name} ({env.file})"
    for method, shape in (("reset", "reset(self, record)"), ("step", "step(self, reply)")):
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise ConfigError(f"{where} has no method {method}; an environment defines {shape}")
        _takes(fn, (None, {}), f"{where}.{method}", shape)
    try:
        inspect.signature(cls).bind(**env.kwargs)
    except TypeError as e:
        raise ConfigError(
            f"{key}.kwargs: {env.name}({', '.join(env.kwargs)}) does not match its __init__: {e}"
        ) from None
    return cls


def toolbox(env, key: str, module) -> T.Toolbox | None:
    """The run's tools: functions of `module` (`env.file`'s), or `python` (the sandboxed interpreter)."""
    if not env.tools:
        return None
    functions = []
    for name in env.tools:
        fn = getattr(module, name, None) if module is not None else None
        if fn is None and name == "python":
            fn = T.python_tool(wall_s=env.tool_timeout_s)
        if not callable(fn):
            raise ConfigError(
                f"{key}.tools: no function {name!r} in {env.file or '(no env.file)'}; name functions of "
                "env.file, or `python` for the sandboxed interpreter"
            )
        functions.append(fn)
    return T.Toolbox(functions, timeout_s=env.tool_timeout_s)


class ToolsOnly:
    """The episode without an environment: the record's prompt; a turn without tool calls ends it."""

    def reset(self, record: dict) -> list[dict]:
        from ladle.data.prompts import to_prompt

        return to_prompt(record)[0]

    def step(self, reply: str) -> dict:
        return {"messages": [], "reward": None, "done": True}


class Transcript:
    """Token ids of an episode's context: the first messages, and the messages after a reply,
    rendered after a fixed base conversation and cut just after its assistant's text (see the
    module docstring). Cutting there, not at the base's own rendering, keeps templates that
    render a last assistant turn differently (Qwen3's empty <think>) to what follows it."""

    def __init__(self, tok, template, schemas: list[dict], source: str):
        self.tok, self.template, self.schemas, self.source = tok, template, schemas, source
        base = [{"role": "user", "content": "ladle"}, {"role": "assistant", "content": MARK}]
        self.base, self.kw = T.with_tools(template, base, schemas)
        head = template.render(self.base[:-1], add_generation_prompt=True, **self.kw)
        text = template.render(self.base, **self.kw)
        if not text.startswith(head) or text.count(MARK) != 1:
            raise ConfigError(
                f"the chat template ({source}) renders an assistant's turn other than after its generation "
                "prompt; multi-turn episodes cannot append to it"
            )

    def first(self, messages: list[dict]) -> list[int]:
        msgs, kw = T.with_tools(self.template, messages, self.schemas)
        return self.tok.encode(self.template.render(msgs, add_generation_prompt=True, **kw))

    def after(self, messages: list[dict], end: str) -> list[int]:
        """The tokens after a reply that ended with the text `end` (its end token; "" for none):
        the template's close of the turn ("<|im_end|>\n"), less the end the reply holds, the
        messages, the next generation prompt."""
        full = self.template.render([*self.base, *messages], add_generation_prompt=True, **self.kw)
        if full.count(MARK) != 1:
            raise ValueError(
                f"the chat template ({self.source}) drops the assistant's turn before {messages!r:.200}"
            )
        text = full[full.index(MARK) + len(MARK) :]
        if end and text.startswith(end):  # the end token the reply already holds
            text = text[len(end) :]
        return self.tok.encode(text)


@dataclass
class Episode:
    """One episode's state: its key, its transcript as token ids after the first prompt (mask 1
    on the model's replies), the messages, its rewards and tool calls."""

    prompt_index: int
    sample: int
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: list[dict] = field(default_factory=list)
    done: bool = False
    finished: bool = True  # ended by the environment or an answer, not by a limit
    failed: str | None = None  # an environment that raised: its description
    last: str = ""  # the last reply's text
    routing: object = None  # an MoE policy's routing at the last turn (its whole transcript)

    def state(self) -> dict:
        """What the other ranks of a tensor-parallel group take from its first (they run no env)."""
        return {k: v for k, v in vars(self).items() if k not in ("prompt_index", "sample")}


def _describe(cls, e: Exception, method: str) -> str:
    """'environment CLASS.METHOD (FILE:LINE) raised TYPE: MESSAGE' (rewards.raised_at)."""
    name = cls.__name__ if cls is not None else "tools"
    where = raised_at(getattr(cls, method, None), e)
    return f"environment {name}.{method}{where} raised {type(e).__name__}: {e}"


class Episodes:
    """Runs a batch's episodes turn by turn (see the module docstring). `env`: the config's
    `grpo.env`/`ppo.env` section; `template`: the prompts' chat template; `end_ids`: the tokens
    that end a turn; `share`: (group, first?) of the ranks that hold the same rows (tensor
    parallelism), whose first runs the environments and tools and hands the others the result;
    `group`: the ranks that generate together and so run as many turns (None: the world; a
    separated placement's engine ranks)."""

    def __init__(
        self,
        env,
        key: str,
        *,
        tok,
        template,
        source: str,
        end_ids: set[int],
        max_len: int,
        share=(None, True),
        group=None,
    ):
        self.cfg, self.key = env, key
        self.max_total = env.max_total_tokens or max_len  # an episode's tokens at most
        module = load_user_file(env.file, f"{key}.file") if env.file else None  # imported once
        self.cls = env_class(env, key, module)
        self.tools = toolbox(env, key, module)
        schemas = self.tools.schemas if self.tools else []
        self.format = None
        if self.tools:
            self.format = env.tool_format if env.tool_format != "auto" else T.detect(template, source)
        self.transcript = Transcript(tok, template, schemas, source)
        self.tok, self.end_ids = tok, end_ids
        self.share, self.first = share
        self.turn_group = group

    def make(self):
        return self.cls(**copy.deepcopy(self.cfg.kwargs)) if self.cls is not None else ToolsOnly()

    def run(self, engine, records: list[dict], index: list[int], sampling: Sampling, *, step: int):
        """Every episode of the prompts `index` (`sampling.n` each): (Rollouts, episodes)."""
        episodes, envs, max_total = [], [], self.max_total
        for i in index:
            for s in range(sampling.n):
                e, env = Episode(i, s), None
                if self.first:
                    env = self.make()
                    try:
                        messages = env.reset(copy.deepcopy(records[i]))
                        _check_messages(messages, "reset")
                        e.messages = list(messages)
                        e.prompt = self.transcript.first(messages)
                    except Exception as x:
                        e.failed, e.done, e.finished = _describe(self.cls, x, "reset"), True, False
                        e.prompt = [self.tok.eos_id or 0]
                    if len(e.prompt) >= max_total:
                        e.done, e.finished = True, False
                episodes.append(e)
                envs.append(env)
        self._share(episodes)
        one = replace(sampling, n=1)
        device = dist.collective_device()
        turn = 0
        # every rank runs as many turns (a laid-out model generates together: FSDP, TP)
        while dist.any_rank(any(not e.done for e in episodes), device, self.turn_group):
            live = [k for k, e in enumerate(episodes) if not e.done]
            r = engine.generate_rows(
                [episodes[k].prompt + episodes[k].tokens for k in live],
                [(episodes[k].prompt_index, episodes[k].sample, turn) for k in live],
                [
                    min(
                        sampling.max_new_tokens, max_total - len(episodes[k].prompt) - len(episodes[k].tokens)
                    )
                    for k in live
                ],
                one,
                step=step,
            )
            for j, k in enumerate(live):
                e = episodes[k]
                e.tokens += r.response_ids[j]
                e.mask += [1] * len(r.response_ids[j])
                e.logps += r.sample_logps[j]
                if r.routing and r.routing[j] is not None:  # earlier positions keep their own turn's
                    prev = e.routing if e.routing is not None else r.routing[j][:0]
                    e.routing = torch.cat([prev, r.routing[j][len(prev) :]])
                e.turns += 1
            if self.first:
                self._act([episodes[k] for k in live], [envs[k] for k in live], r)
            self._share([episodes[k] for k in live])
            turn += 1
        engine.idle()
        out = Rollouts()
        for e in episodes:
            # the routing of every position the model read: a reply's tokens as its own turn
            # decoded them, the context as the next turn's prefill read it
            routing = e.routing if e.routing is not None and e.mask and e.mask[-1] == 1 else None
            out.add(
                e.prompt_index,
                e.sample,
                e.prompt,
                e.tokens,
                e.logps,
                e.finished,
                mask=e.mask,
                routing=routing,
            )
        return out, episodes

    def _act(self, live: list[Episode], envs: list, r: Rollouts) -> None:
        """After a turn's replies: every tool call of the turn run at once (a pool), the other
        replies answered by their environment's `step`; each episode's next messages appended,
        or the episode ends."""
        texts = [self.tok.decode([t for t in reply if t not in self.end_ids]) for reply in r.response_ids]
        calls = [T.parse(t, self.format, set(self.tools.functions)) if self.tools else [] for t in texts]
        results = iter(self.tools.run([c for cs in calls for c in cs]) if self.tools else [])
        for j, (e, env) in enumerate(zip(live, envs, strict=True)):
            e.last = texts[j]
            e.messages.append(T.call_message(texts[j], calls[j]))
            done = False
            try:
                if calls[j]:
                    outs = [next(results) for _ in calls[j]]
                    messages = [
                        T.result_message(self.format, c, o) for c, o in zip(calls[j], outs, strict=True)
                    ]
                    e.tool_calls += [
                        {
                            "turn": e.turns,
                            "name": c.name,
                            "arguments": c.arguments,
                            "error": c.error,
                            "result": o,
                        }
                        for c, o in zip(calls[j], outs, strict=True)
                    ]
                else:
                    got = env.step(texts[j])
                    if not isinstance(got, dict) or not isinstance(got.get("done", False), bool):
                        raise TypeError(
                            f"step must return a dict with messages, reward, done; it returned {got!r:.120}"
                        )
                    messages, done = list(got.get("messages") or []), got.get("done", False)
                    _check_messages(messages, "step")
                    if got.get("reward") is not None:
                        e.reward += float(got["reward"])
            except Exception as x:
                e.failed, e.done, e.finished = _describe(self.cls, x, "step"), True, False
                continue
            self._next(e, messages, done, r.response_ids[j], r.finished[j])

    def _next(self, e: Episode, messages: list[dict], done: bool, reply: list[int], finished: bool) -> None:
        """The episode ends, or the messages after its reply join the transcript as context."""
        if not finished:  # a reply cut by the cap or the budget: truncated, whatever followed it
            e.done, e.finished = True, False
            return
        if done:
            e.done = True
            e.messages += messages  # the environment's last word, for the logs (never trained on)
            return
        if e.turns >= self.cfg.max_turns:  # out of turns
            e.done, e.finished = True, False
            return
        end = (
            self.tok.decode(reply[-1:], skip_special_tokens=False)
            if reply and reply[-1] in self.end_ids
            else ""
        )
        try:
            more = self.transcript.after(messages, end)
        except Exception as x:  # the template cannot render what the environment or a tool gave
            why = (
                f"the chat template ({self.transcript.source}) cannot render the messages after a reply: {x}"
            )
            e.failed, e.done, e.finished = why, True, False
            return
        if len(e.prompt) + len(e.tokens) + len(more) >= self.max_total:  # no room for another reply
            e.done, e.finished = True, False
            return
        e.messages += messages
        e.tokens += more
        e.mask += [0] * len(more)
        e.logps += [0.0] * len(more)

    def _share(self, episodes: list[Episode]) -> None:
        """Tensor parallelism: the group's first rank's episodes, on every rank of the group."""
        if self.share is None or dist.world_size(self.share) == 1:
            return
        states = dist.all_gather_objects([e.state() for e in episodes] if self.first else None, self.share)[0]
        for e, s in zip(episodes, states, strict=True):
            vars(e).update(s)

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()


def _check_messages(messages, method: str) -> None:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages
    ):
        raise TypeError(
            f"{method} must give a list of messages, dicts with 'role' and 'content'; got {messages!r:.120}"
        )


def episodes_for(cfg, name: str, tok, end_ids: set[int], par=None, group=None) -> Episodes | None:
    """The Episodes of the RL section `name` (`grpo`, `ppo`) when it has an `env`, on the prompts'
    chat template (the one `ladle data prepare --task prompts` rendered them with). `par`: the
    layout (its TP ranks hold the same rows; None: one process's check before launch); `group`:
    the ranks that turn together (`Episodes`)."""
    section = getattr(cfg, name)
    if section.env is None:
        return None
    from ladle.data.folder import load_meta
    from ladle.data.sft import ChatEncoder

    template = load_meta(cfg.data.path).get("template")
    encoder = ChatEncoder(tok, None if template in (None, "tokenizer") else template)
    return Episodes(
        section.env,
        f"{name}.env",
        tok=tok,
        template=encoder.template,
        source=encoder.template.source,
        end_ids=end_ids,
        max_len=cfg.data.seq_len,
        share=(par.shared_group, par.shared_rank == 0) if par is not None else (None, True),
        group=group,
    )
