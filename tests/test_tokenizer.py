import hashlib
import json
import random

import pytest

from ladle.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer
from ladle.errors import DataError

WORDS = "the quick brown fox jumps over lazy dog def return import class lambda yield".split()


def _corpus(root):
    rng = random.Random(0)
    (root / "sub").mkdir(parents=True)
    (root / "skip").mkdir()
    for i in range(4):
        lines = [" ".join(rng.choices(WORDS, k=12)) for _ in range(50)]
        (root / f"doc{i}.txt").write_text("\n".join(lines) + "\n")
    (root / "sub" / "more.txt").write_text("héllo wörld 日本語 テキスト\n" * 20)
    (root / "skip" / "excluded.txt").write_text("zzzqqq " * 500)
    (root / "notes.md").write_text("xxyyzz " * 500)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = _corpus(tmp_path_factory.mktemp("corpus"))
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    path = train_tokenizer([str(root)], vocab_size=400, output=str(out), glob="*.txt", exclude=["skip/*"])
    return path


def test_train_writes_loadable_folder_with_special_tokens_first(trained):
    assert (trained / "tokenizer.json").is_file()
    config = json.loads((trained / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
    )
    assert "model_max_length" in config
    tok = load_tokenizer(trained)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert (tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")) == (3, 4)  # ChatML markers
    assert 261 < tok.vocab_size <= 400
    assert tok.hash == hashlib.sha256((trained / "tokenizer.json").read_bytes()).hexdigest()
    assert tok.path == trained


def test_glob_and_exclude_filter_training_files(trained):
    tok = load_tokenizer(trained)
    # Excluded and non-matching files contributed no merges: their repeated words stay in pieces.
    assert len(tok.encode("zzzqqq")) > 1
    assert len(tok.encode("xxyyzz")) > 1
    assert len(tok.encode(" quick")) == 1


def test_round_trip_of_arbitrary_text(trained):
    tok = load_tokenizer(trained)
    rng = random.Random(1)
    samples = [
        "",
        "plain ascii text\nwith lines\r\n\ttabs",
        "  leading spaces and trailing  ",
        "emoji 🎉👩‍👩‍👧 CJK 漢字 combining é RTL שלום",
        bytes(range(256)).decode("latin-1"),
        "\x00\x01\x7f nul and controls \ufffd \ufeff",
        "".join(chr(c) for c in rng.sample([c for c in range(0x20000) if not 0xD800 <= c < 0xE000], 300)),
    ]
    for text in samples:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode_batch(samples) == [tok.encode(s) for s in samples]
    # No special tokens are added by encode; decode skips them unless asked.
    ids = tok.encode("a b")
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == "a b"
    assert tok.decode([tok.bos_id, *ids], skip_special_tokens=False) == "<|bos|>a b"


def test_folder_saved_by_transformers_gives_identical_ids(trained, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = "the lazy fox 日本語 🎉 def f():\n    return 1\n"
    ours = load_tokenizer(trained)
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(trained / "tokenizer.json"),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    hf.save_pretrained(tmp_path / "saved")
    theirs = load_tokenizer(tmp_path / "saved")
    assert theirs.encode(text) == ours.encode(text)
    assert (theirs.bos_id, theirs.eos_id, theirs.pad_id) == (0, 1, 2)
    # And transformers reads our folder the same way.
    auto = AutoTokenizer.from_pretrained(str(trained))
    assert auto(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2)
    assert auto.decode(ours.encode(text)) == text


def test_special_ids_from_config_forms_and_fallback_names(trained, tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((trained / "tokenizer.json").read_bytes())
    tok = load_tokenizer(folder)  # no tokenizer_config.json: found by our names
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)

    config = {"bos_token": None, "eos_token": {"content": "<|pad|>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    assert tok.bos_id is None  # explicit null: no bos
    assert tok.eos_id == 2  # dict form
    assert tok.pad_id == 2  # not in the config: fallback name

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    other = tmp_path / "llama_like"
    other.mkdir()
    HFTokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}, unk_token="<unk>")).save(
        str(other / "tokenizer.json")
    )
    tok = Tokenizer(other)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, None)


def test_missing_tokenizer_json_message(tmp_path):
    with pytest.raises(DataError) as err:
        load_tokenizer(tmp_path)
    message = str(err.value)
    assert f"tokenizer folder {tmp_path} has no tokenizer.json" in message
    assert "ladle tokenizer train" in message and "tokenizer.path" in message
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_train_errors(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(DataError, match=r"no input files found .* matching glob '\*\.py'"):
        train_tokenizer([str(tmp_path)], vocab_size=300, output=str(tmp_path / "t"), glob="*.py")
    with pytest.raises(DataError, match="at least 261"):
        train_tokenizer([str(tmp_path)], vocab_size=100, output=str(tmp_path / "t"))
    with pytest.raises(DataError, match="does not exist"):
        train_tokenizer([str(tmp_path / "missing")], vocab_size=300, output=str(tmp_path / "t"))


def test_train_reads_text_field_of_jsonl(tmp_path):
    lines = [json.dumps({"text": "abcabc " * 50, "meta": "ignoredword"}) for _ in range(20)]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    out = train_tokenizer([str(tmp_path / "data.jsonl")], vocab_size=300, output=str(tmp_path / "t"))
    tok = load_tokenizer(out)
    assert len(tok.encode(" abcabc")) == 1
    assert tok.token_to_id('"text"') is None  # JSON syntax was not trained on


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _stress_texts():
    import sysconfig
    from pathlib import Path

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rng = random.Random(2)
    chars = [c for c in range(0x30000) if not 0xD800 <= c < 0xE000]
    return [
        *[(stdlib / n).read_text(encoding="utf-8") for n in ("argparse.py", "textwrap.py", "locale.py")],
        "emoji 🎉👩‍👩‍👧 CJK 漢字 combining e\u0301 RTL שלום ١٢٣ ² ½ Ⅷ ۳",
        "tabs\t\tand\r\nCRLF\n\n\n  \u00a0nbsp \u3000ideo \u2028ls \u0085nel \u200bzw x\u000by\u000cz",
        "I'M it'S we'LL 12345678 3.14159 ___init___ a__b x--y",
        "".join(chr(c) for c in rng.sample(chars, 2000)),
        "".join(rng.choice(" \t\n\r'sS1a.é漢") for _ in range(3000)),
        "",
    ]


def _variant(trained, tmp_path, kind):
    """The trained vocabulary behind another pre-tokenizer / normalizer pipeline."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HF

    hf = HF.from_file(str(trained / "tokenizer.json"))
    if kind == "split":  # Llama 3 / Qwen2 style
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        hf.normalizer = normalizers.NFC()
    elif kind == "prefix":  # not reproduced: must fall back to the library
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    out = tmp_path / kind
    out.mkdir()
    hf.save(str(out / "tokenizer.json"))
    return out


@pytest.mark.parametrize("kind", ["bytelevel", "split", "prefix"])
def test_cached_bpe_gives_the_library_ids(trained, tmp_path, kind):
    from ladle.data.bpe_cache import CachedBPE

    tok = load_tokenizer(trained if kind == "bytelevel" else _variant(trained, tmp_path, kind))
    fast = CachedBPE.for_tokenizer(tok._tok)
    assert (fast is None) == (kind == "prefix")
    texts = _stress_texts()
    texts += ["x = 1 <|eos|> y", "<|bos|>"]  # added-token text: left to the library
    library = [e.ids for e in tok._tok.encode_batch(texts, add_special_tokens=False)]
    assert tok.encode_batch(texts) == library
    assert tok.encode_batch(texts) == library  # again, from a warm word cache
    if fast is not None:
        # every stress text took the fast path (none fell back), and added-token text did not
        assert [fast.encode(t) for t in texts[:-2]] == library[:-2]
        assert fast.encode(texts[-1]) is None and fast.encode(texts[-2]) is None
        assert library[-1] == [tok.bos_id]


def test_trained_folder_chats_as_transformers_does(trained):
    # Its ChatML template, rendered and tokenized by transformers: the same ids, markers single tokens.
    from transformers import AutoTokenizer

    chat = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    ours = load_tokenizer(trained).apply_chat_template(chat)
    theirs = AutoTokenizer.from_pretrained(trained).apply_chat_template(chat, tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    assert ours == list(theirs) and ours[0] == 3 and ours.count(4) == 2
