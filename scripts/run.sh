#!/usr/bin/env bash
# kbit's two entry points on a fresh machine (Python 3.11, Java 17):
#   scripts/run.sh main   install (idempotent) + start the local stack + run the smoke benchmark deployment
#   scripts/run.sh test   install (idempotent, with the test and ray extras) + run the test suite
#   scripts/run.sh fast   install (idempotent) + the lint and import gates + tests/unit (no service starts)
# Installation is skipped when nothing it depends on changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${KBIT_VENV:-$ROOT/.venv}
STAMP=$VENV/.kbit-install-stamp

die() { echo "kbit: $*" >&2; exit 2; }

find_python() {
  for py in "${KBIT_PYTHON:-}" python3.11 python3.12 python3; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 13) else 1)'; then
      echo "$py"; return 0
    fi
  done
  return 1
}

check_java() {
  command -v java >/dev/null 2>&1 || die "Java 17 or newer is required (Spark runs on it): install e.g. openjdk-17-jre-headless"
  local v
  v=$(java -version 2>&1 | awk -F'"' '/version/ {print $2}' | cut -d. -f1)
  [ "${v:-0}" -ge 17 ] 2>/dev/null || die "Java 17 or newer is required, found Java ${v:-unknown} ($(command -v java))"
}

# Apache Kafka's pinned jars (deployments/kafka/pom.xml) into $VENV/kafka/libs; idempotent, see the script.
install_kafka() { KBIT_VENV=$VENV bash scripts/install_kafka.sh; }

# The Schema Registry (Apicurio, deployments/registry/pom.xml) into $VENV/registry/app; idempotent, see the script.
# Profiles start it with registry.local.enabled; the suite's registry tests need it. In CI a failed install fails
# the run; elsewhere kbit says what is missing and goes on (the registry is optional, and those tests skip).
install_registry() {
  KBIT_VENV=$VENV bash scripts/install_registry.sh && return 0
  if [ -n "${CI:-}" ] || [ "${KBIT_REQUIRE_APACHE_KAFKA:-}" = 1 ]; then
    die "installing Apicurio Registry failed (CI needs it: the Schema Registry tests run on it): see $VENV/registry/install.log"
  fi
  echo "kbit: Apicurio Registry is not installed: registry.local.enabled cannot start, and the registry tests skip" >&2
}

# s3proxy (deployments/s3proxy/pom.xml) into $VENV/s3proxy; idempotent, see the script. The team profile's artifact
# store (stack.artifacts: s3) and its test need it; like the registry, only CI fails when it cannot be installed.
install_s3proxy() {
  KBIT_VENV=$VENV bash scripts/install_s3proxy.sh && return 0
  if [ -n "${CI:-}" ]; then
    die "installing s3proxy failed (CI needs it: the team profile's test runs on it): see $VENV/s3proxy/install.log"
  fi
  echo "kbit: s3proxy is not installed: stack.artifacts=s3 cannot start, and the team profile's test skips" >&2
}

install_torch() {
  # torch 2.13.0 and no other version. The CPU build (+cpu) comes from whatever wheel source the machine offers
  # (a find-links folder, KBIT_TORCH_INDEX); otherwise PyPI's torch==2.13.0, which is the CUDA build: it runs on
  # CPU as well, and DeepSpeed is told its accelerator is the CPU (DS_ACCELERATOR) wherever no GPU is found.
  local extra=()
  [ -n "${KBIT_TORCH_INDEX:-}" ] && extra=(--extra-index-url "$KBIT_TORCH_INDEX")
  if ! gpu_present && "$VENV/bin/pip" install -q "${extra[@]}" "torch==2.13.0+cpu" 2>/dev/null; then
    return 0
  fi
  "$VENV/bin/pip" install -q "${extra[@]}" "torch==2.13.0"
}

install_nftables() {
  # The bed's shaped links drop packets with nftables (docs/network.md); the shaping tests skip without `nft`. As root
  # on Debian it comes from apt, once; elsewhere this says what to install and the suite goes on.
  command -v nft >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get install -y -q nftables || { apt-get update -q && apt-get install -y -q nftables; }; } >/dev/null 2>&1 && return 0
  fi
  echo "kbit: no \`nft\` (apt-get install nftables): the shaped-link tests skip" >&2
}

install_sshd() {
  # Ray's cluster launcher on the bed (`ray up` over SSH, tests/testbed/test_ray_launcher.py) needs sshd, ssh and rsync;
  # the bed starts an sshd of its own on each node host's bed address (docs/orchestration.md). As root on Debian they
  # come from apt, once (a machine without an init starts no system sshd); elsewhere this says what to install and the
  # launcher's test skips (fails under CI or KBIT_REQUIRE_BED=1).
  [ -x /usr/sbin/sshd ] && command -v rsync >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get install -y -q openssh-server rsync || { apt-get update -q && apt-get install -y -q openssh-server rsync; }; } \
      >/dev/null 2>&1 && return 0
  fi
  echo "kbit: no sshd or rsync (apt-get install openssh-server rsync): the bed's \`ray up\` test skips" >&2
}

install_chromium() {
  # The team stack's test of what a browser sees behind the login (tests/integration/test_stack_team.py) drives headless
  # Chromium through scripts/ui_screenshots.py. As root on Debian it comes from apt, once; elsewhere this says what to
  # install and that test skips (fails under CI or KBIT_REQUIRE_APACHE_KAFKA=1).
  command -v chromium >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null 2>&1 && return 0
  fi
  echo "kbit: no chromium (apt-get install chromium): the team stack's browser login test skips" >&2
}

gpu_present() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

install() {
  local extras=$1 digest
  digest=$(cat pyproject.toml requirements/*.txt scripts/run.sh | sha256sum | cut -d' ' -f1)-$extras
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$digest" ] && [ -x "$VENV/bin/kbit" ]; then
    return 0
  fi
  local py
  py=$(find_python) || die "Python 3.11 is required (set KBIT_PYTHON to its path if it is not python3.11 on PATH)"
  check_java
  echo "kbit: installing into $VENV (first run takes a few minutes)" >&2
  [ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --require-hashes --no-deps -r requirements/broker.txt
  "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null \
    || install_torch
  DS_BUILD_OPS=0 "$VENV/bin/pip" install -q --disable-pip-version-check -c requirements/constraints.txt -e ".[$extras]"
  echo "$digest" > "$STAMP"
}

# The architecture and style gates, before any test: a wrong import (docs/architecture.md's layer map), a lint finding
# or an unformatted file fails the run.
gates() {
  "$VENV/bin/lint-imports" --no-cache
  "$VENV/bin/ruff" check .
  "$VENV/bin/ruff" format --check .
}

# run_suite: the test suite as two pytest sessions side by side
source scripts/suite.sh

export SPARK_LOCAL_IP=127.0.0.1 PREFECT_SERVER_ANALYTICS_ENABLED=false PYTHONUNBUFFERED=1
export PYSPARK_PYTHON="$VENV/bin/python" PYSPARK_DRIVER_PYTHON="$VENV/bin/python"

case "${1:-}" in
  main)
    install test,ray
    check_java
    # Apache Kafka is the default local broker (kafka.embedded.broker): without its jars the stack cannot start.
    install_kafka || die "installing Apache Kafka (the default broker) failed: see $VENV/kafka/install.log"
    install_registry
    install_s3proxy
    exec bash scripts/main_job.sh "${@:2}"
    ;;
  test)
    install test,ray
    check_java
    install_nftables
    install_sshd
    install_chromium
    # The suite's broker is Apache Kafka. In CI (or with KBIT_REQUIRE_APACHE_KAFKA=1) a failed install fails the run;
    # elsewhere the suite falls back to Tansu, and the tests that need Apache Kafka skip.
    if ! install_kafka; then
      if [ -n "${CI:-}" ] || [ "${KBIT_REQUIRE_APACHE_KAFKA:-}" = 1 ]; then
        die "installing Apache Kafka failed (CI needs it: every broker-facing test runs on it): see $VENV/kafka/install.log"
      fi
      echo "kbit: Apache Kafka is not installed: the suite runs on Tansu (KBIT_TEST_BROKER=tansu) and the tests that need Apache Kafka skip" >&2
      export KBIT_TEST_BROKER=tansu
    fi
    install_registry
    install_s3proxy
    # Everything temporary (torchelastic, TorchDistributor, pytest) lands in one per-run dir.
    TMPDIR=$(mktemp -d "${TMPDIR:-/tmp}/kbit-test.XXXXXX"); export TMPDIR
    trap 'rm -rf "$TMPDIR"' EXIT
    gates
    run_suite "${@:2}"
    ;;
  fast)
    # The edit-test loop, in minutes: the gates and tests/unit but its `slow` tests (a training run of 90 s), which
    # start no service (no broker, Spark, Ray or server: tests/unit/conftest.py fails a test that asks for one), so
    # no Java or Apache Kafka is needed either. The full suite (`test`) runs everything.
    install test,ray
    gates
    exec "$VENV/bin/python" -m pytest tests/unit -m "not slow" "${@:2}"
    ;;
  install)
    install test,ray
    install_kafka
    install_registry
    install_s3proxy
    ;;
  *)
    echo "usage: scripts/run.sh main|test|fast|install [args]" >&2; exit 2 ;;
esac
