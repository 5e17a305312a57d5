#!/usr/bin/env bash
# Install Chromium and its WebDriver (the Debian `chromium` and `chromium-driver` packages)
# for the tests that drive the operator's console in a headless browser
# (tests/integration/test_console.py). Idempotent: when both commands are on PATH it prints
# nothing and exits 0. Nothing is fetched at test time; the browser runs headless on loopback.
#
#   scripts/chromium.sh    install what is missing (as root, or through sudo)
set -euo pipefail

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi

log() { echo "chromium: $*" >&2; }

if ! command -v apt-get >/dev/null 2>&1; then
    log "chromium/chromedriver are missing and apt-get is not available here;"
    log "install Chromium and a matching chromedriver (both on PATH) by other means"
    exit 1
fi

SUDO=()
if [[ "$(id -u)" != 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo -n)
    else
        log "installing the Debian chromium packages needs root (or sudo)"
        exit 1
    fi
fi

# Another `make test` may be installing packages at the same time: wait for dpkg's lock.
APT=(apt-get -qq -o DPkg::Lock::Timeout=300)
log "installing the Debian chromium and chromium-driver packages"
"${SUDO[@]}" "${APT[@]}" update >/dev/null
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
    "${APT[@]}" install -y --no-install-recommends chromium chromium-driver >/dev/null

if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    log "the chromium packages installed, but chromium/chromedriver are still not on PATH"
    exit 1
fi
log "installed $(chromium --version 2>/dev/null | head -n 1)"
