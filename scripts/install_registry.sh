#!/usr/bin/env bash
# Install the pinned Schema Registry (Apicurio Registry, deployments/registry/pom.xml) that `kbit stack up` starts
# when registry.local.enabled is set, and that the suite's registry fixture runs:
#   scripts/install_registry.sh [DEST]   DEST defaults to $KBIT_VENV/registry (.venv/registry); the app lands in
#                                        DEST/app (quarkus-run.jar, lib/, app/, quarkus/)
# Idempotent: nothing is resolved again while DEST/.pom-digest matches the pom's digest. Maven's local repository is
# DEST/m2 (never ~/.m2); Maven checks Central's SHA-1 strictly (-C) and this script the archive's pinned SHA-256.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEST=$(realpath -m "${1:-${KBIT_VENV:-$ROOT/.venv}/registry}")
POM=$ROOT/deployments/registry/pom.xml
VERSION=$(sed -n 's:.*<apicurio.version>\(.*\)</apicurio.version>.*:\1:p' "$POM")
ARCHIVE=apicurio-registry-app-$VERSION-all.tar.gz
# sha256sum of $ARCHIVE as Maven Central serves it (Central publishes SHA-1 and MD5 only)
SHA256=8bc6751c76d963734224b01d5e7f84ccb3cb61c87d3bd77c36c35f10a5cbed63

die() { echo "kbit: $*" >&2; exit 2; }

# shellcheck source=scripts/maven_artifact.sh
. "$ROOT/scripts/maven_artifact.sh"
digest=$(sha256sum "$POM" "$0" "$ROOT/scripts/maven_artifact.sh" | sha256sum | cut -d' ' -f1)
current "$DEST" "$digest" app/quarkus-run.jar && exit 0
fetch_pinned "Apicurio Registry $VERSION" "$POM" "$DEST" "$ARCHIVE" "$SHA256"
rm -rf "$DEST/app.new"
mkdir -p "$DEST/app.new"
tar -xzf "$DEST/download/$ARCHIVE" -C "$DEST/app.new"
[ -f "$DEST/app.new/quarkus-run.jar" ] || die "$ARCHIVE holds no quarkus-run.jar"
rm -rf "$DEST/app" "$DEST/download"
mv "$DEST/app.new" "$DEST/app"
echo "$digest" > "$DEST/.pom-digest"
