"""Map-style datasets as dataset sources: a ``torch.utils.data.Dataset`` from the user's factory
(``dataset.name: torch``), or images and labels in .npy/.npz files (``dataset.name: arrays``).

Items are ``(image, label)``: the image a tensor, array or PIL image of shape [C, H, W] or [H, W] (a PIL image's
[H, W, C] is transposed), uint8 or floating point; the label an integer class. Every image must have item 0's shape.
Read in index order, in chunks, through the dataset's ``__getitems__`` when it has one (torch's batched fetch).

``exact=False`` (producing into Kafka) gives uint8 pixels, as every kbit format carries them: float images must
then lie in [0, 1] and are rounded to 8 bits. ``exact=True`` (``train.data: direct``) hands float images over as
they are, normalised or not.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kbit_core.config import DatasetConfig
from kbit_core.datasets.base import DatasetSource
from kbit_core.errors import ConfigError
from kbit_core.user_imports import import_object


class ArrayDataset(torch.utils.data.Dataset):
    """Images and labels in a .npz file (arrays ``images`` and ``labels``) or a directory holding ``images.npy``
    (memory-mapped) and ``labels.npy``; labels are also read to count the classes when none is configured."""

    def __init__(self, path: Path) -> None:
        if path.is_dir():
            self.images = _load(path / "images.npy", mmap_mode="r")
            self.labels = _load(path / "labels.npy")
        elif path.suffix == ".npz":
            with _load(path) as arrays:
                missing = {"images", "labels"} - set(arrays.files)
                if missing:
                    raise ConfigError(f"dataset.path={path} holds {arrays.files}, not {sorted(missing)}")
                self.images, self.labels = arrays["images"], arrays["labels"]
        else:
            raise ConfigError(
                f"dataset.path={path} is neither a .npz file nor a directory of images.npy and labels.npy"
            )
        if self.images.ndim not in (3, 4) or self.labels.ndim != 1 or len(self.images) != len(self.labels):
            raise ConfigError(
                f"dataset.path={path}: images of shape {self.images.shape} and labels of shape {self.labels.shape}; "
                "expected [N, C, H, W] or [N, H, W] images and [N] labels"
            )
        self.num_classes = int(self.labels.max()) + 1 if len(self.labels) else 1

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return self.images[index], int(self.labels[index])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[np.ndarray, int]]:
        """A chunk in one read of the (memory-mapped) arrays instead of one per item."""
        lo, hi = indices[0], indices[-1] + 1
        if list(indices) == list(range(lo, hi)):
            return list(zip(self.images[lo:hi], self.labels[lo:hi].tolist(), strict=True))
        return [self[i] for i in indices]


def _load(path: Path, mmap_mode: Any = None) -> Any:
    """``np.load``: an array, or a .npz file's arrays."""
    try:
        return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"dataset.path: cannot read {path}: {exc}") from None


def open_map_source(cfg: DatasetConfig, *, exact: bool = False) -> MapStyleSource:
    """The map-style dataset ``cfg`` names (``torch`` or ``arrays``) as a source."""
    if cfg.name == "arrays":
        assert cfg.path is not None  # DatasetConfig refuses arrays without a path
        path = Path(cfg.path).expanduser()
        return MapStyleSource(ArrayDataset(path), cfg, f"dataset.path={str(path)!r}", exact)
    assert cfg.factory is not None  # DatasetConfig refuses torch without a factory
    where = f"dataset.factory={cfg.factory!r}"
    factory = import_object(cfg.factory, "dataset.factory")
    try:
        dataset = factory(**cfg.kwargs)
    except Exception as exc:  # the user's code: any failure is reported as theirs, in one line
        raise ConfigError(f"{where} failed with dataset.kwargs={cfg.kwargs}: {type(exc).__name__}: {exc}") from None
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(f"{where} returned {type(dataset).__name__}, not a map-style Dataset (len() and [index])")
    return MapStyleSource(dataset, cfg, where, exact)


class MapStyleSource(DatasetSource):
    """A map-style dataset read in index order; ``where`` (the setting naming it) starts every error about it."""

    def __init__(self, dataset: Any, cfg: DatasetConfig, where: str, exact: bool) -> None:
        self.dataset, self.where, self.exact = dataset, where, exact
        self.name = cfg.source_name
        length = len(dataset)
        self.num_records = min(length, cfg.num_records or length)
        if self.num_records == 0:
            raise ConfigError(f"{where}: the dataset is empty")
        first = _image_array(_pair(dataset[0], 0, where)[0])
        if first.ndim != 3:
            raise ConfigError(f"{where}: item 0 has an image of shape {first.shape}; expected [C, H, W] or [H, W]")
        self.image_shape = (int(first.shape[0]), int(first.shape[1]), int(first.shape[2]))
        self.num_classes = cfg.num_classes or _class_count(dataset, where)

    def check_ends(self, head: int = 64) -> None:
        """Read the first ``head`` items and the last one: a dataset whose items do not fit fails before anything is
        launched (an item in between fails when a rank or the producer reads it, with the same error)."""
        self.read(0, min(head, self.num_records))
        self.read(self.num_records - 1, self.num_records)

    def kept_labels(self) -> Any:
        """The dataset's labels when it keeps them all in ``targets`` or ``labels`` (torchvision's ImageFolder, kbit's
        arrays), else None."""
        kept = next((getattr(self.dataset, a) for a in ("targets", "labels") if hasattr(self.dataset, a)), None)
        return kept if kept is not None and len(kept) == len(self.dataset) else None

    def labels_at(self, indices: np.ndarray) -> np.ndarray:
        """int64 labels of the items at ``indices``: from :meth:`kept_labels` without reading an image, else item by
        item."""
        kept = self.kept_labels()
        if kept is not None:
            return np.asarray(kept)[indices].astype(np.int64)
        return np.array(
            [_label(self.dataset[int(i)][1], int(i), self.num_classes, self.where) for i in indices], dtype=np.int64
        )

    def _chunks(self, start: int, stop: int, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for lo in range(start, stop, batch_size):
            yield self.read(lo, min(lo + batch_size, stop))

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Items ``[start, stop)``: images [n, C, H, W] (uint8, or float32 when ``exact`` and the dataset's are
        floats) and labels int64[n]; ConfigError naming the item whose image or label does not fit."""
        indices = range(start, stop)
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(list(indices)) if getitems is not None else [self.dataset[i] for i in indices]
        for index, item in zip(indices, items, strict=True):
            _pair(item, index, self.where)
        labels = self._labels([item[1] for item in items], start)
        return self._pixels(self._images([item[0] for item in items], start), start, stop), labels

    def _images(self, images: list[Any], start: int) -> np.ndarray:
        """The images stacked in one call (a read of 4,096 tensors took 50 ms converting each, 28 ms so); item by item
        only to name the one that does not fit."""
        try:
            tensors = all(isinstance(image, torch.Tensor) for image in images)
            stacked = (
                torch.stack(images).detach().cpu().numpy() if tensors else np.stack(list(map(_image_array, images)))
            )
        except (RuntimeError, ValueError):  # shapes differ: found below
            stacked = None
        if stacked is not None and stacked.ndim == 3:  # [n, H, W]
            stacked = stacked[:, None]
        if stacked is not None and stacked.shape[1:] == self.image_shape:
            return stacked
        for index, image in enumerate(map(_image_array, images), start):
            if image.shape != self.image_shape:
                raise ConfigError(
                    f"{self.where}: item {index} has an image of shape {image.shape}, item 0 one of "
                    f"{self.image_shape}; every image must have one shape"
                )
        return np.stack(list(map(_image_array, images)))

    def _labels(self, labels: list[Any], start: int) -> np.ndarray:
        """int64[n], checked at once; item by item only to name the one that is no class (or to read tensors)."""
        values = np.asarray(labels) if all(type(label) is int for label in labels) else None
        if values is not None and ((values >= 0) & (values < self.num_classes)).all():
            return values.astype(np.int64, copy=False)
        return np.array(
            [_label(label, index, self.num_classes, self.where) for index, label in enumerate(labels, start)],
            dtype=np.int64,
        )

    def _pixels(self, pixels: np.ndarray, start: int, stop: int) -> np.ndarray:
        """uint8 as they are; floats as they are when ``exact``, else checked to lie in [0, 1] and rounded to 8 bits."""
        if pixels.dtype == np.uint8:
            return pixels
        if not np.issubdtype(pixels.dtype, np.floating):
            raise ConfigError(
                f"{self.where}: items {start}..{stop - 1} hold {pixels.dtype} images; use uint8 or floats"
            )
        if self.exact:
            return pixels.astype(np.float32, copy=False)
        if pixels.min() < 0 or pixels.max() > 1:
            raise ConfigError(
                f"{self.where}: items {start}..{stop - 1} have pixels outside [0, 1] ({pixels.min():.3g} to "
                f"{pixels.max():.3g}); Kafka carries 8-bit pixels, so produce needs uint8 images or floats in [0, 1] "
                "(train.data: direct takes them as they are)"
            )
        return np.rint(pixels * 255).astype(np.uint8)


def _pair(item: Any, index: int, where: str) -> Any:
    """``item``, when it is an (image, label) pair."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ConfigError(f"{where}: item {index} is a {type(item).__name__}, not an (image, label) pair")
    return item


def _image_array(image: Any) -> np.ndarray:
    """An item's image as a [C, H, W] array (a tensor's, an array's, or a PIL image's [H, W] / [H, W, C] pixels)."""
    if isinstance(image, torch.Tensor):
        array = image.detach().cpu().numpy()
    else:
        array = np.asarray(image)
        if array.ndim == 3 and hasattr(image, "getbands"):  # a PIL image: channels last
            array = array.transpose(2, 0, 1)
    return array[None] if array.ndim == 2 else array


def _label(label: Any, index: int, num_classes: int, where: str) -> int:
    value = label
    if isinstance(label, torch.Tensor) and label.numel() == 1 or isinstance(label, np.ndarray) and label.size == 1:
        value = label.item()
    if isinstance(value, (bool, float)) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{where}: item {index} has the label {label!r}, not an integer class")
    if not 0 <= value < num_classes:
        raise ConfigError(
            f"{where}: item {index} has the label {value}, outside the {num_classes} classes 0..{num_classes - 1}"
        )
    return int(value)


def _class_count(dataset: Any, where: str) -> int:
    """The dataset's ``num_classes``, else the length of its ``classes`` (torchvision's datasets have those)."""
    count = getattr(dataset, "num_classes", None)
    if count is None and getattr(dataset, "classes", None) is not None:
        count = len(dataset.classes)
    if not isinstance(count, int) or count < 1 or isinstance(count, bool):
        raise ConfigError(
            f"{where}: the dataset has no `num_classes` or `classes` attribute to count its classes; "
            "set dataset.num_classes"
        )
    return count
