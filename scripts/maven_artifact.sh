# Sourced by scripts/install_registry.sh and scripts/install_s3proxy.sh: one pinned artifact from Maven Central.
# Needs ROOT (the checkout) and die() from the sourcing script.

# current DEST DIGEST FILE: whether DEST holds FILE installed from a pom and script whose digest is DIGEST
current() {
  [ -f "$1/.pom-digest" ] && [ "$(cat "$1/.pom-digest")" = "$2" ] && [ -e "$1/$3" ]
}

# fetch_pinned WHAT POM DEST FILE SHA256: resolve POM's one artifact into DEST/download/FILE with `mvn -C` (Central's
# SHA-1 checked strictly; Maven's local repository is DEST/m2, never ~/.m2) and check the file's pinned SHA-256
fetch_pinned() {
  local what=$1 pom=$2 dest=$3 file=$4 sha256=$5 log
  command -v mvn >/dev/null 2>&1 || die "installing $what needs Maven 3.6+ (apt-get install maven)"
  echo "kbit: resolving $what into $dest" >&2
  mkdir -p "$dest"
  rm -rf "$dest/download"
  log=$dest/install.log
  if ! mvn -B -q -C -f "$pom" -Dmaven.repo.local="$dest/m2" \
        dependency:copy-dependencies -DoutputDirectory="$dest/download" >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    die "resolving ${pom#"$ROOT"/} from Maven Central failed (full log: $log)"
  fi
  echo "$sha256  $dest/download/$file" | sha256sum -c --quiet - >>"$log" 2>&1 \
    || die "$file does not have the pinned SHA-256 $sha256 (log: $log)"
}
