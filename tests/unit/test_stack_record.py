"""The machine-local record of a running stack (kbit_core/stack_record.py): a profile with any workdir finds the
stack's Ray head and its token there, only while the head runs, and the suite never finds a user's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbit_core import ray_env, stack_record
from kbit_core.config import KbitConfig
from kbit_core.launch.ray_train import ray_target
from tests.conftest import TEST_HOME, USER_SERVICE_VARIABLES


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    """A socket listening on a free loopback port: a service that answers on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(stack_record.STATE_DIR_VARIABLE, str(tmp_path / "state"))
    return tmp_path / "state"


def head_record(workdir: Path, port: int, pid: int | None = None) -> stack_record.StackRecord:
    token = ray_env.create_token(ray_env.own_token_file(workdir))
    head = stack_record.RayHeadRecord(address=f"127.0.0.1:{port}", token_file=token, pid=pid or os.getpid())
    return stack_record.StackRecord(workdir=workdir, broker="127.0.0.1:19092", ray_head=head)


def test_a_profile_with_another_workdir_joins_the_recorded_head_with_its_token(state_dir, listening, tmp_path):
    stack = tmp_path / "stack-workdir"
    path = stack_record.save(head_record(stack, listening.getsockname()[1]))
    profile = KbitConfig.from_dict({"workdir": str(tmp_path / "profile-workdir"), "launch": {"engine": "ray"}})

    address, token = ray_target(profile)
    assert path == state_dir / "stack.json" and address == f"127.0.0.1:{listening.getsockname()[1]}"
    own = ray_env.own_token_file(profile.run_dir)
    assert ray_env.join_token_file(address, None, token, own) == ray_env.own_token_file(stack)
    # an address the profile names wins over the record, which then lends it no token
    named = profile.override({"launch.ray_address": "10.0.0.1:6379"})
    assert ray_target(named) == ("10.0.0.1:6379", None)


def test_a_head_that_stopped_or_closed_its_port_is_not_joined(state_dir, listening, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stack_record.save(head_record(tmp_path / "a", listening.getsockname()[1], pid=int(dead.stdout)))
    assert stack_record.running_ray_head() is None, "its process has exited"
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: nothing answers there
        stack_record.save(head_record(tmp_path / "b", closed.getsockname()[1]))
        assert stack_record.running_ray_head() is None, "nothing accepts connections on its port"
    assert [s.workdir for s in stack_record.recorded_stacks()] == [tmp_path / "a", tmp_path / "b"]


def test_down_forgets_only_its_own_stack(state_dir, listening, tmp_path):
    port = listening.getsockname()[1]
    stack_record.save(head_record(tmp_path / "a", port))
    stack_record.save(head_record(tmp_path / "b", port))
    stack_record.save(head_record(tmp_path / "a", port))  # `up` again replaces its entry
    assert [s.workdir for s in stack_record.recorded_stacks()] == [tmp_path / "b", tmp_path / "a"]
    stack_record.forget(tmp_path / "a")
    assert [s.workdir for s in stack_record.recorded_stacks()] == [tmp_path / "b"]


def test_the_record_lives_under_the_state_home_unless_named(monkeypatch, tmp_path):
    monkeypatch.delenv(stack_record.STATE_DIR_VARIABLE)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert stack_record.record_path() == tmp_path / "xdg" / "kbit" / "stack.json"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert stack_record.record_path() == Path.home() / ".local" / "state" / "kbit" / "stack.json"
    assert ".ray" not in stack_record.record_path().parts


def test_the_suite_never_finds_a_users_stack(listening, tmp_path, monkeypatch):
    """A user's stack left running (`kbit stack up --ray`): its head listens on the profile's Ray port and its record
    sits in the user's state directory. The suite's configs still start a Ray runtime of their own."""
    # as a fresh suite process has them (tests/conftest.py clears them at import): in the full suite, earlier tests'
    # in-process Ray drivers leave the suite's own head in RAY_ADDRESS
    for variable in USER_SERVICE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    port = listening.getsockname()[1]
    users_state = tmp_path / "users-home" / ".local" / "state" / "kbit"
    record = head_record(tmp_path / "users-stack", port).model_dump(mode="json")
    users_state.mkdir(parents=True)
    (users_state / "stack.json").write_text(json.dumps({"stacks": [record]}))

    assert stack_record.state_dir() == TEST_HOME / "kbit-state", "tests/conftest.py names the suite's own"
    cfg = KbitConfig.from_dict({"workdir": str(tmp_path / "w"), "launch": {"engine": "ray", "ray_head_port": port}})
    assert ray_target(cfg) == (None, None)
    # the control: in the user's environment the same config joins that head
    code = "from kbit_core.config import KbitConfig; from kbit_core.launch.ray_train import ray_target; "
    code += f"print(ray_target(KbitConfig.from_dict({{'workdir': {str(tmp_path / 'w')!r}}}))[0])"
    env = {**os.environ, stack_record.STATE_DIR_VARIABLE: str(users_state)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"127.0.0.1:{port}"


def test_a_profile_naming_no_registry_finds_the_running_stacks_own(state_dir, listening, tmp_path):
    from kbit_core.config import RegistryConfig
    from kbit_core.formats.confluent.source import configured_or_stack_registry
    from kbit_core.formats.decoders import make_record_decoder

    url = f"http://127.0.0.1:{listening.getsockname()[1]}/apis/ccompat/v7"
    stack_record.save(stack_record.StackRecord(workdir=tmp_path / "stack", registry_url=url))
    assert stack_record.running_registry_url() == url
    decoder = make_record_decoder("confluent-avro", {}, topic="t")  # no registry.* set: the stack's
    assert decoder.source.url == url
    own = RegistryConfig(url="http://10.0.0.1:8081")
    assert configured_or_stack_registry(own) == own  # a registry the profile names wins
    listening.close()
    assert stack_record.running_registry_url() is None  # nothing answers there any more
    assert not configured_or_stack_registry(RegistryConfig()).enabled
