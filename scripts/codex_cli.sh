#!/usr/bin/env bash
# Install Codex CLI (the npm package @openai/codex) once per version, for the test that runs
# it against the router, the way scripts/claude_code.sh installs Claude Code: into the cache
# outside the repository (HIVENET_CACHE, default ~/.cache/hivenet-router), in a scratch
# folder renamed into place only when complete, under a lock, so a second run is a stat call.
#
#   scripts/codex_cli.sh          install what is missing, print the path as KEY=VALUE
#   scripts/codex_cli.sh --print  print the path without installing anything
set -euo pipefail

CODEX_VERSION="0.171.0"
CACHE="${HIVENET_CACHE:-$HOME/.cache/hivenet-router}"
DIR="$CACHE/codex-$CODEX_VERSION"
CODEX="$DIR/node_modules/.bin/codex"

if [[ "${1:-}" == "--print" ]]; then
    echo "CODEX_CLI=$CODEX"
    exit 0
fi

log() { echo "codex_cli: $*" >&2; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.codex_cli.lock"
flock 9

if [[ -x "$CODEX" ]] && "$CODEX" --version >/dev/null 2>&1; then
    echo "CODEX_CLI=$CODEX"
    exit 0
fi
if ! command -v npm >/dev/null; then
    if command -v apt-get >/dev/null; then
        log "installing Node.js and npm"
        apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null
    else
        log "npm is missing and cannot be installed here"
        exit 1
    fi
fi
log "installing @openai/codex $CODEX_VERSION"
SCRATCH="$(mktemp -d "$CACHE/.codex.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
# The package is a Node.js launcher for a native binary that comes in a platform package
# among its optional dependencies (so Node.js is needed at run time too).
echo '{"name": "hivenet-codex", "private": true}' >"$SCRATCH/package.json"
(cd "$SCRATCH" && npm install --no-audit --no-fund --loglevel=error \
        "@openai/codex@$CODEX_VERSION" >/dev/null)
"$SCRATCH/node_modules/.bin/codex" --version >/dev/null
rm -rf "$DIR"
mv "$SCRATCH" "$DIR"
trap - EXIT
echo "CODEX_CLI=$CODEX"
