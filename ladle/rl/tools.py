"""Tools for multi-turn episodes (ladle/rl/env.py): plain Python functions, with type hints and a
Google-style docstring, offered to the model in its chat template's own tool format; the calls
in the model's turn parsed, run with a time limit each, and their results (or an error the model
can read) sent back as the next turn's messages.

Schemas: the JSON schema `transformers.utils.get_json_schema` writes for the same function
({"type": "function", "function": {name, description, parameters, return?}}), so a template
renders ladle's tools as it renders transformers'. A tool without a type hint or an argument's
description is refused before launch, naming it.

Formats (what the model writes when it calls, and the role its results come back in):

    hermes   Qwen2.5 / Qwen3: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, one or
             more a turn; results `tool` messages (the template gathers them in one user turn)
    llama3   Llama-3.1: the whole turn one JSON object {"name": ..., "parameters": {...}}
             (an optional <|python_tag|> before it); results `tool` messages (role ipython)
    glm4     GLM-4: the turn begins with the tool's name on a line of its own, then its JSON
             arguments; results `observation` messages

`detect` finds the format from the template itself (what it renders for an assistant's tool
call); a template that renders no tools has none, and a run that asks for tools with it stops
before launch. A call that cannot be read (broken JSON, no name, an unknown tool, arguments the
function does not take) is answered with an error message, never a crash: the model learns from
it. A tool that raises answers with its exception; one past its time limit with a timeout.

`python`: the built-in tool that runs a program in ladle's sandbox (ladle/rl/sandbox.py) and
returns what it printed.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from ladle.errors import ConfigError

FORMATS = ("hermes", "llama3", "glm4")


# -- schemas, as transformers' get_json_schema writes them -------------------------------------
_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n\s*(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG = re.compile(r"(?:^|\n)\s*(\w+):\s*(.*?)\s*(?=\n\s*\w+:|\Z)", re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_BASIC = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}


def _where(fn: Callable) -> str:
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)


def _type(hint, fn: Callable) -> dict:
    """The JSON schema of a type hint."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is None:
        if hint in _BASIC:
            return {"type": _BASIC[hint]}
        if hint in (list, tuple):
            return {"type": "array"}
        if hint is Any:
            return {}
        return {"type": "object"}  # dict, or a class (transformers' choice too)
    if origin is Union or origin is types.UnionType:
        subs = [_type(t, fn) for t in args if t is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subs):
            names = sorted({s["type"] for s in subs})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subs}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal:
        kinds = []
        for a in args:
            if type(a) not in _BASIC:
                raise ConfigError(
                    f"tool {fn.__name__} ({_where(fn)}): Literal[...] of {a!r}: only plain values"
                )
            if _BASIC[type(a)] not in kinds:
                kinds.append(_BASIC[type(a)])
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin is list:
        return {"type": "array", "items": _type(args[0], fn)} if args else {"type": "array"}
    if origin is tuple:
        if len(args) == 1 or ... in args:
            raise ConfigError(
                f"tool {fn.__name__} ({_where(fn)}): tuple hint {hint}: use list[...] for a sequence"
            )
        return {"type": "array", "prefixItems": [_type(t, fn) for t in args]} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object", **({"additionalProperties": _type(args[1], fn)} if len(args) == 2 else {})}
    raise ConfigError(f"tool {fn.__name__} ({_where(fn)}): cannot describe the type hint {hint} in JSON")


def schema(fn: Callable) -> dict:
    """The tool's JSON schema (transformers' `get_json_schema`'s). A ConfigError names the function
    and its file:line when an argument has no type hint or no description in the docstring."""
    name = getattr(fn, "__name__", "tool")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ConfigError(
            f"tool {name} ({_where(fn)}) has no docstring: describe it, and each argument under 'Args:' "
            "(Google style), so the model knows what it does"
        )
    sig = inspect.signature(fn)
    hints = get_type_hints(fn)
    required, properties = [], {}
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ConfigError(
                f"tool {name} ({_where(fn)}): *{p.name} cannot be described; name each argument"
            )
        if p.name not in hints:
            raise ConfigError(
                f"tool {name} ({_where(fn)}): argument {p.name!r} has no type hint; the model's calls are "
                "checked against the types (e.g. `def lookup(word: str) -> str`)"
            )
        if p.default is p.empty:
            required.append(p.name)
    for arg, hint in hints.items():
        if arg != "return":
            properties[arg] = _type(hint, fn)
    m = _DESCRIPTION.search(doc.strip())
    description = m.group(1).strip() if m else None
    args_block = _ARGS.search(doc.strip())
    described = {}
    if args_block:
        lines = "\n".join(line for line in args_block.group(1).strip().split("\n") if line.strip())
        described = {k: re.sub(r"\s*\n+\s*", " ", v.strip()) for k, v in _ARG.findall(lines)}
    for arg, s in properties.items():
        if arg not in described:
            raise ConfigError(
                f"tool {name} ({_where(fn)}): the docstring describes no argument {arg!r}; add it under 'Args:'"
            )
        desc = described[arg]
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", desc, flags=re.IGNORECASE)
        if choices:
            s["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            desc = desc[: choices.start()].strip()
        s["description"] = desc
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        ret = _type(hints["return"], fn)
        returns = _RETURNS.search(doc.strip())
        if returns:
            ret["description"] = returns.group(1).strip()
        out["return"] = ret
    return {"type": "function", "function": out}


# -- the model's calls ---------------------------------------------------------------------------
@dataclass
class Call:
    """A tool call read from the model's turn: `name` and `arguments`, or `error` (what was wrong
    with it, told to the model) and the `text` it came from."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    text: str = ""


def _call(obj, text: str, args_key: str) -> Call:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call(error='a tool call is a JSON object with a "name" and its "' + args_key + '"', text=text)
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return Call(obj["name"], error=f'the "{args_key}" of a tool call must be a JSON object', text=text)
    return Call(obj["name"], args, text=text)


def _json(text: str, args_key: str) -> Call:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Call(error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})", text=text)
    return _call(obj, text, args_key)


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse(text: str, fmt: str, names: set[str]) -> list[Call]:
    """The tool calls in a model's turn (its text, end tokens dropped), in the template's format;
    [] when the turn calls nothing (an answer)."""
    if fmt == "hermes":
        out = []
        for m in _HERMES.finditer(text):
            call = _json(m.group(1).strip(), "arguments")
            if not m.group(2):
                call = Call(call.name, error="the tool call has no closing </tool_call>", text=m.group(0))
            out.append(call)
        return out
    if fmt == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return []
        return [_json(body, "parameters")]
    if fmt == "glm4":
        head, _, rest = text.lstrip("\n").partition("\n")
        if head.strip() not in names:
            return []
        call = _json(rest.strip(), "arguments")
        if call.error is None or call.name:
            return [call]
        try:  # GLM-4 writes the arguments alone: the name is the first line
            args = json.loads(rest.strip())
        except json.JSONDecodeError as e:
            return [Call(head.strip(), error=f"the tool's arguments are not valid JSON ({e.msg})", text=text)]
        if not isinstance(args, dict):
            return [Call(head.strip(), error="the tool's arguments must be a JSON object", text=text)]
        return [Call(head.strip(), args, text=text)]
    raise ValueError(f"tool format {fmt!r}: one of {', '.join(FORMATS)}")


def result_message(fmt: str, call: Call, content: str) -> dict:
    """A tool's result as the message the template renders after the model's turn."""
    role = "observation" if fmt == "glm4" else "tool"
    return {"role": role, "name": call.name, "content": content}


def call_message(text: str, calls: list[Call]) -> dict:
    """The model's turn as an assistant message (the transcript's; never rendered again)."""
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
            if c.error is None
        ]
    return message


# -- the template's format -----------------------------------------------------------------------
def _probe(x: int) -> int:
    """A probe.

    Args:
        x: a number
    """
    return x


def tools_in_system(template, schemas: list[dict]) -> bool:
    """The template reads its tools from a system message's `tools` (GLM-4-9b-chat's), not from
    the `tools` variable."""
    probe = [{"role": "user", "content": "hi"}]
    name = schemas[0]["function"]["name"]
    if name in template.render(probe, add_generation_prompt=True, tools=schemas):
        return False
    system = [{"role": "system", "content": "", "tools": schemas}, *probe]
    return name in template.render(system, add_generation_prompt=True)


def with_tools(template, messages: list[dict], schemas: list[dict]) -> tuple[list[dict], dict]:
    """(messages, render keyword arguments) that show the tools to the model."""
    if not schemas:
        return messages, {}
    if tools_in_system(template, schemas):
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "tools": schemas}, *messages[1:]], {}
        return [{"role": "system", "content": "", "tools": schemas}, *messages], {}
    return messages, {"tools": schemas}


def detect(template, source: str) -> str:
    """The tool format of a chat template (ladle.data.chat.ChatTemplate), from what it renders for
    an assistant's tool call; a ConfigError when it renders no tools."""
    probe = [schema(_probe)]
    call = {"type": "function", "function": {"name": "_probe", "arguments": {"x": 7}}}
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "_probe", "content": "7"},
    ]
    try:
        messages, kw = with_tools(template, chat, probe)
        text = template.render(messages, add_generation_prompt=True, **kw)
    except Exception:  # a template that refuses tool messages has no tool format either
        text = ""
    if "<tool_call>" in text:
        return "hermes"
    if re.search(r'\{"name": "_probe", "parameters": \{"x": 7\}\}', text):
        return "llama3"
    if tools_in_system(template, probe) and "<|observation|>" in template.render(
        [{"role": "user", "content": "hi"}, {"role": "observation", "content": "7"}]
    ):
        return "glm4"
    raise ConfigError(
        f"the chat template ({source}) has no tool format: it does not render tools or an assistant's tool "
        f"call as Qwen's <tool_call>, Llama-3.1's JSON or GLM-4's do; use a model whose template calls tools, "
        f"or name the format with env.tool_format ({', '.join(FORMATS)})"
    )


# -- running the calls ---------------------------------------------------------------------------
def python_tool(wall_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512, max_chars: int = 2000):
    """The built-in `python` tool: the program runs in ladle's sandbox; its output comes back."""
    from ladle.rl import sandbox

    limits = sandbox.Limits(wall_s=wall_s, cpu_s=cpu_s, memory_bytes=memory_mb << 20)

    def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it prints.

        Args:
            code: the program's source; print what you want to see
        """
        r = sandbox.run(code, "", limits)
        out = r.stdout + (f"\n{r.stderr.strip().splitlines()[-1]}" if not r.ok and r.stderr.strip() else "")
        if r.timed_out:
            out += f"\n(stopped: ran past {wall_s:g} s)"
        return out[-max_chars:] if len(out) > max_chars else out

    return python


class Toolbox:
    """The run's tools by name, their schemas, and a pool that runs a turn's calls side by side,
    each within `timeout_s` of the turn's start. A call past its limit is answered with a timeout
    and left to finish in its thread (Python cannot stop a thread), the pool it holds given up
    for a fresh one; a tool that must be stopped runs its work in the sandbox, as `python` does."""

    def __init__(self, functions: list[Callable], timeout_s: float = 10.0, workers: int = 64):
        self.functions = {f.__name__: f for f in functions}
        self.schemas = [schema(f) for f in functions]
        self.timeout_s, self.workers, self.pool = timeout_s, workers, None

    def run(self, calls: list[Call]) -> list[str]:
        """Each call's result as text (JSON for what is not a string), or the error to tell the
        model, all calls in flight together."""
        futures = {}
        out: list[str | None] = [None] * len(calls)
        if self.pool is None:  # started at the first call (and again after a close)
            self.pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="ladle-tool")
        for k, c in enumerate(calls):
            if c.error is not None:
                out[k] = f"Error: {c.error}"
            elif c.name not in self.functions:
                out[k] = f"Error: no tool named {c.name!r}; the tools are {', '.join(self.functions)}"
            else:
                try:
                    inspect.signature(self.functions[c.name]).bind(**c.arguments)
                except TypeError as e:
                    out[k] = f"Error: wrong arguments for {c.name}: {e}"
                    continue
                futures[k] = self.pool.submit(self.functions[c.name], **c.arguments)
        # every call's limit counts from now, the turn's calls side by side
        _, late = concurrent.futures.wait(futures.values(), timeout=self.timeout_s)
        for k, f in futures.items():
            if f in late:
                out[k] = f"Error: {calls[k].name} timed out after {self.timeout_s:g} s"
                continue
            try:
                value = f.result()
                out[k] = value if isinstance(value, str) else json.dumps(value, default=str)
            except Exception as e:
                out[k] = f"Error: {calls[k].name} raised {type(e).__name__}: {e}"
        if late:  # their threads run on: the next turn gets a fresh pool, not the busy one
            self.close()
        return typing.cast(list[str], out)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
