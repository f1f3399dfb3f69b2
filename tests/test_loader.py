"""Packed samples, the global order, rank slices, resume position and prefetch."""

import numpy as np
import pytest
import torch

from ladle.data.loader import BatchLayout, PackedSamples, PretrainLoader, SampleOrder, eval_batches
from ladle.errors import DataError


class Stream:
    """A TokenStream stand-in: documents of given lengths, token value = its stream offset."""

    def __init__(self, lengths):
        self.doc_lengths = np.asarray(lengths, dtype=np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(self.doc_lengths)[:-1]])
        self.num_tokens = int(self.doc_lengths.sum())
        self.tokens = np.arange(self.num_tokens, dtype=np.int64)

    def read(self, start, stop):
        return self.tokens[start:stop]


def test_sample_targets_positions_and_documents():
    s = PackedSamples(Stream([5, 3, 10]), seq_len=4)
    assert len(s) == (18 - 1) // 4
    x = s.get(1)  # stream offsets 4..7, targets 5..8; doc 0 is [0,5), doc 1 [5,8), doc 2 [8,18)
    assert x["tokens"].tolist() == [4, 5, 6, 7]
    assert x["targets"].tolist() == [5, 6, 7, 8]
    assert x["positions"].tolist() == [4, 0, 1, 2]  # restart at the document start
    assert x["doc_ids"].tolist() == [0, 1, 1, 1]
    # data.document_mask=false: one causal sequence, default positions 0.. in the model
    y = PackedSamples(Stream([5, 3, 10]), seq_len=4, document_mask=False).get(1)
    assert sorted(y) == ["targets", "tokens"] and y["tokens"].tolist() == [4, 5, 6, 7]


def test_too_little_data_is_a_clear_error():
    with pytest.raises(DataError, match="fewer than one sample of data.seq_len"):
        PackedSamples(Stream([3]), seq_len=8)


def test_order_is_a_function_of_seed_and_epoch():
    a, b = SampleOrder(50, seed=3), SampleOrder(50, seed=3)
    first = [a(g) for g in range(50)]
    assert sorted(first) == list(range(50))  # each epoch is a permutation
    assert first == [b(g) for g in range(50)]
    assert first != [SampleOrder(50, seed=4)(g) for g in range(50)]
    second = [a(g) for g in range(50, 100)]
    assert sorted(second) == list(range(50)) and second != first
    # random access in any order gives the same answer
    assert [SampleOrder(50, 3)(g) for g in (99, 0, 57)] == [second[49], first[0], second[7]]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_read_disjoint_slices_covering_the_batch(world):
    per_step = None
    for step in range(3):
        seen = []
        for r in range(world):
            layout = BatchLayout(micro_batch_size=2, grad_accum_steps=3, dp_rank=r, dp_world=world)
            per_step = layout.global_batch
            for mb in layout.rank_indices(step * per_step):
                seen.extend(mb)
        assert sorted(seen) == list(range(step * per_step, (step + 1) * per_step))
        assert len(set(seen)) == len(seen)


def test_step_sees_the_same_samples_however_it_is_split():
    def step_set(micro, accum, world, step=2):
        out = set()
        for r in range(world):
            lay = BatchLayout(micro, accum, r, world)
            for mb in lay.rank_indices(step * lay.global_batch):
                out.update(mb)
        return out

    assert step_set(8, 1, 1) == step_set(1, 8, 1) == step_set(2, 2, 2) == step_set(1, 2, 4)


def loader(consumed=0, seed=0):
    s = PackedSamples(Stream([7, 30, 11, 25, 40, 9]), seq_len=8)
    return PretrainLoader(
        s, BatchLayout(2, 2), seed=seed, device=torch.device("cpu"), consumed_samples=consumed
    )


def test_resumed_loader_continues_with_the_next_samples():
    full = loader()
    batches = [full.next() for _ in range(6)]
    full.close()
    half = loader()
    for _ in range(3):
        half.next()
    state = half.state_dict()
    half.close()
    resumed = loader()
    resumed.load_state_dict(state)
    for expected in batches[3:]:
        got = resumed.next()
        for a, b in zip(expected, got, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)
    resumed.close()
    assert state == {"consumed_samples": 3 * 4}


def test_prefetched_batches_equal_direct_ones_and_wait_is_measured():
    ld = loader(seed=5)
    got = ld.next()
    direct = ld.step_batches(0)
    ld.close()
    assert len(got) == 2 and got[0]["tokens"].shape == (2, 8)
    for a, b in zip(got, direct, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert ld.data_s >= 0.0


def test_producer_errors_reach_the_training_thread():
    ld = loader()

    def boom(_):
        raise OSError("disk went away")

    ld.step_batches = boom
    with pytest.raises(OSError, match="disk went away"):
        ld.next()


def test_eval_batches_are_fixed_and_in_stream_order():
    s = PackedSamples(Stream([100]), seq_len=8)
    lay = BatchLayout(3, 5)
    a = list(eval_batches(s, lay, steps=2, device=torch.device("cpu")))
    assert len(a) == 2
    assert a[0]["tokens"][0].tolist() == list(range(8))
    assert a[1]["tokens"][0, 0].item() == 3 * 8
