#!/usr/bin/env bash
# Set up a fresh machine: a virtualenv in .venv with the package and its extras.
#   scripts/setup.sh          service + trainer side (torch CPU wheel, megatron-core)
#   scripts/setup.sh --test   also the test tools: pytest, playwright, promtool/prometheus,
#                             the frameworks of scripts/frameworks.txt (--no-deps),
#                             docker-compose and chromium (Debian packages; the browser tests
#                             drive /usr/bin/chromium), and a running PostgreSQL
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -c 'import torch' 2>/dev/null || "${pip[@]}" "torch==2.13.0"

if [ "${1:-}" != "--test" ]; then
  "${pip[@]}" -e ".[torch,postgres]"
  exit 0
fi

"${pip[@]}" -e ".[torch,postgres,test]"
# frameworks whose own code the suite runs (tests/e2e/test_frameworks.py): pinned, --no-deps
"${pip[@]}" --no-deps -r scripts/frameworks.txt

missing=()
command -v promtool >/dev/null || missing+=(prometheus)
command -v docker-compose >/dev/null || missing+=(docker-compose)
[ -x /usr/bin/chromium ] || missing+=(chromium fonts-dejavu-core)
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
