"""synthetic_digits is a real learning problem: a small CNN and the original's MLP learn it quickly on CPU,
and it is not solved by a single step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from kbit_core.config import DatasetConfig
from kbit_core.datasets import open_source

NUM_TRAIN, NUM_TEST = 4000, 1000


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    source = open_source(DatasetConfig(name="synthetic_digits", num_records=NUM_TRAIN + NUM_TEST, seed=7))
    _, images, labels = next(source.batches(batch_size=NUM_TRAIN + NUM_TEST))
    x = torch.from_numpy(images.astype(np.float32) / 255)
    y = torch.from_numpy(labels)
    return x[:NUM_TRAIN], y[:NUM_TRAIN], x[NUM_TRAIN:], y[NUM_TRAIN:]


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def original_mlp() -> nn.Module:
    """The DDP_KBIT notebook's model: 784-512-512-10."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, max_steps: int | None = None) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(0)
    steps = 0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for batch in order.split(64):
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                return


@pytest.fixture(autouse=True)
def one_thread() -> None:
    # Deterministic, and polite to the other processes sharing a small CI machine.
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_small_cnn_reaches_90_percent(digits) -> None:
    x_train, y_train, x_test, y_test = digits
    model = small_cnn()
    train(model, x_train, y_train, epochs=3)
    assert accuracy(model, x_test, y_test) >= 0.90


def test_original_mlp_learns_it(digits) -> None:
    x_train, y_train, x_test, y_test = digits
    model = original_mlp()
    train(model, x_train, y_train, epochs=3)
    assert accuracy(model, x_test, y_test) >= 0.85


def test_one_step_is_not_enough(digits) -> None:
    x_train, y_train, x_test, y_test = digits
    model = small_cnn()
    train(model, x_train, y_train, epochs=1, max_steps=1)
    assert accuracy(model, x_test, y_test) < 0.5
