"""The order of training batches: every batch from one bucket, shuffled deterministically from
the seed and the epoch, split between processes so that all ranks always hold the same bucket."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator

from torch.utils.data import Sampler


class BucketBatchSampler(Sampler[list[tuple[int, int]]]):
    """Batches of one target size each, shuffled deterministically from (seed, epoch).

    With several processes every step draws one *global* batch of `batch size × processes`
    images from one bucket and each process takes its slice, so all ranks always hold the same
    bucket (no shape mismatch, no hang) and the global batch is the same however many processes
    share it. A global batch that comes up short is filled up with images of the same bucket
    (from the start of its shuffled list), unless `drop_last` drops it.
    """

    def __init__(self, targets: list[tuple[int, int]], batch_sizes: dict[tuple[int, int], int],
                 drop_last: bool, seed: int, world_size: int = 1, rank: int = 0):
        self.buckets: dict[tuple[int, int], list[int]] = defaultdict(list)
        for index, target in enumerate(targets):
            self.buckets[target].append(index)
        self.batch_sizes = batch_sizes
        self.drop_last = drop_last
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The epoch to iterate next, from its `start`-th batch (resuming mid-epoch)."""
        self.epoch = epoch
        self.start = start

    def batches(self, epoch: int) -> list[list[int]]:
        """Every global batch of one epoch, in training order."""
        rng = random.Random(f"{self.seed}-buckets-{epoch}")
        batches = []
        for target in sorted(self.buckets):
            indices = list(self.buckets[target])
            rng.shuffle(indices)
            size = self.batch_sizes[target] * self.world_size
            for start in range(0, len(indices), size):
                batch = indices[start : start + size]
                if len(batch) < size and self.drop_last:
                    continue
                if len(batch) < size and self.world_size > 1:  # every rank needs a full share
                    batch += [indices[i % len(indices)] for i in range(size - len(batch))]
                batches.append(batch)
        rng.shuffle(batches)
        return batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self.batches(self.epoch)[self.start :]:
            share = len(batch) // self.world_size
            yield [(index, self.epoch) for index in batch[self.rank * share : (self.rank + 1) * share]]

    def __len__(self) -> int:
        return len(self.batches(self.epoch)) - self.start
