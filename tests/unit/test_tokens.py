"""The token-sequence payload: synthetic_tokens is deterministic and learnable, raw and protobuf carry its uint16 ids
bit for bit (stock and fast decoders), and what cannot carry them is refused in one line."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kbit_core.config import DatasetConfig, ModelConfig
from kbit_core.data.batching import to_batch
from kbit_core.datasets import open_source
from kbit_core.datasets.tokens import MOTIF_LENGTH
from kbit_core.errors import ConfigError, CorruptRecordError
from kbit_core.formats import get_codec
from kbit_core.train.models import build_model, check_vocabulary

SEQ_LEN, VOCAB = 24, 1000


def tokens(num_records: int = 3000, seed: int = 5, **kwargs: int) -> object:
    return open_source(
        DatasetConfig(
            name="synthetic_tokens", num_records=num_records, seed=seed, seq_len=SEQ_LEN, vocab_size=VOCAB, **kwargs
        )
    )


def read_all(source, batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    parts = list(source.batches(0, None, batch_size))
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))  # type: ignore[return-value]


def test_records_depend_on_seed_and_index_only_and_carry_their_class_motif() -> None:
    source = tokens()
    indices, ids, labels = read_all(source, 3000)
    assert ids.dtype == np.uint16 and ids.shape == (3000, SEQ_LEN) and source.image_shape == (SEQ_LEN,)
    assert ids.max() > 255 and ids.max() < VOCAB, "ids need uint16 and stay in the vocabulary"
    again = read_all(tokens(num_records=5000), 777)
    assert np.array_equal(again[1][:3000], ids) and np.array_equal(again[2][:3000], labels)
    assert not np.array_equal(read_all(tokens(seed=6), 3000)[1], ids)
    windows = np.lib.stride_tricks.sliding_window_view(ids, MOTIF_LENGTH, axis=1)  # [n, positions, motif]
    planted = (windows[:, :, None, :] == source.motifs[None, None]).all(axis=-1).any(axis=1)  # [n, classes]
    assert np.array_equal(planted.argmax(axis=1), labels) and (planted.sum(axis=1) == 1).all()
    assert np.bincount(labels, minlength=10).min() > 200


@pytest.mark.slow  # about 90 s of training on a loaded 2-core VM: the full suite runs it, the fast tier does not
def test_token_transformer_learns_the_motifs_from_ids() -> None:
    _, ids, labels = read_all(tokens(num_records=3000), 3000)
    x, y = to_batch(ids, labels, np.arange(len(labels)))[:2]
    assert x.dtype == torch.int64
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(name="token_transformer", kwargs={"vocab_size": VOCAB, "dim": 32, "heads": 2}), (SEQ_LEN,), 10
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    first_loss = None
    for _ in range(3):
        for batch in torch.randperm(2500, generator=torch.Generator().manual_seed(0)).split(64):
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            first_loss = first_loss if first_loss is not None else loss.item()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model.eval()(x[2500:]).argmax(dim=1) == y[2500:]).float().mean().item()
    assert accuracy >= 0.9, f"held-out accuracy {accuracy:.3f} after 3 epochs (first loss {first_loss:.2f})"


@pytest.mark.parametrize("decoder", ["stock", "fast"])
@pytest.mark.parametrize("fmt", ["raw", "protobuf"])
@pytest.mark.parametrize("records_per_message", [1, 5])
def test_raw_and_protobuf_bytes_carry_uint16_ids_bit_for_bit(fmt: str, records_per_message: int, decoder: str) -> None:
    indices, ids, labels = read_all(tokens(num_records=203), 203)
    codec = get_codec(fmt, "bytes", (SEQ_LEN,), records_per_message, num_classes=10, decoder=decoder, dtype="uint16")
    decoded = codec.decode(codec.encode(indices, ids, labels))
    assert decoded.pixels.dtype == np.uint16 and np.array_equal(decoded.pixels, ids)
    assert np.array_equal(decoded.labels, labels) and np.array_equal(decoded.indices, indices)
    assert getattr(codec, "deferred_batches", 0) == 0, "the fast path reads token values itself"


@pytest.mark.parametrize("fmt", ["raw", "protobuf"])
def test_token_and_image_codecs_differ_in_fingerprint_and_refuse_each_others_values(fmt: str) -> None:
    token_codec = get_codec(fmt, "bytes", (SEQ_LEN,), dtype="uint16")
    byte_codec = get_codec(fmt, "bytes", (SEQ_LEN,))
    assert token_codec.schema_fingerprint() != byte_codec.schema_fingerprint()
    values = byte_codec.encode(np.arange(2), np.ones((2, SEQ_LEN), np.uint8), np.zeros(2, np.int64))
    with pytest.raises(CorruptRecordError, match="cannot decode value 0 of 2"):
        token_codec.decode(values)


@pytest.mark.parametrize(
    ("fmt", "layout", "message"),
    [
        ("protobuf", "list", "protobuf/list carries pixels as floats in [0, 1]; uint16 records (token ids) need"),
        ("avro", "bytes", "avro/bytes carries uint8 pixels only; uint16 records (token ids) travel in raw or"),
        ("json", "bytes", "json/bytes carries uint8 pixels only"),
        ("bson", "bytes", "bson/bytes carries uint8 pixels only"),
        ("mongodb_avro", "bytes", "mongodb_avro/bytes carries uint8 pixels only"),
    ],
)
def test_layouts_that_cannot_carry_token_ids_are_refused_in_one_line(fmt: str, layout: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        get_codec(fmt, layout, (SEQ_LEN,), dtype="uint16")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"vocab_size": 70_000}, "dataset.vocab_size=70000: synthetic_tokens stores token ids as uint16"),
        ({"vocab_size": 30}, "dataset.vocab_size=30: synthetic_tokens stores token ids as uint16, so the vocab"),
        ({"seq_len": 3}, "dataset.seq_len=3: synthetic_tokens needs 4..65535 tokens per record"),
    ],
)
def test_a_dataset_its_ids_cannot_describe_is_refused_in_one_line(settings: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        open_source(DatasetConfig(name="synthetic_tokens", num_records=10, **settings))
    assert "\n" not in str(caught.value)


def test_a_model_whose_embedding_is_smaller_than_the_vocabulary_is_refused_in_one_line() -> None:
    small = build_model(ModelConfig(name="token_transformer", kwargs={"vocab_size": 500}), (SEQ_LEN,), 10)
    with pytest.raises(ConfigError, match=r"holds 500 ids, but .* dataset.vocab_size=1000; set train.model.kwargs"):
        check_vocabulary(small, VOCAB)
    check_vocabulary(
        build_model(ModelConfig(name="token_transformer", kwargs={"vocab_size": VOCAB}), (SEQ_LEN,), 10), VOCAB
    )


def test_image_models_refuse_token_sequences_naming_the_model_that_reads_them() -> None:
    with pytest.raises(ConfigError, match=r"train.model.name='cnn' classifies images.*use token_transformer"):
        build_model(ModelConfig(name="cnn"), (SEQ_LEN,), 10)
