"""Deployment artefacts: Prometheus rules and config, Grafana dashboard, docker-compose, Dockerfile.

Pure file checks plus the real binaries (Debian's ``prometheus`` package for ``promtool``,
``docker-compose`` v1); one in-process service is started, for a real scrape of ``/metrics``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from auditor.testing.tools import require_tool

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROM_DIR / "alerts.yml"
ALERTS_TEST = PROM_DIR / "alerts_test.yml"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "auditor.json"
DATASOURCE = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDER = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "auditor.yml"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
ALERTS_DOC = ROOT / "docs" / "alerts.md"

DASHBOARD_UID = "auditor-overview"
DATASOURCE_UID = "auditor-prometheus"
#: Metrics of Prometheus itself that expressions may use besides the service's own.
PROMETHEUS_OWN_METRICS = {"up"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
#: Alerts the issues and DESIGN.md ask for.
REQUIRED_ALERTS = {
    "AuditorCPDisagreement",
    "AuditorAppliedStatisticWrong",
    "AuditorReportsMissing",
    "AuditorInconsistentSteps",
    "AuditorDown",
    "AuditorRanksStalled",
}
#: DESIGN.md §6: every one of these must be on the dashboard.
DESIGN_METRICS = {
    "auditor_reports_received_total",
    "auditor_reports_rejected_total",
    "auditor_steps_audited_total",
    "auditor_faults_total",
    "auditor_cp_disagreement_sigma",
    "auditor_applied_error_sigma",
    "auditor_last_audited_step",
    "auditor_ingest_duration_seconds",
}


# --------------------------------------------------------------------------- helpers


def exported_metrics() -> set[str]:
    from auditor.server.metrics import EXPORTED_METRICS

    return set(EXPORTED_METRICS)


def run_tool(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    exe = require_tool(args[0], "prometheus")
    proc = subprocess.run(
        [exe, *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc


_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "inf", "nan", "atan2",
}


def promql_metric_names(expr: str) -> set[str]:
    """Every metric name an expression selects (not functions, labels, keywords or values)."""
    e = re.sub(r"\$\{[^}]*\}|\$\w+", "x", expr)  # Grafana variables ($run, ${run:regex}, $__rate_interval)
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', e)  # string literals
    e = re.sub(r"\{[^{}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range and subquery selectors
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\boffset\s+-?\w+", " ", e)
    e = re.sub(r"@\s*\S+", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        token = m.group(0)
        before = e[m.start() - 1] if m.start() else " "
        if before.isdigit() or before == ".":  # exponent of a number: 1e-8
            continue
        if e[m.end():].lstrip().startswith("("):  # function or aggregation
            continue
        if token.lower() in _KEYWORDS or token == "x":
            continue
        names.add(token)
    return names


def auditor_names(expr: str) -> set[str]:
    """The simple scan: every identifier that looks like one of the service's metrics."""
    return set(re.findall(r"\bauditor_[a-z_]+", expr))


def family(name: str, exported: set[str]) -> str | None:
    """The exported family a series name belongs to, or None."""
    if name in exported or name in PROMETHEUS_OWN_METRICS:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in exported:
            return name[: -len(suffix)]
    return None


def rule_exprs(text: str) -> list[tuple[str, str]]:
    """(rule name, expr) of every rule of a Prometheus rule file.

    A small reader for the two forms used in rule files (block scalar ``expr: |`` and a
    one-line ``expr: ...``), so the test needs no YAML library; the rule count is
    cross-checked against promtool's.
    """
    lines = text.splitlines()
    out: list[tuple[str, str]] = []
    name = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^\s*-\s*(alert|record):\s*(\S+)", line)
        if m:
            name = m.group(2)
        m = re.match(r"^(\s*)(?:-\s+)?expr:\s*(.*)$", line)
        if m:
            indent, rest = len(m.group(1)), m.group(2).strip()
            if rest[:1] in ("|", ">"):
                block = []
                i += 1
                while i < len(lines) and (
                    not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent
                ):
                    block.append(lines[i])
                    i += 1
                out.append((name, "\n".join(block).strip()))
                continue
            if rest[:1] in ("'", '"'):
                rest = rest[1:-1]
            out.append((name, rest))
        i += 1
    return out


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: dict) -> list[dict]:
    panels = []
    for p in dash.get("panels", []):
        panels.append(p)
        panels.extend(p.get("panels", []))  # panels inside collapsed rows
    return panels


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    exprs = []
    for p in all_panels(dash):
        for t in p.get("targets", []):
            if t.get("expr"):
                exprs.append((f"panel {p['id']} ({p.get('title')}) {t.get('refId')}", t["expr"]))
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if q:
            # Grafana's label_values(SELECTOR, LABEL): the selector is PromQL, the rest is not.
            m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", q, re.S)
            exprs.append((f"variable {v['name']}", m.group(1) if m else q))
    return exprs


# --------------------------------------------------------------------------- promtool


def test_promtool_check_rules():
    out = run_tool("promtool", "check", "rules", str(ALERTS.relative_to(ROOT))).stdout
    n = int(re.search(r"SUCCESS: (\d+) rules found", out).group(1))
    assert n == len(rule_exprs(ALERTS.read_text())), "rule_exprs() missed a rule: fix the reader"


def test_promtool_check_config():
    out = run_tool("promtool", "check", "config", str(PROM_CONFIG.relative_to(ROOT))).stdout
    assert "1 rule files found" in out, out  # rule_files resolved relative to the config file
    # and from any working directory
    run_tool("promtool", "check", "config", str(PROM_CONFIG), cwd=Path("/"))


def test_promtool_unit_tests_for_alerts():
    run_tool("promtool", "test", "rules", str(ALERTS_TEST.relative_to(ROOT)))


def test_every_alert_has_unit_test_runbook_and_annotations():
    text = ALERTS.read_text()
    alerts = re.findall(r"^\s*-\s*alert:\s*(\S+)", text, re.M)
    assert REQUIRED_ALERTS <= set(alerts), REQUIRED_ALERTS - set(alerts)
    tested = set(re.findall(r"alertname:\s*(\S+)", ALERTS_TEST.read_text()))
    assert set(alerts) <= tested, f"alerts without a promtool unit test: {set(alerts) - tested}"
    doc = ALERTS_DOC.read_text()
    for block in re.split(r"^\s*-\s*alert:", text, flags=re.M)[1:]:
        name = block.split()[0]
        for key in ("summary:", "description:", "runbook_url:"):
            assert key in block, f"{name} has no {key}"
        # absolute (clickable in Alertmanager and Grafana), base from the auditor_url external label
        assert ('runbook_url: "{{ with $externalLabels.auditor_url }}{{ . }}{{ else }}http://localhost:8000{{ end }}'
                f'/runbook#{name.lower()}"') in block, name
        assert re.search(rf"^## {name}\b", doc, re.M), f"docs/alerts.md has no section '## {name}'"
        if name != "AuditorDown" and "reason" not in block:
            assert "{{ $labels.run }}" in block and "{{ $labels.statistic }}" in block, name


# --------------------------------------------------------------------------- metric names


def test_promql_reader_finds_metric_names():
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(auditor_ingest_duration_seconds_bucket'
        '{run=~"$run"}[$__rate_interval]))) / 1e-8 or vector(0) + sum without (kind) '
        '(auditor_faults_total{kind="x"} offset 10m) and on (run) up == bool 0'
    )
    assert promql_metric_names(expr) == {"auditor_ingest_duration_seconds_bucket", "auditor_faults_total", "up"}


def _check_names(where: str, expr: str, exported: set[str]) -> set[str]:
    names = promql_metric_names(expr)
    assert auditor_names(expr) <= names, f"{where}: reader disagrees with the scan: {expr}"
    unknown = {n for n in names if family(n, exported) is None}
    assert not unknown, f"{where} uses metrics the service does not export: {sorted(unknown)}\n{expr}"
    return {family(n, exported) for n in names}


def test_alert_rules_use_only_exported_metrics():
    exported = exported_metrics()
    used = set()
    for name, expr in rule_exprs(ALERTS.read_text()):
        used |= _check_names(f"alert {name}", expr, exported)
    assert {"auditor_cp_disagreement_sigma", "auditor_applied_error_sigma", "auditor_faults_total",
            "auditor_steps_audited_total", "up"} <= used


def test_dashboard_uses_only_exported_metrics_and_shows_all_of_them():
    exported = exported_metrics()
    used = set()
    for where, expr in dashboard_exprs(dashboard()):
        used |= _check_names(where, expr, exported)
    assert DESIGN_METRICS <= used, f"metrics not on the dashboard: {DESIGN_METRICS - used}"


def _scraped_families(tmp_path) -> set[str]:
    """The metric families a real service exports on ``/metrics`` once it has audited a
    step, rejected a report and seen ranks fall behind (an in-process server on SQLite)."""
    import time

    import httpx
    from factory import reference_reports
    from prometheus_client.parser import text_string_to_metric_families

    from auditor.config import Settings
    from auditor.server import BackgroundServer

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'm.db'}", grace_seconds=0.2, sweep_interval_seconds=0.1)
    with BackgroundServer(settings) as url:
        assert httpx.post(f"{url}/v1/reports", json={"reports": reference_reports("m", buggy=True)}).status_code == 200
        one = reference_reports("m", buggy=True, step=1)[:1]  # rank 1 never reports step 1: behind
        assert httpx.post(f"{url}/v1/reports", json={"reports": one}).status_code == 200
        assert httpx.post(f"{url}/v1/reports", json={"reports": [{}]}).status_code == 422
        time.sleep(0.6)  # the sweep audits step 1 incomplete
        text = httpx.get(f"{url}/metrics").text
    # prometheus-client's creation timestamps (FAMILY_created) are not families of their own
    return {f.name if f.type != "counter" else f.name + "_total" for f in text_string_to_metric_families(text)
            if f.name.startswith("auditor_") and not f.name.endswith("_created")}


def test_every_metric_is_on_the_dashboard_or_listed_internal(tmp_path):
    """Each family a real scrape shows is EXPORTED_METRICS', and queried by a panel unless
    INTERNAL_METRICS lists it (with why); nothing internal is on the dashboard."""
    from auditor.server.metrics import INTERNAL_METRICS

    scraped = _scraped_families(tmp_path)
    assert scraped == exported_metrics(), scraped ^ exported_metrics()
    used = set()
    for where, expr in dashboard_exprs(dashboard()):
        used |= _check_names(where, expr, exported_metrics())
    assert scraped - set(INTERNAL_METRICS) <= used, f"no panel for {sorted(scraped - set(INTERNAL_METRICS) - used)}"
    assert not set(INTERNAL_METRICS) & used and set(INTERNAL_METRICS) <= scraped
    assert all(why.strip() for why in INTERNAL_METRICS.values())


def test_deploy_doc_lists_every_alert_rule():
    """docs/deploy.md's alert table names each rule of alerts.yml with the rule's severity."""
    rules = dict(re.findall(r"^\s*-\s*alert:\s*(\S+)\n(?:.*\n)*?\s*severity:\s*(\w+)", ALERTS.read_text(), re.M))
    doc = (ROOT / "docs" / "deploy.md").read_text()
    table = dict(re.findall(r"^\| `(Auditor\w+)` \| (\w+) \|", doc, re.M))
    assert table == rules, {"missing": sorted(set(rules) - set(table)), "not rules": sorted(set(table) - set(rules)),
                            "severity": sorted(k for k in rules if k in table and table[k] != rules[k])}


def test_dashboard_promql_parses(tmp_path):
    """Every dashboard expression, with Grafana variables substituted, parses in promtool."""
    rules = []
    for i, (_, expr) in enumerate(dashboard_exprs(dashboard())):
        e = re.sub(r"\$__\w+|\$\{__\w+\}", "5m", expr)
        e = re.sub(r"\$\{\w+(?::\w+)?\}|\$\w+", ".*", e)
        rules.append({"record": f"dashboard:expr_{i}", "expr": e})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    out = run_tool("promtool", "check", "rules", str(path)).stdout
    assert f"SUCCESS: {len(rules)} rules found" in out, out


# --------------------------------------------------------------------------- grafana


def test_dashboard_structure():
    dash = dashboard()
    assert dash["uid"] == DASHBOARD_UID
    ids = [p["id"] for p in all_panels(dash)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    assert all(isinstance(i, int) for i in ids)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"run", "statistic"} <= set(variables)
    for name in ("run", "statistic"):
        q = variables[name]["query"]
        q = q["query"] if isinstance(q, dict) else q
        assert q.startswith("label_values(auditor_steps_audited_total") and q.endswith(f", {name})"), q
    for p in all_panels(dash):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == DATASOURCE_UID, p["title"]
        assert p.get("targets"), f"panel {p['title']} has no query"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == DATASOURCE_UID, p["title"]
    exprs = " ".join(e for _, e in dashboard_exprs(dash))
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs


def test_grafana_provisioning_matches_dashboard_and_compose():
    ds = DATASOURCE.read_text()
    assert re.search(rf"^\s*uid:\s*{DATASOURCE_UID}\s*$", ds, re.M)
    assert "url: http://prometheus:9090" in ds
    provider_path = re.search(r"^\s*path:\s*(\S+)", DASHBOARD_PROVIDER.read_text(), re.M).group(1)
    compose = COMPOSE.read_text()
    assert f"./deploy/grafana/dashboards:{provider_path}:ro" in compose


# --------------------------------------------------------------------------- compose, docker


def test_docker_compose_config(tmp_path):
    exe = require_tool("docker-compose", "docker-compose")
    clean = {"PATH": os.environ["PATH"]}
    # the example's values are empty: compose refuses it as it is, naming the first secret
    example = ROOT / "deploy" / "env.example"
    proc = subprocess.run([exe, "-f", str(COMPOSE), "--env-file", str(example), "config", "-q"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=clean)
    assert proc.returncode != 0 and "POSTGRES_PASSWORD" in proc.stderr, proc.stderr
    # filled in, with a password a URL could not hold as it is
    env_file = tmp_path / ".env"
    env_file.write_text(example.read_text().replace("POSTGRES_PASSWORD=", "POSTGRES_PASSWORD=p@ss/w:rd%1")
                        .replace("AUDITOR_TOKEN=", "AUDITOR_TOKEN=tok-3f9a").replace(
                            "GRAFANA_ADMIN_PASSWORD=", "GRAFANA_ADMIN_PASSWORD=graf-77"))
    base = [exe, "-f", str(COMPOSE), "--env-file", str(env_file)]
    proc = subprocess.run([*base, "config"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=clean)
    assert proc.returncode == 0, f"docker-compose config exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    # the secrets come from the env file: they appear in the resolved config, not in the compose file;
    # the password as PGPASSWORD, the URL without it
    assert "tok-3f9a" in proc.stdout and "PGPASSWORD: p@ss/w:rd%1" in proc.stdout, proc.stdout
    assert "AUDITOR_DATABASE_URL: postgresql+psycopg://auditor@postgres:5432/auditor" in proc.stdout
    services = subprocess.run([*base, "config", "--services"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120).stdout.split()
    assert {"auditor", "postgres", "prometheus", "grafana"} <= set(services), services
    # without one, compose refuses to start and names the missing variable
    empty = ROOT / "deploy" / "docker" / "entrypoint.sh"  # any file without the variables
    proc = subprocess.run([exe, "-f", str(COMPOSE), "--env-file", str(empty), "config", "-q"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={"PATH": os.environ["PATH"]})
    assert proc.returncode != 0 and "POSTGRES_PASSWORD" in proc.stderr, proc.stderr


def test_the_database_password_travels_outside_the_url(monkeypatch):
    """The compose stack's URL carries no password; PostgreSQL's client takes it from
    PGPASSWORD, so any character works: a real connection of the service's engine to the
    local PostgreSQL, with a password holding "@", "/", ":" and "%", uses it unchanged."""
    from auditor.db.engine import make_engine
    from auditor.testing.postgres import PG_ADMIN_URL

    secret = "p@ss/w:rd%1"
    monkeypatch.setenv("PGPASSWORD", secret)
    engine = make_engine(PG_ADMIN_URL.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            assert conn.connection.dbapi_connection.info.password == secret
    finally:
        engine.dispose()


def test_the_entrypoint_refuses_placeholder_secrets(tmp_path):
    """deploy/docker/entrypoint.sh exits 2 naming the variable when a secret is an old
    example's placeholder ("change-me-too"), before it touches the database; a real value
    goes on to `auditor db upgrade` then `auditor serve` (a stub `auditor` records them)."""
    stub = tmp_path / "bin" / "auditor"
    stub.parent.mkdir()
    stub.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\n")
    stub.chmod(0o755)
    entry = ROOT / "deploy" / "docker" / "entrypoint.sh"
    env = {"PATH": f"{stub.parent}:{os.environ['PATH']}", "PGPASSWORD": "x7", "AUDITOR_TOKEN": "change-me-too"}
    proc = subprocess.run(["sh", str(entry)], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 2 and "AUDITOR_TOKEN is a placeholder" in proc.stderr, proc.stderr
    assert not (tmp_path / "calls").exists()
    proc = subprocess.run(["sh", str(entry)], capture_output=True, text=True, timeout=30,
                          env={**env, "AUDITOR_TOKEN": "tok-3f9a"})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "calls").read_text().splitlines() == ["db upgrade", "serve --host 0.0.0.0 --port 8000"]


def test_compose_mounts_exist_and_wire_the_stack():
    compose = COMPOSE.read_text()
    for host_path in re.findall(r"^\s*-\s*\./([^:\s]+):", compose, re.M):
        assert (ROOT / host_path).exists(), f"docker-compose.yml mounts missing ./{host_path}"
    assert "postgresql+psycopg://auditor@postgres:5432/auditor" in compose and "PGPASSWORD: ${POSTGRES_PASSWORD:?" in compose
    for key, secret in (("POSTGRES_PASSWORD", "POSTGRES_PASSWORD"), ("AUDITOR_TOKEN", "AUDITOR_TOKEN"),
                        ("GF_SECURITY_ADMIN_PASSWORD", "GRAFANA_ADMIN_PASSWORD")):
        assert re.search(rf"{key}: \$\{{{secret}:\?", compose), secret  # from the env file only
    assert "condition: service_healthy" in compose
    prom = PROM_CONFIG.read_text()
    assert "job_name: auditor" in prom and '"auditor:8000"' in prom
    assert re.search(r"rule_files:\s*\n\s*-\s*alerts\.yml", prom)


def test_dockerfile():
    text = DOCKERFILE.read_text()
    assert text.count("FROM python:3.11-slim") >= 1
    assert '.[postgres]' in text
    assert re.search(r"^USER\s+(?!root)(?!0\b)\S+", text, re.M), "the image must not run as root"
    assert re.search(r"^HEALTHCHECK .*\n?.*/healthz", text, re.M)
    for src in re.findall(r"^COPY\s+(?!--from)(.+)\s+\S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"Dockerfile copies missing {path}"
    entry = (ROOT / "deploy" / "docker" / "entrypoint.sh").read_text()
    assert entry.index("auditor db upgrade") < entry.index("exec auditor serve --host 0.0.0.0")
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "!deploy/docker/entrypoint.sh" in ignore
