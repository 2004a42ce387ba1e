"""`octopipe tokenize` throughput: a JSON-lines corpus made from this repository's docs, tokenized
to UTF-8 bytes and by a BPE tokenizer (8,000 ids, trained here on the same text with the
`tokenizers` package), by `octopipe.data.tokenize_files` with 1 and `--workers` processes, beside
the plain loop a script would write (the tokenizer called on one document at a time, the ids
appended to the file), which is what `tokenize` did before stop 48. Every run's file is checked to
hold the same ids as the plain loop's.

    python benchmarks/tokenize_speed.py [--mb 50] [--workers 2]

Needs transformers and tokenizers (the `dev` extra). Timings are wall seconds on this machine,
one after another in one run: compare them with each other, not across runs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from octopipe.data import read_documents, tokenize_files  # noqa: E402


def corpus(path: Path, megabytes: float) -> int:
    """Documents of 200-4,000 characters cut at random from README.md and docs/benchmarks.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8") + (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    rng = random.Random(0)
    size = count = 0
    with path.open("w", encoding="utf-8") as out:
        while size < megabytes * 2**20:
            length = rng.randint(200, 4000)
            start = rng.randint(0, len(text) - length)
            out.write(json.dumps({"text": text[start:start + length]}) + "\n")
            size += length
            count += 1
    return count


def bpe(folder: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = (ROOT / "README.md").read_text(encoding="utf-8") + (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=8000, special_tokens=["[UNK]", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="</s>").save_pretrained(folder)
    return str(folder)


def plain_loop(source: Path, output: Path, tokenizer: str | None, eod: int) -> None:
    """One document at a time, as a script would: list(bytes) or tokenizer(text)["input_ids"]."""
    encode = (lambda text: list(text.encode("utf-8"))) if tokenizer is None else None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(tokenizer)
        encode = lambda text: loaded(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    with output.open("wb") as stream:
        for text in read_documents(source):
            stream.write(np.asarray(list(encode(text)) + [eod], dtype=np.uint16).tobytes())


def _line(name: str, how: str, megabytes: float, seconds: float) -> None:
    print(f"{name:<10}{how:<36}{seconds:>9.2f}{megabytes / seconds:>8.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=50.0, help="corpus size, megabytes of text")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        source = work / "corpus.jsonl"
        documents = corpus(source, args.mb)
        tokenizer = bpe(work / "bpe")
        print(f"corpus: {documents:,} documents, {source.stat().st_size / 2**20:.1f} MB of JSON lines")
        print(f"{'tokenizer':<10}{'how':<36}{'seconds':>9}{'MB/s':>8}")
        for name, path, eod in (("byte", None, 0), ("bpe 8000", tokenizer, 1)):
            reference = work / "plain.bin"
            started = time.perf_counter()
            plain_loop(source, reference, path, eod)
            _line(name, "plain loop, a document a call", args.mb, time.perf_counter() - started)
            expected = np.fromfile(reference, dtype=np.uint16)
            for workers in (1, args.workers):
                out = work / f"w{workers}.bin"
                started = time.perf_counter()
                tokenize_files([source], out, tokenizer=path or "byte", eod=eod, workers=workers)
                _line(name, f"tokenize_files, workers={workers}", args.mb, time.perf_counter() - started)
                assert np.array_equal(np.fromfile(out, dtype=np.uint16), expected), (name, workers)
        print("every file holds the plain loop's ids")


if __name__ == "__main__":
    main()
