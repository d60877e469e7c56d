"""The Ray head that `kbit stack up --ray` starts is found by a profile with another workdir: it joins the head with
the token kept in the stack's workdir, through the machine-local record (kbit_core/stack_record.py), and `kbit stack
down` takes the head out of the record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kbit_core import ray_env, stack_record
from kbit_core.config import KbitConfig
from kbit_core.stack import LocalStack
from tests.conftest import free_port

pytestmark = [pytest.mark.ray]

# In a process of its own (a process joins one Ray cluster once): join as a profile would, report what it joined.
JOIN = """
import json, os, sys
import ray
from kbit_core.config import KbitConfig
from kbit_core.launch.ray_train import ensure_ray
ensure_ray(KbitConfig.from_dict(json.loads(sys.argv[1])))
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "token": os.environ["RAY_AUTH_TOKEN_PATH"]}))
"""


def test_a_profile_with_another_workdir_joins_the_stacks_head_with_its_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a record of its own: stacks other tests left recorded in the suite's state dir are not this test's
    monkeypatch.setenv(stack_record.STATE_DIR_VARIABLE, str(tmp_path / "state"))
    stack_cfg = KbitConfig.from_dict(
        {
            "workdir": str(tmp_path / "stack"),
            "kafka": {"bootstrap_servers": f"127.0.0.1:{free_port()}"},  # no embedded broker: only the head starts
            "launch": {"ray_head_port": free_port(), "ray_client_server_port": free_port()},
        }
    )
    stack = LocalStack(stack_cfg)
    stack.up(broker_only=True, ray=True)
    try:
        head = stack_record.running_ray_head()
        assert head is not None and head.address == f"127.0.0.1:{stack_cfg.launch.ray_head_port}"
        profile = {"workdir": str(tmp_path / "profile"), "launch": {"engine": "ray"}}  # names no address, no token
        # a user's shell with no Ray variables (in the full suite this process holds the suite's own head's)
        env = {k: v for k, v in os.environ.items() if k not in (*ray_env.USER_TOKEN_VARIABLES, "RAY_ADDRESS")}
        done = subprocess.run(
            [sys.executable, "-c", JOIN, json.dumps(profile)], capture_output=True, text=True, timeout=300, env=env
        )
        assert done.returncode == 0, done.stderr[-3000:]
        joined = json.loads(done.stdout.splitlines()[-1])
        assert joined == {"gcs": head.address, "token": str(ray_env.own_token_file(stack_cfg.run_dir))}
        assert not ray_env.own_token_file(tmp_path / "profile").exists(), "joining never creates a token"
    finally:
        stack.down()
    assert stack_record.running_ray_head() is None
    assert stack_cfg.run_dir not in [s.workdir for s in stack_record.recorded_stacks()]
