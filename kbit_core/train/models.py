"""Model registry: built-in image classifiers (MLP, CNN, ResNet, ViT, token transformer) returning logits, plus user models named by import path."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from kbit_core.config import ModelConfig
from kbit_core.errors import ConfigError
from kbit_core.train.transformer import ImageShape, TokenTransformer, ViT
from kbit_core.train.user_code import import_object

ModelBuilder = Callable[..., nn.Module]


class MLP(nn.Module):
    """The original notebook's network: flatten → 512 → 512 → classes, returning logits (no softmax: defect 12)."""

    def __init__(self, image_shape: ImageShape, num_classes: int, hidden: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(image_shape), hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class CNN(nn.Module):
    """The classic two-conv PyTorch-example network, ending in logits so CrossEntropyLoss applies log-softmax once."""

    def __init__(self, image_shape: ImageShape, num_classes: int, hidden: int = 50, dropout: float = 0.5) -> None:
        super().__init__()
        channels, height, width = image_shape
        # Two (conv k5, no padding) + (max-pool 2) stages shrink each side to ((s - 4) // 2 - 4) // 2.
        out_h, out_w = (((s - 4) // 2 - 4) // 2 for s in (height, width))
        if out_h < 1 or out_w < 1:
            raise ConfigError(f"model 'cnn' needs images of at least 16×16, got {height}×{width}")
        self.features = nn.Sequential(
            nn.Conv2d(channels, 10, kernel_size=5),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Conv2d(10, 20, kernel_size=5),
            nn.Dropout2d(dropout),
            nn.MaxPool2d(2),
            nn.ReLU(),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(20 * out_h * out_w, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with batch norm and an identity (or 1×1 projection) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """A small CIFAR-style ResNet; global average pooling makes it work at any input size (3×32×32, 1×28×28)."""

    def __init__(
        self,
        image_shape: ImageShape,
        num_classes: int,
        widths: tuple[int, ...] = (16, 32, 64),
        blocks_per_stage: int = 1,
    ) -> None:
        super().__init__()
        channels = image_shape[0]
        layers: list[nn.Module] = [
            nn.Conv2d(channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        ]
        in_width = widths[0]
        for stage, width in enumerate(widths):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(in_width, width, stride))
                in_width = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_width, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


_BUILTIN: dict[str, ModelBuilder] = {
    "mlp": MLP,
    "cnn": CNN,
    "resnet": ResNet,
    "vit": ViT,
    "token_transformer": TokenTransformer,
}
_TAKES_TOKENS = ("token_transformer",)


def model_names() -> tuple[str, ...]:
    """Names of the built-in models (user models are addressed as 'package.module:factory')."""
    return tuple(_BUILTIN)


def check_vocabulary(model: nn.Module, vocab_size: int) -> None:
    """ConfigError when the model's first token embedding holds fewer ids than a token dataset's ``vocab_size``
    (the first batch would otherwise fail inside ``nn.Embedding`` with an index error)."""
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None and embedding.num_embeddings < vocab_size:
        raise ConfigError(
            f"train.model: its token embedding holds {embedding.num_embeddings} ids, but the dataset has "
            f"dataset.vocab_size={vocab_size}; set train.model.kwargs.vocab_size >= {vocab_size}"
        )


def build_model(spec: ModelConfig, image_shape: ImageShape | tuple[int], num_classes: int) -> nn.Module:
    """Build the classifier named by ``spec`` for images of ``image_shape`` (C, H, W), or token sequences (L,).

    Args:
        spec: ``cfg.train.model``: a built-in name (mlp, cnn, resnet) or 'package.module:factory',
            plus keyword arguments for the builder.
        image_shape: (channels, height, width) of one input image, or (length,) of one token sequence (whose
            ids only token_transformer and user models take).
        num_classes: Number of output logits.

    Returns:
        A module mapping float32[B, C, H, W] to logits float32[B, num_classes].
    """
    builder = import_object(spec.name, "train.model.name", _BUILTIN)
    if len(image_shape) == 1 and spec.name in _BUILTIN and spec.name not in _TAKES_TOKENS:
        raise ConfigError(
            f"train.model.name={spec.name!r} classifies images, but the dataset's records are token sequences of "
            f"shape {tuple(image_shape)}; use {' or '.join(_TAKES_TOKENS)}"
        )
    kwargs: dict[str, Any] = dict(spec.kwargs)
    try:
        model = builder(image_shape=tuple(image_shape), num_classes=num_classes, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"train.model: cannot build {spec.name!r} with kwargs {kwargs}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"train.model.name={spec.name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model
