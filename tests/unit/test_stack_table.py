"""`kbit stack status` in an 80-column terminal: every URL stays on one line (a link to click), log paths fold."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from kbit_core.cli.stack import _table
from kbit_core.service import ServiceStatus


def test_urls_stay_whole_and_paths_fold_in_a_narrow_terminal() -> None:
    services = [
        ServiceStatus(
            "prefect-server", True, 23232, "http://127.0.0.1:4200", Path("/srv/kbit/.kbit/prefect-server.log")
        ),
        ServiceStatus("mlflow-server", True, 23929, "http://127.0.0.1:5000", Path("/srv/kbit/.kbit/mlflow-server.log")),
        ServiceStatus("prefect-worker", False, None, None, None),
    ]
    console = Console(width=80, record=True)
    console.print(_table(services))
    text = console.export_text()
    assert "http://127.0.0.1:4200" in text and "http://127.0.0.1:5000" in text
    # the whole path is there, though folded over lines
    assert "/srv/kbit/.kbit/prefect-server.log" in "".join(
        line.split("│")[-2].strip() for line in text.splitlines() if line.count("│") > 2
    )
