#!/usr/bin/env bash
# Install Claude Code (the npm package @anthropic-ai/claude-code) once per version, for the
# test that runs it against the router. It lands in a cache outside the repository
# (HIVENET_CACHE, default ~/.cache/hivenet-router), in a scratch folder renamed into place
# only when complete, under a lock, so a second run is a stat call.
#
#   scripts/claude_code.sh          install what is missing, print the path as KEY=VALUE
#   scripts/claude_code.sh --print  print the path without installing anything
set -euo pipefail

CLAUDE_CODE_VERSION="2.1.332"
CACHE="${HIVENET_CACHE:-$HOME/.cache/hivenet-router}"
DIR="$CACHE/claude-code-$CLAUDE_CODE_VERSION"
CLAUDE="$DIR/node_modules/.bin/claude"

if [[ "${1:-}" == "--print" ]]; then
    echo "CLAUDE_CODE=$CLAUDE"
    exit 0
fi

log() { echo "claude_code: $*" >&2; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.claude_code.lock"
flock 9

if [[ -x "$CLAUDE" ]] && "$CLAUDE" --version >/dev/null 2>&1; then
    echo "CLAUDE_CODE=$CLAUDE"
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
log "installing @anthropic-ai/claude-code $CLAUDE_CODE_VERSION"
SCRATCH="$(mktemp -d "$CACHE/.claude-code.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
# The package's binary comes from a platform package among its optional dependencies; it
# needs no Node.js of its own at run time.
echo '{"name": "hivenet-claude-code", "private": true}' >"$SCRATCH/package.json"
(cd "$SCRATCH" && npm install --no-audit --no-fund --loglevel=error \
        "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >/dev/null)
"$SCRATCH/node_modules/.bin/claude" --version >/dev/null
rm -rf "$DIR"
mv "$SCRATCH" "$DIR"
trap - EXIT
echo "CLAUDE_CODE=$CLAUDE"
