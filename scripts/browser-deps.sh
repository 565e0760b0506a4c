#!/usr/bin/env bash
# Install what the real-browser tests need: Debian's Chromium, driven by Python Playwright (from
# requirements.txt) with executable_path=/usr/bin/chromium. Never `playwright install`: it downloads
# browsers, and this machine may have no way out.
# Idempotent: when /usr/bin/chromium is there, it installs nothing and prints nothing.
set -euo pipefail

[ -x /usr/bin/chromium ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "browser-deps: installing chromium with apt (once)" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >&2
else
    echo "browser-deps: the browser tests need Debian's Chromium at /usr/bin/chromium." \
        "Install it, e.g. 'sudo apt-get install chromium', or deselect them with -m 'not browser'." >&2
    exit 1
fi
