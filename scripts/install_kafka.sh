#!/usr/bin/env bash
# Install the pinned Apache Kafka jars (deployments/kafka/pom.xml) for kbit's local broker:
#   scripts/install_kafka.sh [DEST]      DEST defaults to $KBIT_VENV/kafka (.venv/kafka); the jars land in DEST/libs
# Idempotent: nothing is resolved again while DEST/.pom-digest matches the pom's digest. Maven's local repository is
# DEST/m2 (never ~/.m2), so the install depends on no user's home and a version bump downloads only what changed.
# With KAFKA_HOME set (an unpacked Apache Kafka 4.x distribution) nothing is installed: its libs/ is used instead.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEST=${1:-${KBIT_VENV:-$ROOT/.venv}/kafka}
POM=$ROOT/deployments/kafka/pom.xml
STAMP=$DEST/.pom-digest

die() { echo "kbit: $*" >&2; exit 2; }

if [ -n "${KAFKA_HOME:-}" ]; then
  compgen -G "$KAFKA_HOME/libs/kafka_2.13-*.jar" >/dev/null \
    || die "KAFKA_HOME=$KAFKA_HOME holds no libs/kafka_2.13-*.jar: point it at an unpacked Apache Kafka 4.x, or unset it"
  exit 0
fi

command -v java >/dev/null 2>&1 || die "Apache Kafka needs Java 17 or newer: install e.g. openjdk-17-jre-headless"
digest=$(sha256sum "$POM" | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$digest" ] && compgen -G "$DEST/libs/kafka_2.13-*.jar" >/dev/null; then
  exit 0
fi
command -v mvn >/dev/null 2>&1 \
  || die "installing Apache Kafka needs Maven 3.6+ (apt-get install maven), or KAFKA_HOME set to an unpacked Kafka 4.x"

echo "kbit: resolving Apache Kafka $(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$POM") into $DEST/libs" >&2
mkdir -p "$DEST"
rm -rf "$DEST/libs.new"
log=$DEST/install.log
if ! mvn -B -q -f "$POM" -Dmaven.repo.local="$DEST/m2" \
      dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$DEST/libs.new" >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  die "resolving deployments/kafka/pom.xml from Maven Central failed (full log: $log)"
fi
compgen -G "$DEST/libs.new/kafka_2.13-*.jar" >/dev/null || die "Maven resolved no kafka_2.13 jar (log: $log)"
rm -rf "$DEST/libs"
mv "$DEST/libs.new" "$DEST/libs"
echo "$digest" > "$STAMP"
