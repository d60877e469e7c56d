"""README.md's command blocks run as written, in order, on a fresh clone, as a new user would run them: in a `git
clone` of this checkout, with an empty HOME, against services of the test's own (free ports) and at small sizes,
both given through `KBIT_SET`, which README documents.

Two kinds of block are not run, each named with its reason in the output (`pytest -rA` or `-s` shows it):
- the `scripts/run.sh` block: installing, running the main job and running this whole suite are what CI itself
  runs, and this test runs inside that suite;
- a block README marks with `<!-- not run: reason -->` on the line before it.
The clone's `.venv` is the suite's own environment (a link to it): installing is `scripts/run.sh`'s part, above.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, USER_SERVICE_VARIABLES, free_port, processes_mentioning

_BLOCK = re.compile(r"(?:<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*\n)?```bash\n(?P<body>.*?)```", re.DOTALL)
CI_RUNS = "scripts/run.sh"
# Small sizes for every profile the blocks load (each is a documented setting, given through KBIT_SET).
SMALL = {
    "dataset.num_records": 2000,
    "train.epochs": 1,
    "stream.duration_s": 15,
    "stream.idle_timeout_s": 5,  # how long the ranks wait after the stream's last record before they stop
    "stream.eval_records": 500,
}
# Variables of the user's shell that would point the blocks at other services, tokens or settings.
USERS = (*USER_SERVICE_VARIABLES, "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "KBIT_STATE_DIR")


@dataclass(frozen=True)
class Block:
    body: str
    skip: str | None  # why it is not run; None: it runs


def readme_blocks(text: str) -> list[Block]:
    """README's ```bash blocks in order, each with the reason it is not run (or None)."""
    blocks = []
    for match in _BLOCK.finditer(text):
        body, reason = match["body"], match["reason"]
        if reason is None and CI_RUNS in body:
            reason = f"the {CI_RUNS} commands: CI runs them, and this test runs inside the suite they start"
        blocks.append(Block(body, reason))
    return blocks


def test_readme_blocks_are_read_with_their_reasons() -> None:
    text = "a\n```bash\nbash scripts/run.sh test\n```\n<!-- not run: needs root -->\n```bash\nkbit cluster up\n```\n"
    text += "text\n```bash\nkbit stack up\nkbit stack down\n```\n```python\nprint()\n```\n"
    found = readme_blocks(text)
    assert [b.body for b in found] == [
        "bash scripts/run.sh test\n",
        "kbit cluster up\n",
        "kbit stack up\nkbit stack down\n",
    ]
    assert "CI runs them" in str(found[0].skip) and [b.skip for b in found[1:]] == ["needs root", None]
    readme = readme_blocks((REPO / "README.md").read_text())
    assert [b for b in readme if b.skip is None], "README has command blocks to run"


def blocks_env(clone: Path, home: Path) -> dict[str, str]:
    """The user's environment, but an empty HOME, the clone's code and the test's own ports and sizes."""
    ports = {
        "kafka.embedded.port": free_port(),
        "kafka.embedded.controller_port": free_port(),
        "stack.prefect_port": free_port(),
        "stack.mlflow_port": free_port(),
        "launch.ray_head_port": free_port(),
        "launch.ray_client_server_port": free_port(),
    }
    settings = " ".join(shlex.quote(f"{key}={value}") for key, value in {**ports, **SMALL}.items())
    env = {k: v for k, v in os.environ.items() if k not in USERS and not k.startswith("XDG_")}
    return {**env, "HOME": str(home), "PYTHONPATH": str(clone), "KBIT_SET": settings}


def script(blocks: list[Block]) -> str:
    """The blocks to run as one shell session (a block's `source` and `&` carry into the next), each announced."""
    parts = ["set -eo pipefail"]
    for number, block in enumerate(blocks, 1):
        if block.skip is None:
            parts += [f"echo '== README block {number}' >&2", block.body]
    return "\n".join(parts) + "\n"


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.ray
@pytest.mark.prefect
@pytest.mark.timeout(3000)  # the blocks' own limit (2,400 s) and the clean-up after it
def test_every_readme_command_block_runs_as_written_on_a_fresh_clone(tmp_path: Path) -> None:
    clone, home = tmp_path / "clone", tmp_path / "home"
    home.mkdir()
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=300)
    (clone / ".venv").symlink_to(sys.prefix)
    blocks = readme_blocks((clone / "README.md").read_text())
    for number, block in enumerate(blocks, 1):
        if block.skip is not None:
            print(f"README block {number} not run: {block.skip}")
    env = blocks_env(clone, home)
    log = tmp_path / "blocks.log"
    with log.open("w") as out:
        session = subprocess.Popen(
            ["bash", "-c", script(blocks)],
            cwd=clone,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        returncode = session.wait(timeout=2400)
        assert returncode == 0, f"README's blocks failed ({returncode}):\n{log.read_text()[-6000:]}"
    finally:
        with contextlib.suppress(ProcessLookupError):  # the session's commands, a background producer too
            os.killpg(session.pid, signal.SIGKILL)
        session.wait(timeout=60)
        subprocess.run(["bash", "-c", "source .venv/bin/activate && kbit stack down"], cwd=clone, env=env, timeout=300)
        for pid in processes_mentioning(str(clone)):  # what the blocks started and `down` did not stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
