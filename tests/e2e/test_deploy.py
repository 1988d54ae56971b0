"""Deployment artefacts: Prometheus rules and config, Grafana dashboard, docker-compose, Dockerfile.

Pure file checks plus the real binaries (Debian's ``prometheus`` package for ``promtool``,
``docker-compose`` v1); no server is started here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

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
    exe = shutil.which(args[0])
    if exe is None:
        pytest.fail(f"{args[0]} not found on PATH: install the Debian package 'prometheus'")
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


def test_docker_compose_config():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose binary not installed (Debian package docker-compose)")
    env_file = ROOT / "deploy" / "env.example"
    base = [exe, "-f", str(COMPOSE), "--env-file", str(env_file)]
    proc = subprocess.run([*base, "config"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"docker-compose config exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    # the secrets come from the env file: they appear in the resolved config, not in the compose file
    assert "change-me-too" in proc.stdout and "auditor:change-me@postgres" in proc.stdout
    services = subprocess.run([*base, "config", "--services"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120).stdout.split()
    assert {"auditor", "postgres", "prometheus", "grafana"} <= set(services), services
    # without one, compose refuses to start and names the missing variable
    empty = ROOT / "deploy" / "docker" / "entrypoint.sh"  # any file without the variables
    proc = subprocess.run([exe, "-f", str(COMPOSE), "--env-file", str(empty), "config", "-q"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={"PATH": os.environ["PATH"]})
    assert proc.returncode != 0 and "POSTGRES_PASSWORD" in proc.stderr, proc.stderr


def test_compose_mounts_exist_and_wire_the_stack():
    compose = COMPOSE.read_text()
    for host_path in re.findall(r"^\s*-\s*\./([^:\s]+):", compose, re.M):
        assert (ROOT / host_path).exists(), f"docker-compose.yml mounts missing ./{host_path}"
    assert "postgresql+psycopg://auditor:${POSTGRES_PASSWORD:?" in compose
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
