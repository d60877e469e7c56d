"""Model registry: built-in shapes and logits, user models by import path, clear errors."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from kbit_core.config import ModelConfig
from kbit_core.errors import ConfigError
from kbit_core.train.models import build_model, model_names


@pytest.mark.parametrize("name", model_names())
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)], ids=["mnist", "colour"])
def test_builtin_models_map_images_to_logits(name: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name), shape, num_classes=10).eval()
    out = model(torch.rand(4, *shape))
    assert out.shape == (4, 10) and out.dtype == torch.float32
    # Logits, not probabilities: the original applied softmax before CrossEntropyLoss (defect 12).
    assert not torch.allclose(out.exp().sum(dim=1), torch.ones(4), atol=1e-3)
    assert not torch.allclose(out.sum(dim=1), torch.ones(4), atol=1e-3)


def test_mlp_is_the_original_784_512_512_10() -> None:
    model = build_model(ModelConfig(name="mlp"), (1, 28, 28), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 512), (512, 512), (512, 10)]


def test_cnn_is_the_classic_two_conv_net_on_mnist() -> None:
    model = build_model(ModelConfig(name="cnn"), (1, 28, 28), 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [(1, 10, (5, 5)), (10, 20, (5, 5))]
    assert [(m.in_features, m.out_features) for m in linears] == [(320, 50), (50, 10)]


def test_kwargs_reach_the_builder() -> None:
    model = build_model(ModelConfig(name="resnet", kwargs={"widths": [8, 16], "blocks_per_stage": 2}), (3, 32, 32), 5)
    assert model.head[-1].in_features == 16 and model(torch.rand(2, 3, 32, 32)).shape == (2, 5)


def test_cnn_rejects_images_too_small() -> None:
    with pytest.raises(ConfigError, match="at least 16×16, got 8×8"):
        build_model(ModelConfig(name="cnn"), (1, 8, 8), 10)


def test_user_model_by_import_path(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("kbit_test_user_models")

    def tiny(image_shape: tuple[int, int, int], num_classes: int, width: int = 4) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(image_shape[0] * image_shape[1] * image_shape[2], num_classes))

    module.tiny = tiny
    module.not_a_model = lambda image_shape, num_classes: "oops"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    model = build_model(ModelConfig(name="kbit_test_user_models:tiny", kwargs={"width": 8}), (1, 4, 4), 3)
    assert model(torch.rand(2, 1, 4, 4)).shape == (2, 3)
    with pytest.raises(ConfigError, match="returned str, not a torch.nn.Module"):
        build_model(ModelConfig(name="kbit_test_user_models:not_a_model"), (1, 4, 4), 3)
    with pytest.raises(ConfigError, match="cannot build .* with kwargs {'depth': 3}"):
        build_model(ModelConfig(name="kbit_test_user_models:tiny", kwargs={"depth": 3}), (1, 4, 4), 3)


@pytest.mark.parametrize(
    "name, message",
    [
        ("transformer", "neither mlp/cnn/resnet/vit/token_transformer nor 'package.module:factory'"),
        ("no_such_package_kbit.models:build", "cannot import 'no_such_package_kbit.models'"),
        ("kbit_core.train.models:missing", "has no callable 'missing'"),
    ],
)
def test_unknown_models_raise_config_error(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_model(ModelConfig(name=name), (1, 28, 28), 10)


def test_vit_cuts_digits_into_16_patches_and_exposes_its_layers() -> None:
    model = build_model(ModelConfig(name="vit", kwargs={"depth": 3}), (1, 28, 28), 10)
    assert model.embedding.position.shape == (1, 1 + 16, 64)
    layers = model.layers()
    assert len(layers) == 1 + 3 + 1  # embedding, blocks, head: the cut points a pipeline chooses from
    x = torch.rand(3, 1, 28, 28)
    out = x
    for layer in layers:
        out = layer(out)
    torch.testing.assert_close(out, model(x))


def test_token_transformer_reads_token_ids_and_images_as_tokens() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="token_transformer", kwargs={"vocab_size": 8}), (1, 28, 28), 10).eval()
    images = torch.rand(2, 1, 28, 28)
    ids = model.embedding.tokens(images)
    assert ids.shape == (2, 49) and ids.dtype == torch.int64 and 0 <= ids.min() and ids.max() < 8
    torch.testing.assert_close(model(images), model(ids))
    assert model(torch.randint(0, 8, (2, 20))).shape == (2, 10)  # any sequence up to the position table's length


def test_vit_rejects_a_patch_that_does_not_divide_the_image() -> None:
    with pytest.raises(ConfigError, match="patch=5 does not divide the 28×28 images"):
        build_model(ModelConfig(name="vit", kwargs={"patch": 5}), (1, 28, 28), 10)
