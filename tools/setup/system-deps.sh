#!/usr/bin/env bash
# Installs the Debian packages some test sessions use for real (not mocks):
#   openssh-server, pdsh  ds-launch's ssh and pdsh runners launch a 2-"node" job over loopback sshd
#   libaio-dev            ds-offload-aio builds its libaio binding (cffi) at install time
#   fio                   the aio benchmark's peer
# Runs from nox before the sessions that need them. Idempotent and quick when all are present.
# Without root or apt-get it only reports what is missing: the packages still install (ds-offload-aio
# falls back to a thread pool) and the tests that need a missing tool fail, naming it.
set -euo pipefail

PACKAGES=(openssh-server pdsh libaio-dev fio)

missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done

if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi

if ! command -v apt-get >/dev/null || [ "$(id -u)" -ne 0 ]; then
    echo "system-deps: missing Debian packages: ${missing[*]} (needs root and apt-get to install;" \
        "install them by hand: apt-get install -y ${missing[*]})" >&2
    exit 0
fi

echo "system-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; then
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
