"""Chat templates render and tokenize as transformers' apply_chat_template does."""

import json

import pytest

from ladle.data.tokenizer import load_tokenizer
from ladle.errors import DataError

CHATML = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + message['role']) }}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
TOOLS = (
    "{% for m in messages %}{% if m.role == 'tool' %}{% continue %}{% endif %}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m.content | tojson }}{% endif %}\n{% endfor %}"
)
# GLM-4's templates as their tokenizer_config.json files have them (glm-4-9b-chat-hf; GLM-4-0414),
# transcribed with the prose of the tool descriptions shortened: the constructs are all there
# (a role name spliced into the marker, an undefined `metadata`, `tools` inside a message,
# `tojson(indent=4)`, `dict.get`, a filtered loop).
GLM4 = (
    "[gMASK]<sop>{% for item in messages %}{% if item['tools'] is defined %}<|system|>\n"
    "You are ChatGLM.\n\n# Tools{% set tools = item['tools'] %}{% for tool in tools %}"
    "{% if tool['type'] == 'function' %}\n\n## {{ tool['function']['name'] }}\n\n"
    "{{ tool['function'] | tojson(indent=4) }}\nCall it with JSON arguments."
    "{% elif tool['type'] == 'python' %}\n\n## python\n\nRuns in a Jupyter notebook.{% endif %}"
    "{% endfor %}{% endif %}{% if item['content'] %}<|{{ item['role'] }}|>{{ item['metadata'] }}\n"
    "{{ item['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GLM4_0414 = (
    "[gMASK]<sop>{%- if tools -%}<|system|>\n# Tools\n{% for tool in tools %}"
    '{%- set function = tool.function if tool.get("function") else tool %}\n\n## {{ function.name }}\n\n'
    "{{ function | tojson(indent=4, ensure_ascii=False) }}\nCall it with JSON arguments.{%- endfor %}"
    "{%- endif -%}{%- for msg in messages %}{%- if msg.role == 'system' %}<|system|>\n{{ msg.content }}"
    "{%- endif %}{%- endfor %}{%- for message in messages if message.role != 'system' %}"
    "{%- set role = message['role'] %}{%- set content = message['content'] %}"
    '{%- set meta = message.get("metadata", "") %}{%- if role == \'user\' %}<|user|>\n{{ content }}'
    "{%- elif role == 'assistant' and not meta %}<|assistant|>\n{{ content }}"
    "{%- elif role == 'assistant' and meta %}<|assistant|>{{ meta }} \n{{ content }}"
    "{%- elif role == 'observation' %}<|observation|>\n{{ content }}{%- endif %}{%- endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = [
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CHAT = [
    {"role": "user", "content": "  Write a function that adds two numbers. "},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "tool", "content": "ignored"},
    {"role": "user", "content": "Und jetzt für drei Zahlen, bitte — «schnell»!"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, corpus):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(p) for p in corpus.iterdir()], trainer)
    out = tmp_path_factory.mktemp("chat")
    tok.save(str(out / "tokenizer.json"))
    return out


def _write_config(folder, template):
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("template", [CHATML, LLAMA3, TOOLS, [{"name": "default", "template": CHATML}]])
@pytest.mark.parametrize("gen", [False, True])
def test_ids_equal_transformers_apply_chat_template(folder, template, gen):
    from transformers import AutoTokenizer

    _write_config(folder, template)
    chat = CHAT if template is TOOLS else [m for m in CHAT if m["role"] != "tool"]
    hf = AutoTokenizer.from_pretrained(folder)
    text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    ours = load_tokenizer(folder)
    assert ours.chat_template.render(chat, add_generation_prompt=gen) == text
    assert ours.apply_chat_template(chat, add_generation_prompt=gen) == list(ids)
    if template is CHATML:  # the chat markers are single special tokens
        assert ours.token_to_id("<|im_start|>") in ours.apply_chat_template(chat)


TOOL = {
    "type": "function",
    "function": {"name": "add", "description": "Summe «zweier» Zahlen", "parameters": {"type": "object"}},
}


@pytest.mark.parametrize("template", [GLM4, GLM4_0414], ids=["glm-4", "glm-4-0414"])
@pytest.mark.parametrize("tools", [False, True])
def test_glm4_templates_render_as_transformers(folder, template, tools):
    # GLM-4 puts the tools in a message of their own; GLM-4-0414 takes them as `tools=`.
    from transformers import AutoTokenizer

    _write_config(folder, template)
    chat = [{"role": "system", "content": "Be brief."}] + [m for m in CHAT if m["role"] != "tool"]
    chat[2] = {**chat[2], "metadata": "add"} if template is GLM4_0414 else chat[2]
    kw = {}
    if tools and template is GLM4:
        chat = [{"role": "system", "content": "", "tools": [TOOL, {"type": "python"}]}, *chat]
    elif tools:
        kw = {"tools": [TOOL]}
    hf = AutoTokenizer.from_pretrained(folder)
    ours = load_tokenizer(folder)
    for gen in (False, True):
        text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen, **kw)
        assert ours.chat_template.render(chat, add_generation_prompt=gen, **kw) == text
    assert text.startswith("[gMASK]<sop>") and text.endswith("<|assistant|>")
    assert ("## add" in text) == tools and "<|user|>\n  Write a function" in text


def test_template_errors_and_the_sandbox(folder):
    _write_config(folder, LLAMA3)
    tok = load_tokenizer(folder)
    with pytest.raises(DataError, match="unknown role tool"):
        tok.apply_chat_template(CHAT)
    _write_config(folder, "{{ messages.__class__.__mro__ }}")  # attribute escapes are blocked
    with pytest.raises(DataError, match=rf"{folder}/tokenizer_config.json: chat template: .*unsafe"):
        load_tokenizer(folder).apply_chat_template(CHAT)
    _write_config(folder, "{% for m in messages %}")
    with pytest.raises(DataError, match=rf"{folder}/tokenizer_config.json: chat template line 1"):
        _ = load_tokenizer(folder).chat_template
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}{{ raise_exception('no') }}")
    with pytest.raises(DataError, match=rf"{folder}/chat_template.jinja: chat template: no"):  # it wins
        load_tokenizer(folder).apply_chat_template(CHAT)
    (folder / "chat_template.jinja").unlink()
    _write_config(folder, None)
    with pytest.raises(DataError, match="no chat_template"):
        load_tokenizer(folder).apply_chat_template(CHAT)
