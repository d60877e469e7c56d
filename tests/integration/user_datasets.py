"""Map-style datasets named by import path in the tests' configs (dataset.factory), as a user's package's would be."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kbit_core.datasets.synthetic import SyntheticDigits


class Digits(torch.utils.data.Dataset):
    """The synthetic digits as a user would hand them over: float tensors [1, 28, 28] in [0, 1], integer labels,
    read item by item; ``bad_item`` gets an image one row short, ``bad_label`` the label 10 of no class."""

    classes = [str(digit) for digit in range(10)]

    def __init__(self, num_records: int, seed: int = 0, bad_item: int | None = None, bad_label: int | None = None):
        _, images, labels = next(SyntheticDigits(num_records, seed).batches(0, num_records, num_records))
        self.images, self.labels, self.bad_item = torch.from_numpy(images).float() / 255, labels.tolist(), bad_item
        if bad_label is not None:
            self.labels[bad_label] = len(self.classes)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        return (image[:, 1:] if index == self.bad_item else image), self.labels[index]


def digits(num_records: int = 2000, seed: int = 0, bad_item: int | None = None, bad_label: int | None = None) -> Digits:
    return Digits(num_records, seed, bad_item, bad_label)


def pictures(num_records: int = 4) -> list[tuple[Any, np.int64]]:
    """A plain list of (RGB PIL image 8 wide, 6 high, numpy label): a map-style dataset as torchvision's would be
    without a transform; pixel (y, x) of picture i is (i, y, x)."""
    from PIL import Image  # Pillow comes with matplotlib (a kbit dependency) but kbit itself never imports it

    grid = np.stack(np.meshgrid(np.arange(6), np.arange(8), indexing="ij"), axis=-1).astype(np.uint8)
    return [
        (Image.fromarray(np.concatenate([np.full((6, 8, 1), i, np.uint8), grid], axis=-1)), np.int64(i % 2))
        for i in range(num_records)
    ]


def sorted_digits(num_records: int = 2000, keep_labels: bool = True) -> torch.utils.data.Dataset:
    """The synthetic digits stored sorted by class, as an ImageFolder is; ``keep_labels=False`` hides the ``labels``
    list, so that a reader must read each item for its label."""
    dataset = Digits(num_records)
    order = np.argsort(dataset.labels, kind="stable")
    dataset.images, dataset.labels = dataset.images[order], [dataset.labels[i] for i in order]
    if keep_labels:
        return dataset
    hidden = torch.utils.data.Subset(dataset, range(len(dataset)))
    hidden.classes = dataset.classes
    return hidden
