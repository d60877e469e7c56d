"""Storing a run's artifacts: an upload that fails (after MLflow's own retries) is one line naming the run, the
artifact and, on the team profile, kbit's object store when that is what no longer answers."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from kbit_core.config import KbitConfig
from kbit_core.errors import TrackingError
from kbit_core.service import port_open

__all__ = ["storing"]

MAX_CAUSE_CHARS = 300


def _cause(cfg: KbitConfig, exc: Exception) -> str:
    """Why an upload failed: kbit's s3proxy down (the MLflow server answers only 500 then), else MLflow's message."""
    st = cfg.stack
    if st.artifacts == "s3" and not port_open(st.host, st.s3_port, timeout_s=2.0):
        return (
            f"kbit's object store (s3proxy) at http://{st.host}:{st.s3_port} does not answer "
            f"(its log: {cfg.run_dir / 's3proxy.log'}; `kbit stack up` starts it again)"
        )
    return re.sub(r"\s+", " ", str(exc)).strip()[:MAX_CAUSE_CHARS]


@contextlib.contextmanager
def storing(cfg: KbitConfig, run_id: str, name: str) -> Iterator[None]:
    """Around an artifact upload to MLflow run ``run_id``: MLflow's exception becomes one TrackingError line."""
    # mlflow takes seconds to import: loaded only when a run is tracked
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        raise TrackingError(
            f"MLflow run {run_id}: storing artifact {name!r} through {cfg.tracking_uri()} failed: {_cause(cfg, exc)}"
        ) from None
