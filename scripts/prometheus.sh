#!/usr/bin/env bash
# Install Prometheus and promtool (the Debian `prometheus` package) for the test that
# evaluates the dashboards' and alert rules' PromQL against a live Prometheus
# (tests/integration/test_dashboards.py). Idempotent: when both commands are on PATH it
# prints nothing and exits 0. The package starts no service where there is no init system;
# the test runs its own Prometheus on a loopback port.
#
#   scripts/prometheus.sh    install what is missing (as root, or through sudo)
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi

log() { echo "prometheus: $*" >&2; }

if ! command -v apt-get >/dev/null 2>&1; then
    log "prometheus/promtool are missing and apt-get is not available here;"
    log "install Prometheus 2.x (prometheus and promtool on PATH) by other means"
    exit 1
fi

SUDO=()
if [[ "$(id -u)" != 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo -n)
    else
        log "installing the Debian prometheus package needs root (or sudo)"
        exit 1
    fi
fi

# Another `make test` may be installing packages at the same time: wait for dpkg's lock
# rather than fail on it.
APT=(apt-get -qq -o DPkg::Lock::Timeout=300)
log "installing the Debian prometheus package"
"${SUDO[@]}" "${APT[@]}" update >/dev/null
# The recommended node exporter is not needed: the router is the only target.
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
    "${APT[@]}" install -y --no-install-recommends prometheus >/dev/null

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    log "the prometheus package installed, but prometheus/promtool are still not on PATH"
    exit 1
fi
log "installed $(prometheus --version 2>&1 | head -n 1)"
