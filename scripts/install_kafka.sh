#!/usr/bin/env bash
# Install the pinned Apache Kafka jars (deployments/kafka/pom.xml) for kbit's local broker, and Spark's Kafka source
# (deployments/spark-kafka/pom.xml) for the data-plane benchmark:
#   scripts/install_kafka.sh [DEST]      DEST defaults to $KBIT_VENV/kafka (.venv/kafka); the jars land in DEST/libs
#                                        and DEST/spark-source/libs, and the previous release's (UPGRADE_FROM, the
#                                        bed's rolling upgrade starts on it) in DEST/UPGRADE_FROM/libs
# Idempotent: nothing is resolved again while DEST/.pom-digest matches the pom's digest (and the version). Maven's local repository is
# DEST/m2 (never ~/.m2), so the install depends on no user's home and a version bump downloads only what changed.
# With KAFKA_HOME set (an unpacked Apache Kafka 4.x distribution) nothing is installed: its libs/ is used instead.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEST=$(realpath -m "${1:-${KBIT_VENV:-$ROOT/.venv}/kafka}")  # absolute: Maven resolves paths against the pom
POM=$ROOT/deployments/kafka/pom.xml

die() { echo "kbit: $*" >&2; exit 2; }

if [ -n "${KAFKA_HOME:-}" ]; then
  compgen -G "$KAFKA_HOME/libs/kafka_2.13-*.jar" >/dev/null \
    || die "KAFKA_HOME=$KAFKA_HOME holds no libs/kafka_2.13-*.jar: point it at an unpacked Apache Kafka 4.x, or unset it"
  exit 0
fi

command -v java >/dev/null 2>&1 || die "Apache Kafka needs Java 17 or newer: install e.g. openjdk-17-jre-headless"

# The Apache Kafka release before the pom's: `kbit cluster up --kafka-version` starts the test bed's brokers on it and
# `kbit cluster fault rolling-upgrade` upgrades them to the pom's (docs/reliability.md). Same pom, this version.
UPGRADE_FROM=4.3.1

# resolve POM's runtime closure into DEST/libs unless DEST/.pom-digest matches; JAR_GLOB names the jar that must land;
# MAVEN_ARGS (optional, e.g. -Dkafka.version=X) go to Maven and into the digest
resolve() {
  local what=$1 pom=$2 dest=$3 jar_glob=$4 maven_args=${5:-} digest log
  digest=$(sha256sum "$pom" | cut -d' ' -f1)${maven_args:+ $maven_args}
  if [ -f "$dest/.pom-digest" ] && [ "$(cat "$dest/.pom-digest")" = "$digest" ] && compgen -G "$dest/libs/$jar_glob" >/dev/null; then
    return 0
  fi
  command -v mvn >/dev/null 2>&1 \
    || die "installing $what needs Maven 3.6+ (apt-get install maven), or KAFKA_HOME set to an unpacked Kafka 4.x"
  echo "kbit: resolving $what into $dest/libs" >&2
  mkdir -p "$dest"
  rm -rf "$dest/libs.new"
  log=$dest/install.log
  # shellcheck disable=SC2086  # MAVEN_ARGS is a list of words
  if ! mvn -B -q -f "$pom" -Dmaven.repo.local="$M2" $maven_args \
        dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$dest/libs.new" >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    die "resolving ${pom#"$ROOT"/} from Maven Central failed (full log: $log)"
  fi
  compgen -G "$dest/libs.new/$jar_glob" >/dev/null || die "Maven resolved no $jar_glob (log: $log)"
  rm -rf "$dest/libs"
  mv "$dest/libs.new" "$dest/libs"
  echo "$digest" > "$dest/.pom-digest"
}

M2=$DEST/m2
resolve "Apache Kafka $(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$POM")" "$POM" "$DEST" 'kafka_2.13-*.jar'
# Spark's Kafka source for the data-plane benchmark (kbit bench-data --spark-peer), beside Kafka's jars
resolve "Spark's Kafka source" "$ROOT/deployments/spark-kafka/pom.xml" "$DEST/spark-source" 'spark-sql-kafka-0-10_2.13-*.jar'
# The previous release for the bed's rolling upgrade, from the same pom (its dependencies are the same artifacts)
resolve "Apache Kafka $UPGRADE_FROM" "$POM" "$DEST/$UPGRADE_FROM" "kafka_2.13-$UPGRADE_FROM.jar" "-Dkafka.version=$UPGRADE_FROM"
