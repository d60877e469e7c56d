"""Run an entry function on every rank through Ray Train's TorchTrainer, with run_distributed's contract.

The hand-off is the one :func:`kbit_core.launch.distributor.run_distributed` uses: each rank gets the config as
JSON once and builds its own ``KbitConfig``, arguments travel as hand-off JSON, and rank 0 writes its result as
hand-off JSON into the launch's directory under the run directory (which, as under Spark, every host must share), so
the driver never unpickles a rank's result. Ray Train joins the torch process group before the entry runs
(``train.distributed.init_process_group`` then uses it as it is). What Ray itself moves (the entry function and
the loop config on the way in, a failed rank's exception on the way out) crosses Ray's own channel, pickled:
Ray's trust domain, as Spark's channel is TorchDistributor's; on a shared cluster keep Ray's token
authentication on (the default since Ray 2.52) and the cluster's ports off untrusted networks.

Failures come back as the launcher-independent types: :class:`WorkerFailedError` when a rank raised,
:class:`RayWorkerDiedError` (a :class:`RankDiedError`) when Ray found a rank's process dead without a Python
error. ``launch.ray_max_failures`` lets Ray Train restart the worker group itself; each restart resumes from
kbit's latest checkpoint, exactly as ``train.api``'s restart loop does.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from kbit_core import handoff, ray_env, stack_record
from kbit_core.config import KbitConfig, is_loopback
from kbit_core.errors import ConfigError, DistributedError
from kbit_core.launch.distributor import RankDiedError, RankEntry, WorkerFailedError
from kbit_core.launch.failures import is_peer_failure
from kbit_core.service import port_open

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"

_ACTOR_FIELD = re.compile(r"^\s*(pid|ip):\s*(\S+)", re.MULTILINE)


class RayWorkerDiedError(RankDiedError):
    """Ray found a rank's worker process dead without a Python error (killed, OOM, segfault, lost node).

    Ray does not relay the signal or exit code, so ``exit`` is None; ``pid`` is the dead process's, when Ray named it.
    """

    def __init__(self, message: str, *, rank: int, host: str | None, pid: int | None) -> None:
        WorkerFailedError.__init__(self, message, rank=f"rank{rank}", exception_type="ActorDiedError", host=host)
        self.exit, self.pid = None, pid


def ray_target(cfg: KbitConfig) -> tuple[str | None, Path | None]:
    """The Ray cluster to join and the token file its local stack recorded: ``launch.ray_address`` (no recorded
    token), else the head of a running local stack, else (None, None): a Ray runtime private to this process.
    Nothing else that listens on this machine is joined, on Ray's ports or any other."""
    if cfg.launch.ray_address is not None:
        return cfg.launch.ray_address, None
    head = stack_record.running_ray_head()
    return (None, None) if head is None else (head.address, head.token_file)


def ensure_ray(cfg: KbitConfig) -> None:
    """Connect this process to Ray once: ``launch.ray_address``, else the head a running local stack recorded
    (:mod:`kbit_core.stack_record`, whatever its workdir), else a private runtime.

    Every connection authenticates with a token (:mod:`kbit_core.ray_env`): a private runtime uses the one kbit keeps
    for the workdir (created on first use), a head is joined with its own. The private runtime (and a loopback head)
    keep every Ray socket on 127.0.0.1.
    """
    launch = cfg.launch
    address, recorded_token = ray_target(cfg)
    if address is not None and address.startswith("ray://"):
        _check_client_server(address)
    already = sys.modules.get("ray")
    if already is not None and already.is_initialized():
        return  # a process joins one cluster once, with the environment it joined with
    own_token = ray_env.own_token_file(cfg.run_dir)
    token = (
        ray_env.create_token(own_token)
        if address is None
        else ray_env.join_token_file(address, launch.ray_auth_token_file, recorded_token, own_token)
    )
    ray_env.activate(ray_env.ray_env(token, loopback=address is None or _is_local(address)))
    try:
        # the `ray` extra: optional, and seconds to import
        import ray
    except ImportError:
        raise ConfigError("launch.engine=ray needs Ray: pip install 'kbit[ray]'") from None
    if address is not None:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=True)
        return
    cpus_needed = launch.num_processes * launch.ray_resources_per_worker.get("CPU", 1.0)
    log.info("starting a Ray runtime private to this process on 127.0.0.1")
    # address="local": a new runtime even when a `ray start` head on this machine would be found otherwise.
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, int(cpus_needed + 0.999)),
        include_dashboard=False,
        object_store_memory=launch.ray_object_store_mb * 2**20,
        _node_ip_address="127.0.0.1",
    )


def _check_client_server(address: str) -> None:
    """Fail within seconds when nothing serves Ray Client at ``address``; Ray itself retries for about 30 s and then
    blames the network."""
    host, port = address.removeprefix("ray://").rsplit(":", 1)
    if not port_open(host.strip("[]"), int(port), timeout_s=5.0):
        raise ConfigError(
            f"launch.ray_address={address}: nothing accepts connections at {host}:{port}; a head serves Ray Client "
            f"only when started with `ray start --head --ray-client-server-port={port}` (kbit's own head: "
            f"launch.ray_client_server_port={port} with `kbit stack up --ray`)"
        )


def _is_local(address: str) -> bool:
    # 'auto' joins the cluster this machine is a node of, on whatever address that node has.
    return address != "auto" and is_loopback(address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]"))


def run_ray(entry: RankEntry, cfg: KbitConfig, *args: Any, result_type: Any = None) -> Any:
    """Run ``entry(cfg, *args)`` on ``launch.num_processes`` Ray Train workers; return rank 0's result.

    The same contract as :func:`kbit_core.launch.distributor.run_distributed`; ``entry`` must be importable by
    Ray's workers (they get this process's PYTHONPATH).

    Raises:
        WorkerFailedError: a rank raised (its traceback in the message) or died (:class:`RayWorkerDiedError`).
        DistributedError: Ray could not run the job (no resources, the cluster went away).
    """
    ensure_ray(cfg)  # first: Ray reads its environment at import
    # the `ray` extra: optional, and seconds to import
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    launch = cfg.launch
    launch_dir = cfg.run_dir / "ray" / f"launch-{uuid.uuid4().hex[:8]}"
    launch_dir.mkdir(parents=True)
    resources = dict(launch.ray_resources_per_worker)
    if launch.use_gpu:
        resources.setdefault("GPU", 1.0)
    trainer = TorchTrainer(
        _run_rank,
        train_loop_config={
            "entry": entry,
            "config_json": cfg.to_secret_json(),
            "args_json": handoff.dumps(list(args)),
            "launch_dir": str(launch_dir),
        },
        torch_config=TorchConfig(backend="nccl" if launch.use_gpu else "gloo", timeout_s=launch.timeout_s),
        scaling_config=ScalingConfig(
            num_workers=launch.num_processes, use_gpu=launch.use_gpu, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=launch_dir.name,
            storage_path=str(launch_dir.parent),
            failure_config=FailureConfig(max_failures=launch.ray_max_failures),
            worker_runtime_env=_worker_runtime_env(),
        ),
    )
    log.info("launching %s on Ray (%s)", getattr(entry, "__qualname__", entry), _describe(cfg))
    try:
        trainer.fit()
        text = (launch_dir / RESULT_FILE).read_text()
    except Exception as exc:
        raise _worker_failure(exc, cfg) from exc
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)
    result = handoff.loads(text)
    return result if result_type is None else TypeAdapter(result_type).validate_python(result)


def _worker_runtime_env() -> dict[str, Any]:
    # Ray's workers start from the raylet's environment, not this process's; torchrun children under Spark
    # inherit the driver's PYTHONPATH, so the same entry and model modules import under both launchers.
    path = os.environ.get("PYTHONPATH")
    return {"env_vars": {"PYTHONPATH": path}} if path else {}


def _describe(cfg: KbitConfig) -> str:
    launch = cfg.launch
    return (
        f"num_workers={launch.num_processes} use_gpu={launch.use_gpu} "
        f"resources_per_worker={launch.ray_resources_per_worker} address={launch.ray_address or 'local'}"
    )


def _run_rank(loop_config: dict[str, Any]) -> None:
    """Per-worker wrapper: build the config, resume from kbit's checkpoint on a Ray restart, run ``entry``."""
    # the `ray` extra: optional, and seconds to import
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    launch_dir = Path(loop_config["launch_dir"])
    cfg = KbitConfig.from_json(loop_config["config_json"])
    started = launch_dir / f"started-rank{rank}"
    if started.exists():
        # Ray Train restarted the worker group (FailureConfig): go on from where the failed attempt left off.
        log.warning("rank %d: Ray restarted the worker group; resuming from the latest checkpoint", rank)
        cfg = cfg.resuming("latest")
    started.touch()
    result = loop_config["entry"](cfg, *handoff.loads(loop_config["args_json"]))
    if rank == 0:
        (launch_dir / RESULT_FILE).write_text(handoff.dumps(result))


def _worker_failure(exc: Exception, cfg: KbitConfig) -> DistributedError:
    """One typed error for a failed Ray run: a rank's own Python error first, then a rank that died."""
    # the `ray` extra: optional, and seconds to import
    from ray.exceptions import RayActorError
    from ray.train import ControllerError, WorkerGroupError

    where = f"distributed run failed ({_describe(cfg)})"
    if isinstance(exc, WorkerGroupError):
        # A worker process that died reaches the controller as a failed health check wrapping Ray's actor error.
        failures = sorted(
            (rank, getattr(error, "health_check_failure", error)) for rank, error in exc.worker_failures.items()
        )
        died = [(rank, error) for rank, error in failures if isinstance(error, RayActorError)]
        raised = [(rank, error) for rank, error in failures if not isinstance(error, RayActorError)]
        own = [(rank, error) for rank, error in raised if not is_peer_failure(_text(error))]
        if own:
            return _raised(where, *own[0])
        if died:  # the peers' "connection reset" errors are its consequence
            return _died(where, died[0][0], str(died[0][1]))
        if raised:
            return _raised(where, *raised[0])
    if isinstance(exc, ControllerError) and isinstance(exc.controller_failure, RayActorError):
        # A worker that died while the group was starting: Ray does not say which rank it was.
        return _died(where, -1, str(exc.controller_failure))
    if isinstance(exc, FileNotFoundError):
        return DistributedError(f"{where}: rank 0 finished without writing its result ({exc})")
    return DistributedError(f"{where}; Ray said: {str(exc)[-3000:]}")


def _raised(where: str, rank: int, error: BaseException) -> WorkerFailedError:
    kind = f"{type(error).__module__}.{type(error).__qualname__}".removeprefix("builtins.")
    return WorkerFailedError(f"{where}; rank{rank} raised:\n{_text(error)}", rank=f"rank{rank}", exception_type=kind)


def _died(where: str, rank: int, ray_message: str) -> RayWorkerDiedError:
    fields = dict(_ACTOR_FIELD.findall(ray_message))
    pid = int(fields["pid"]) if fields.get("pid", "").isdigit() else None
    who = f"rank {rank}" if rank >= 0 else "a rank"
    message = (
        f"{where}: {who} on host {fields.get('ip', '?')} (pid {pid}) died with no Python error (an OOM kill, "
        f"a segfault, a kill -9 or a lost node); Ray said:\n{ray_message[-1500:]}"
    )
    return RayWorkerDiedError(message, rank=rank, host=fields.get("ip"), pid=pid)


def _text(error: BaseException) -> str:
    return "".join(traceback.format_exception(error)).rstrip()
