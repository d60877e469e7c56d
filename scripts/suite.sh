# The test suite as two pytest sessions side by side (`run_suite [pytest arguments]`; scripts/run.sh sources this
# after setting VENV and TMPDIR): the bed's tests, then the Ray and fault tests, README's commands and the unit tests;
# and the rest. Much of each session's time is spent waiting (on brokers, JVMs and Ray nodes starting, on timeouts,
# on shaped links), so on two cores the two take less than one after the other. README's commands (the suite's
# longest test) are on the bed's side to even the two out: in CI the bed's session had ended 13 min before the rest.
# Measured, the whole command: 91 min as one session, 80 as two, 69 with README's commands moved and the bed down
# after its last test (tests/testbed/conftest.py).
# Each session has a TMPDIR of its own, and so its own HOME, state and Ray directories (tests/conftest.py); every port
# the suite binds is a free one. Each session's lines are prefixed with its name. Asked for particular tests (a path
# or a node id), one session runs them.
BESIDE=(tests/testbed tests/ray tests/faults tests/integration/test_readme_commands.py tests/unit)

names_tests() {
  local arg
  for arg in "$@"; do
    case $arg in -*) ;; *::*|tests|tests/*) return 0 ;; esac
  done
  return 1
}

suite_session() {  # name, pytest arguments
  local name=$1
  mkdir -p "$TMPDIR/$name"
  TMPDIR="$TMPDIR/$name" "$VENV/bin/python" -m pytest "${@:2}" 2>&1 | sed -u "s/^/[$name] /"
  return "${PIPESTATUS[0]}"
}

run_suite() {
  local rc_beside=0 rc_rest=0 beside
  set +e
  if names_tests "$@"; then
    "$VENV/bin/python" -m pytest "$@"
    rc_rest=$?
    rc_beside=5
  else
    suite_session bed "$@" "${BESIDE[@]}" &
    beside=$!
    suite_session rest "$@" "${BESIDE[@]/#/--ignore=}"
    rc_rest=$?
    wait "$beside"
    rc_beside=$?
  fi
  set -e
  # pytest's 5: this session collected no test (`-k` chose none of its tests); both 5: no test at all
  [ $rc_rest -eq 5 ] && [ $rc_beside -eq 5 ] && { echo "kbit: pytest collected no tests" >&2; exit 1; }
  [ $rc_rest -ne 5 ] && [ $rc_rest -ne 0 ] && exit $rc_rest
  [ $rc_beside -ne 5 ] && exit $rc_beside
  exit 0
}
