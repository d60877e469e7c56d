#!/usr/bin/env bash
# Regenerate kbit_core/formats/schemas/kbit_pb2.py from kbit.proto.
#
# Uses grpcio-tools' bundled protoc (pinned below) so the output is reproducible; its gencode
# version (6.x/7.35 for 1.85.x) must not be newer than the protobuf runtime (7.36.2).
# Usage: scripts/gen_proto.sh [OUTPUT_DIR]   (default: kbit_core/formats/schemas)
set -euo pipefail

GRPCIO_TOOLS_VERSION="1.85.1"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
SCHEMAS="kbit_core/formats/schemas"
OUT="${1:-$ROOT/$SCHEMAS}"

found="$("$PYTHON" -c 'from importlib.metadata import version; print(version("grpcio-tools"))' 2>/dev/null || true)"
if [[ "$found" != "$GRPCIO_TOOLS_VERSION" ]]; then
  echo "gen_proto.sh: needs grpcio-tools==$GRPCIO_TOOLS_VERSION (found: ${found:-none});" \
       "install it with: $PYTHON -m pip install grpcio-tools==$GRPCIO_TOOLS_VERSION" >&2
  exit 1
fi

mkdir -p "$OUT"
cd "$ROOT/$SCHEMAS"
"$PYTHON" -m grpc_tools.protoc --proto_path=. --python_out="$OUT" kbit.proto
echo "generated $OUT/kbit_pb2.py with grpcio-tools $GRPCIO_TOOLS_VERSION"
