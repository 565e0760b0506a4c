#!/usr/bin/env bash
# Install what the project needs on this machine: the sandbox's system packages, and a venv.
# Idempotent: a second run installs nothing new. Used by both `make run` and `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
[ -x /usr/bin/bwrap ] || need_apt+=(bubblewrap)
[ -x /usr/bin/python3 ] || need_apt+=(python3)
[ -x /usr/bin/setpriv ] || need_apt+=(util-linux)  # drops root for bubblewrap when workers run as root
ldconfig -p 2>/dev/null | grep -q libseccomp.so.2 || need_apt+=(libseccomp2)
if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: installing ${need_apt[*]} with apt" >&2
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >&2
    else
        echo "setup: the sandbox needs: ${need_apt[*]}. Install them, e.g. 'sudo apt-get install ${need_apt[*]}'." >&2
        exit 1
    fi
fi

python=""
for candidate in "${PYTHON:-}" python3.11 python3; do
    [ -n "$candidate" ] || continue
    path=$(command -v "$candidate" 2>/dev/null) || continue
    if "$path" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
        python=$path
        break
    fi
done
if [ -z "$python" ]; then
    echo "setup: Python 3.11 is needed (set PYTHON=/path/to/python3.11)." >&2
    exit 1
fi

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $python" >&2
    "$python" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing requirements.txt" >&2
    .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt >&2
    echo "$want" > "$stamp"
fi
