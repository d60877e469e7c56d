"""Screenshots of the MLflow and Prefect UIs as a new user meets them, taken with headless Chromium.

    python scripts/ui_screenshots.py --mlflow http://127.0.0.1:5000 --prefect http://127.0.0.1:4200 \
        --experiment kbit-nightly --out screenshots/
    python scripts/ui_screenshots.py --training --mlflow http://127.0.0.1:5000 --experiment kbit-train-smoke \
        --out docs/images/

MLflow: the landing page, the experiment as it opens, the newest benchmark parent run (its description), its summary.md in the
artifact viewer, and the compare view of its configurations. Prefect: the deployments list, the nightly
deployment (its schedule) and the newest benchmark artifact. With --training, MLflow only: the newest training
run's page, its Model metrics tab, its logged model, and the registered model and version it became, each PNG
reduced to a 256-colour palette (docs keep them small). Chromium comes from Debian's package
(`apt-get install chromium`); the IDs come from the servers' REST APIs.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

WINDOW = "1600,1000"
TALL_WINDOW = "1600,2400"  # a run page keeps its description below params and tags
RENDER_BUDGET_MS = 15000  # virtual time the single-page apps get to fetch and render before the shot
MODEL_TRAINING = "workflowType=machine_learning"  # what kbit's links ask for (kbit_core.tracking.run_url)
# Real seconds a page gets before a live shot: the run page's charts load their histories after virtual time
# would have run out (--virtual-time-budget shoots them as spinners).
LIVE_WAIT_S = 20


def api(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method="POST" if data else "GET", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"null")


def shoot(browser: str, url: str, path: Path, window: str = WINDOW) -> Path:
    """One full-window PNG of ``url`` after the page had RENDER_BUDGET_MS of virtual time."""
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={window}",
            f"--virtual-time-budget={RENDER_BUDGET_MS}",
            f"--screenshot={path}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    print(f"{path.name}: {url}")
    return path


def shoot_live(browser: str, url: str, path: Path, window: str = WINDOW) -> Path:
    """One PNG of ``url`` after LIVE_WAIT_S real seconds, through the DevTools protocol of a headless Chromium."""
    from websockets.sync.client import connect  # comes with uvicorn (MLflow's server); only live shots need it

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as profile:
        chromium = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={window}"]
            + [f"--remote-debugging-port={port}", f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            page = _devtools_page(port)
            with connect(page["webSocketDebuggerUrl"], max_size=None) as ws:
                _devtools(ws, 1, "Page.navigate", {"url": url})
                time.sleep(LIVE_WAIT_S)
                shot = _devtools(ws, 2, "Page.captureScreenshot", {"format": "png"})
            path.write_bytes(base64.b64decode(shot["data"]))
        finally:
            chromium.terminate()
            chromium.wait(timeout=30)
    print(f"{path.name}: {url}")
    return path


def _devtools_page(port: int) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        try:
            return next(t for t in api(f"http://127.0.0.1:{port}/json") if t["type"] == "page")
        except (OSError, StopIteration):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _devtools(ws: Any, call_id: int, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """Send one DevTools command and return its result, passing over the events that arrive meanwhile."""
    ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
    while True:
        message = json.loads(ws.recv())
        if message.get("id") == call_id:
            return message["result"]


def newest_run(mlflow: str, eid: str, experiment: str, kind: str) -> str:
    """The id of the newest finished run of ``kind`` (tag ``kbit.kind``) in the experiment."""
    runs = api(
        f"{mlflow}/api/2.0/mlflow/runs/search",
        {
            "experiment_ids": [eid],
            "filter": f"tags.`kbit.kind` = '{kind}' and attributes.status = 'FINISHED'",
            "max_results": 1,
            "order_by": ["attributes.start_time DESC"],
        },
    ).get("runs", [])
    if not runs:
        raise SystemExit(f"experiment {experiment!r} holds no finished {kind} run yet")
    return runs[0]["info"]["run_id"]


def mlflow_pages(mlflow: str, experiment: str) -> dict[str, str]:
    """The MLflow pages worth seeing: experiment, newest benchmark parent, its summary, the compare view."""
    exp = api(
        f"{mlflow}/api/2.0/mlflow/experiments/get-by-name?" + urllib.parse.urlencode({"experiment_name": experiment})
    )["experiment"]
    eid = exp["experiment_id"]
    parent = newest_run(mlflow, eid, experiment, "benchmark")
    children = api(
        f"{mlflow}/api/2.0/mlflow/runs/search",
        {"experiment_ids": [eid], "filter": f"tags.mlflow.parentRunId = '{parent}'", "max_results": 100},
    ).get("runs", [])
    compare = urllib.parse.quote(json.dumps([c["info"]["run_id"] for c in children]))
    experiments = urllib.parse.quote(json.dumps([eid]))
    run = f"{mlflow}/#/experiments/{eid}/runs/{parent}"
    return {
        "mlflow_0_landing": f"{mlflow}/",
        "mlflow_1_experiment": f"{mlflow}/#/experiments/{eid}?{MODEL_TRAINING}",
        "mlflow_1_experiment_without_link_parameter": f"{mlflow}/#/experiments/{eid}",
        "mlflow_2_parent_run": f"{run}?{MODEL_TRAINING}",
        "mlflow_3_summary_md": f"{run}/artifacts/benchmark/summary.md?{MODEL_TRAINING}",
        "mlflow_4_compare": f"{mlflow}/#/compare-runs?runs={compare}&experiments={experiments}&{MODEL_TRAINING}",
        "mlflow_5_history_png": f"{run}/artifacts/history/history.png?{MODEL_TRAINING}",
    }


def training_pages(mlflow: str, experiment: str) -> dict[str, str]:
    """The pages a user opens after `kbit train`: the run (its description opens with the result and the curves'
    plot), its Model metrics tab, its logged model, the registered model and the version it became."""
    eid = api(
        f"{mlflow}/api/2.0/mlflow/experiments/get-by-name?" + urllib.parse.urlencode({"experiment_name": experiment})
    )["experiment"]["experiment_id"]
    run_id = newest_run(mlflow, eid, experiment, "train")
    versions = api(
        f"{mlflow}/api/2.0/mlflow/model-versions/search?" + urllib.parse.urlencode({"filter": f"run_id = '{run_id}'"})
    ).get("model_versions", [])
    run = f"{mlflow}/#/experiments/{eid}/runs/{run_id}"
    pages = {
        "mlflow_train_0_landing": f"{mlflow}/",
        "mlflow_train_1_experiment": f"{mlflow}/#/experiments/{eid}",
        "mlflow_train_2_run": f"{run}?{MODEL_TRAINING}",
        "mlflow_train_3_model_metrics": f"{run}/model-metrics?{MODEL_TRAINING}",
    }
    logged = api(
        f"{mlflow}/api/2.0/mlflow/logged-models/search",
        {"experiment_ids": [eid], "filter": f"source_run_id = '{run_id}'"},
    ).get("models", [])
    if logged:
        pages["mlflow_train_4_logged_model"] = f"{mlflow}/#/experiments/{eid}/models/{logged[0]['info']['model_id']}"
    if versions:
        name, version = versions[0]["name"], versions[0]["version"]
        pages["mlflow_train_5_registered_model"] = f"{mlflow}/#/models/{urllib.parse.quote(name)}"
        pages["mlflow_train_6_model_version"] = f"{mlflow}/#/models/{urllib.parse.quote(name)}/versions/{version}"
    return pages


def shrink(path: Path) -> None:
    """``path`` rewritten with a 256-colour palette: a UI screenshot's few colours, at a third of the bytes."""
    from PIL import Image  # Pillow comes with matplotlib; only this step needs it

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256)
    small.save(path, optimize=True)


def prefect_pages(prefect: str) -> dict[str, str]:
    """The Prefect pages worth seeing: deployments, the scheduled deployment, the newest benchmark artifact."""
    deployments = api(f"{prefect}/api/deployments/filter", {"limit": 50})
    scheduled = next((d for d in deployments if d.get("schedules")), None)
    collections = api(f"{prefect}/api/artifacts/latest/filter", {"limit": 50})
    summaries = [a for a in collections if (a.get("key") or "").startswith("kbit-benchmark")]
    summary = max(summaries, key=lambda a: a["updated"], default=None)
    pages = {"prefect_1_deployments": f"{prefect}/deployments"}
    if scheduled:
        pages["prefect_2_scheduled_deployment"] = f"{prefect}/deployments/deployment/{scheduled['id']}"
    if summary:
        pages["prefect_3_benchmark_artifact"] = f"{prefect}/artifacts/artifact/{summary['latest_id']}"
    return pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mlflow", default="http://127.0.0.1:5000")
    parser.add_argument("--prefect", default="http://127.0.0.1:4200")
    parser.add_argument("--experiment", default="kbit-nightly")
    parser.add_argument("--out", type=Path, default=Path("screenshots"))
    parser.add_argument("--training", action="store_true", help="the newest training run's pages (MLflow only)")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("no chromium on PATH: apt-get install -y chromium")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.training:
        for name, url in training_pages(args.mlflow.rstrip("/"), args.experiment).items():
            tall = name in ("mlflow_train_2_run", "mlflow_train_3_model_metrics")
            shrink(shoot_live(browser, url, args.out / f"{name}.png", TALL_WINDOW if tall else WINDOW))
        return
    pages = {**mlflow_pages(args.mlflow.rstrip("/"), args.experiment), **prefect_pages(args.prefect.rstrip("/"))}
    for name, url in pages.items():
        tall = name in ("mlflow_2_parent_run", "prefect_3_benchmark_artifact")
        shoot(browser, url, args.out / f"{name}.png", TALL_WINDOW if tall else WINDOW)


if __name__ == "__main__":
    main()
