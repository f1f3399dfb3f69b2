import json
import pickle
import random
import shutil

import numpy as np
import pytest

from ladle.data import inspect as inspect_module
from ladle.data.indexed import IndexedDataset
from ladle.data.inspect import format_inspect, inspect_data
from ladle.data.prepare import load_meta, open_split, prepare
from ladle.data.sources import iter_files
from ladle.data.tokenizer import load_tokenizer, train_tokenizer
from ladle.errors import DataError

WORDS = "alpha beta gamma delta épsilon ζήτα 日本 🎉 def return\n  \t".split(" ")


def _texts(n, seed=0):
    rng = random.Random(seed)
    # Each document starts with a unique word: never empty, never a duplicate of another.
    return [
        f"d{i} " + " ".join(rng.choices(WORDS, k=rng.randint(1, 60))) + ("\n" if i % 3 else "")
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokcorpus")
    (root / "c.txt").write_text("\n".join(_texts(200, seed=9)))
    return str(train_tokenizer([str(root)], vocab_size=320, output=str(root.parent / "tok")))


def _prepare(inputs, tok_dir, out, **kw):
    kw.setdefault("workers", 1)
    kw.setdefault("progress", False)
    return prepare(
        inputs if isinstance(inputs, list) else [str(inputs)], tokenizer=tok_dir, output=str(out), **kw
    )


def _decoded(data_dir, split, tok):
    stream = open_split(data_dir, split)
    docs = []
    for start, length in zip(stream.doc_starts, stream.doc_lengths, strict=True):
        ids = stream.read(int(start), int(start + length))
        assert ids[-1] == tok.eos_id
        docs.append(tok.decode(ids[:-1], skip_special_tokens=False))
    return docs


def test_round_trip_text_jsonl_parquet(tmp_path, tok_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _texts(30)
    raw = tmp_path / "raw"
    (raw / "a").mkdir(parents=True)
    for i, t in enumerate(texts[:10]):
        (raw / "a" / f"{i:02d}.txt").write_text(t, newline="")
    (raw / "b.jsonl").write_text(
        "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts[10:20]))
    )
    pq.write_table(pa.table({"text": texts[20:]}), raw / "c.parquet", row_group_size=4)
    tok = load_tokenizer(tok_dir)

    meta = _prepare(raw, tok_dir, tmp_path / "out")
    assert _decoded(tmp_path / "out", "train", tok) == texts  # sorted walk: a/, b.jsonl, c.parquet
    assert meta["splits"]["train"]["documents"] == 30
    assert meta["splits"]["val"] == {"documents": 0, "tokens": 0, "shards": []}
    assert meta["bad_records"] == {}
    expected_tokens = sum(len(tok.encode(t)) + 1 for t in texts)
    assert meta["splits"]["train"]["tokens"] == expected_tokens
    on_disk = load_meta(tmp_path / "out")
    assert on_disk == meta
    for key in ("format", "version", "tokenizer_hash", "tokenizer_path", "vocab_size", "eos_id", "dtype"):
        assert key in meta
    assert (meta["format"], meta["dtype"], meta["eos_id"], meta["tokenizer_hash"]) == (
        "megatron-mmidx",
        "uint16",
        tok.eos_id,
        tok.hash,
    )


def test_val_split_by_document_is_deterministic_and_worker_independent(tmp_path, tok_dir):
    texts = _texts(120, seed=3)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = load_tokenizer(tok_dir)
    m1 = _prepare(tmp_path / "d.jsonl", tok_dir, tmp_path / "w1", val_fraction=0.25, seed=7, workers=1)
    m2 = _prepare(tmp_path / "d.jsonl", tok_dir, tmp_path / "w2", val_fraction=0.25, seed=7, workers=2)
    assert m1["splits"] == m2["splits"]
    for split in ("train", "val"):
        a, b = open_split(tmp_path / "w1", split), open_split(tmp_path / "w2", split)
        assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
    train, val = _decoded(tmp_path / "w1", "train", tok), _decoded(tmp_path / "w1", "val", tok)
    assert 10 < len(val) < 50
    # Whole documents, each in exactly one split, in corpus order within each split.
    assert sorted(train + val) == sorted(texts)
    assert [t for t in texts if t in set(val)] == val
    _prepare(tmp_path / "d.jsonl", tok_dir, tmp_path / "s8", val_fraction=0.25, seed=8)
    assert _decoded(tmp_path / "s8", "val", tok) != val


def test_bad_records_counted_with_examples(tmp_path, tok_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = tmp_path / "raw"
    raw.mkdir()
    lines = [
        json.dumps({"text": "good one"}),
        "{not json",
        json.dumps({"other": "x"}),
        json.dumps({"text": 5}),
        json.dumps({"text": "   "}),
        b'{"text": "bad \xff byte"}',
        "",  # blank line: not a record
        json.dumps({"text": "good two"}),
        json.dumps(["a list"]),
    ]
    data = b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n"
    (raw / "a.jsonl").write_bytes(data)
    (raw / "b.txt").write_bytes(b"line one\nline two\nthree \xc3\x28 bad\n")
    (raw / "c.txt").write_text("")
    pq.write_table(pa.table({"text": ["fine", None, ""]}), raw / "d.parquet")
    meta = _prepare(raw, tok_dir, tmp_path / "out")
    a, b, c, d = (str(raw / n) for n in ("a.jsonl", "b.txt", "c.txt", "d.parquet"))
    assert meta["bad_records"] == {
        "invalid JSON": 1,
        "missing field 'text'": 3,
        "non-string field 'text'": 1,
        "empty text": 3,
        "undecodable bytes": 2,
    }
    assert meta["bad_examples"] == {
        "invalid JSON": [f"{a}:2"],
        "missing field 'text'": [f"{a}:3", f"{a}:9", f"{d}:row 1"],
        "non-string field 'text'": [f"{a}:4"],
        "empty text": [f"{a}:5", f"{c}:1", f"{d}:row 2"],
        "undecodable bytes": [f"{a}:6", f"{b}:3"],
    }
    assert meta["splits"]["train"]["documents"] == 3
    assert load_meta(tmp_path / "out")["bad_records"] == meta["bad_records"]


def test_bad_examples_capped_at_five(tmp_path, tok_dir, capsys):
    (tmp_path / "d.jsonl").write_text("{bad\n" * 9 + '{"text": "ok"}\n')
    meta = _prepare(tmp_path / "d.jsonl", tok_dir, tmp_path / "out")
    assert meta["bad_records"] == {"invalid JSON": 9}
    assert meta["bad_examples"]["invalid JSON"] == [f"{tmp_path / 'd.jsonl'}:{i}" for i in range(1, 6)]
    err = capsys.readouterr().err
    assert "prepared 1 documents" in err and "invalid JSON: 9" in err


def test_strict_raises_naming_file_and_line(tmp_path, tok_dir):
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"text": ""}\n')
    with pytest.raises(DataError, match=rf"{tmp_path / 'd.jsonl'}:2: empty text"):
        _prepare(tmp_path / "d.jsonl", tok_dir, tmp_path / "out", strict=True)
    assert not (tmp_path / "out").exists()


def test_no_input_files(tmp_path, tok_dir):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("hello")
    with pytest.raises(DataError, match=r"no input files found in .*raw matching glob '\*\.py'"):
        _prepare(tmp_path / "raw", tok_dir, tmp_path / "out", glob="*.py")
    with pytest.raises(DataError, match="does not exist"):
        _prepare(tmp_path / "nope", tok_dir, tmp_path / "out")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match="no usable documents .*empty text"):
        _prepare(tmp_path / "empty.txt", tok_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_output_untouched_on_failure_and_replaced_on_success(tmp_path, tok_dir):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text('{"text": "first version"}\n')
    out = tmp_path / "out"
    _prepare(raw, tok_dir, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    # Fails midway: many good documents (several shards written) then a bad one, in strict mode.
    (raw / "b.jsonl").write_text('{"text": "more text here"}\n' * 200 + "{broken\n")
    with pytest.raises(DataError, match=r"b\.jsonl:201: invalid JSON"):
        _prepare(raw, tok_dir, out, strict=True, shard_tokens=100)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "raw"]  # no temporary folder left

    meta = _prepare(raw, tok_dir, out)  # a previous prepare output is replaced
    assert meta["splits"]["train"]["documents"] == 201
    assert load_meta(out) == meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "raw"]

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not a `ladle data prepare` output"):
        _prepare(raw, tok_dir, foreign)
    assert (foreign / "keep.txt").read_text() == "mine"


def test_output_inside_input_is_not_read_back(tmp_path, tok_dir):
    (tmp_path / "a.txt").write_text("some text")
    for _ in range(2):
        meta = _prepare(tmp_path, tok_dir, tmp_path / "prepared")
        assert meta["splits"]["train"]["documents"] == 1
        assert meta["bad_records"] == {}


def test_open_split_reads_across_shard_boundaries(tmp_path, tok_dir):
    texts = _texts(40, seed=5)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = load_tokenizer(tok_dir)
    meta = _prepare(tmp_path / "d.jsonl", tok_dir, tmp_path / "out", shard_tokens=60)
    shards = meta["splits"]["train"]["shards"]
    assert len(shards) > 5
    for name in shards:  # a shard holds at most shard_tokens tokens, unless one document is longer
        ds = IndexedDataset(tmp_path / "out" / name)
        assert ds.num_tokens <= 60 or len(ds) == 1

    expected = np.concatenate([np.array([*tok.encode(t), tok.eos_id]) for t in texts])
    stream = open_split(tmp_path / "out", "train")
    assert stream.num_tokens == expected.size and stream.dtype == np.uint16
    assert np.array_equal(stream.read(0, stream.num_tokens), expected)
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = sorted(rng.integers(0, expected.size + 1, size=2))
        assert np.array_equal(stream.read(int(a), int(b)), expected[a:b])
    lengths = [len(tok.encode(t)) + 1 for t in texts]
    assert stream.doc_lengths.tolist() == lengths
    assert stream.doc_starts.tolist() == np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    with pytest.raises(IndexError):
        stream.read(0, stream.num_tokens + 1)
    clone = pickle.loads(pickle.dumps(stream))
    assert np.array_equal(clone.read(0, clone.num_tokens), expected)
    empty = open_split(tmp_path / "out", "val")  # val_fraction 0: an empty stream
    assert (empty.num_tokens, empty.num_documents, empty.dtype) == (0, 0, np.uint16)
    assert empty.read(0, 0).size == 0

    # The same shards as plain Megatron data: no meta.json, all pairs form the train split.
    megatron = tmp_path / "megatron"
    megatron.mkdir()
    for name in shards:
        for ext in (".bin", ".idx"):
            shutil.copy(tmp_path / "out" / f"{name}{ext}", megatron / f"{name}{ext}")
    plain = open_split(megatron, "train")
    assert plain.meta is None and np.array_equal(plain.read(0, plain.num_tokens), expected)
    single = open_split(megatron / shards[0])
    assert single.num_tokens == IndexedDataset(megatron / shards[0]).num_tokens
    assert open_split(megatron, "val").num_tokens == 0
    shutil.copy(megatron / f"{shards[-1]}.bin", megatron / "val_text_document.bin")
    shutil.copy(megatron / f"{shards[-1]}.idx", megatron / "val_text_document.idx")
    val = open_split(megatron, "val")
    assert np.array_equal(val.read(0, val.num_tokens), IndexedDataset(megatron / shards[-1]).tokens)
    assert open_split(megatron, "train").num_tokens == expected.size
    report = inspect_data(megatron)
    assert report["meta"] is None and report["splits"]["train"]["tokens"] == expected.size
    assert "without meta.json" in format_inspect(report)


def test_load_meta_missing(tmp_path):
    with pytest.raises(DataError, match=r"has no meta.json\): run `ladle data prepare` first"):
        load_meta(tmp_path / "nothing")
    with pytest.raises(DataError, match="run `ladle data prepare` first"):
        open_split(tmp_path / "nothing")


def test_inspect_entropy_matches_numpy_reference(tmp_path, tok_dir, monkeypatch):
    texts = _texts(50, seed=11)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    _prepare(tmp_path / "d.jsonl", tok_dir, tmp_path / "out", shard_tokens=200)
    monkeypatch.setattr(inspect_module, "ENTROPY_CHUNK", 97)  # many chunks, crossing shards

    tok = load_tokenizer(tok_dir)
    ids = np.concatenate([np.array([*tok.encode(t), tok.eos_id]) for t in texts])
    p = np.unique(ids, return_counts=True)[1] / ids.size
    reference = float(-(p * np.log(p)).sum())

    report = inspect_data(tmp_path / "out", samples=2)
    assert report["unigram_entropy_nats"] == pytest.approx(reference, rel=1e-12)
    assert report["distinct_tokens"] == p.size
    assert report["splits"]["train"]["documents"] == 50
    assert sum(b["documents"] for b in report["splits"]["train"]["length_histogram"]) == 50
    assert [s["text"] for s in report["samples"]] == [texts[0][:200], texts[1][:200]]
    text = format_inspect(report)
    assert "nats/token" in text and "train: 50 documents" in text


def test_iter_files_sorted_glob_exclude(tmp_path):
    for rel in ["b.py", "a/z.py", "a/y.txt", "a/test/t.py", "site-packages/x.py", "c/d/e.py", "a.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    found = [
        p.relative_to(tmp_path).as_posix()
        for p in iter_files([tmp_path], "*.py", ["site-packages/*", "*/test/*"])
    ]
    assert found == ["a/z.py", "a.py", "b.py", "c/d/e.py"]
    assert list(iter_files([tmp_path / "a" / "y.txt"], "*.py")) == [tmp_path / "a" / "y.txt"]


def test_memory_stays_flat_as_the_corpus_grows(tmp_path, tok_dir):
    """Peak Python + numpy allocations during prepare are bounded by the in-flight chunks, not by
    the corpus: a corpus 8x larger peaks at about the same (tracemalloc sees numpy's buffers)."""
    import tracemalloc

    texts = _texts(400, seed=3)

    def peak_for(copies, name):
        f = tmp_path / f"{name}.jsonl"
        with f.open("w") as out:
            for i in range(copies):
                for t in texts:
                    out.write(json.dumps({"text": f"{i} {t}"}) + "\n")
        tracemalloc.start()
        _prepare(f, tok_dir, tmp_path / f"out_{name}")
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return f.stat().st_size, peak

    small_size, small_peak = peak_for(10, "small")
    big_size, big_peak = peak_for(80, "big")
    assert big_size > 7 * small_size
    assert big_peak < 1.5 * small_peak + 2**20, (small_peak, big_peak)
    assert big_peak < big_size / 2
