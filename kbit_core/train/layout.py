"""Which ranks read data, and for which data-parallel rank: plain data parallelism, pipeline stages, tensor parallel.

Under model parallelism several processes share one data-parallel rank's batches. Only one of them reads (a
pipeline's first stage; rank 0 of a tensor-parallel group), and the shard planner plans for the data-parallel
ranks, not for every process: the readers' loaders are the ones a data-parallel run of ``data_parallel_size``
ranks would have. The other processes iterate placeholders of the same length (their batches come from the
activations, or from their group's reader).

Layouts: a pipeline is pipe-major, as DeepSpeed lays it out (rank = stage × data-parallel size + data-parallel
rank); tensor parallelism is tensor-minor, as torch's device mesh ("dp", "tp") lays it out (rank = data-parallel
rank × tensor-parallel size + tensor-parallel rank), so a tensor-parallel group is consecutive ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from kbit_core.config import KbitConfig
from kbit_core.data.loader import LoaderStats
from kbit_core.train.distributed import DistEnv, broadcast_from_main
from kbit_core.train.loop import SplitLoaders

LoaderFactory = Callable[[KbitConfig, DistEnv], SplitLoaders]


@dataclasses.dataclass(frozen=True)
class DataLayout:
    reads: bool  # this process builds real loaders
    data_parallel_rank: int
    data_parallel_size: int
    model_parallel_rank: int  # the stage, or the rank within the tensor-parallel group


def data_layout(cfg: KbitConfig, env: DistEnv) -> DataLayout:
    """This process's place: which data-parallel rank's batches it trains, and whether it reads them itself."""
    stages, tensor_parallel = cfg.train.pipeline.stages, cfg.train.tensor_parallel.size
    data_parallel_size = env.world_size // (stages * tensor_parallel)
    if stages > 1:
        stage, data_parallel_rank = divmod(env.rank, data_parallel_size)
        return DataLayout(stage == 0, data_parallel_rank, data_parallel_size, stage)
    data_parallel_rank, tensor_parallel_rank = divmod(env.rank, tensor_parallel)
    return DataLayout(tensor_parallel_rank == 0, data_parallel_rank, data_parallel_size, tensor_parallel_rank)


class PlaceholderLoader:
    """Stands for a split's loader on a process that reads no data: as many (empty, empty) batches as the reader's
    loader yields, so every process runs the same steps."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.position = 0
        self.stats = LoaderStats()

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        empty = torch.empty(0)
        while self.position < self.length:
            self.position += 1
            yield empty, empty

    def set_epoch(self, epoch: int) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]

    def close(self) -> None:
        """Nothing to release."""


def layout_loaders(cfg: KbitConfig, env: DistEnv, make_loaders: LoaderFactory) -> SplitLoaders:
    """Collective: this process's loaders. Under plain data parallelism, ``make_loaders(cfg, env)``; under model
    parallelism, the readers' loaders for their data-parallel rank, and placeholders of the same lengths (rank 0's,
    sent to all) elsewhere."""
    if cfg.train.pipeline.stages == 1 and cfg.train.tensor_parallel.size == 1:
        return make_loaders(cfg, env)
    layout = data_layout(cfg, env)
    loaders = None
    if layout.reads:
        data_env = dataclasses.replace(env, rank=layout.data_parallel_rank, world_size=layout.data_parallel_size)
        loaders = make_loaders(cfg, data_env)
    shape = broadcast_from_main(
        {"lengths": {name: len(loader) for name, loader in loaders.splits().items()}, "plan": loaders.plan}
        if loaders is not None
        else None
    )
    if loaders is not None:
        return loaders
    return SplitLoaders(**{name: PlaceholderLoader(n) for name, n in shape["lengths"].items()}, plan=shape["plan"])
