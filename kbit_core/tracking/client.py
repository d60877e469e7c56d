"""The MLflow client kbit uses for a config's store, logged in to the stack's MLflow server when ``stack.auth`` put
kbit's login in front of it (a refused login is one line, not a traceback from whichever call came first)."""

from __future__ import annotations

import base64
import os
import urllib.error
import urllib.request
from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.errors import TrackingError
from kbit_core.servers import logins

__all__ = ["check_login", "mlflow_client"]


def mlflow_client(cfg: KbitConfig) -> Any:
    """An MlflowClient for ``cfg``'s store, logged in to the stack's MLflow server when ``stack.auth`` put it behind
    kbit's login (unless this process was given a login of its own: MLFLOW_TRACKING_USERNAME/PASSWORD)."""
    from mlflow import MlflowClient  # mlflow takes seconds to import: only when a store is used

    uri = cfg.tracking_uri()
    if cfg.stack.auth and uri.startswith(("http://", "https://")):
        logins.log_in(cfg.run_dir)
        check_login(uri)
    return MlflowClient(tracking_uri=uri)


def check_login(uri: str) -> None:
    """One request as this process's MLflow login; a refused one is a one-line TrackingError (MLflow's own client
    would fail later, with a traceback, on whichever call came first)."""
    user = os.environ.get("MLFLOW_TRACKING_USERNAME", "")
    secret = os.environ.get("MLFLOW_TRACKING_PASSWORD", "")
    token = base64.b64encode(f"{user}:{secret}".encode()).decode()
    url = f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/search?max_results=1"
    request = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30):
            return
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise TrackingError(
                f"the MLflow server at {uri} refused the login of user {user!r} ({exc.code}): check "
                "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD, or the stack's state/credentials/login.password"
            ) from None
    except (urllib.error.URLError, OSError) as exc:
        raise TrackingError(f"the MLflow server at {uri} cannot be reached: {exc}") from None
