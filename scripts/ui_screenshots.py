"""Screenshots of the MLflow and Prefect UIs as a new user meets them, taken with headless Chromium.

    python scripts/ui_screenshots.py --mlflow http://127.0.0.1:5000 --prefect http://127.0.0.1:4200 \
        --experiment kbit-nightly --out screenshots/

MLflow: the landing page, the experiment as it opens, the newest benchmark parent run (its description), its summary.md in the
artifact viewer, and the compare view of its configurations. Prefect: the deployments list, the nightly
deployment (its schedule) and the newest benchmark artifact. Chromium comes from Debian's package
(`apt-get install chromium`); the IDs come from the servers' REST APIs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

WINDOW = "1600,1000"
TALL_WINDOW = "1600,2400"  # a run page keeps its description below params and tags
RENDER_BUDGET_MS = 15000  # virtual time the single-page apps get to fetch and render before the shot
MODEL_TRAINING = "workflowType=machine_learning"  # what kbit's links ask for (kbit_core.tracking.run_url)


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


def mlflow_pages(mlflow: str, experiment: str) -> dict[str, str]:
    """The MLflow pages worth seeing: experiment, newest benchmark parent, its summary, the compare view."""
    exp = api(
        f"{mlflow}/api/2.0/mlflow/experiments/get-by-name?" + urllib.parse.urlencode({"experiment_name": experiment})
    )["experiment"]
    eid = exp["experiment_id"]
    runs = api(
        f"{mlflow}/api/2.0/mlflow/runs/search",
        {
            "experiment_ids": [eid],
            "filter": "tags.`kbit.kind` = 'benchmark' and attributes.status = 'FINISHED'",
            "max_results": 1,
            "order_by": ["attributes.start_time DESC"],
        },
    ).get("runs", [])
    if not runs:
        raise SystemExit(f"experiment {experiment!r} holds no finished benchmark run yet")
    parent = runs[0]["info"]["run_id"]
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
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("no chromium on PATH: apt-get install -y chromium")
    args.out.mkdir(parents=True, exist_ok=True)
    pages = {**mlflow_pages(args.mlflow.rstrip("/"), args.experiment), **prefect_pages(args.prefect.rstrip("/"))}
    for name, url in pages.items():
        tall = name in ("mlflow_2_parent_run", "prefect_3_benchmark_artifact")
        shoot(browser, url, args.out / f"{name}.png", TALL_WINDOW if tall else WINDOW)


if __name__ == "__main__":
    main()
