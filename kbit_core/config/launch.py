"""How and where ranks are launched: the launch section and the address helpers it validates with."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from kbit_core.config.base import Section


class LaunchConfig(Section):
    master: str = Field("local[2]", description="Spark master: local[N], local-cluster[...], spark://host:port ...")
    num_processes: int = Field(2, ge=1)
    local_mode: bool = True
    use_gpu: bool = False
    timeout_s: int = Field(900, ge=10, description="Process-group timeout inside the workers.")
    executor_instances: int | None = Field(None, ge=1)
    executor_cores: int | None = Field(None, ge=1)
    executor_memory: str | None = None
    executor_gpu_amount: int | None = Field(None, ge=0)
    task_gpu_amount: float | None = Field(None, ge=0)
    gpu_discovery_script: Path | None = None
    driver_host: str = Field(
        "127.0.0.1",
        description="Address executors use to reach the driver "
        "(spark.driver.host); must be reachable from every executor host on a cluster.",
    )
    driver_bind_address: str = Field(
        "127.0.0.1",
        description="Address the driver's sockets bind to (spark.driver.bindAddress); 0.0.0.0 binds every interface.",
    )
    driver_port: int | None = Field(None, ge=1, le=65535, description="spark.driver.port; unset = random.")
    block_manager_port: int | None = Field(
        None, ge=1, le=65535, description="spark.driver.blockManager.port; unset = random."
    )
    spark_conf: dict[str, str] = Field(default_factory=dict)
    engine: Literal["spark", "ray", "torchrun"] = Field(
        "spark",
        description="Who starts the ranks: Spark's TorchDistributor, Ray Train's TorchTrainer (the `ray` "
        "extra), or plain `torchrun --standalone` on this host (no Spark or Java; one machine only).",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join: 'host:port' of a head, 'ray://host:port' "
        "(Ray Client) or 'auto'; unset = the head of a running `kbit stack up --ray` (found in the "
        "machine-local stack record, whatever its workdir), else a Ray runtime private to this process.",
    )
    ray_auth_token_file: Path | None = Field(
        None,
        description="File holding the token of the Ray cluster at "
        "launch.ray_address; unset: RAY_AUTH_TOKEN(_PATH) from the environment, "
        "else the token file the running local stack recorded for its head, else the token kbit keeps for the "
        "workdir's own heads (<workdir>/ray/auth_token).",
    )
    ray_head_port: int = Field(
        6390,
        ge=1,
        le=65535,
        description="GCS port of the local head `kbit stack up --ray` starts (bound to 127.0.0.1).",
    )
    ray_object_store_mb: int = Field(
        1024, ge=80, description="Object store of a Ray runtime kbit starts itself (Ray's default takes 30 % of RAM)."
    )
    ray_include_dashboard: bool = Field(False, description="Start Ray's dashboard (on 127.0.0.1) with the local head.")
    ray_client_server_port: int = Field(
        10001,
        ge=1024,
        le=65535,
        description="Port of the Ray Client server that "
        "Ray starts with every head (Ray's default 10001), on 127.0.0.1 for the local "
        "head: launch.ray_address 'ray://127.0.0.1:<port>' joins through it.",
    )
    ray_resources_per_worker: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Ray resources each rank reserves "
        "(ScalingConfig.resources_per_worker); launch.use_gpu adds one GPU.",
    )
    ray_max_failures: int = Field(
        0,
        ge=0,
        description="Ray Train's own worker-group restarts (FailureConfig); each "
        "resumes from kbit's latest checkpoint. checkpoint.max_restarts restarts on top.",
    )

    @model_validator(mode="after")
    def _check_launch(self) -> LaunchConfig:
        if self.engine == "ray":
            return self._check_ray()
        if self.engine == "torchrun":
            return self
        if self.master.startswith(("spark://", "yarn", "k8s://")):
            for name in ("driver_host", "driver_bind_address"):
                if is_loopback(getattr(self, name)):
                    raise ValueError(
                        f"launch.{name}={getattr(self, name)} is a loopback address, which executors on other hosts "
                        f"cannot reach with launch.master={self.master}; set launch.{name} to this machine's "
                        f"address on the cluster network"
                    )
        local_n = local_slots(self.master)
        if not self.local_mode and local_n is not None and local_n < self.num_processes:
            raise ValueError(
                f"launch.master={self.master} has {local_n} task slots but local_mode=False needs "
                f"num_processes={self.num_processes} barrier slots"
            )
        if self.use_gpu and not self.local_mode and self.master.startswith("local["):
            raise ValueError(
                "GPU task resources on a plain local[N] master hang Spark; use local_mode=true, "
                "local-cluster[...] or a cluster master"
            )
        if self.use_gpu and self.master.startswith("spark://") and self.gpu_discovery_script is None:
            raise ValueError(
                "use_gpu on a spark:// cluster needs gpu_discovery_script: a script path that exists "
                "on every executor host (a generated one would exist on the driver only)"
            )
        return self

    def _check_ray(self) -> LaunchConfig:
        bad = {name: amount for name, amount in self.ray_resources_per_worker.items() if amount < 0}
        if bad:
            raise ValueError(f"launch.ray_resources_per_worker has negative amounts {bad}")
        if self.ray_address is not None and not re.fullmatch(r"auto|(ray://)?[\w.\-\[\]:]+:\d+", self.ray_address):
            raise ValueError(f"launch.ray_address={self.ray_address!r} is not 'auto', 'host:port' or 'ray://host:port'")
        return self


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def local_slots(master: str) -> int | None:
    if master.startswith("local[") and master.endswith("]"):
        inner = master[6:-1]
        if inner == "*":
            return os.cpu_count() or 1
        try:
            return int(inner.split(",")[0])
        except ValueError:
            return None
    return None
