"""A rank's loaders of several splits, built over one shared reader (one consumer, one bounds query for all)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from kbit_core.config import ClientName, KbitConfig
from kbit_core.data.loader import ShardLoader
from kbit_core.data.loader_modes import loader_reader
from kbit_core.data.reader import RangeReader
from kbit_core.errors import ConfigError
from kbit_core.kafka.manifest import Manifest, manifest_codec
from kbit_core.sharding import split_names


def make_split_loader(
    cfg: KbitConfig,
    manifest: Manifest,
    split: str,
    rank: int,
    world_size: int,
    *,
    epoch: int = 0,
    client: ClientName | None = None,
    reader: RangeReader | None = None,
) -> ShardLoader:
    """The loader of ``split`` for ``rank`` of ``world_size`` over the topic ``manifest`` describes.

    ``reader`` (another loader's ``.reader`` of the same topic) makes the loaders share one consumer (and its
    bounds check); its owner closes it. :func:`make_split_loaders` builds all splits that way.
    """
    if reader is None:
        return ShardLoader(
            cfg,
            manifest,
            split,
            rank,
            world_size,
            manifest_codec(manifest, cfg.reader.decoder, cfg.registry),
            epoch=epoch,
            client=client,
        )
    if reader.topic != manifest.topic or client not in (None, reader.client):
        wanted = f" with client {client}" if client else ""
        raise ConfigError(
            f"the loader of topic {manifest.topic!r}{wanted} cannot share the {reader.client} reader "
            f"of topic {reader.topic!r}"
        )
    return ShardLoader(cfg, manifest, split, rank, world_size, reader.codec, epoch=epoch, reader=reader)


class SplitLoaderSet(Mapping[str, ShardLoader]):
    """One rank's loaders of several splits over one shared :class:`RangeReader`: one consumer, which also asks the
    broker's offset bounds once when :meth:`connect` checks every split's ranges together."""

    def __init__(self, reader: RangeReader, loaders: Mapping[str, ShardLoader]) -> None:
        self.reader = reader
        self._loaders = dict(loaders)

    def __getitem__(self, split: str) -> ShardLoader:
        return self._loaders[split]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)

    def connect(self) -> None:
        """Open the consumer and check every split's planned ranges against the broker through it in one bounds
        query (with ``reader.workers: process`` or ``partitions`` only the check, closing the consumer after it:
        each loader's worker processes read with consumers of their own)."""
        ranges = [r for loader in self._loaders.values() for r in loader.shard.ranges]
        if self.reader.reader_cfg.workers != "thread":
            self.reader.check(ranges)
            self.reader.close()
        else:
            self.reader.connect(ranges)

    def close(self) -> None:
        for loader in self._loaders.values():
            loader.close()
        self.reader.close()

    def __enter__(self) -> SplitLoaderSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_split_loaders(
    cfg: KbitConfig,
    manifest: Manifest,
    rank: int,
    world_size: int,
    splits: Sequence[str] | None = None,
    *,
    epoch: int = 0,
    client: ClientName | None = None,
) -> SplitLoaderSet:
    """The loaders of ``splits`` (default: every split ``shard.split_rates`` defines) for ``rank``, sharing one
    reader. Nothing connects until :meth:`SplitLoaderSet.connect` or the first read."""
    names = split_names(cfg.shard.split_rates) if splits is None else tuple(splits)
    reader = loader_reader(cfg, manifest, client)
    return SplitLoaderSet(
        reader, {s: make_split_loader(cfg, manifest, s, rank, world_size, epoch=epoch, reader=reader) for s in names}
    )
