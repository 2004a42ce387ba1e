"""Token data for `train --data`: sequences, the per-epoch shuffle, replicas' shares, refusals."""

import pickle

import numpy as np
import pytest
import torch

from octopipe.data import DTYPES, TokenBatches, TrainingData, split_samples, token_stream, vocabulary_size
from octopipe.errors import ArgumentError, DataError


@pytest.fixture
def stream(tmp_path):
    """0, 1, 2, ... 1000 as a raw uint16 file: a token's id is its position."""
    path = tmp_path / "tokens.bin"
    np.arange(1001, dtype=np.uint16).tofile(path)
    return path


def test_sequences_are_cut_seq_len_apart_and_the_target_is_the_next_token(stream):
    data = TokenBatches(str(stream), seq_len=10, batch_size=3, shuffle=False)
    assert data.num_samples == 100  # (1001 - 1) // 10: each sequence is 11 tokens, sharing one with the next
    (inputs,), target = data.batch(0)
    assert inputs.dtype == target.dtype == torch.int64 and inputs.shape == target.shape == (3, 10)
    assert inputs[1].tolist() == list(range(10, 20)) and target[1].tolist() == list(range(11, 21))
    (later,), _ = data.batch(2)  # in file order: sequences 6, 7, 8
    assert later[:, 0].tolist() == [60, 70, 80]
    # the last whole sequence is 99 (990..1000); a tail shorter than 11 tokens is left out
    assert TokenBatches(str(stream), seq_len=10, batch_size=1, shuffle=False).batch(99)[1][0, -1].item() == 1000


def test_each_epoch_is_a_seeded_permutation_and_the_order_runs_on_across_epochs(stream):
    data = TokenBatches(str(stream), seq_len=100, batch_size=4)  # 10 sequences: 2.5 steps an epoch
    seen = [i for k in range(5) for i in data.sample_indices(k)]  # 20 = two whole epochs
    assert sorted(seen[:10]) == sorted(seen[10:]) == list(range(10))
    assert seen[:10] != list(range(10)) and seen[:10] != seen[10:]
    assert seen == [i for k in range(5) for i in TokenBatches(str(stream), seq_len=100, batch_size=4).sample_indices(k)]
    other = TokenBatches(str(stream), seq_len=100, batch_size=4, seed=7)
    assert [i for k in range(5) for i in other.sample_indices(k)] != seen
    # a later step needs nothing before it (a resumed run reads on from its iteration)
    assert TokenBatches(str(stream), seq_len=100, batch_size=4).sample_indices(3) == seen[12:16]


def test_replicas_split_each_global_batch_whatever_their_count(stream):
    one = TokenBatches(str(stream), seq_len=10, batch_size=12)
    two = TokenBatches(str(stream), seq_len=10, batch_size=6, replicas=2)
    three = TokenBatches(str(stream), seq_len=10, batch_size=4, replicas=3)
    for k in range(20):  # over several epochs
        assert one.sample_indices(k) == two.sample_indices(k, 0) + two.sample_indices(k, 1)
        assert one.sample_indices(k) == [i for r in range(3) for i in three.sample_indices(k, r)]
    assert two.global_batch == 12 and "(2 replicas x 6)" in two.describe()
    with pytest.raises(ArgumentError, match="replica 2 out of range 0..1"):
        two.batch(0, 2)


def test_npy_files_name_their_dtype_and_raw_files_take_one(tmp_path):
    ids = np.arange(300, dtype=np.int32)
    np.save(tmp_path / "ids.npy", ids)
    assert token_stream(tmp_path / "ids.npy").dtype == np.int32
    ids.astype(np.uint32).tofile(tmp_path / "ids.bin")
    assert token_stream(tmp_path / "ids.bin", "uint32").tolist() == list(range(300))
    assert len(token_stream(tmp_path / "ids.bin")) == 600  # read as uint16 it is twice as long: the caller's word
    data = TokenBatches(str(tmp_path / "ids.bin"), seq_len=7, batch_size=2, dtype="uint32", shuffle=False)
    assert data.batch(1)[0][0][0].tolist() == list(range(14, 21))
    assert set(DTYPES) == {"uint16", "uint32", "int32", "int64"}


@pytest.mark.parametrize("write, dtype, message", [
    (lambda p: p.write_bytes(b"\x01\x02\x03"), None, "3 bytes is not a whole number of uint16 tokens"),
    (lambda p: p.write_bytes(b""), None, "the file is empty"),
    (lambda p: np.save(p, np.zeros((4, 4), np.int64)), None, r"shape \(4, 4\).*one flat stream"),
    (lambda p: np.save(p, np.zeros(40, np.float32)), None, "float32 values; token ids are integers"),
    (lambda p: np.save(p, np.zeros(40, np.int64)), "int32", "its header says int64, not the int32 given"),
    (lambda p: p.write_bytes(b"not numpy"), None, "not a readable .npy array"),
    (lambda p: np.arange(10, dtype=np.uint16).tofile(p), None, "10 tokens, fewer than one sequence of 16 \\+ 1"),
])
def test_bad_files_are_refused_with_what_to_do(tmp_path, write, dtype, message):
    path = tmp_path / ("data.npy" if "npy" in message or "shape" in message or "values" in message or "header" in message
                       else "data.bin")
    write(path)
    with pytest.raises(DataError, match=message):
        TokenBatches(str(path), seq_len=16, batch_size=2, dtype=dtype, what="--data")
    with pytest.raises(DataError, match="no such file"):
        token_stream(tmp_path / "missing.bin")
    with pytest.raises(ArgumentError, match="'float16' is not one of"):
        token_stream(path, "float16")


def test_a_token_outside_the_vocabulary_is_named_with_its_position(stream):
    data = TokenBatches(str(stream), seq_len=10, batch_size=2, shuffle=False, vocab_size=95, what="--data")
    data.batch(3)  # sequences 6 and 7: tokens 60..80
    with pytest.raises(DataError, match=r"--data .*: token 95 at position 95 is outside the model's vocabulary of 95"):
        data.batch(4)


def test_eod_mask_leaves_out_each_target_after_an_end_of_document(tmp_path):
    # Megatron's --eod-mask-loss: where the input token is the end of a document, its target
    # (the next document's first token) is ignored; a file without the id is noted
    path = tmp_path / "docs.bin"
    np.array([5, 6, 9, 7, 9, 8, 8, 8, 9, 5, 6], dtype=np.uint16).tofile(path)
    train = TokenBatches(str(path), seq_len=5, batch_size=2, shuffle=False, vocab_size=10)
    data = TrainingData(train, eod_mask=9)
    (inputs,), target = data.batch(0)
    assert inputs.tolist() == [[5, 6, 9, 7, 9], [8, 8, 8, 9, 5]]
    # the end of document itself is predicted (9 after 6); what follows it is not
    assert target.tolist() == [[6, 9, -100, 9, -100], [8, 8, 9, -100, 6]]
    assert TrainingData(train).batch(0)[1].tolist() == train.batch(0)[1].tolist()  # without it: untouched
    assert data.check_vocabulary() == []
    notes = TrainingData(train, eod_mask=4).check_vocabulary()
    assert len(notes) == 1 and f"{path} never holds token 4, so nothing is masked there" in notes[0]
    for bad in (10, -1, True):
        with pytest.raises(ArgumentError, match=f"--eod-mask-loss {bad!r}: not a token id of the model's vocabulary"):
            TrainingData(train, eod_mask=bad)


def test_validation_sets_are_read_in_order_and_must_hold_their_batches(stream):
    valid = TokenBatches(str(stream), seq_len=10, batch_size=5, replicas=2, shuffle=False, what="--eval-data")
    assert [valid.sample_indices(k, r) for k in range(2) for r in range(2)] == [
        [0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    train = TokenBatches(str(stream), seq_len=10, batch_size=5, replicas=2)
    assert TrainingData(train, valid, eval_iters=10).eval_iters == 10  # 100 sequences: exactly enough
    with pytest.raises(DataError, match="11 batches of 10 sequences need 110 sequences .* the file holds 100"):
        TrainingData(train, valid, eval_iters=11)
    every = TrainingData(train, valid, eval_interval=3)
    assert [done for done in range(1, 8) if every.evaluates_after(done, last=7)] == [3, 6, 7]
    assert [done for done in range(1, 8) if TrainingData(train, valid).evaluates_after(done, last=7)] == [7]
    assert not TrainingData(train).evaluates_after(7, last=7)


def test_batches_pickle_without_their_mapping(stream):
    data = TokenBatches(str(stream), seq_len=10, batch_size=3)
    before = data.batch(5)
    copy = pickle.loads(pickle.dumps(data))
    assert copy._tokens is None and copy._orders == {}
    after = copy.batch(5)
    assert torch.equal(before[0][0], after[0][0]) and torch.equal(before[1], after[1])


def test_the_vocabulary_is_the_first_embeddings_rows():
    from octopipe import models

    assert vocabulary_size(models.build("llama", "tiny")) == models.config("llama", "tiny").vocab_size
    assert vocabulary_size(torch.nn.Linear(2, 2)) is None


def test_a_split_reads_its_own_range_of_the_files_sequences(stream):
    assert split_samples(100, (949, 50, 1)) == [(0, 95), (95, 100), (100, 100)]
    assert split_samples(187, (90, 8, 2)) == [(0, 168), (168, 183), (183, 187)]
    assert split_samples(10, (1, 0)) == [(0, 10), (10, 10)]
    with pytest.raises(DataError, match="10 sequences leave part 2 none"):
        split_samples(10, (100, 1))
    with pytest.raises(ArgumentError, match="non-negative weights"):
        split_samples(10, (1, -1))
    part = TokenBatches(str(stream), seq_len=10, batch_size=4, samples=(95, 100), shuffle=False)
    assert part.num_samples == 5 and part.file_samples == 100
    assert [part.sample_indices(k) for k in range(2)] == [[95, 96, 97, 98], [99, 95, 96, 97]]
    assert part.batch(0)[0][0][0, 0].item() == 950
    shuffled = TokenBatches(str(stream), seq_len=10, batch_size=5, samples=(0, 95))
    assert sorted(i for k in range(19) for i in shuffled.sample_indices(k)) == list(range(95))
    assert "sequences 95-99 of its 100 of 10 + 1" in part.describe()
    with pytest.raises(DataError, match="sequences 90..100 asked for, but the file holds 100"):
        TokenBatches(str(stream), seq_len=10, batch_size=1, samples=(90, 101))
    with pytest.raises(DataError, match="need 8 sequences of 10 \\+ 1 tokens, but its split holds 5; evaluate fewer"):
        TrainingData(shuffled, part, eval_iters=2)


def test_a_resumed_run_reads_on_after_the_sequences_consumed_whatever_its_batch(stream):
    def data(batch_size, replicas=1, seed=1234):
        return TrainingData(TokenBatches(str(stream), seq_len=10, batch_size=batch_size, replicas=replicas, seed=seed))

    first = data(4)
    assert first.batch(3)[0][0].tolist() == first.train.batch(3)[0][0].tolist()
    saved = {"iteration": 3, **first.saved(3)}
    assert saved["consumed_samples"] == 12 and saved["data"]["seed"] == 1234
    order = [i for k in range(10) for i in first.train.sample_indices(k)]
    wider = data(4, replicas=2)  # a global batch of 8 after one of 4
    assert wider.resume(saved, "ckpt") is None and wider.consumed == 12
    (zero,), _ = wider.batch(0, 0)
    (one,), _ = wider.batch(0, 1)
    assert [row[0].item() // 10 for row in (*zero, *one)] == order[12:20]
    assert wider.saved(1)["consumed_samples"] == 20 and wider.saved(1)["data"] == first.saved(0)["data"]
    other = data(4, seed=9)
    assert "this run reads" in other.resume(saved, "ckpt") and other.consumed == 12
    fresh = data(4)
    assert "keeps no data position" in fresh.resume({"iteration": 5}, "ckpt") and fresh.consumed == 0
    with pytest.raises(DataError, match="its consumed_samples is -1"):
        fresh.resume({"consumed_samples": -1}, "ckpt")


def test_tokenize_writes_what_train_reads(tmp_path):
    from octopipe.data import tokenize_files

    (tmp_path / "a.txt").write_text("héllo\n", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "ab"}\n\n{"text": "c", "id": 3}\n', encoding="utf-8")
    done = tokenize_files([tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / "out.bin", eod=10)
    ids = list("héllo\n".encode()) + [10, 97, 98, 10, 99, 10]
    assert (done.documents, done.tokens, done.dtype, done.vocab_size) == (3, len(ids), "uint16", 256)
    assert token_stream(tmp_path / "out.bin").tolist() == ids
    assert tokenize_files([tmp_path / "b.jsonl"], tmp_path / "out.npy").tokens == 3
    assert tokenize_files([tmp_path / "b.jsonl"], tmp_path / "eod.bin", eod=70_000).vocab_size == 70_001
    assert token_stream(tmp_path / "out.npy").tolist() == [97, 98, 99]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:2: no string field 'text' \(give the field .* --json-key\)"):
        tokenize_files([tmp_path / "bad.jsonl"], tmp_path / "x.bin")
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.bin.partial").exists()  # (nothing half-written)
    (tmp_path / "junk.jsonl").write_text("{oops\n", encoding="utf-8")
    with pytest.raises(DataError, match="junk.jsonl:1: not a JSON object"):
        tokenize_files([tmp_path / "junk.jsonl"], tmp_path / "x.bin")
    with pytest.raises(DataError, match="byte tokenizer has no end-of-sequence token"):
        tokenize_files([tmp_path / "a.txt"], tmp_path / "x.bin", eod="eos")
    # in worker processes (Megatron's --workers), chunks of documents in order: the same stream,
    # in a .npy too (written as it comes, its header once the count is known)
    import octopipe.data

    (tmp_path / "many.jsonl").write_text("".join(f'{{"text": "doc {k} é"}}\n' for k in range(700)), encoding="utf-8")
    one = tokenize_files([tmp_path / "many.jsonl", tmp_path / "a.txt"], tmp_path / "one.npy", eod=3)
    two = tokenize_files([tmp_path / "many.jsonl", tmp_path / "a.txt"], tmp_path / "two.npy", eod=3, workers=2)
    assert one == two and one.documents == 701 and one.tokens > 700 * octopipe.data.TOKENIZE_CHUNK // 100
    assert np.load(tmp_path / "two.npy").tolist() == np.load(tmp_path / "one.npy").tolist()
    assert np.load(tmp_path / "one.npy").tolist()[:9] == list(b"doc 0 \xc3\xa9") + [3]
    assert sorted(path.name for path in tmp_path.iterdir() if "one.npy" in path.name) == ["one.npy"]  # no leftovers
    with pytest.raises(ArgumentError, match="tokenize --workers 0: give a count of processes >= 1"):
        tokenize_files([tmp_path / "a.txt"], tmp_path / "x.bin", workers=0)


def test_tokenize_refuses_what_it_cannot_write_faithfully(tmp_path):
    from octopipe.data import tokenize_files

    (tmp_path / "a.txt").write_bytes(b"a\r\nb\rc")
    tokenize_files([tmp_path / "a.txt"], tmp_path / "crlf.bin")
    assert token_stream(tmp_path / "crlf.bin").tolist() == list(b"a\r\nb\rc")  # (the file's bytes, \r kept)
    with pytest.raises(ArgumentError, match="is one of the input files, which writing it would destroy"):
        tokenize_files([tmp_path / "a.txt"], tmp_path / "a.txt")
    assert (tmp_path / "a.txt").read_bytes() == b"a\r\nb\rc"
    (tmp_path / "lone.jsonl").write_text('{"text": "ok"}\n{"text": "a\\ud83db"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="lone.jsonl:2: its text is not valid Unicode .* lone surrogate"):
        tokenize_files([tmp_path / "lone.jsonl"], tmp_path / "x.bin", workers=2)
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match="latin.jsonl:2: not UTF-8 text"):
        tokenize_files([tmp_path / "latin.jsonl"], tmp_path / "x.bin")
    with pytest.raises(ArgumentError, match="--eod 4294967296: give a token id .* 2\\*\\*32 - 1"):
        tokenize_files([tmp_path / "a.txt"], tmp_path / "x.bin", eod=1 << 32)
    assert not list(tmp_path.glob("x.bin*"))


def test_tokenize_with_a_hugging_face_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from octopipe.data import tokenize_files

    def saved(vocab, name):
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="</s>").save_pretrained(
            tmp_path / name)
        return str(tmp_path / name)

    (tmp_path / "docs.jsonl").write_text('{"text": "hello world"}\n{"text": "world"}\n', encoding="utf-8")
    small = saved({"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}, "small")
    done = tokenize_files([tmp_path / "docs.jsonl"], tmp_path / "out.bin", tokenizer=small, eod="eos")
    assert token_stream(tmp_path / "out.bin").tolist() == [2, 3, 1, 3, 1] and done.vocab_size == 4
    assert tokenize_files([tmp_path / "docs.jsonl"], tmp_path / "two.bin", tokenizer=small, eod="eos", workers=2) == done
    assert token_stream(tmp_path / "two.bin").tolist() == [2, 3, 1, 3, 1]
    # a vocabulary over 65,536 ids: uint32, which train reads with --data-dtype uint32
    large = saved({"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}, "world": 70_002}, "large")
    done = tokenize_files([tmp_path / "docs.jsonl"], tmp_path / "big.bin", tokenizer=large)
    assert done.dtype == "uint32" and token_stream(tmp_path / "big.bin", "uint32").tolist() == [0, 70_002, 70_002]
    with pytest.raises(DataError, match="cannot load it"):
        tokenize_files([tmp_path / "docs.jsonl"], tmp_path / "x.bin", tokenizer=str(tmp_path / "missing"))
    # a vocabulary with gaps (4 entries, an id of 70,000): sized by its largest id, so uint32
    sparse = saved({"[UNK]": 0, "</s>": 1, "hello": 2, "world": 70_000}, "sparse")
    done = tokenize_files([tmp_path / "docs.jsonl"], tmp_path / "sparse.bin", tokenizer=sparse)
    assert (done.dtype, done.vocab_size) == ("uint32", 70_001)
    assert token_stream(tmp_path / "sparse.bin", "uint32").tolist() == [2, 70_000, 70_000]


def test_a_blend_takes_each_files_share_of_every_thousand_sequences_in_its_own_order(tmp_path):
    from octopipe.data import BLEND_PERIOD, BlendedBatches

    # a file whose sequence k starts with token k (sequences of 4 + 1, tokens < 60000)
    for name, first in (("a", 0), ("b", 30_000)):
        np.concatenate([[first + k] * 4 for k in range(6000)] + [[0]]).astype(np.uint16).tofile(tmp_path / f"{name}.bin")

    def part(name, seed=1234):
        return TokenBatches(str(tmp_path / f"{name}.bin"), seq_len=4, batch_size=1, seed=seed)

    def sequence(blend, position):  # (file, its sequence) at a position of the blend
        (inputs,), _ = blend.batch_at(position, 0)
        value = int(inputs[0, 0])
        return ("b", value - 30_000) if value >= 30_000 else ("a", value)

    blend = BlendedBatches((part("a"), part("b")), (3.0, 1.0), batch_size=1)
    drawn = [sequence(blend, q) for q in range(2 * BLEND_PERIOD)]
    assert [name for name, _ in drawn[:BLEND_PERIOD]].count("b") == 250 and blend.taken(BLEND_PERIOD) == [750, 250]
    assert "bbb" not in "".join(name for name, _ in drawn) and "aaaa" not in "".join(name for name, _ in drawn)
    for name in ("a", "b"):  # each file in its own (shuffled) order, from its start, with no repeats
        own = [k for file, k in drawn if file == name]
        assert own == [part(name).index_at(j) for j in range(len(own))]
    # any position is found at once, and a step's sequences do not depend on the replica count
    assert blend.locate(10**12 + 7) == (blend.locate(7)[0], 10**9 * (750 if blend.locate(7)[0] == 0 else 250)
                                        + blend.locate(7)[1])
    wide = BlendedBatches((part("a"), part("b")), (3.0, 1.0), batch_size=8)
    halves = BlendedBatches((part("a"), part("b")), (3.0, 1.0), batch_size=4, replicas=2)
    for step in (0, 5, 123):
        assert torch.equal(wide.batch(step)[0][0], torch.cat([halves.batch(step, r)[0][0] for r in range(2)]))
    assert "75% from" in wide.describe() and "25% from" in wide.describe()
    data = TrainingData(wide)
    assert data.saved(2)["data"]["weights"] == [3.0, 1.0]
    other = TrainingData(BlendedBatches((part("a"), part("b")), (1.0, 1.0), batch_size=8))
    assert "this run reads" in other.resume({"consumed_samples": 16, **{"data": data.saved(2)["data"]}}, "ckpt")
    with pytest.raises(DataError, match="rounds to none of every 1000 sequences"):
        BlendedBatches((part("a"), part("b")), (1.0, 5000.0), batch_size=1)
    with pytest.raises(ArgumentError, match="two or more files and a weight for each"):
        BlendedBatches((part("a"),), (1.0,), batch_size=1)
    valid = BlendedBatches((TokenBatches(str(tmp_path / "a.bin"), seq_len=4, batch_size=1, shuffle=False, samples=(0, 30)),
                            part("b")), (3.0, 1.0), batch_size=8)
    valid.check_enough(5)  # 40 sequences: 30 from a, 10 from b
    with pytest.raises(DataError, match="take 36 from .*a.bin, which holds 30"):
        valid.check_enough(6)
