"""Chat templates: a tokenizer folder's Jinja `chat_template`, rendered as `transformers` renders it.

Templates from the Hub are untrusted code, so they run in Jinja's immutable sandbox with only
what transformers gives them: `trim_blocks`/`lstrip_blocks`, the loop-control extension, a
`tojson` filter that keeps non-ASCII text, `raise_exception`, `strftime_now`, the tokenizer's
special tokens (`bos_token`, `eos_token`, ...), and `{% generation %}` blocks (rendered as
they are; they mark the assistant's tokens, which SFT loss masks will use). The token ids of a
rendered chat equal `apply_chat_template`'s (tests/test_chat.py).
"""

from __future__ import annotations

import json
from datetime import datetime

from ladle.errors import DataError

# Built-in templates (`ladle data prepare --task sft --template NAME`), for tokenizers without one
# or to override it. Their markers must be single tokens of the vocabulary (prepare checks).
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2.5's template without tool calls: a default system prompt, tool results as user turns.
QWEN = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3's template; tool results take Llama 3.1's `ipython` role.
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
BUILTIN = {"chatml": CHATML, "qwen": QWEN, "llama3": LLAMA3}
MARKERS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "qwen": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
}
# Tokens that end an assistant turn in the templates above (generation stops at them too), and
# GLM-4's next-turn markers, which end its assistant's turns (its generation config stops there).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|user|>", "<|observation|>")

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    def __init__(
        self, template: str, special_tokens: dict[str, str] | None = None, source: str = "chat_template"
    ):
        """`source`: where the template comes from (a file), which its errors name."""
        import jinja2

        self.source = source
        try:
            self._template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"{source}: chat template line {e.lineno}: {e.message}") from None
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_config(
        cls,
        config: dict,
        name: str = "default",
        source: str = "tokenizer_config.json",
        template: str | None = None,
    ) -> ChatTemplate | None:
        """The template of a tokenizer_config.json dict (a string, or a list of named templates),
        or `template` (a chat_template.jinja file's), or None when there is none."""
        template = template if template is not None else config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get(name)
        if not isinstance(template, str):
            return None
        special = {}
        for key in SPECIAL_KEYS:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(template, special, source)

    def render(
        self, messages: list[dict], *, add_generation_prompt: bool = False, tools=None, **kwargs
    ) -> str:
        import jinja2

        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise DataError(f"message {i}: expected a dict with 'role' and 'content', got {m!r}")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self.special_tokens,
                **kwargs,
            )
        except jinja2.TemplateError as e:  # a sandbox refusal too (SecurityError)
            raise DataError(f"{self.source}: chat template: {e}") from None
