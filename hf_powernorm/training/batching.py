"""Batching: fairseq's token-budget batches, fixed-size batches, padding and the data loaders.

`TokenBudgetBatchSampler` is fairseq's `--max-tokens` (length-bucketed batches of at most
`max_tokens` padded tokens, the paper's batching); `ShuffledBatchSampler` gives batches of a fixed
number of examples (`--per_device_train_batch_size`, as in Transformers' examples). Both shuffle by
(seed, epoch) alone, so that a resumed run sees the batches an unbroken one would. `PaddingCollator`
pads the three tasks' examples and marks real tokens in the masks that every norm receives.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from .tokenization import sequence_lengths

IGNORE_INDEX = -100


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Length-bucketed batches whose padded size (longest length x batch size) is <= `max_tokens`.

    As fairseq's `--max-tokens`: examples are sorted by length (ties broken randomly by seed and
    epoch), cut greedily into batches, and the batch order is shuffled by (seed, epoch). With
    `num_replicas > 1`, batches are dealt round-robin and the list is padded by repeating its first
    batches, so every rank gets the same number. Call `set_epoch` before each epoch.

    Under `accelerator.prepare`, keep `num_replicas=1`: Accelerate shards batch samplers itself
    (round-robin, `even_batches=True`), and `set_epoch` must still be called on this object.
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0, max_sentences: int | None = None) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}); got {rank}")
        too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
        if too_long:
            index, length = too_long[0]
            raise ValueError(f"example {index} has {length} tokens, more than max_tokens={max_tokens} "
                             f"({len(too_long)} such examples); raise --max_tokens or lower the "
                             f"maximum sequence length")
        self.lengths, self.max_tokens, self.max_sentences = list(lengths), max_tokens, max_sentences
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.num_replicas, self.rank = num_replicas, rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _all_batches(self) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        order.sort(key=self.lengths.__getitem__)  # stable: equal lengths keep the random order
        batches, batch, longest = [], [], 0
        for index in order:
            longest_if_added = max(longest, self.lengths[index])
            full = self.max_sentences is not None and len(batch) >= self.max_sentences
            if batch and (longest_if_added * (len(batch) + 1) > self.max_tokens or full):
                batches.append(batch)
                batch, longest_if_added = [], self.lengths[index]
            batch.append(index)
            longest = longest_if_added
        if batch:
            batches.append(batch)
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._all_batches()
        if not batches:
            return iter(())
        total = len(self) * self.num_replicas
        padded = [batches[i % len(batches)] for i in range(total)]
        return iter(padded[self.rank::self.num_replicas])

    def __len__(self) -> int:
        # The greedy cut depends only on the sorted lengths, so the count is the same every epoch.
        if not hasattr(self, "_num_batches"):
            self._num_batches = len(self._all_batches())
        return math.ceil(self._num_batches / self.num_replicas)


@dataclass
class PaddingCollator:
    """Pads `input_ids` with `pad_token_id`, sequence `labels` with -100, and adds `attention_mask`.

    One collator for the three tasks: seq2seq (`input_ids` + `labels`; the model builds its decoder
    inputs from the labels), causal LM blocks (`labels` equal to `input_ids`) and classification
    (an integer `label`, returned as `labels`). With `decoder_attention_mask=True` the decoder's
    padding is marked too, so norms with batch statistics in the decoder leave it out (decoder
    position t reads label t - 1, so it is real exactly when label t is).
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    decoder_attention_mask: bool = False  # seq2seq: mark the decoder positions that have a label

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = {"input_ids": self._pad([f["input_ids"] for f in features], self.pad_token_id)}
        batch["attention_mask"] = self._pad([[1] * len(f["input_ids"]) for f in features], 0)
        key = next((k for k in ("labels", "label") if k in features[0]), None)
        if key is None:
            return batch
        labels = [f[key] for f in features]
        if isinstance(labels[0], (list, tuple, torch.Tensor)):
            batch["labels"] = self._pad(labels, IGNORE_INDEX)
            if self.decoder_attention_mask:
                batch["decoder_attention_mask"] = (batch["labels"] != IGNORE_INDEX).long()
        else:
            batch["labels"] = torch.tensor([int(label) for label in labels], dtype=torch.long)
        return batch

    def _pad(self, sequences: list[Sequence[int]], value: int) -> torch.Tensor:
        length = max(len(s) for s in sequences)
        if self.pad_to_multiple_of:
            length = math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of
        out = torch.full((len(sequences), length), value, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            out[row, :len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
        return out



class ShuffledBatchSampler(Sampler[list[int]]):
    """Batches of `batch_size` examples in an order shuffled by (seed, epoch); the last batch may
    be smaller. Call `set_epoch` before each epoch."""

    def __init__(self, num_examples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}")
        self.num_examples, self.batch_size, self.shuffle, self.seed, self.epoch = (
            num_examples, batch_size, shuffle, seed, 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return iter([order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)])

    def __len__(self) -> int:
        return math.ceil(self.num_examples / self.batch_size)


def train_loader(dataset: Any, collate: PaddingCollator, *, seed: int, max_tokens: int | None = None,
                 batch_size: int | None = None,
                 length_columns: tuple[str, ...] = ("input_ids",)) -> tuple[DataLoader, Sampler]:
    """Training batches: fixed-size with `batch_size`, else token-budget with `max_tokens` (the
    longest of `length_columns` counts). Accelerate deals them out to the processes, so the sampler
    has one replica here. Returns the loader and its sampler (for `set_epoch`)."""
    if batch_size is not None:
        sampler: Sampler = ShuffledBatchSampler(len(dataset), batch_size, seed=seed)
    elif max_tokens is not None:
        sampler = TokenBudgetBatchSampler(sequence_lengths(dataset, length_columns), max_tokens, seed=seed)
    else:
        raise ValueError("train_loader needs max_tokens or batch_size")
    # Its own generator: a DataLoader draws a seed at each `iter()`, which from the global RNG would
    # shift dropout after a resume (the resumed run starts an iterator where the unbroken one did not).
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, generator=generator), sampler


def eval_loader(dataset: Any, collate: PaddingCollator, batch_size: int) -> DataLoader:
    """Sequential batches of an evaluation split."""
    return DataLoader(dataset, batch_size=batch_size, collate_fn=collate)
