#!/usr/bin/env bash
# Install azurite (Azure's blob-storage emulator, an npm package) into $VENV/azurite for the
# storage conformance tests (tests/azurite.py starts it on 127.0.0.1, like moto for S3).
#
# Idempotent and quiet: returns in a fraction of a second when the pinned version is there; a
# fresh install takes about 20 s (npm's own cache, ~/.npm, makes a reinstall quicker). Needs
# Node.js and npm: when they are missing it installs Debian's (apt-get, as root), else it says
# what to do and fails.
set -euo pipefail
cd "$(dirname "$0")/.."

# 3.35.0: the newest release that runs on Node.js 20 (this machine's); 3.36 and later need 21+.
AZURITE_VERSION=3.35.0
VENV=${VENV:-.venv}
DEST=$VENV/azurite

installed() {
    [[ -x $DEST/node_modules/.bin/azurite-blob ]] \
        && grep -q "\"version\": \"$AZURITE_VERSION\"" "$DEST/node_modules/azurite/package.json" 2>/dev/null
}

if command -v node >/dev/null && installed; then
    exit 0
fi

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "install_azurite: installing Node.js and npm (Debian packages)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
    else
        echo "install_azurite: Node.js and npm are needed for the azurite tests; install them" \
             "(e.g. apt-get install nodejs npm) and run scripts/setup_env.sh again" >&2
        exit 1
    fi
fi

echo "install_azurite: installing azurite $AZURITE_VERSION into $DEST (npm)"
# Into a scratch folder first, so an interrupted install never looks complete.
rm -rf "$DEST.partial"
npm install --prefix "$DEST.partial" --no-audit --no-fund --loglevel=error \
    "azurite@$AZURITE_VERSION" >/dev/null
rm -rf "$DEST"
mv "$DEST.partial" "$DEST"
installed || { echo "install_azurite: $DEST/node_modules/.bin/azurite-blob missing after install" >&2; exit 1; }
