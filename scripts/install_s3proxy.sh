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

# shellcheck source=scripts/maven_artifact.sh
. "$ROOT/scripts/maven_artifact.sh"
digest=$(sha256sum "$POM" "$0" "$ROOT/scripts/maven_artifact.sh" | sha256sum | cut -d' ' -f1)
current "$DEST" "$digest" s3proxy.jar && exit 0
fetch_pinned "s3proxy $VERSION" "$POM" "$DEST" "$JAR" "$SHA256"
mv "$DEST/download/$JAR" "$DEST/s3proxy.jar"
rm -rf "$DEST/download"
echo "$digest" > "$DEST/.pom-digest"
