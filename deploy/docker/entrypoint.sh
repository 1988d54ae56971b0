#!/bin/sh
# Container entrypoint: bring the schema up to date, then serve.
# Extra arguments go to `auditor serve` (e.g. `--workers 4`).
set -eu
auditor db upgrade
exec auditor serve --host 0.0.0.0 --port "${AUDITOR_PORT:-8000}" "$@"
