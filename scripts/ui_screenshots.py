"""Screenshots of the MLflow and Prefect UIs as a new user meets them, taken with headless Chromium.

    python scripts/ui_screenshots.py --mlflow http://127.0.0.1:5000 --prefect http://127.0.0.1:4200 \
        --experiment kbit-nightly --out screenshots/
    python scripts/ui_screenshots.py --training --mlflow http://127.0.0.1:5000 --experiment kbit-train-smoke \
        --out docs/images/
    eval "$(kbit stack env -c deployments/profiles/team.yaml)"; python scripts/ui_screenshots.py --login --out docs/images/

MLflow: the landing page, the experiment as it opens, the newest benchmark parent run (its description), its summary.md in the
artifact viewer, and the compare view of its configurations. Prefect: the deployments list, the nightly
deployment (its schedule) and the newest benchmark artifact. With --training, MLflow only: the newest training
run's page, its Model metrics tab, its logged model, and the registered model and version it became, each PNG
reduced to a 256-colour palette (docs keep them small). With --login: what a browser sees on servers behind a
login (the team profile's `stack.auth`): MLflow's landing page and Prefect's dashboard without the login (MLflow
answers 401 and asks for a basic-auth login, Prefect's UI shows its login page), then logged in.

Servers behind a login are logged in to with the login kbit's clients use (`kbit stack env` exports it):
MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD for MLflow (its REST API and, as an Authorization header, the
browser), PREFECT_API_AUTH_STRING for Prefect (its REST API and, typed into the UI's login page, the browser);
MLFLOW_TRACKING_URI and PREFECT_API_URL are the default URLs. No password is ever on a command line or printed.
Chromium comes from Debian's package (`apt-get install chromium`), driven through its DevTools protocol; the IDs
come from the servers' REST APIs.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

WINDOW = (1600, 1000)
TALL_WINDOW = (1600, 2400)  # a run page keeps its description below params and tags
PAGE_DEADLINE_S = 120  # how long a page may take to load and go quiet (a busy machine, MLflow's login hash per request)
SETTLE_S = 2  # after the network went quiet: what the single-page apps fetched gets rendered
MODEL_TRAINING = "workflowType=machine_learning"  # what kbit's links ask for (kbit_core.tracking.run_url)
# Real seconds a training page gets before its shot: the run page's charts load their histories after the network
# first goes quiet (a shot then shows them as spinners).
LIVE_WAIT_S = 20
# Prefect's login page (both of its UIs): one password field, for the server's auth string (user:password)
PASSWORD_FIELD = "document.querySelector('input[type=password]')"
LOGIN_HINT = (
    "log in with what `kbit stack env` exports (MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD for MLflow, "
    "PREFECT_API_AUTH_STRING for Prefect)"
)

Headers = dict[str, str]


def basic_auth(login: str | None) -> Headers:
    """The Authorization header that sends ``login`` (user:password), or none."""
    return {"Authorization": "Basic " + base64.b64encode(login.encode()).decode()} if login else {}


def mlflow_login() -> Headers:
    """MLflow's basic-auth login from the environment kbit's clients use, as a header (none without it)."""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    return basic_auth(f"{user}:{password}" if user and password else None)


def secrets_in_env() -> list[str]:
    """The logins of the environment in every form this script sends them: what no message may show."""
    found = [os.environ.get(name) or "" for name in ("MLFLOW_TRACKING_PASSWORD", "PREFECT_API_AUTH_STRING")]
    headers = [mlflow_login(), basic_auth(found[1] or None)]
    return [s for s in found + [h["Authorization"].split()[1] for h in headers if h] if s]


def masked(text: str) -> str:
    for secret in secrets_in_env():
        text = text.replace(secret, "***")
    return text


def api(url: str, body: dict[str, Any] | None = None, headers: Headers | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url,
        data=data,
        method="POST" if data else "GET",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise SystemExit(
                f"{url} answered {exc.code} ({'a wrong login' if headers else 'no login'}): {LOGIN_HINT}"
            ) from None
        raise


def mlflow_api(url: str, body: dict[str, Any] | None = None) -> Any:
    return api(url, body, mlflow_login())


def prefect_api(url: str, body: dict[str, Any] | None = None) -> Any:
    return api(url, body, basic_auth(os.environ.get("PREFECT_API_AUTH_STRING")))


class Chromium:
    """One headless Chromium with a profile of its own, driven through its DevTools protocol: each shot opens its
    page afresh (with the headers given for its server), waits until the page is quiet, and captures the window."""

    def __init__(self, binary: str, cancel_logins: bool = False) -> None:
        """``cancel_logins``: answer each login the browser is asked for with Cancel, as a user without the login
        does (the page then shows the server's 401 answer); otherwise a headless Chromium shows an empty error page."""
        self.binary = binary
        self.cancel_logins = cancel_logins
        self.events: list[dict[str, Any]] = []
        self.calls = 0
        self.replies = REPLY_IDS

    def __enter__(self) -> Chromium:
        from websockets.sync.client import connect  # comes with uvicorn (MLflow's server); only the browser needs it

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # Chromium's helper processes may still write to its profile as it exits: leftovers are not worth an error
        self.profile = tempfile.TemporaryDirectory(prefix="kbit-chromium-", ignore_cleanup_errors=True)
        self.process = subprocess.Popen(
            [self.binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
            + [f"--remote-debugging-port={port}", f"--user-data-dir={self.profile.name}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.ws = connect(_devtools_page(port)["webSocketDebuggerUrl"], max_size=None)
        for method in ("Page.enable", "Network.enable", "Runtime.enable"):
            self.call(method)
        self.call("Page.setLifecycleEventsEnabled", {"enabled": True})
        if self.cancel_logins:  # every request passes through Fetch, so that the login prompts come to this script
            self.call("Fetch.enable", {"handleAuthRequests": True})
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.ws.close()
        self.process.terminate()
        self.process.wait(timeout=30)
        self.profile.cleanup()

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one DevTools command and return its result, keeping the events that arrive meanwhile."""
        self.calls += 1
        self.ws.send(json.dumps({"id": self.calls, "method": method, "params": params or {}}))
        while True:
            message = self.receive()
            if message.get("id") == self.calls:
                if "error" in message:
                    raise RuntimeError(f"Chromium's DevTools {method}: {message['error'].get('message')}")
                return message["result"]

    def receive(self, timeout: float | None = None) -> dict[str, Any]:
        """The next message from the browser; a request Fetch paused goes on, a login prompt is cancelled."""
        message = json.loads(self.ws.recv(timeout))
        self.events.append(message)
        params = message.get("params", {})
        if message.get("method") == "Fetch.requestPaused":
            self._reply("Fetch.continueRequest", {"requestId": params["requestId"]})
        elif message.get("method") == "Fetch.authRequired":
            cancel = {"response": "CancelAuth"}
            self._reply("Fetch.continueWithAuth", {"requestId": params["requestId"], "authChallengeResponse": cancel})
        return message

    def _reply(self, method: str, params: dict[str, Any]) -> None:
        """A command whose answer no one waits for (its id out of :meth:`call`'s range)."""
        self.replies += 1
        self.ws.send(json.dumps({"id": self.replies, "method": method, "params": params}))

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})["result"].get("value")

    def wait_for(self, expression: str, what: str) -> None:
        """Poll ``expression`` in the page until it is true; ``what`` names it when it never gets there."""
        deadline = time.monotonic() + PAGE_DEADLINE_S
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise SystemExit(f"{what}: not there after {PAGE_DEADLINE_S} s")
            time.sleep(0.5)

    def open(self, url: str, headers: Headers, window: tuple[int, int]) -> dict[str, Any]:
        """Load ``url`` anew (every request with ``headers``) and wait until its network is quiet; its document's
        response (status, headers)."""
        width, height = window
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height} | NOT_MOBILE)
        self.call("Network.setExtraHTTPHeaders", {"headers": headers})
        self.call("Page.navigate", {"url": "about:blank"})  # a new document, also where only the #route changes
        self.events.clear()
        loader = self.call("Page.navigate", {"url": url})["loaderId"]
        deadline = time.monotonic() + PAGE_DEADLINE_S
        while not any(_is_event(e, "Page.lifecycleEvent", loaderId=loader, name="networkIdle") for e in self.events):
            if time.monotonic() > deadline:
                raise SystemExit(f"{url}: still loading after {PAGE_DEADLINE_S} s")
            try:
                self.receive(timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                pass
        documents = [
            e["params"]["response"]
            for e in self.events
            if _is_event(e, "Network.responseReceived", loaderId=loader, type="Document")
        ]
        return documents[-1] if documents else {}

    def shoot(
        self,
        url: str,
        path: Path,
        headers: Headers | None = None,
        window: tuple[int, int] = WINDOW,
        settle_s: float = SETTLE_S,
        ready: str | None = None,
    ) -> Path:
        """One PNG of ``url``'s window once it is quiet, ``ready`` (a JavaScript condition) holds, and ``settle_s``
        passed; one line says what the server answered and where the page ended up."""
        document = self.open(url, headers or {}, window)
        if ready:
            self.wait_for(ready, f"{url}: {ready}")
        time.sleep(settle_s)
        shot = self.call("Page.captureScreenshot", {"format": "png"})
        path.write_bytes(base64.b64decode(shot["data"]))
        headers_back = {name.lower(): value for name, value in (document.get("headers") or {}).items()}
        challenge = headers_back.get("www-authenticate")
        print(
            f"{path.name}: {url} -> HTTP {document.get('status')}"
            + (f", asks for a login ({challenge})" if challenge else "")
            + f", at {self.evaluate('location.href')}"
        )
        return path

    def log_in_to_prefect(self, prefect: str) -> None:
        """Type PREFECT_API_AUTH_STRING into the login page of Prefect's UI and submit it, as a user does: the UI
        keeps it in the browser's local storage and sends it with every request of the pages after. A login the
        server refuses ends here, before the browser."""
        auth_string = required("PREFECT_API_AUTH_STRING", f"Prefect at {prefect}")
        api(f"{prefect}/api/admin/version", headers=basic_auth(auth_string))
        self.open(f"{prefect}/", {}, WINDOW)
        self.wait_for(f"{PASSWORD_FIELD} !== null", f"the login page of Prefect's UI at {prefect}")
        self.evaluate(f"{PASSWORD_FIELD}.focus()")
        self.call("Input.insertText", {"text": auth_string})
        self.evaluate(f"{PASSWORD_FIELD}.form.requestSubmit()")
        self.wait_for(
            "!location.pathname.endsWith('/login')",
            f"Prefect's UI at {prefect} did not take the login in PREFECT_API_AUTH_STRING",
        )


REPLY_IDS = 1_000_000  # ids of the commands sent while the browser is waited on: never one that call() waits for
NOT_MOBILE = {"deviceScaleFactor": 1, "mobile": False}
# What shows that each UI rendered its first page for a logged-in user
MLFLOW_SHOWN = "document.body.innerText.includes('Experiments')"
PREFECT_SHOWN = "!location.pathname.endsWith('/login') && document.body.innerText.includes('Dashboard')"


def _is_event(message: dict[str, Any], method: str, **params: str) -> bool:
    return message.get("method") == method and all(message["params"].get(k) == v for k, v in params.items())


def _devtools_page(port: int) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        try:
            return next(t for t in api(f"http://127.0.0.1:{port}/json") if t["type"] == "page")
        except (OSError, StopIteration):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def newest_run(mlflow: str, eid: str, experiment: str, kind: str) -> str:
    """The id of the newest finished run of ``kind`` (tag ``kbit.kind``) in the experiment."""
    runs = mlflow_api(
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
    exp = mlflow_api(
        f"{mlflow}/api/2.0/mlflow/experiments/get-by-name?" + urllib.parse.urlencode({"experiment_name": experiment})
    )["experiment"]
    eid = exp["experiment_id"]
    parent = newest_run(mlflow, eid, experiment, "benchmark")
    children = mlflow_api(
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
    eid = mlflow_api(
        f"{mlflow}/api/2.0/mlflow/experiments/get-by-name?" + urllib.parse.urlencode({"experiment_name": experiment})
    )["experiment"]["experiment_id"]
    run_id = newest_run(mlflow, eid, experiment, "train")
    versions = mlflow_api(
        f"{mlflow}/api/2.0/mlflow/model-versions/search?" + urllib.parse.urlencode({"filter": f"run_id = '{run_id}'"})
    ).get("model_versions", [])
    run = f"{mlflow}/#/experiments/{eid}/runs/{run_id}"
    pages = {
        "mlflow_train_0_landing": f"{mlflow}/",
        "mlflow_train_1_experiment": f"{mlflow}/#/experiments/{eid}",
        "mlflow_train_2_run": f"{run}?{MODEL_TRAINING}",
        "mlflow_train_3_model_metrics": f"{run}/model-metrics?{MODEL_TRAINING}",
    }
    logged = mlflow_api(
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
    deployments = prefect_api(f"{prefect}/api/deployments/filter", {"limit": 50})
    scheduled = next((d for d in deployments if d.get("schedules")), None)
    collections = prefect_api(f"{prefect}/api/artifacts/latest/filter", {"limit": 50})
    summaries = [a for a in collections if (a.get("key") or "").startswith("kbit-benchmark")]
    summary = max(summaries, key=lambda a: a["updated"], default=None)
    pages = {"prefect_1_deployments": f"{prefect}/deployments"}
    if scheduled:
        pages["prefect_2_scheduled_deployment"] = f"{prefect}/deployments/deployment/{scheduled['id']}"
    if summary:
        pages["prefect_3_benchmark_artifact"] = f"{prefect}/artifacts/artifact/{summary['latest_id']}"
    return pages


def prefect_asks_for_login(prefect: str) -> bool:
    """Whether Prefect's server keeps its API behind an auth string (its UI then opens on a login page)."""
    return api(f"{prefect}/ui-settings").get("auth") is not None


def required(name: str, server: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise SystemExit(f"{server} asks for a login and {name} is not set: {LOGIN_HINT}")
    return value


def login_pages(browser: str, mlflow: str, prefect: str, out: Path) -> None:
    """What a browser sees on servers behind a login: each UI's first page without the login, then with it."""
    required("MLFLOW_TRACKING_PASSWORD", f"MLflow at {mlflow}")
    with Chromium(browser, cancel_logins=True) as anonymous:
        shrink(anonymous.shoot(f"{mlflow}/", out / "login_0_mlflow_without_login.png"))
        login_page = f"{PASSWORD_FIELD} !== null"
        shrink(anonymous.shoot(f"{prefect}/", out / "login_1_prefect_without_login.png", ready=login_page))
    with Chromium(browser) as user:
        user.log_in_to_prefect(prefect)
        shrink(user.shoot(f"{mlflow}/", out / "login_2_mlflow_logged_in.png", mlflow_login(), ready=MLFLOW_SHOWN))
        shrink(user.shoot(f"{prefect}/", out / "login_3_prefect_logged_in.png", ready=PREFECT_SHOWN))


def benchmark_pages(browser: str, mlflow: str, prefect: str, experiment: str, out: Path) -> None:
    """The benchmark's MLflow and Prefect pages, logged in to each server that asks for it."""
    with Chromium(browser) as chromium:
        for name, url in mlflow_pages(mlflow, experiment).items():
            tall = name == "mlflow_2_parent_run"
            chromium.shoot(url, out / f"{name}.png", mlflow_login(), TALL_WINDOW if tall else WINDOW)
        if prefect_asks_for_login(prefect):
            chromium.log_in_to_prefect(prefect)
        for name, url in prefect_pages(prefect).items():
            tall = name == "prefect_3_benchmark_artifact"
            chromium.shoot(url, out / f"{name}.png", window=TALL_WINDOW if tall else WINDOW)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    parser.add_argument(
        "--mlflow", default=tracking_uri if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    )
    prefect_api_url = os.environ.get("PREFECT_API_URL", "").removesuffix("/api")
    parser.add_argument("--prefect", default=prefect_api_url or "http://127.0.0.1:4200")
    parser.add_argument("--experiment", default="kbit-nightly")
    parser.add_argument("--out", type=Path, default=Path("screenshots"))
    parser.add_argument("--training", action="store_true", help="the newest training run's pages (MLflow only)")
    parser.add_argument("--login", action="store_true", help="each UI's first page without the login, then with it")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("no chromium on PATH: apt-get install -y chromium")
    args.out.mkdir(parents=True, exist_ok=True)
    mlflow, prefect = args.mlflow.rstrip("/"), args.prefect.rstrip("/")
    if args.login:
        login_pages(browser, mlflow, prefect, args.out)
    elif args.training:
        with Chromium(browser) as chromium:
            for name, url in training_pages(mlflow, args.experiment).items():
                window = TALL_WINDOW if name in ("mlflow_train_2_run", "mlflow_train_3_model_metrics") else WINDOW
                shrink(chromium.shoot(url, args.out / f"{name}.png", mlflow_login(), window, LIVE_WAIT_S))
    else:
        benchmark_pages(browser, mlflow, prefect, args.experiment, args.out)


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:  # one line, with no password in it, instead of a traceback that could quote one
        sys.exit(masked(f"ui_screenshots: {type(exc).__name__}: {exc}"))
