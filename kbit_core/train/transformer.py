"""Small transformers over the datasets' images: a ViT over patches and a token-sequence classifier.

Both are an embedding, a stack of pre-norm encoder blocks and a head on the class token, each a separate
top-level layer (``layers()``), so pipeline parallelism can cut the stack between any two of them and activation
checkpointing can recompute one block at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kbit_core.errors import ConfigError

ImageShape = tuple[int, int, int]


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate query, key, value and output projections.

    Separate projections (not nn.MultiheadAttention's fused one) are what tensor parallelism splits: q, k and v by
    output features (whole heads per rank), the output projection by input features. The head count is read off
    the projections' width at run time, so a rank holding some of the heads attends with those.
    """

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim, self.dropout = dim // heads, dropout
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape

        def heads(projected: Tensor) -> Tensor:  # [B, L, h·d] -> [B, h, L, d]
            return projected.view(batch, length, -1, self.head_dim).transpose(1, 2)

        attended = nn.functional.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), dropout_p=self.dropout if self.training else 0.0
        )
        return self.out(attended.transpose(1, 2).reshape(batch, length, -1))


class EncoderBlock(nn.Module):
    """Pre-norm self-attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Dropout(dropout), nn.Linear(dim * mlp_ratio, dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ClassTokenHead(nn.Module):
    """Layer norm, then logits from the class token (position 0)."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.norm(x[:, 0]))


class PatchEmbedding(nn.Module):
    """Non-overlapping patch × patch squares, projected to ``dim``, after a learned class token, plus positions."""

    def __init__(self, image_shape: ImageShape, patch: int | None, dim: int) -> None:
        super().__init__()
        channels, height, width = image_shape
        if patch is None:  # 7 for 28×28 digits (16 patches), 8 for 32×32 colour images
            patch = next(p for p in (7, 8, 4, 2, 1) if height % p == 0 and width % p == 0)
        if height % patch or width % patch:
            raise ConfigError(f"model 'vit': patch={patch} does not divide the {height}×{width} images")
        self.project = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.position = nn.Parameter(torch.randn(1, 1 + (height // patch) * (width // patch), dim) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.project(x).flatten(2).transpose(1, 2)  # [B, patches, dim]
        return torch.cat([self.cls.expand(len(x), -1, -1), tokens], dim=1) + self.position


class TokenEmbedding(nn.Module):
    """Token ids [B, L] embedded after a class token, plus positions. A record shape (L,) is a token dataset's,
    whose ids come straight in; images (C, H, W) become tokens first: each ``pool`` × ``pool`` square's mean
    intensity, quantised to ``vocab_size`` levels (so the digits train it too)."""

    def __init__(self, image_shape: tuple[int, ...], vocab_size: int, pool: int, dim: int) -> None:
        super().__init__()
        if len(image_shape) == 1:
            (length,) = image_shape
        else:
            _, height, width = image_shape
            if height % pool or width % pool:
                raise ConfigError(f"model 'token_transformer': pool={pool} does not divide the {height}×{width} images")
            length = (height // pool) * (width // pool)
        self.vocab_size, self.pool = vocab_size, pool
        self.embed = nn.Embedding(vocab_size, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.position = nn.Parameter(torch.randn(1, 1 + length, dim) * 0.02)

    def tokens(self, images: Tensor) -> Tensor:
        """[B, C, H, W] floats in [0, 1] → [B, (H/pool)·(W/pool)] token ids."""
        means = nn.functional.avg_pool2d(images.float().mean(dim=1, keepdim=True), self.pool).flatten(1)
        return (means.clamp(0, 1) * (self.vocab_size - 1)).round().long()

    def forward(self, x: Tensor) -> Tensor:
        ids = x if not x.is_floating_point() else self.tokens(x)
        embedded = self.embed(ids)
        return torch.cat([self.cls.expand(len(ids), -1, -1), embedded], dim=1) + self.position[:, : 1 + ids.shape[1]]


class EncoderClassifier(nn.Module):
    """embedding → blocks → head, kept as separate top-level layers (see the module docstring)."""

    def __init__(
        self, embedding: nn.Module, dim: int, depth: int, heads: int, mlp_ratio: int, dropout: float, num_classes: int
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"transformer: dim={dim} is not a multiple of heads={heads}")
        self.embedding = embedding
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, mlp_ratio, dropout) for _ in range(depth))
        self.head = ClassTokenHead(dim, num_classes)

    def layers(self) -> list[nn.Module]:
        """The model as a flat sequence of layers, applied one after another (pipeline stages cut it)."""
        return [self.embedding, *self.blocks, self.head]

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers():
            x = layer(x)
        return x


class ViT(EncoderClassifier):
    """A small Vision Transformer: 7×7 patches of a 28×28 digit make 16 tokens; 2 blocks of width 64 train on CPU in
    seconds per epoch. ``patch`` unset: the largest of 7, 8, 4, 2 that divides the images."""

    def __init__(
        self,
        image_shape: ImageShape,
        num_classes: int,
        patch: int | None = None,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(PatchEmbedding(image_shape, patch, dim), dim, depth, heads, mlp_ratio, dropout, num_classes)


class TokenTransformer(EncoderClassifier):
    """A token-sequence classifier: integer token ids [B, L] (or images turned into tokens, see TokenEmbedding).
    ``vocab_size`` must exceed every id of the data (a token dataset states its ``vocab_size``)."""

    def __init__(
        self,
        image_shape: tuple[int, ...],
        num_classes: int,
        vocab_size: int = 16,
        pool: int = 4,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: int = 2,
        dropout: float = 0.0,
    ) -> None:
        embedding = TokenEmbedding(image_shape, vocab_size, pool, dim)
        super().__init__(embedding, dim, depth, heads, mlp_ratio, dropout, num_classes)
