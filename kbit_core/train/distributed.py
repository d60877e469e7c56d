"""The per-rank distributed environment: validated env variables, device and backend, seeding, init and teardown."""

from __future__ import annotations

import gc
import logging
import os
import random
import socket
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kbit_core import handoff
from kbit_core.errors import DistributedError

log = logging.getLogger(__name__)

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# The pid of the process that started this rank (torchrun's agent), as the rank wrapper saw it on entry.
LAUNCHER_PID_ENV = "KBIT_LAUNCHER_PID"


def launcher_pid() -> int:
    """The process that started this rank: recorded by the rank wrapper as the rank began (a launcher that dies
    during set-up is still told apart from the process that inherits the rank), else this process's parent now
    (Ray's worker processes, whose parent is the raylet)."""
    return int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as torchrun / TorchDistributor describe it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    device: torch.device

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_var(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"environment variable {name}={raw!r} is not an integer") from None


def read_env(use_gpu: bool, environ: Mapping[str, str] | None = None) -> DistEnv:
    """Validate the torchrun variables and pick this rank's device (cuda:LOCAL_RANK with use_gpu, else cpu).

    Raises:
        DistributedError: a variable is missing, not an integer, out of range, or the GPU is unavailable.
    """
    environ = os.environ if environ is None else environ
    missing = [name for name in ENV_VARS if not environ.get(name)]
    if missing:
        raise DistributedError(
            f"distributed environment incomplete: {', '.join(missing)} not set (launch through "
            "TorchDistributor or torchrun, which set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)"
        )
    rank, world_size, local_rank, port = (
        _int_var(environ, n) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    )
    if world_size < 1:
        raise DistributedError(f"WORLD_SIZE={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise DistributedError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    if not 0 <= local_rank <= rank:
        raise DistributedError(
            f"LOCAL_RANK={local_rank} is inconsistent with RANK={rank} (needs 0 <= LOCAL_RANK <= RANK)"
        )
    if not 1 <= port <= 65535:
        raise DistributedError(f"MASTER_PORT={port} is not a TCP port")
    if use_gpu:
        if not torch.cuda.is_available():
            raise DistributedError("launch.use_gpu=true but CUDA is not available in this worker")
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise DistributedError(
                f"LOCAL_RANK={local_rank} but only {visible} CUDA device(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); two ranks would share a GPU"
            )
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistEnv(rank, world_size, local_rank, environ["MASTER_ADDR"], port, device)


def import_deepspeed(device: torch.device) -> ModuleType | None:
    """DeepSpeed, or None with a warning so the caller falls back to DDP."""
    if device.type == "cpu":
        # DeepSpeed picks its accelerator once, at import; without this it would choose CUDA whenever one exists.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        # deepspeed loads only for DeepSpeed runs (seconds to import, and it picks an accelerator)
        import deepspeed
    except Exception as exc:  # an installed but broken DeepSpeed raises more than ImportError
        warnings.warn(
            f"deepspeed.enabled=true but deepspeed cannot be imported ({exc}); falling back to DDP",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return deepspeed


def init_process_group(env: DistEnv, timeout_s: int, deepspeed: ModuleType | None = None) -> None:
    """Join the job's process group (through DeepSpeed's comm layer when ``deepspeed`` is given).

    Ray Train's TorchTrainer joins the group before the entry runs; DDP then uses that group as it is, and
    DeepSpeed's ``init_distributed`` adopts it.
    """
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    timeout = timedelta(seconds=timeout_s)
    if deepspeed is None and dist.is_initialized():
        return
    if deepspeed is None:
        dist.init_process_group(
            env.backend, timeout=timeout, device_id=env.device if env.device.type == "cuda" else None
        )
        return
    if env.device.type == "cpu":
        # On CPU, init_distributed JIT-compiles the shm all-reduce op, used only for inference; skipping it
        # avoids a ~20 s compile and a hard failure on machines without a C++ toolchain.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=env.backend, timeout=timeout, auto_mpi_discovery=False)


def seed_everything(seed: int, rank: int, deterministic: bool, device: torch.device) -> None:
    """Seed python, numpy and torch with ``seed + rank``; optionally force deterministic kernels."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    if deterministic:
        if device.type == "cuda":
            # cuBLAS needs a fixed workspace to be deterministic; it must be set before the first matmul.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False
        # Some CUDA kernels (adaptive pooling backward, scatter-add) have no deterministic version; on GPU they
        # warn instead of failing the run. CPU training is fully deterministic.
        torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
        # Deterministic mode also NaN-fills every torch.empty by default, a debugging aid that turns DeepSpeed's
        # large preallocated gradient buckets into seconds per backward; results stay deterministic without it.
        torch.utils.deterministic.fill_uninitialized_memory = False


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (TorchDistributor's local mode returns whichever rank writes last)."""
    payload = _to_bytes(obj if dist.get_rank() == 0 else None)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    dist.broadcast(length, src=0)
    if dist.get_rank() != 0:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=payload.device)
    dist.broadcast(payload, src=0)
    return _from_bytes(payload)


def gather_to_main(obj: Any, env: DistEnv) -> list[Any] | None:
    """Every rank's ``obj`` as a list on rank 0 (None elsewhere); small hand-off-encodable values only."""
    gathered = all_gather(obj, env)
    return gathered if env.is_main else None


def all_gather(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's small ``obj`` on every rank, sent as hand-off JSON (never pickled: it crosses sockets)."""
    payload = _to_bytes(obj)
    lengths = [torch.zeros(1, dtype=torch.int64, device=payload.device) for _ in range(env.world_size)]
    dist.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device))
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=payload.device)
    padded[: payload.numel()] = payload
    buffers = [torch.empty(longest, dtype=torch.uint8, device=payload.device) for _ in range(env.world_size)]
    dist.all_gather(buffers, padded)
    return [_from_bytes(buffer[: int(n.item())]) for buffer, n in zip(buffers, lengths)]


def _collective_device() -> torch.device:
    # nccl moves only CUDA tensors; gloo only CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(handoff.dumps(obj).encode()), dtype=torch.uint8).to(_collective_device())


def _from_bytes(payload: torch.Tensor) -> Any:
    return handoff.loads(payload.cpu().numpy().tobytes().decode())


def rank_identity(env: DistEnv) -> dict[str, Any]:
    """Where this rank runs: its rank, its host's name and the address it reaches the rendezvous host from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        # Connecting a UDP socket sends nothing; it only picks the interface that routes to MASTER_ADDR.
        probe.connect((env.master_addr, env.master_port))
        address = probe.getsockname()[0]
    return {"rank": env.rank, "host": socket.gethostname(), "address": address}


def teardown() -> None:
    """Leave the process group cleanly.

    The caller must already have dropped its model, DDP wrapper and optimizer: destroying the group while
    they are alive makes gloo abort at interpreter exit (SIGABRT), which hangs torchelastic's exit barrier.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
