"""Ray's environment, set in this one place for every Ray process kbit starts or joins: token authentication with a
token kbit keeps itself (never ``~/.ray``), no usage reports, and loopback-only sockets for a local Ray.

Ray reads ``RAY_AUTH_MODE`` and the token once per process (its C++ config and token loader cache them), and its
cluster-mode switch at import. :func:`activate` therefore also refreshes those caches when ``ray`` is already
imported, so whichever module imported Ray first, this process uses the environment given here.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from kbit_core.errors import ConfigError

# Starting a worker group imports torch in every worker; on a busy 2-core machine that outlasts Ray's 60 s.
_COMMON = {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300"}
# Ray resolves a 127.0.0.1 node address to the machine's own address and then listens on every interface; with
# "cluster mode" off it keeps the loopback address for the node, its gRPC servers and the rendezvous (MASTER_ADDR).
# A head on the test bed must have it on: nodes on other hosts join it.
_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
_CLUSTER = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
# The Ray Client server forks a server per client from a process busy with gRPC threads; with gRPC's fork handlers
# on, the child often aborts ("Check failed: next_worker->state == KICKED", ray-project/ray#63202): here 5 of the
# first 6 connections after a head started, none of 15 with the handlers off. The child only execs, so needs none.
# Ray 2.60's `ray start --block` answers SIGTERM by draining the node for Ray Serve, up to 30 s, before it stops its
# processes; kbit runs no Serve replicas, so a node it started stops at once (`kbit stack down`, the bed's `down`).
NODE_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
HEAD_ENV = {**NODE_ENV, "GRPC_ENABLE_FORK_SUPPORT": "false"}
# Where a user keeps the token of a Ray cluster kbit did not start (Ray's own variables, read in that order).
USER_TOKEN_VARIABLES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# As this process found them, before activate() set any: a child kbit started inherits its parent's token here.
_USER_TOKEN = {name: os.environ.get(name) for name in USER_TOKEN_VARIABLES}


def own_token_file(run_dir: Path) -> Path:
    """The token of the Ray clusters kbit starts for ``run_dir`` (a workdir, or the test bed's directory)."""
    return run_dir / "ray" / "auth_token"


def create_token(path: Path) -> Path:
    """``path``, holding a new 256-bit token (mode 0600) unless it holds one already."""
    if path.is_file() and path.read_text().strip():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))
    os.chmod(path, 0o600)  # an existing empty file keeps its mode through O_CREAT
    return path


def ray_env(token_file: Path | None, *, loopback: bool) -> dict[str, str]:
    """The variables a Ray process (head, node, driver, Ray Client) needs to use the token in ``token_file`` (None:
    the token the user's environment names)."""
    token = {} if token_file is None else {"RAY_AUTH_TOKEN_PATH": str(token_file)}
    return {**_COMMON, **(_LOOPBACK if loopback else _CLUSTER), **token}


def join_token_file(address: str, configured: Path | None, recorded: Path | None, own: Path) -> Path | None:
    """The token file for joining the Ray cluster at ``address``, or None when the user's environment names the token.

    In order: ``launch.ray_auth_token_file``; Ray's own variables in the user's environment; the token file the
    running local stack recorded for its head (``recorded``, :mod:`kbit_core.stack_record`); the token kbit keeps
    for this workdir. Raises ConfigError naming the setting when none has it: joining never creates a token, a new
    one would be refused by the cluster.
    """
    if configured is not None:
        if not configured.is_file() or not configured.read_text().strip():
            raise ConfigError(
                f"launch.ray_auth_token_file={configured}: no token there (the Ray cluster at "
                f"{address} needs its token)"
            )
        return configured
    if any(_USER_TOKEN.values()):
        return None
    for candidate in (recorded, own):
        if candidate is not None and candidate.is_file() and candidate.read_text().strip():
            return candidate
    raise ConfigError(
        f"the Ray cluster at {address} asks for its token, and kbit has none for it: heads that "
        f"`kbit stack up --ray` starts keep theirs in <their workdir>/ray/auth_token (this workdir's: {own}); "
        f"for another cluster set launch.ray_auth_token_file (or RAY_AUTH_TOKEN_PATH) to its token file"
    )


def activate(env: dict[str, str]) -> None:
    """Make ``env`` this process's Ray environment, including in a Ray that was imported before.

    Without RAY_AUTH_TOKEN_PATH in ``env``, the user's own token variables are put back as the process found them.
    """
    os.environ.update(env)
    if "RAY_AUTH_TOKEN_PATH" in env:
        os.environ.pop("RAY_AUTH_TOKEN", None)  # Ray prefers the variable over the file
    else:
        for name, value in _USER_TOKEN.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if "ray" not in sys.modules:
        return
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "1"
    from ray._raylet import AuthenticationTokenLoader, Config  # Ray's caches of the mode and the token

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
