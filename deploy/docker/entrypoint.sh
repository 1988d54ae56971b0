#!/bin/sh
# Container entrypoint: bring the schema up to date, then serve.
# Extra arguments go to `auditor serve` (e.g. `--workers 4`).
set -eu
# the placeholders of an old deploy/env.example are not secrets
for name in PGPASSWORD AUDITOR_TOKEN AUDITOR_READ_TOKEN; do
    eval "value=\${$name:-}"
    case "$value" in
        change-me*|CHANGE-ME*|changeme*)
            echo "auditor: $name is a placeholder ('$value'): set a real secret in .env (openssl rand -hex 32)" >&2
            exit 2 ;;
    esac
done
auditor db upgrade
exec auditor serve --host 0.0.0.0 --port "${AUDITOR_PORT:-8000}" "$@"
