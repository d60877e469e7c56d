#!/usr/bin/env bash
# Install the pinned s3proxy (deployments/s3proxy/pom.xml) that `kbit stack up` starts when stack.artifacts is s3
# (the team profile, deployments/profiles/team.yaml):
#   scripts/install_s3proxy.sh [DEST]    DEST defaults to $KBIT_VENV/s3proxy (.venv/s3proxy); the jar lands at
#                                        DEST/s3proxy.jar
# Idempotent: nothing is resolved again while DEST/.pom-digest matches the pom's digest. Maven's local repository is
# DEST/m2 (never ~/.m2); Maven checks Central's SHA-1 strictly (-C) and this script the jar's pinned SHA-256.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEST=$(realpath -m "${1:-${KBIT_VENV:-$ROOT/.venv}/s3proxy}")
POM=$ROOT/deployments/s3proxy/pom.xml
VERSION=$(sed -n 's:.*<s3proxy.version>\(.*\)</s3proxy.version>.*:\1:p' "$POM")
JAR=s3proxy-$VERSION-jar-with-dependencies.jar
# sha256sum of $JAR as Maven Central serves it (Central publishes SHA-1 and MD5 only)
SHA256=f3ff95bd78a7afbbcd5da56f8f6180ef71ad00601392f7e2f5a220c97ad69eef

die() { echo "kbit: $*" >&2; exit 2; }

digest=$(sha256sum "$POM" "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$DEST/.pom-digest" ] && [ "$(cat "$DEST/.pom-digest")" = "$digest" ] && [ -f "$DEST/s3proxy.jar" ]; then
  exit 0
fi
command -v mvn >/dev/null 2>&1 || die "installing s3proxy needs Maven 3.6+ (apt-get install maven)"
echo "kbit: resolving s3proxy $VERSION into $DEST" >&2
mkdir -p "$DEST"
rm -rf "$DEST/download"
log=$DEST/install.log
if ! mvn -B -q -C -f "$POM" -Dmaven.repo.local="$DEST/m2" \
      dependency:copy-dependencies -DoutputDirectory="$DEST/download" >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  die "resolving ${POM#"$ROOT"/} from Maven Central failed (full log: $log)"
fi
echo "$SHA256  $DEST/download/$JAR" | sha256sum -c --quiet - >>"$log" 2>&1 \
  || die "$JAR does not have the pinned SHA-256 $SHA256 (log: $log)"
mv "$DEST/download/$JAR" "$DEST/s3proxy.jar"
rm -rf "$DEST/download"
echo "$digest" > "$DEST/.pom-digest"
