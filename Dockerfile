# syntax=docker/dockerfile:1
# The auditor service: `docker build -t auditor .` (docker-compose.yml builds it for you).
# The container applies migrations (`auditor db upgrade`), then runs
# `auditor serve --host 0.0.0.0 --port 8000`; arguments after the image name go to serve.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md alembic.ini ./
COPY auditor ./auditor
COPY migrations ./migrations
# the alert runbook, served at /runbook (auditor/web/runbook.md links to it)
COPY docs/alerts.md ./docs/alerts.md
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install ".[postgres]"

FROM python:3.11-slim
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 auditor \
 && useradd --system --uid 10001 --gid auditor --home-dir /app --create-home --shell /usr/sbin/nologin auditor
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/entrypoint.sh /usr/local/bin/auditor-entrypoint
WORKDIR /app
USER auditor:auditor
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
ENTRYPOINT ["/bin/sh", "/usr/local/bin/auditor-entrypoint"]
