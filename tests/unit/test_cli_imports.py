"""The CLI's import budget: `kbit --help` and a config error answer without importing torch, Spark, Ray, MLflow or
the other heavy libraries; each command imports what it runs only after its config has loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "pyspark", "ray", "mlflow", "deepspeed", "pandas", "scipy", "matplotlib", "prefect", "pyarrow")

# Runs the CLI in a fresh interpreter with the given arguments and prints which heavy libraries it imported.
PROBE = """
import json, sys
from kbit_core.cli import app
try:
    app(sys.argv[1:], standalone_mode=False)
except BaseException as exc:
    pass
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))))
"""


def heavy_imports(*args: str) -> tuple[list[str], str]:
    probe = f"HEAVY = {HEAVY!r}\n{PROBE}"
    done = subprocess.run(
        [sys.executable, "-c", probe, *args], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_help_imports_no_heavy_library() -> None:
    imported, _ = heavy_imports("--help")
    assert imported == []


@pytest.mark.parametrize(
    "command",
    [
        ["train"],
        ["bench-train"],
        ["bench-placement"],
        ["bench"],
        ["bench-stream"],
        ["bench-data"],
        ["produce"],
        ["history"],
        ["stack", "status"],
        ["cluster", "status"],
    ],
)
def test_a_config_error_answers_before_any_heavy_import(command: list[str], tmp_path: Path) -> None:
    profile = tmp_path / "bad.yaml"
    profile.write_text("train:\n  epochs: -3\n")
    imported, stderr = heavy_imports(*command, "--config", str(profile))
    assert "train.epochs" in stderr
    assert imported == []
