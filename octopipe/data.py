"""Token data for training: a file of token ids cut into sequences, batched per step and replica;
and the making of such files from text (`tokenize_files`, `octopipe tokenize`).

`octopipe train --data FILE` reads one flat stream of token ids, either a raw binary file (`.bin`;
uint16 unless told otherwise, the dtype nanoGPT's preprocessing and Megatron's indexed datasets
use for vocabularies under 65,536) or a NumPy `.npy` array (its header names the dtype). The
stream is memory-mapped, never read whole.

- The stream is cut into `num_samples` sequences of `seq_len + 1` tokens, each starting `seq_len`
  after the last (so consecutive sequences share one token, as Megatron's GPT dataset cuts them):
  a sequence's first `seq_len` tokens are the model's input and its last `seq_len` the target, the
  next token at every position. A tail shorter than that is left out.
- Each step takes the next `replicas * batch_size` sequences of an order that is a seeded
  permutation per epoch (`shuffle`) or the file's own (validation); replica `r` takes the `r`-th
  `batch_size` of them. Across epochs the orders follow one another, so a global batch may span
  two. A run resumed from a checkpoint goes on after the sequences it consumed (`TrainingData`
  keeps them with the checkpoint, as Megatron keeps its consumed_samples), so another batch size
  or replica count after a resume neither skips nor repeats any.
- Every batch is checked against the model's vocabulary (`vocab_size`) before it is used: a token
  id out of range is an error that names the file and the token's position, not an index error
  inside an embedding on some rank.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from octopipe.errors import ArgumentError, DataError

DTYPES: dict[str, Any] = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}
"""The token dtypes a raw `.bin` file may hold (`--data-dtype`); a `.npy` file's header names its own."""

IGNORE_INDEX = -100
"""A target left out of the loss (`torch.nn.functional.cross_entropy`'s ignore_index, which
`models.lm_loss` keeps)."""

DEFAULT_DTYPE = "uint16"
"""A raw file's dtype unless told otherwise: what Megatron's and nanoGPT's preprocessing write for
vocabularies under 65,536 tokens."""


def token_stream(path: str | os.PathLike[str], dtype: str | None = None, *, what: str = "data") -> np.ndarray:
    """The file's token ids, memory-mapped, as a 1-D array. `.npy`: the array it holds (1-D, of
    integers; `dtype`, where given, must be its own); any other file: raw tokens of `dtype`
    (default uint16)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} {path}: no such file; give a file of token ids (raw .bin, or .npy)")
    if dtype is not None and dtype not in DTYPES:
        raise ArgumentError(f"{what} {path}: token dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise DataError(f"{what} {path}: not a readable .npy array ({exc}); save the token ids with numpy.save") from None
        if tokens.ndim != 1:
            raise DataError(f"{what} {path}: holds an array of shape {tuple(tokens.shape)}; the token ids must be one flat "
                            "stream (numpy.save(path, ids.reshape(-1)))")
        if tokens.dtype.kind not in "iu":
            raise DataError(f"{what} {path}: holds {tokens.dtype} values; token ids are integers (save them as uint16, "
                            "uint32, int32 or int64)")
        if dtype is not None and np.dtype(DTYPES[dtype]) != tokens.dtype:
            raise DataError(f"{what} {path}: its header says {tokens.dtype}, not the {dtype} given; drop the dtype "
                            "(a .npy file names its own)")
        return tokens
    kind = np.dtype(DTYPES[dtype or DEFAULT_DTYPE])
    size = path.stat().st_size
    if size % kind.itemsize:
        raise DataError(f"{what} {path}: {size} bytes is not a whole number of {kind.name} tokens ({kind.itemsize} bytes "
                        "each); give the dtype it was written in (--data-dtype)")
    if size == 0:
        raise DataError(f"{what} {path}: the file is empty")
    return np.memmap(path, dtype=kind, mode="r")


@dataclass
class TokenBatches:
    """Batches of `batch_size` sequences of `seq_len` tokens per replica from a token file (see
    the module doc). Pickles by its settings, so spawned workers open the file themselves."""

    path: str
    seq_len: int
    batch_size: int
    replicas: int = 1
    dtype: str | None = None
    shuffle: bool = True
    seed: int = 1234
    vocab_size: int | None = None
    samples: tuple[int, int] | None = None
    """The range [start, stop) of the file's sequences this set reads (a split of one file into
    training and validation sets, `split_samples`); None: all of them."""
    what: str = "data"
    """How errors name the file (a CLI flag, e.g. "--data")."""
    _tokens: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _orders: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(f"{self.what} {self.path}: {name} must be a positive integer, got {value!r}")
        if self.file_samples < 1:
            raise DataError(f"{self.what} {self.path}: {len(self.tokens)} tokens, fewer than one sequence of "
                            f"{self.seq_len} + 1; give more data or a shorter --seq-len")
        if self.samples is not None:
            start, stop = self.samples
            if not 0 <= start < stop <= self.file_samples:
                raise DataError(f"{self.what} {self.path}: sequences {start}..{stop - 1} asked for, but the file holds "
                                f"{self.file_samples} sequences of {self.seq_len} + 1 tokens (0..{self.file_samples - 1})"
                                "; give more data or another split")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None, "_orders": {}}

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = token_stream(self.path, self.dtype, what=self.what)
        return self._tokens

    @property
    def file_samples(self) -> int:
        """Sequences of seq_len + 1 tokens in the file (each starting seq_len after the last)."""
        return (len(self.tokens) - 1) // self.seq_len

    @property
    def num_samples(self) -> int:
        """Sequences this set reads: the file's, or its range of them (`samples`)."""
        if self.samples is None:
            return self.file_samples
        return self.samples[1] - self.samples[0]

    @property
    def global_batch(self) -> int:
        """Sequences per step over every replica."""
        return self.replicas * self.batch_size

    @property
    def steps_per_epoch(self) -> float:
        return self.num_samples / self.global_batch

    def _order(self, epoch: int) -> torch.Tensor:
        order = self._orders.get(epoch)
        if order is None:
            if self.shuffle:
                order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(self.num_samples)
            self._orders = {epoch: order}  # (steps walk the epochs in turn: one order held at a time)
        return order

    def sample_indices(self, iteration: int, replica: int = 0) -> list[int]:
        """The sequences replica `replica` trains on at `iteration` (0-based over the whole run)."""
        if iteration < 0:
            raise ArgumentError(f"{self.what} {self.path}: iteration {iteration} is negative")
        return self.indices_at(iteration * self.global_batch, replica)

    def indices_at(self, position: int, replica: int = 0) -> list[int]:
        """The sequences replica `replica` reads of the global batch that starts at `position` of
        the order (the sequences read before it, over the whole run: Megatron's consumed samples)."""
        if not 0 <= replica < self.replicas:
            raise ArgumentError(f"{self.what} {self.path}: replica {replica} out of range 0..{self.replicas - 1}")
        if position < 0:
            raise ArgumentError(f"{self.what} {self.path}: position {position} is negative")
        first = position + replica * self.batch_size
        return [self.index_at(position) for position in range(first, first + self.batch_size)]

    def index_at(self, position: int) -> int:
        """The file's sequence at `position` of the order (epochs following one another)."""
        epoch, offset = divmod(position, self.num_samples)
        return (self.samples[0] if self.samples is not None else 0) + int(self._order(epoch)[offset])

    def rows(self, indices: Sequence[int]) -> torch.Tensor:
        """The file's sequences `indices` ([len, seq_len + 1] int64), checked against the vocabulary."""
        rows = np.stack([np.asarray(self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1]) for i in indices])
        tokens = torch.from_numpy(rows.astype(np.int64))
        if self.vocab_size is not None:
            bad = (tokens >= self.vocab_size) | (tokens < 0)
            if bool(bad.any()):
                row, column = (int(x) for x in bad.nonzero()[0])
                raise DataError(self._outside(int(tokens[row, column]), indices[row] * self.seq_len + column))
        return tokens

    def identity(self) -> dict[str, Any]:
        """What a checkpoint keeps of this order, to tell whether a resumed run reads the same."""
        return {"path": str(self.path), "seed": self.seed, "seq_len": self.seq_len,
                "samples": list(self.samples) if self.samples is not None else None}

    def batch(self, iteration: int, replica: int = 0) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        """((input ids,), target ids) for `replica` at `iteration`: int64 tensors of
        [batch_size, seq_len], the target the input shifted by one token."""
        if iteration < 0:
            raise ArgumentError(f"{self.what} {self.path}: iteration {iteration} is negative")
        return self.batch_at(iteration * self.global_batch, replica)

    def batch_at(self, position: int, replica: int = 0) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        """`batch` of the global batch that starts at `position` of the order (`indices_at`)."""
        tokens = self.rows(self.indices_at(position, replica))
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()

    def check_vocabulary(self, chunk: int = 1 << 24, count: int | None = None) -> int:
        """Refuse a file holding a token id outside [0, vocab_size) anywhere, read in chunks of
        `chunk` tokens (a pass over the file; each batch is checked again as it is read). Returns
        how often the file holds token `count` (0 without it)."""
        if self.vocab_size is None and count is None:
            return 0
        tokens, found = self.tokens, 0
        for start in range(0, len(tokens), chunk):
            part = np.asarray(tokens[start:start + chunk])
            if self.vocab_size is not None:
                bad = np.flatnonzero((part >= self.vocab_size) | (part < 0))
                if len(bad):
                    raise DataError(self._outside(int(part[bad[0]]), start + int(bad[0])))
            if count is not None:
                found += int(np.count_nonzero(part == count))
        return found

    def _outside(self, token: int, position: int) -> str:
        raw = "" if Path(self.path).suffix == ".npy" else (
            f"; or, if the file was written in another dtype than the {self.tokens.dtype} it is read as, give that "
            "(--data-dtype)")
        return (f"{self.what} {self.path}: token {token} at position {position} is outside the model's vocabulary of "
                f"{self.vocab_size}; tokenize with the model's tokenizer, or give the model a larger vocabulary "
                f"(--set vocab_size=N for a built-in model){raw}")

    def check_enough(self, batches: int) -> None:
        """Refuse a validation set that `batches` global batches would read past the end of (so
        that no sequence is counted twice in one evaluation)."""
        need = batches * self.global_batch
        if need > self.num_samples:
            raise DataError(f"{self.what} {self.path}: {batches} batch{'es' if batches > 1 else ''} of {self.global_batch} "
                            f"sequence{'s' if self.global_batch > 1 else ''} need {need} sequences of {self.seq_len} + 1 "
                            f"tokens, but {'its split' if self.samples is not None else 'the file'} holds "
                            f"{self.num_samples}; evaluate fewer batches (--eval-iters) or give more data")

    def describe(self, steps: bool = True) -> str:
        """One line: the file, its tokens and sequences, and (`steps`) the step's sequences and
        the epoch's length."""
        tokens = self.tokens
        held = (f"{self.num_samples:,} sequences of {self.seq_len} + 1" if self.samples is None else
                f"sequences {self.samples[0]:,}-{self.samples[1] - 1:,} of its {self.file_samples:,} of "
                f"{self.seq_len} + 1")
        order = f"shuffled (seed {self.seed})" if self.shuffle else "in file order"
        if not steps:
            return f"{self.path}: {len(tokens):,} {tokens.dtype} tokens, {held}, {order}"
        return (f"{self.path}: {len(tokens):,} {tokens.dtype} tokens, {held}; {self.global_batch} a step"
                + (f" ({self.replicas} replicas x {self.batch_size})" if self.replicas > 1 else "")
                + (f", an epoch every {self.steps_per_epoch:.4g} steps, {order}" if self.shuffle else f", {order}"))


BLEND_PERIOD = 1000
"""`BlendedBatches` realizes its weights over every run of this many sequences, rounded to it."""


@dataclass
class BlendedBatches:
    """Batches drawn from several token files by weight (Megatron's `--data-path 0.3 A 0.7 B`):
    the weights are rounded to counts out of `BLEND_PERIOD` (largest remainders), and every run
    of that many sequences of the order takes exactly those counts, interleaved as Megatron's
    blending interleaves them (each next sequence from the file furthest below its share). Each
    file is read in its own order (`parts`: their `TokenBatches`, whose batch sizes are not
    used), so the sequence at any position of the blend is found without walking to it."""

    parts: tuple[TokenBatches, ...]
    weights: tuple[float, ...]
    batch_size: int
    replicas: int = 1
    what: str = "data"

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len(self.weights) != len(self.parts):
            raise ArgumentError(f"{self.what}: blending takes two or more files and a weight for each, got "
                                f"{len(self.parts)} files and {len(self.weights)} weights")
        if any(not math.isfinite(w) or w <= 0 for w in self.weights):
            raise ArgumentError(f"{self.what}: blending weights must be positive, got {list(self.weights)}")
        if len({part.seq_len for part in self.parts}) != 1:
            raise ArgumentError(f"{self.what}: the blended files are cut at different sequence lengths")
        total = sum(self.weights)
        quotas = [w / total * BLEND_PERIOD for w in self.weights]
        counts = [math.floor(q) for q in quotas]
        for index in sorted(range(len(quotas)), key=lambda i: counts[i] - quotas[i])[:BLEND_PERIOD - sum(counts)]:
            counts[index] += 1
        if 0 in counts:
            raise DataError(f"{self.what}: weight {self.weights[counts.index(0)]:g} rounds to none of every "
                            f"{BLEND_PERIOD} sequences; give it a larger share")
        pattern: list[int] = []
        taken = [0] * len(counts)
        for index in range(BLEND_PERIOD):  # each next sequence from the file furthest below its share
            part = max(range(len(counts)), key=lambda d: (counts[d] * (index + 1) / BLEND_PERIOD - taken[d], -d))
            pattern.append(part)
            taken[part] += 1
        self._counts, self._pattern = counts, pattern
        self._before = [[0] * len(counts)]  # per offset in the period: each file's sequences before it
        for part in pattern:
            self._before.append([n + (d == part) for d, n in enumerate(self._before[-1])])

    @property
    def seq_len(self) -> int:
        return self.parts[0].seq_len

    @property
    def global_batch(self) -> int:
        return self.replicas * self.batch_size

    @property
    def samples(self) -> None:  # (a blend is of whole parts: their own ranges say where they read)
        return None

    @property
    def path(self) -> str:
        return " + ".join(str(part.path) for part in self.parts)

    @property
    def file_samples(self) -> int:
        return sum(part.num_samples for part in self.parts)

    def locate(self, position: int) -> tuple[int, int]:
        """(file, the file's own position) of the blend's sequence at `position`."""
        period, offset = divmod(position, BLEND_PERIOD)
        part = self._pattern[offset]
        return part, period * self._counts[part] + self._before[offset][part]

    def batch_at(self, position: int, replica: int = 0) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        if not 0 <= replica < self.replicas:
            raise ArgumentError(f"{self.what}: replica {replica} out of range 0..{self.replicas - 1}")
        first = position + replica * self.batch_size
        rows = []
        for where in range(first, first + self.batch_size):
            part, own = self.locate(where)
            rows.append(self.parts[part].rows([self.parts[part].index_at(own)]))
        tokens = torch.cat(rows)
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()

    def batch(self, iteration: int, replica: int = 0) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        return self.batch_at(iteration * self.global_batch, replica)

    def taken(self, position: int) -> list[int]:
        """Each file's sequences among the blend's first `position`."""
        period, offset = divmod(position, BLEND_PERIOD)
        return [period * count + before for count, before in zip(self._counts, self._before[offset])]

    def check_enough(self, batches: int) -> None:
        """Refuse a validation blend whose first `batches` global batches would read a file past
        its end (so that no sequence counts twice in one evaluation)."""
        for part, need in zip(self.parts, self.taken(batches * self.global_batch)):
            if need > part.num_samples:
                raise DataError(f"{self.what}: {batches} batch{'es' if batches > 1 else ''} of {self.global_batch} "
                                f"sequences take {need} from {part.path}, which holds {part.num_samples}; evaluate "
                                "fewer batches (--eval-iters) or give more data")

    def identity(self) -> dict[str, Any]:
        return {"blend": [part.identity() for part in self.parts], "weights": list(self.weights)}

    def describe(self) -> str:
        total = sum(self.weights)
        return (f"a blend of {len(self.parts)} files, {self.global_batch} sequences a step"
                + (f" ({self.replicas} replicas x {self.batch_size})" if self.replicas > 1 else "") + "; "
                + "; ".join(f"{100 * w / total:.3g}% from {part.describe(steps=False)}"
                            for w, part in zip(self.weights, self.parts)))


def split_samples(total: int, weights: Sequence[float], what: str = "--split") -> list[tuple[int, int]]:
    """Cut `total` sequences into consecutive ranges [start, stop) in proportion to `weights`
    (Megatron's --split 949,50,1: training, validation, test), each boundary rounded to the
    nearest sequence. Refuses a weight that is negative, a training weight of zero, or a training
    or validation range that comes out empty where its weight is not zero (a test part may: one
    under a batch is named and not evaluated)."""
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ArgumentError(f"{what} {','.join(f'{w:g}' for w in weights)}: give non-negative weights, not all zero "
                            "(e.g. 98,2: 98% to training, 2% to validation)")
    if weights[0] == 0:
        raise ArgumentError(f"{what} {','.join(f'{w:g}' for w in weights)}: leaves no training part; give training "
                            "the first, non-zero weight (e.g. 98,2: 98% to training, 2% to validation)")
    ranges, start, done = [], 0, 0.0
    for weight in weights:
        done += weight
        stop = round(total * done / sum(weights))
        if weight > 0 and stop <= start and len(ranges) < 2:
            raise DataError(f"{what} {','.join(f'{w:g}' for w in weights)}: {total} sequences leave part "
                            f"{len(ranges) + 1} none; give it a larger share or more data")
        ranges.append((start, stop))
        start = stop
    return ranges


def vocabulary_size(model: torch.nn.Module) -> int | None:
    """The rows of the model's first embedding table (its vocabulary), None if it has none."""
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            return int(module.num_embeddings)
    return None


@dataclass
class TrainingData:
    """What a training loop reads each step: `train`'s batches, and where given the validation
    set `valid`, whose first `eval_iters` batches are evaluated after every `eval_interval` steps
    (counted over the whole run, as the iteration is) and after the last (Megatron's
    --eval-interval and --eval-iters)."""

    train: TokenBatches | BlendedBatches
    valid: TokenBatches | BlendedBatches | None = None
    eval_interval: int | None = None
    """None: evaluate after the last step only."""
    eval_iters: int = 4
    consumed: int = 0
    """Training sequences read before this run (a resumed checkpoint's consumed samples): step k
    of this run reads the global batch at `consumed + k * global_batch` of the order, so a run
    resumed with another batch or replica count reads on where the last one stopped."""
    eod_mask: int | None = None
    """An end-of-document id (what `tokenize --eod` wrote): every target whose input token is it
    (a document's first token, predicted across the boundary) is set to `IGNORE_INDEX`, so the
    loss leaves it out, as Megatron's --eod-mask-loss does. The step's loss is then the mean over
    the targets that count in the whole global batch (train with `loss_weight=models.lm_tokens`),
    and a validation loss the mean over every such target of its batches. None: every target
    counts."""

    test: TokenBatches | BlendedBatches | None = None
    """The test part of a `--split` (None without one): evaluated once, after the last step, on
    its first `test_batches` global batches."""

    def __post_init__(self) -> None:
        if self.valid is not None:
            self.valid.check_enough(self.eval_iters)
        if self.eod_mask is not None:
            vocab = self.files()[0].vocab_size
            if isinstance(self.eod_mask, bool) or not isinstance(self.eod_mask, int) or not (
                    0 <= self.eod_mask < (vocab if vocab is not None else 1 << 63)):
                raise ArgumentError(f"--eod-mask-loss {self.eod_mask!r}: not a token id of the model's vocabulary "
                                    f"(0-{vocab - 1 if vocab is not None else 'any'}); give the end-of-document id "
                                    "the data was tokenized with (octopipe tokenize --eod)")

    def files(self) -> list[TokenBatches]:
        """Every file's `TokenBatches` of the training, validation and test sets (a blend's parts;
        a `--split` file's once for each of its parts)."""
        sets = [tokens for tokens in (self.train, self.valid, self.test) if tokens is not None]
        return [part for tokens in sets for part in (tokens.parts if isinstance(tokens, BlendedBatches) else (tokens,))]

    def check_vocabulary(self) -> list[str]:
        """Refuse a token id outside the model's vocabulary in any file (a pass over each). With
        `eod_mask`, the same pass counts that id: a note for each file that never holds it (the
        mask would leave nothing out there: another id than the data's end of document?)."""
        notes, seen = [], set()
        for tokens in self.files():
            if (tokens.path, tokens.tokens.dtype) in seen:  # (a split's parts: one file, one pass)
                continue
            seen.add((tokens.path, tokens.tokens.dtype))
            found = tokens.check_vocabulary(count=self.eod_mask)
            if self.eod_mask is not None and not found:
                notes.append(f"--eod-mask-loss {self.eod_mask}: {tokens.path} never holds token {self.eod_mask}, so "
                             "nothing is masked there; is it the id the data was tokenized with (tokenize --eod)?")
        return notes

    def batch(self, step: int, replica: int = 0) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        """Replica `replica`'s batch at step `step` of this run (0-based), its targets masked
        after each end of document where `eod_mask` is given."""
        return self.masked(*self.train.batch_at(self.consumed + step * self.train.global_batch, replica))

    def masked(self, inputs: tuple[torch.Tensor], target: torch.Tensor) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        """(inputs, target) with every target whose input is `eod_mask` set to `IGNORE_INDEX`."""
        if self.eod_mask is None:
            return inputs, target
        return inputs, target.masked_fill(inputs[0] == self.eod_mask, IGNORE_INDEX)

    def saved(self, steps: int) -> dict[str, Any]:
        """What a checkpoint taken after `steps` steps of this run keeps of the data: the sequences
        consumed (Megatron's consumed_samples) and which order they were read in."""
        return {"consumed_samples": self.consumed + steps * self.train.global_batch, "data": self.train.identity()}

    def resume(self, extra: dict[str, Any], where: str) -> str | None:
        """Take a resumed checkpoint's `extra` (what `saved` wrote; a checkpoint without it was
        trained on other batches: the data starts at its beginning): set `consumed`, and return a
        note where the checkpoint read another file or order than this run does, else None."""
        consumed = extra.get("consumed_samples", 0)
        if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise DataError(f"{where}: its consumed_samples is {consumed!r}, not a count of sequences")
        self.consumed = consumed
        before, now = extra.get("data"), self.saved(0)["data"]
        if "consumed_samples" not in extra:
            return (f"{where}: the checkpoint keeps no data position (trained without --data): this run reads "
                    f"{self.train.path} from its first sequence")
        if before != now:
            return (f"{where}: the checkpoint was trained on {before}, this run reads {now}; it goes on from the "
                    f"{consumed:,} sequences consumed, in this run's order")
        return None

    def evaluates_after(self, done: int, last: int) -> bool:
        """Whether to evaluate once `done` iterations are done, `last` being the run's final one."""
        if self.valid is None:
            return False
        return done == last or (self.eval_interval is not None and done % self.eval_interval == 0)

    def evaluate(self, engine: Any, tokens: TokenBatches | BlendedBatches | None = None,
                 batches: int | None = None) -> float:
        """The validation loss: the mean of `engine.evaluate` over the first `eval_iters` global
        batches of `valid`, each replica's engine on its own share of each (a collective, like a
        step). `tokens`, `batches`: another set's first batches (the test part: `test_batches`)."""
        tokens = self.valid if tokens is None else tokens
        batches = self.eval_iters if batches is None else batches
        assert tokens is not None and batches > 0
        replica = engine.replicas.replica
        losses = [engine.evaluate(*self.masked(*tokens.batch(k, replica))) for k in range(batches)]
        if self.eod_mask is None:
            return sum(losses) / len(losses)
        # each batch's loss is the mean over its targets that count: weigh it by them (every
        # replica's share, which each rank reads for itself)
        counts = [sum(int((self.masked(*tokens.batch(k, r))[1] != IGNORE_INDEX).sum()) for r in range(tokens.replicas))
                  for k in range(batches)]
        if not any(counts):  # (every target masked: a mean over nothing)
            return float("nan")
        return sum(loss * count for loss, count in zip(losses, counts) if count) / sum(counts)

    @property
    def test_batches(self) -> int:
        """The test part's global batches evaluated after the last step (Megatron evaluates its
        test split then): `eval_iters`, or as many whole ones as it holds where that is fewer
        (0: none, or less than one batch)."""
        if self.test is None:
            return 0
        for batches in range(self.eval_iters, 0, -1):
            try:
                self.test.check_enough(batches)
            except DataError:
                continue
            return batches
        return 0


# -- making token files ---------------------------------------------------------------------------

BYTE_TOKENIZER = "byte"
"""`tokenize_files`' default tokenizer: a text's UTF-8 bytes, ids 0-255 (the built-in tiny models'
vocabulary holds them)."""


@dataclass(frozen=True)
class TokenizedFiles:
    """What `tokenize_files` wrote: documents, tokens, the ids' dtype and the vocabulary a model
    needs to read them (the tokenizer's, or past the end-of-document id where that is larger)."""

    documents: int
    tokens: int
    dtype: str
    vocab_size: int


def read_documents(path: str | os.PathLike[str], json_key: str = "text") -> Iterator[str]:
    """A file's documents: a JSON-lines file (`.jsonl`, Megatron's input) one a line, its
    `json_key` field; any other file is one document, its whole text (UTF-8)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenize {path}: no such file")
    if path.suffix != ".jsonl":
        try:  # (bytes decoded as they are: \r\n stays two tokens, as the file holds it)
            yield path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"tokenize {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        return
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"tokenize {path}:{number}: not UTF-8 text ({exc.reason} at byte {exc.start} of "
                                "the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"tokenize {path}:{number}: not a JSON object ({exc.msg}); a .jsonl file holds one "
                                "document a line, as {\"text\": \"...\"}") from None
            if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                raise DataError(f"tokenize {path}:{number}: no string field {json_key!r} (give the field that holds "
                                "the text with --json-key)")
            text = record[json_key]
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # (a lone surrogate escape, such as \ud83d alone)
                raise DataError(f"tokenize {path}:{number}: its text is not valid Unicode ({exc.reason} at character "
                                f"{exc.start}: a lone surrogate escape?); fix or drop that line") from None
            yield text


def _tokenizer(name: str) -> tuple[Any, int, int | None]:
    """(a list of texts -> their id arrays, vocabulary size, end-of-document id or None) for
    `name`: "byte", or a Hugging Face tokenizer's name or folder (its batch call, which a fast
    tokenizer runs on every core)."""
    if name == BYTE_TOKENIZER:
        return _byte_ids, 256, None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"tokenize --tokenizer {name}: a Hugging Face tokenizer needs transformers (pip install "
                        "transformers), or use --tokenizer byte") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise DataError(f"tokenize --tokenizer {name}: cannot load it ({str(exc).splitlines()[0][:200]}); give a "
                        "folder holding the tokenizer's files, or a name in the local Hugging Face cache") from None

    backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
    batch = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)

    def encode(texts: list[str]) -> list[np.ndarray]:
        if batch is not None:  # (a fast tokenizer's own batch call: every core, without the offsets)
            return [np.asarray(encoding.ids, dtype=np.int64) for encoding in batch(texts, add_special_tokens=False)]
        return [np.asarray(ids, dtype=np.int64) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    # (an id past len(tokenizer): a vocabulary with gaps; the file's dtype must hold the largest)
    return encode, max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1), tokenizer.eos_token_id


def _byte_ids(texts: list[str]) -> list[np.ndarray]:
    return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]


TOKENIZE_CHUNK = 256
"""Documents `tokenize_files` hands its tokenizer (or a worker) at once."""

_WORKER_ENCODE: list[Any] = []
"""A `tokenize --workers` process's tokenizer (`_start_worker`)."""


def _start_worker(name: str) -> None:
    _WORKER_ENCODE[:] = [_tokenizer(name)[0]]


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    return _WORKER_ENCODE[0](texts)


def _chunks(inputs: Sequence[str | os.PathLike[str]], json_key: str) -> Iterator[list[str]]:
    chunk: list[str] = []
    for path in inputs:
        for text in read_documents(path, json_key):
            chunk.append(text)
            if len(chunk) == TOKENIZE_CHUNK:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def tokenize_files(inputs: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str], *,
                   tokenizer: str = BYTE_TOKENIZER, eod: int | str | None = None,
                   json_key: str = "text", workers: int = 1) -> TokenizedFiles:
    """Write the documents of `inputs` (`read_documents`) as one stream of token ids to `output`,
    raw (`.bin`, or any suffix but `.npy`) or a NumPy array (`.npy`): uint16 where the vocabulary
    fits, else uint32. `eod`: an id to end each document with, or "eos" for the tokenizer's
    end-of-sequence token (the byte tokenizer has none). What `train --data` reads (Megatron's
    preprocess_data.py does the same for its own format). `workers` > 1: that many processes
    tokenize chunks of documents, in order (Megatron's --workers); the file is written as they
    come, never held whole (a `.npy`'s header is written once the count is known)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ArgumentError(f"tokenize --workers {workers!r}: give a count of processes >= 1")
    if Path(output).resolve() in {Path(path).resolve() for path in inputs}:
        raise ArgumentError(f"tokenize -o {output}: is one of the input files, which writing it would destroy; give "
                            "another output path")
    encode, vocab, eos = _tokenizer(tokenizer)
    if eod == "eos":
        if eos is None:
            raise DataError(f"tokenize --eod eos: the {tokenizer} tokenizer has no end-of-sequence token; give an id "
                            f"(--eod ID, below {vocab} to fit the models that read these ids) or leave it out")
        eod = eos
    if eod is not None and (isinstance(eod, bool) or not isinstance(eod, int) or not 0 <= eod < 1 << 32):
        raise ArgumentError(f"tokenize --eod {eod!r}: give a token id (an integer from 0 to 2**32 - 1, what a uint32 "
                            "file holds) or eos")
    dtype = np.dtype(np.uint16 if max(vocab, (eod or 0) + 1) <= 1 << 16 else np.uint32)
    end = np.asarray([eod] if eod is not None else [], dtype=dtype)
    output = Path(output)
    partial = output.with_name(output.name + ".partial")  # (renamed into place when whole)
    raw = output.with_name(output.name + ".ids") if output.suffix == ".npy" else partial
    documents = tokens = 0
    pool = None
    try:
        if workers > 1:
            import multiprocessing

            pool = multiprocessing.get_context("spawn").Pool(workers, _start_worker, (tokenizer,))
            encoded: Iterator[list[np.ndarray]] = pool.imap(_encode_in_worker, _chunks(inputs, json_key))
        else:
            encoded = map(encode, _chunks(inputs, json_key))
        with open(raw, "wb") as stream:
            for chunk in encoded:
                for ids in chunk:
                    stream.write(np.concatenate([ids.astype(dtype), end]).tobytes())
                    documents += 1
                    tokens += len(ids) + len(end)
        if raw != partial:  # a .npy: its header, then the ids copied in pieces
            with open(partial, "wb") as stream, open(raw, "rb") as ids_file:
                header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (tokens,)}
                np.lib.format.write_array_header_1_0(stream, header)
                while piece := ids_file.read(1 << 24):
                    stream.write(piece)
        os.replace(partial, output)
    finally:
        if pool is not None:
            pool.terminate()
        partial.unlink(missing_ok=True)
        raw.unlink(missing_ok=True)
    return TokenizedFiles(documents, tokens, dtype.name, max(vocab, (eod or 0) + 1))
