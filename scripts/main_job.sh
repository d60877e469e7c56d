#!/usr/bin/env bash
# The main job after installing (README): start the local stack, run the smoke benchmark through Prefect,
# print its summary table and where to look, and exit non-zero when the flow run did not complete.
#
#   scripts/main_job.sh                      # the smoke benchmark
#   DEPLOYMENT=benchmark/nightly scripts/main_job.sh
#   scripts/main_job.sh --param 'overrides={"bench": {"iterations": 5}}'   # extra `deployment run` options
#
# The stack stays up afterwards (the UIs need it); stop it with `kbit stack down`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=${KBIT_BIN:-.venv/bin}
DEPLOYMENT=${DEPLOYMENT:-benchmark/smoke}
WATCH_TIMEOUT_S=${WATCH_TIMEOUT_S:-3600}

"$BIN/kbit" stack up
eval "$("$BIN/kbit" stack env)"

rc=0
"$BIN/prefect" deployment run "$DEPLOYMENT" --watch --watch-interval 2 --watch-timeout "$WATCH_TIMEOUT_S" "$@" \
    || rc=$?

# The flow publishes its summary as the markdown artifact kbit-benchmark-<profile>.
profile=${DEPLOYMENT#*/}
"$BIN/prefect" artifact inspect "kbit-benchmark-${profile}" --limit 1 -o json 2>/dev/null | "$BIN/python" -c '
import json, sys
from rich.console import Console
from rich.markdown import Markdown
text = sys.stdin.read().strip()
artifacts = json.loads(text) if text.startswith("[") else []
Console(width=None if sys.stdout.isatty() else 200).print(Markdown(artifacts[0]["data"]) if artifacts else "no benchmark summary was published")
' || true

echo "Prefect UI: ${PREFECT_API_URL%/api}    MLflow UI: ${MLFLOW_TRACKING_URI}"
if [ "$rc" -ne 0 ]; then
    echo "the ${DEPLOYMENT} run did not complete (exit code ${rc}): its logs are in the Prefect UI" \
         "and in 'prefect flow-run logs <id>' (the id is printed above)" >&2
fi
exit "$rc"
