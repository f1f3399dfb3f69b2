"""Multi-turn episodes (ladle/rl/env.py) and tools (ladle/rl/tools.py): the transcript's tokens
and loss mask against the chat template's rendering of the whole conversation, tool schemas
against transformers' get_json_schema, tool calls parsed from transformers' rendering of them in
each template, GAE over turns against GAE on the model's tokens alone, and GRPO on a scripted
environment with the tiny model (the training forward's log-probs equal the sampler's over the
model's tokens; context is never trained)."""

from __future__ import annotations

import json
import math
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest
import torch

from ladle.data.chat import BUILTIN, ChatTemplate
from ladle.errors import ConfigError
from ladle.rl import tools as T
from ladle.rl.engine import RolloutEngine
from ladle.rl.env import Episodes, Transcript
from ladle.rl.rollout import Rollouts, Sampling, sequences
from ladle.train.loss import IGNORE_INDEX

TEMPLATES = Path(__file__).parent / "templates"
ENV = textwrap.dedent(
    '''
    class Feedback:
        """Answers each reply with "again N" until `turns` replies; rewards a reply with an "e"."""

        def __init__(self, turns=2):
            self.turns, self.n = turns, 0

        def reset(self, record):
            return [{"role": "user", "content": record["prompt"]}]

        def step(self, reply):
            self.n += 1
            done = self.n >= self.turns
            messages = [] if done else [{"role": "user", "content": f"again {self.n}"}]
            return {"messages": messages, "reward": float("e" in reply), "done": done}


    class Broken:
        def reset(self, record):
            return [{"role": "user", "content": record["prompt"]}]

        def step(self, reply):
            raise ValueError("the game broke")


    class NoStep:
        def reset(self, record):
            return []


    class WrongStep:
        def reset(self, record):
            return []

        def step(self):
            return {}


    def lookup(word: str) -> str:
        """Look a word up.

        Args:
            word: the word to look up
        """
        return word[::-1]


    def untyped(word):
        """No hint.

        Args:
            word: a word
        """
        return word
    '''
)


def env_cfg(**kw):
    base = dict(
        file=None, name=None, kwargs={}, tools=[], tool_format="auto", tool_timeout_s=5.0, max_turns=4,
        max_total_tokens=0,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture
def env_file(tmp_path):
    p = tmp_path / "env.py"
    p.write_text(ENV)
    return p


# -- the transcript's tokens and mask --------------------------------------------------------------
class Scripted(RolloutEngine):
    """Replies by key (prompt index, sample, turn): text encoded, an end token after it (unless
    `cut`), log-probs -0.5 each."""

    def __init__(self, tok, replies, end_id, cut=(), routing=False):
        self.tok, self.replies, self.end_id, self.cut, self.asked = tok, replies, end_id, set(cut), []
        self.routing = routing  # each turn's routing: its turn number at every position it read

    def sync_weights(self):
        return 0.0

    def generate_rows(self, contexts, keys, limits, sampling, *, step):
        out = Rollouts()
        for ctx, key, n in zip(contexts, keys, limits, strict=True):
            self.asked.append((key, list(ctx)))
            ids = self.tok.encode(self.replies[key]) + ([] if key in self.cut else [self.end_id])
            fin = key not in self.cut and len(ids) <= n
            ids = ids[:n]
            rt = (
                torch.full((len(ctx) + len(ids) - 1, 1, 1), key[2], dtype=torch.int16)
                if self.routing
                else None
            )
            out.add(key[0], key[1], ctx, ids, [-0.5] * len(ids), fin, routing=rt)
        return out


def test_turns_are_the_templates_rendering_of_the_whole_conversation(chat_tokenizer, env_file):
    from ladle.data.tokenizer import load_tokenizer
    from ladle.rl.loader import end_ids

    tok = load_tokenizer(chat_tokenizer)
    end = tok.token_to_id("<|im_end|>")
    template = ChatTemplate(BUILTIN["chatml"])
    eps = Episodes(
        env_cfg(file=str(env_file), name="Feedback", kwargs={"turns": 3}), "grpo.env", tok=tok, template=template,
        source="chatml", end_ids=end_ids(tok), max_len=400,
    )  # fmt: skip
    replies = {(5, s, t): f"reply {s}.{t} here" for s in range(2) for t in range(3)}
    engine = Scripted(tok, replies, end)
    records = {5: {"prompt": "Sort: b a"}}
    r, episodes = eps.run(engine, records, [5], Sampling(n=2, max_new_tokens=20), step=0)
    for s in range(2):
        e = episodes[s]
        chat = [{"role": "user", "content": "Sort: b a"}]
        for t in range(3):
            chat.append({"role": "assistant", "content": replies[(5, s, t)]})
            if t < 2:
                chat.append({"role": "user", "content": f"again {t + 1}"})
        # the transcript's ids are the whole conversation as the template renders it, tokenized
        # (up to the last reply's end token: the template's "\n" after it is not generated)
        assert r.prompt_ids[s] + r.response_ids[s] + tok.encode("\n") == tok.encode(template.render(chat))
        assert r.prompt_ids[s] == tok.encode(template.render(chat[:1], add_generation_prompt=True))
        # the mask: 1 on each reply and its end token, 0 on the messages between
        want_mask = []
        for t in range(3):
            want_mask += [1] * (len(tok.encode(replies[(5, s, t)])) + 1)
            if t < 2:
                ctx = (
                    "\n"
                    + template.render(chat[: 2 * t + 3], add_generation_prompt=True)[
                        len(template.render(chat[: 2 * t + 2])) :
                    ]
                )
                want_mask += [0] * len(tok.encode(ctx))
        assert r.mask[s] == want_mask
        assert [lp for lp, m in zip(r.sample_logps[s], r.mask[s], strict=True) if not m] == [
            0.0
        ] * want_mask.count(0)
        assert e.turns == 3 and e.finished and e.reward == 3.0  # "e" in every reply ("here")
        assert [m["role"] for m in e.messages] == [
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
            "assistant",
        ]
        # every turn was generated from the transcript so far, keyed by its turn
        asked = [ctx for key, ctx in engine.asked if key[1] == s]
        assert [key[2] for key, _ in engine.asked if key[1] == s] == [0, 1, 2]
        assert asked[2] == r.prompt_ids[s] + r.response_ids[s][: len(asked[2]) - len(r.prompt_ids[s])]
    # the training rows: targets are the model's tokens alone
    batch = sequences(r)
    for s in range(2):
        p = len(r.prompt_ids[s])
        seq = r.prompt_ids[s] + r.response_ids[s]
        for j, m in enumerate(r.mask[s]):
            want = seq[p + j] if m else IGNORE_INDEX
            assert int(batch["targets"][s, p + j - 1]) == want
        assert int((batch["targets"][s] != IGNORE_INDEX).sum()) == r.model_tokens(s)


def test_a_cut_reply_a_budget_and_max_turns_end_an_episode_truncated(chat_tokenizer, env_file):
    from ladle.data.tokenizer import load_tokenizer
    from ladle.rl.loader import end_ids

    tok = load_tokenizer(chat_tokenizer)
    end = tok.token_to_id("<|im_end|>")
    template = ChatTemplate(BUILTIN["chatml"])

    def run(cut=(), **kw):
        cfg = env_cfg(file=str(env_file), name="Feedback", kwargs={"turns": 9}, **kw)
        eps = Episodes(
            cfg, "grpo.env", tok=tok, template=template, source="chatml", end_ids=end_ids(tok), max_len=400
        )
        replies = {(0, 0, t): "a reply" for t in range(9)}
        return eps.run(Scripted(tok, replies, end, cut), {0: {"prompt": "hi"}}, [0], Sampling(n=1), step=0)

    r, (e,) = run(max_turns=2)
    assert e.turns == 2 and not e.finished and not r.finished[0]
    r, (e,) = run(cut={(0, 0, 1)})
    assert e.turns == 2 and not e.finished and r.mask[0][-1] == 1  # the cut reply is the last
    r, (e,) = run(max_total_tokens=40)
    assert not e.finished and len(r.prompt_ids[0]) + len(r.response_ids[0]) <= 40 and r.mask[0][-1] == 1
    # an environment that is done on a cut reply still leaves it truncated (DAPO's mask_truncated)
    cfg = env_cfg(file=str(env_file), name="Feedback", kwargs={"turns": 1})
    eps = Episodes(
        cfg, "grpo.env", tok=tok, template=template, source="chatml", end_ids=end_ids(tok), max_len=400
    )
    r, (e,) = eps.run(
        Scripted(tok, {(0, 0, 0): "a reply"}, end, {(0, 0, 0)}),
        {0: {"prompt": "hi"}},
        [0],
        Sampling(n=1),
        step=0,
    )
    assert e.turns == 1 and not e.finished and not r.finished[0]


def test_each_reply_keeps_the_routing_of_its_own_turn(chat_tokenizer, env_file):
    # routing replay over turns: a reply's positions as its own turn decoded them, the context
    # after it as the next turn's prefill read it (the scripted engine writes its turn number)
    from ladle.data.tokenizer import load_tokenizer
    from ladle.rl.loader import end_ids

    tok = load_tokenizer(chat_tokenizer)
    cfg = env_cfg(file=str(env_file), name="Feedback", kwargs={"turns": 3})
    eps = Episodes(
        cfg, "grpo.env", tok=tok, template=ChatTemplate(BUILTIN["chatml"]), source="chatml", end_ids=end_ids(tok),
        max_len=400,
    )  # fmt: skip
    engine = Scripted(
        tok, {(0, 0, t): f"reply {t}" for t in range(3)}, tok.token_to_id("<|im_end|>"), routing=True
    )
    r, (e,) = eps.run(engine, {0: {"prompt": "hi"}}, [0], Sampling(n=1), step=0)
    p, mask, rt = len(r.prompt_ids[0]), r.mask[0], r.routing[0][:, 0, 0].tolist()
    assert len(rt) == p + len(mask) - 1  # every position read (the last token never is)
    # turn t read every position before its reply's last token: a position's record is the
    # first turn that read it (a reply's tokens: its own turn; the context: the next one's prefill)
    ends = [p + j - 1 for j in range(1, len(mask)) if mask[j - 1] == 1 and mask[j] == 0] + [p + len(mask) - 1]
    assert len(ends) == e.turns == 3
    assert rt == [min(t for t, end in enumerate(ends) if q < end) for q in range(len(rt))]


# -- tools -----------------------------------------------------------------------------------------
def weather(city: str, unit: Literal["c", "f"] = "c", days: int | None = None) -> dict:
    """Get the weather of a city.

    Args:
        city: the city's name
        unit: the unit of temperature
        days: how many days ahead
            (none: today)

    Returns:
        the forecast
    """
    return {"city": city}


def pick(items: list[str], weights: dict[str, float], mode: str, pair: tuple[int, str]) -> str | int:
    """Pick one.

    Args:
        items: the choices
        weights: a weight by item
        mode: how to pick (choices: ["first", "random"])
        pair: a pair
    """
    return items[0]


@pytest.mark.parametrize("fn", [weather, pick, T._probe])
def test_schemas_equal_transformers_get_json_schema(fn):
    from transformers.utils import get_json_schema

    assert T.schema(fn) == get_json_schema(fn)


def test_a_tool_without_type_hints_or_descriptions_is_refused_by_name():
    def bare(word):
        """A tool.

        Args:
            word: a word
        """

    def undescribed(word: str):
        """A tool."""

    with pytest.raises(
        ConfigError, match=r"tool bare \(.*test_env.py:\d+\): argument 'word' has no type hint"
    ):
        T.schema(bare)
    with pytest.raises(ConfigError, match="tool undescribed .*describes no argument 'word'"):
        T.schema(undescribed)


def render_hf(template: str, messages, tools=None, **kw) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    out, _ = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=template, bos_token="<|begin_of_text|>", **kw
    )
    return out[0]


CALLS = [
    {"name": "weather", "arguments": {"city": "Paris", "unit": "f"}},
    {"name": "lookup", "arguments": {"word": "ok"}},
]


def hf_call(c):
    return {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}


@pytest.mark.parametrize(
    "name, fmt, calls",
    [
        ("qwen2_5", "hermes", CALLS),
        ("qwen3", "hermes", CALLS),
        ("llama3_1", "llama3", CALLS[:1]),
        ("glm4", "glm4", CALLS[:1]),
    ],
)
def test_tool_calls_parse_from_transformers_rendering_in_each_template(name, fmt, calls):
    """The model's turn as transformers renders a tool call in the template is parsed back to
    the same calls; the format is read from the template; and the context after the turn
    (rendered against the fixed base) continues the transcript exactly as transformers renders
    the whole conversation."""
    source = (TEMPLATES / f"{name}.jinja").read_text()
    template = ChatTemplate(source, {"bos_token": "<|begin_of_text|>"})
    assert T.detect(template, name) == fmt
    schemas = [T.schema(weather), T.schema(T._probe)]
    user = [{"role": "user", "content": "Weather in Paris?"}]
    if fmt == "glm4":  # GLM-4-9b-chat: tools in the system message, a call as metadata + JSON
        head = [{"role": "system", "content": "", "tools": schemas}, *user]
        turn = [
            {"role": "assistant", "metadata": c["name"], "content": json.dumps(c["arguments"])} for c in calls
        ]
        results = [{"role": "observation", "content": "17"}]
        kw = {}
    else:
        head, kw = user, {"tools": schemas}
        turn = [{"role": "assistant", "content": "", "tool_calls": [hf_call(c) for c in calls]}]
        results = [{"role": "tool", "name": c["name"], "content": "17"} for c in calls]
    prompt = render_hf(source, head, add_generation_prompt=True, **kw)
    whole = render_hf(source, [*head, *turn, *results], add_generation_prompt=True, **kw)
    assert whole.startswith(prompt)
    # the model's turn: what follows its generation prompt up to its end token
    rest = whole[len(prompt) :]
    end = {"hermes": "<|im_end|>", "llama3": "<|eot_id|>", "glm4": "<|observation|>"}[fmt]
    reply = rest[: rest.index(end)]
    got = T.parse(reply, fmt, {"weather", "lookup", "_probe"})
    assert [(c.name, c.arguments, c.error) for c in got] == [(c["name"], c["arguments"], None) for c in calls]
    # ladle's first prompt and the context after the turn, character for character
    chars = SimpleNamespace(encode=list)
    tr = Transcript(chars, template, schemas, name)
    assert "".join(tr.first(user)) == prompt
    mine = [T.result_message(fmt, c, "17") for c in got]
    assert prompt + reply + end + "".join(tr.after(mine, end)) == whole


def test_malformed_calls_become_messages_to_the_model(tmp_path):
    assert T.parse("no call here", "hermes", set()) == []
    (bad,) = T.parse('<tool_call>\n{"name": "lookup", "arguments": {"word": }\n</tool_call>', "hermes", set())
    assert bad.error.startswith("the tool call is not valid JSON")
    (open_,) = T.parse('<tool_call>\n{"name": "lookup", "arguments": {}}', "hermes", set())
    assert open_.error == "the tool call has no closing </tool_call>"
    (noname,) = T.parse('{"parameters": {}}', "llama3", set())
    assert 'a tool call is a JSON object with a "name"' in noname.error
    assert T.parse("The answer is 4.", "llama3", set()) == []
    assert T.parse("The answer is 4.", "glm4", {"lookup"}) == []

    def slow(s: float) -> str:
        """Sleeps.

        Args:
            s: seconds
        """
        time.sleep(s)
        return "woke"

    def boom(x: int) -> int:
        """Raises.

        Args:
            x: a number
        """
        raise RuntimeError("no luck")

    box = T.Toolbox([slow, boom], timeout_s=0.5)
    calls = [
        T.Call("slow", {"s": 0.0}), T.Call("slow", {"s": 3.0}), T.Call("boom", {"x": 1}), T.Call("nope", {}),
        T.Call("boom", {"y": 1}), bad,
    ]  # fmt: skip
    t0 = time.perf_counter()
    out = box.run(calls + [T.Call("slow", {"s": 3.0})])  # two slow calls: one limit for the turn
    assert time.perf_counter() - t0 < 2.0
    assert out[0] == "woke"
    assert out[1] == "Error: slow timed out after 0.5 s"
    assert out[2] == "Error: boom raised RuntimeError: no luck"
    assert out[3] == "Error: no tool named 'nope'; the tools are slow, boom"
    assert out[4].startswith("Error: wrong arguments for boom:")
    assert out[5].startswith("Error: the tool call is not valid JSON")
    assert out[6] == "Error: slow timed out after 0.5 s"
    assert box.run([T.Call("slow", {"s": 0.0})]) == ["woke"]  # a fresh pool, not the busy one
    box.close()


def test_the_python_tool_runs_in_the_sandbox(tmp_path):
    py = T.python_tool(wall_s=5)
    assert T.schema(py)["function"]["parameters"]["required"] == ["code"]
    assert py("print(6 * 7)").strip() == "42"
    outside = tmp_path / "x"
    got = py(f"open({str(outside)!r}, 'w').write('x')")
    assert (
        not outside.exists()
        and got.strip() == "PermissionError: sandbox: writing outside the sandbox is not allowed"
    )
    assert "ran past" in T.python_tool(wall_s=1)("while True: pass")


def test_a_template_without_a_tool_format_is_refused():
    with pytest.raises(ConfigError, match=r"the chat template \(chatml\) has no tool format"):
        T.detect(ChatTemplate(BUILTIN["chatml"]), "chatml")


# -- GAE over turns ---------------------------------------------------------------------------------
def test_gae_over_turns_equals_gae_on_the_models_tokens_alone():
    from ladle.rl.algorithms import gae

    torch.manual_seed(0)
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    rewards, values = torch.randn(1, 12) * mask, torch.randn(1, 12)
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    keep = mask[0]
    a2, r2 = gae(
        rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum()), dtype=torch.bool), 0.9, 0.8
    )
    assert torch.allclose(adv[:, keep], a2) and torch.allclose(ret[:, keep], r2)
    assert adv[:, ~keep].abs().max() == 0 and ret[:, ~keep].abs().max() == 0


# -- GRPO on episodes, with the tiny model ---------------------------------------------------------
def env_run_config(chat_tokenizer, prompt_data, tmp_path, env_file, **env):
    from test_grpo import grpo_config

    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "run", num_iterations=2, log_rollouts=4)
    cfg["data"]["seq_len"] = 64
    cfg["model"]["max_seq_len"] = 64
    # a stop string the random policy meets soon ends its turns (a turn cut by the cap ends the episode)
    cfg["grpo"].update(stop=["e"], max_response_len=6)
    cfg["grpo"]["env"] = {"file": str(env_file), "name": "Feedback", "kwargs": {"turns": 3}, **env}
    cfg["rewards"] = {"terms": [{"name": "length", "max_tokens": 6, "buffer": 3, "weight": 0.1}]}
    return cfg


def test_grpo_trains_on_episodes_of_several_turns(chat_tokenizer, prompt_data, tmp_path, env_file):
    from ladle.config.load import build_config
    from ladle.data.tokenizer import load_tokenizer
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = env_run_config(chat_tokenizer, prompt_data, tmp_path, env_file)
    assert load("grpo").run(build_config(cfg)) == "completed"
    recs = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(recs) == 4
    assert all(r["turns_mean"] > 1.5 for r in recs), [r["turns_mean"] for r in recs]
    assert all("reward_env_mean" in r and "reward_length_mean" in r for r in recs)
    # fp32: the training forward's log-probs equal the sampler's on every token the model sampled
    # (a context token scored as the model's, or a shifted turn, would show here)
    assert all(r["rollout_logprob_diff"] < 1e-4 for r in recs[1::2])
    tok = load_tokenizer(chat_tokenizer)
    lines = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(lines) == 8
    for e in lines:
        assert len(e["tokens"]) == len(e["mask"]) <= 64
        roles = [m["role"] for m in e["messages"]]
        assert roles[0] == "user" and roles.count("assistant") == e["turns"]
        context = tok.decode([t for t, m in zip(e["tokens"], e["mask"], strict=True) if not m])
        for n in range(1, e["turns"]):
            assert f"again {n}" in context  # the environment's messages are context, never trained
        own = tok.decode([t for t, m in zip(e["tokens"], e["mask"], strict=True) if m])
        assert "again" not in own
        assert e["rewards"]["env"] == sum(
            "e" in m["content"] for m in e["messages"] if m["role"] == "assistant"
        )
    from ladle.ops.report import report

    assert " turns, 0 tool calls</h3>" in report(tmp_path / "run").read_text()


def test_an_environment_that_raises_is_named_and_scored_zero_or_stops(
    chat_tokenizer, prompt_data, tmp_path, env_file, capsys
):
    import yaml

    from ladle.cli import main
    from ladle.train.metrics import read_metrics

    cfg = env_run_config(chat_tokenizer, prompt_data, tmp_path, env_file, name="Broken", kwargs={})
    cfg["train"]["max_steps"] = 2
    cfg["rewards"]["on_error"] = "zero"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "grpo", "--config", str(path)]) == 0
    recs = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    # a reply cut by the cap ends its episode before the environment steps: the rest raised
    assert all(r["reward_errors"] > 0 for r in recs)
    events = (tmp_path / "run" / "events.log").read_text()
    line = ENV.splitlines().index('        raise ValueError("the game broke")') + 1
    assert (
        f"environment Broken.step ({env_file}:{line}) raised ValueError: the game broke; at step 1" in events
    )
    assert "the last reply began" in events and "scored 0 (rewards.on_error: zero)" in events
    capsys.readouterr()
    cfg["rewards"]["on_error"] = "stop"
    cfg["output_dir"] = str(tmp_path / "stop")
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "grpo", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "environment Broken.step" in err and "the game broke; at step 1, train prompt" in err
    assert "the last reply began" in err


def test_environments_and_tools_are_refused_by_name_before_launch(
    chat_tokenizer, prompt_data, tmp_path, env_file, capsys
):
    import yaml

    from ladle.cli import main

    path = tmp_path / "c.yaml"

    def refused(message: str, top=None, **env) -> None:
        cfg = env_run_config(chat_tokenizer, prompt_data, tmp_path, env_file, **env)
        cfg["output_dir"] = str(tmp_path / "never")
        for k, v in (top or {}).items():
            cfg[k] = {**cfg.get(k, {}), **v}
        path.write_text(yaml.safe_dump(cfg))
        assert main(["run", "grpo", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err, err

    refused(
        "grpo.env.name: " + str(env_file) + " defines no class 'Nope' (its classes: Broken, Feedback",
        name="Nope",
    )
    refused(
        f"grpo.env: NoStep ({env_file}) has no method step; an environment defines step(self, reply)",
        name="NoStep",
    )
    refused(f"grpo.env: WrongStep ({env_file}).step must be step(self, reply)", name="WrongStep")
    refused("grpo.env.kwargs: Feedback(rounds) does not match its __init__", kwargs={"rounds": 2})
    refused(
        "grpo.env.file " + str(tmp_path / "gone.py") + ": not a Python file", file=str(tmp_path / "gone.py")
    )
    refused(f"tool untyped ({env_file}:", tools=["untyped"])
    refused("argument 'word' has no type hint", tools=["untyped"])
    refused("grpo.env.tools: no function 'nope'", tools=["nope"])
    # the test tokenizer's template is ChatML, which has no tool format
    refused("has no tool format", tools=["lookup"])
    refused("grpo.env: name 'Feedback' needs `file`, the Python file that defines it", file=None)
    refused("grpo.env.max_total_tokens (100) exceeds data.seq_len (64)", max_total_tokens=100)
    assert not (tmp_path / "never").exists()


def test_a_tool_episode_is_the_templates_rendering_of_the_calls_and_results(tmp_path, env_file):
    """Qwen2.5's template, the tools alone (no environment): a turn that calls `lookup` gets its
    result, the next turn (no call) is the answer and ends the episode; the transcript is, character
    for character, transformers' rendering of the same conversation with the same tools."""
    source = (TEMPLATES / "qwen2_5.jinja").read_text()
    chars = SimpleNamespace(  # a token a character: the transcript compares as text
        encode=list, decode=lambda ids, skip_special_tokens=True: "".join(ids), eos_id="<|endoftext|>"
    )
    eps = Episodes(
        env_cfg(file=str(env_file), tools=["lookup"]), "grpo.env", tok=chars, template=ChatTemplate(source),
        source="qwen2_5", end_ids={"<|im_end|>"}, max_len=4000,
    )  # fmt: skip
    assert eps.format == "hermes"
    call = '<tool_call>\n{"name": "lookup", "arguments": {"word": "abc"}}\n</tool_call>'
    replies = {
        (0, 0, 0): call,
        (0, 0, 1): "It is cba.",
        (0, 1, 0): "<tool_call>\n{broken\n</tool_call>",
        (0, 1, 1): "?",
    }

    class Chars(Scripted):
        def generate_rows(self, contexts, keys, limits, sampling, *, step):
            out = Rollouts()
            for ctx, key in zip(contexts, keys, strict=True):
                ids = [*self.replies[key], "<|im_end|>"]
                out.add(key[0], key[1], ctx, ids, [-0.5] * len(ids), True)
            return out

    r, (good, bad) = eps.run(
        Chars(chars, replies, None), {0: {"prompt": "Reverse abc"}}, [0], Sampling(n=2), step=0
    )
    whole = render_hf(
        source,
        [
            {"role": "user", "content": "Reverse abc"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [hf_call({"name": "lookup", "arguments": {"word": "abc"}})],
            },
            {"role": "tool", "content": "cba"},
            {"role": "assistant", "content": "It is cba."},
        ],
        tools=[T.schema(eps.tools.functions["lookup"])],
    )
    assert "".join(r.prompt_ids[0] + r.response_ids[0]) + "\n" == whole
    assert good.turns == 2 and good.finished and good.last == "It is cba."
    assert good.tool_calls == [
        {"turn": 1, "name": "lookup", "arguments": {"word": "abc"}, "error": None, "result": "cba"}
    ]
    # a call that cannot be read is answered with the error, and the model goes on
    assert bad.turns == 2 and bad.tool_calls[0]["result"].startswith("Error: the tool call is not valid JSON")
    assert "<tool_response>\nError: the tool call is not valid JSON" in "".join(r.response_ids[1])
    eps.close()


def test_ppo_trains_on_episodes_with_values_on_the_models_tokens(
    chat_tokenizer, prompt_data, tmp_path, env_file
):
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = env_run_config(chat_tokenizer, prompt_data, tmp_path, env_file)
    g = cfg.pop("grpo")
    cfg["ppo"] = {
        "num_samples": 2, "max_response_len": 6, "stop": ["e"], "kl_coef": 0.05, "critic_lr": 1e-3, "ppo_epochs": 2,
        "log_rollouts": 2, "env": g["env"],
    }  # fmt: skip
    assert load("ppo").run(build_config(cfg)) == "completed"
    recs = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(recs) == 4 and all(r["turns_mean"] > 1.2 for r in recs)
    assert all(math.isfinite(r["value_loss"]) and math.isfinite(r["loss"]) for r in recs)
    assert recs[0]["rollout_logprob_diff"] < 1e-4


def test_ppo_episodes_with_the_critic_apart_equal_the_shared_run(
    chat_tokenizer, prompt_data, tmp_path, env_file
):
    # ppo.placement: separated: the actor's ranks run the episodes, turning together among
    # themselves (the critic's ranks run none), and hand the rows, masks over turns included, to
    # the critic's: every step equals the run with all models in one process
    import subprocess
    import sys

    import yaml

    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = env_run_config(chat_tokenizer, prompt_data, tmp_path, env_file)
    g = cfg.pop("grpo")
    cfg["train"].update(threads=1)
    cfg["ppo"] = {
        "num_samples": 2, "max_response_len": 6, "stop": ["e"], "kl_coef": 0.05, "critic_lr": 1e-3, "ppo_epochs": 2,
        "env": g["env"],
    }  # fmt: skip
    assert load("ppo").run(build_config(cfg)) == "completed"
    shared = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "ladle", "run", "ppo", "--config", str(path), "--nproc", "2"]
    over = [f"output_dir={tmp_path / 'apart'}", "ppo.placement=separated"]
    r = subprocess.run([*cmd, *over], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    apart = [r for r in read_metrics(tmp_path / "apart") if "loss" in r]
    assert len(apart) == len(shared) == 4 and all(r["turns_mean"] > 1.2 for r in apart)
    for a, b in zip(shared, apart, strict=True):
        for key in ("reward_mean", "turns_mean", "response_len_mean", "loss", "value_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_episodes_on_separated_engine_ranks_equal_the_shared_run(
    chat_tokenizer, prompt_data, tmp_path, env_file
):
    # grpo.placement: separated, max_staleness 0: the engine's rank runs the episodes (its
    # environments beside it) from the weights just sent; every step equals the shared run
    import yaml
    from test_separated import run_cli

    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = env_run_config(chat_tokenizer, prompt_data, tmp_path, env_file)
    cfg["train"].update(threads=1)
    cfg["grpo"]["log_rollouts"] = 0
    cfg["optim"]["lr"] = 3e-3
    assert load("grpo").run(build_config(cfg)) == "completed"
    shared = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    apart = run_cli(path, tmp_path / "apart", "grpo.placement=separated")
    assert len(apart) == len(shared) == 4
    for a, b in zip(shared, apart, strict=True):
        for key in ("reward_mean", "reward_env_mean", "turns_mean", "response_len_mean", "loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
