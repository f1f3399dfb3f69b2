"""The indexed dataset against the Megatron layout, written and parsed here by hand with struct/numpy."""

import pickle
import struct

import numpy as np
import pytest

from ladle.data.indexed import IndexedDataset, IndexedDatasetWriter, dtype_for_vocab
from ladle.errors import DataError

CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}


def write_by_hand(prefix, sequences, document_indices, dtype, modes=None):
    """Megatron's layout: magic, <Q version, <B dtype code, <Q sequences, <Q document indices, then
    int32 lengths, int64 byte pointers, int64 document indices, optional int8 modes."""
    dtype = np.dtype(dtype)
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * dtype.itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.asarray(document_indices, dtype=np.int64).tobytes())
        if modes is not None:
            f.write(np.asarray(modes, dtype=np.int8).tobytes())


def read_by_hand(prefix):
    data = open(f"{prefix}.idx", "rb").read()
    assert data[:9] == b"MMIDIDX\x00\x00"
    version, code, count, doc_count = struct.unpack_from("<QBQQ", data, 9)
    dtype = {8: np.uint16, 4: np.int32}[code]
    offset = 34
    lengths = np.frombuffer(data, np.int32, count, offset)
    pointers = np.frombuffer(data, np.int64, count, offset + 4 * count)
    docs = np.frombuffer(data, np.int64, doc_count, offset + 12 * count)
    assert len(data) == offset + 12 * count + 8 * doc_count
    tokens = np.fromfile(f"{prefix}.bin", dtype=dtype)
    isz = np.dtype(dtype).itemsize
    sequences = [tokens[p // isz : p // isz + n].tolist() for p, n in zip(pointers, lengths, strict=True)]
    return version, np.dtype(dtype), sequences, docs.tolist()


def test_reads_hand_written_megatron_files(tmp_path):
    sequences = [[5, 6, 7], [8], [9, 10], [65535, 0]]
    write_by_hand(tmp_path / "d", sequences, [0, 3, 4], np.uint16)  # doc 0 = 3 sequences
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == 4
    assert ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(4)] == sequences
    assert ds[-1].tolist() == [65535, 0]
    assert ds.sequence_lengths.tolist() == [3, 1, 2, 2]
    assert ds.sequence_pointers.tolist() == [0, 6, 8, 12]
    assert ds.document_indices.tolist() == [0, 3, 4]
    assert ds.tokens.tolist() == [5, 6, 7, 8, 9, 10, 65535, 0]
    assert ds.num_tokens == 8
    assert ds.sequence_modes is None
    with pytest.raises(IndexError):
        ds[4]


def test_reads_multimodal_sequence_modes(tmp_path):
    write_by_hand(tmp_path / "m", [[1, 2], [3]], [0, 1, 2], np.int32, modes=[0, 1])
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.int32
    assert ds.sequence_modes.tolist() == [0, 1]
    assert ds[1].tolist() == [3]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_writer_output_parses_by_hand(tmp_path, dtype):
    docs = [[1, 2, 3], [], list(range(100)), [np.iinfo(dtype).max]]
    with IndexedDatasetWriter(tmp_path / "w", dtype) as w:
        for d in docs[:2]:
            w.add_document(d)
        for d in docs[2:]:
            w.add_document(np.array(d, dtype=dtype))
    version, read_dtype, sequences, doc_indices = read_by_hand(tmp_path / "w")
    assert version == 1 and read_dtype == np.dtype(dtype)
    assert sequences == docs
    assert doc_indices == [0, 1, 2, 3, 4]  # one sequence per document
    ds = IndexedDataset(tmp_path / "w")
    assert [ds[i].tolist() for i in range(len(ds))] == docs


def test_writer_uses_temporary_names_until_finalize(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "t", np.uint16)
    w.add_document([1, 2])
    assert not (tmp_path / "t.bin").exists() and not (tmp_path / "t.idx").exists()
    w.finalize()
    assert (tmp_path / "t.bin").exists() and (tmp_path / "t.idx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.idx"]

    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "crash", np.uint16) as w:
            w.add_document([1])
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.idx"]


def test_empty_dataset_round_trips(tmp_path):
    with IndexedDatasetWriter(tmp_path / "e", np.uint16):
        pass
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_tokens == 0
    assert ds.document_indices.tolist() == [0]


def test_writer_rejects_ids_out_of_range(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        with IndexedDatasetWriter(tmp_path / "r", np.uint16) as w:
            w.add_document([70000])


def test_bad_files_raise_data_error_naming_the_file(tmp_path):
    write_by_hand(tmp_path / "ok", [[1, 2]], [0, 1], np.uint16)
    idx = (tmp_path / "ok.idx").read_bytes()

    (tmp_path / "magic.idx").write_bytes(b"NOTMMIDX\x00" + idx[9:])
    (tmp_path / "magic.bin").write_bytes((tmp_path / "ok.bin").read_bytes())
    with pytest.raises(DataError, match=r"magic\.idx .*MMIDIDX"):
        IndexedDataset(tmp_path / "magic")

    (tmp_path / "version.idx").write_bytes(idx[:9] + struct.pack("<Q", 2) + idx[17:])
    (tmp_path / "version.bin").write_bytes((tmp_path / "ok.bin").read_bytes())
    with pytest.raises(DataError, match=r"version\.idx has index version 2"):
        IndexedDataset(tmp_path / "version")

    (tmp_path / "short.idx").write_bytes(idx[:-4])
    (tmp_path / "short.bin").write_bytes((tmp_path / "ok.bin").read_bytes())
    with pytest.raises(DataError, match=r"short\.idx .*truncated"):
        IndexedDataset(tmp_path / "short")

    (tmp_path / "nobin.idx").write_bytes(idx)
    (tmp_path / "nobin.bin").write_bytes(b"\x01\x00")  # one token where the index says two
    with pytest.raises(
        DataError, match=r"nobin\.idx places sequence 0 at bytes 0-4 of .*nobin\.bin, which holds 2 "
    ):
        IndexedDataset(tmp_path / "nobin")

    with pytest.raises(DataError, match=r"missing\.idx not found"):
        IndexedDataset(tmp_path / "missing")


def test_dtype_for_vocab():
    assert dtype_for_vocab(32000) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16  # ids 0..65535 fit
    assert dtype_for_vocab(65537) == np.int32  # Megatron has no uint32
    assert dtype_for_vocab(151936) == np.int32


def test_pickles_by_path(tmp_path):
    write_by_hand(tmp_path / "p", [[1, 2, 3]], [0, 1], np.uint16)
    ds = pickle.loads(pickle.dumps(IndexedDataset(tmp_path / "p")))
    assert ds[0].tolist() == [1, 2, 3]
    assert len(pickle.dumps(ds)) < 500
