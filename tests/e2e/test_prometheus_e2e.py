"""A real Prometheus (Debian's ``prometheus`` binary) scraping a live auditor and evaluating the
project's alert rules, while the real demo (gloo workers with Megatron-core process groups)
whitens the reference case twice: reduced over the DP group without CP (slime's bug) and with
CP (the fix).

Everything runs on loopback with free ports, a temporary TSDB and a configuration derived
from ``deploy/prometheus/prometheus.yml`` (1 s scrape and evaluation intervals, the rules of
``deploy/prometheus/alerts.yml``, no Alertmanager). Bounded in time; whatever the test
started is stopped, also on failure.
"""

from __future__ import annotations

import io
import re
import subprocess
import time
import uuid
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml
from rich.console import Console

from auditor.demo import run_demo
from auditor.server import free_port
from auditor.testing.server import ServerProcess
from auditor.testing.tools import require_tool

ROOT = Path(__file__).resolve().parents[2]
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT = "AuditorCPDisagreement"

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(240),
    pytest.mark.usefixtures("prometheus"),
]


@pytest.fixture
def prometheus() -> str:
    """Debian's prometheus (scripts/setup.sh --test installs it): missing, the test fails."""
    return require_tool("prometheus", "prometheus")


def prometheus_config(auditor_port: int, prometheus_port: int) -> dict:
    """deploy/prometheus/prometheus.yml with 1 s intervals, the rules file by absolute path,
    no Alertmanager, the targets on loopback and ``auditor_url`` (the runbook's base) the
    auditor under test."""
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    assert "auditor_url" in cfg["global"]["external_labels"]
    cfg["global"]["external_labels"]["auditor_url"] = f"http://127.0.0.1:{auditor_port}"
    assert cfg["rule_files"] == ["alerts.yml"]
    cfg["rule_files"] = [str(ALERTS)]
    cfg.pop("alerting", None)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["auditor"]["metrics_path"] == "/metrics"
    jobs["auditor"]["static_configs"] = [{"targets": [f"127.0.0.1:{auditor_port}"]}]
    jobs["prometheus"]["static_configs"] = [{"targets": [f"127.0.0.1:{prometheus_port}"]}]
    return cfg


class Prometheus:
    """The prometheus binary on 127.0.0.1 with a throw-away TSDB; a context manager."""

    def __init__(self, config: dict, port: int, workdir: Path):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.workdir = workdir
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Prometheus":
        check = subprocess.run(["promtool", "check", "config", str(self.config_path)],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={self.config_path}",
                 f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        try:
            self._wait(lambda: httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200, 60, "ready")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def _wait(self, ok, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}):\n{self.log_path.read_text()[-3000:]}")
            try:
                got = ok()
                if got:
                    return got
            except httpx.HTTPError as e:
                last = e
            time.sleep(0.25)
        raise TimeoutError(f"prometheus: not {what} after {timeout} s ({last}); log:\n"
                           f"{self.log_path.read_text()[-3000:]}")

    def api(self, path: str, **params) -> dict | list:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        r.raise_for_status()
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def alerts(self, name: str, run: str) -> list[dict]:
        return [a for a in self.api("alerts")["alerts"]
                if a["labels"].get("alertname") == name and a["labels"].get("run") == run]

    def last_evaluation(self, group: str) -> float:
        """Unix time of the newest evaluation of a rule group."""
        (g,) = [g for g in self.api("rules")["groups"] if g["name"] == group]
        m = re.fullmatch(r"([0-9T:-]+)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", g["lastEvaluation"])
        assert m, g["lastEvaluation"]
        zone = "+00:00" if m.group(3) == "Z" else m.group(3)
        return datetime.fromisoformat(m.group(1) + zone).timestamp() + float("0." + (m.group(2) or "0"))


@pytest.fixture
def pg_url(pg_databases):
    return pg_databases("prom")


def test_buggy_demo_fires_cp_disagreement_alert_fixed_run_does_not(pg_url, tmp_path):
    """Prometheus scrapes `auditor serve --workers 2` on PostgreSQL every second; the real demo
    (dp=1, cp=2 gloo workers) whitens the reference case with slime's bug and with the fix.
    AuditorCPDisagreement goes to *firing* for the buggy run, labelled with its run and
    statistic and carrying the auditor's cp_disagreement_sigma (0.433 σ, far above the 0.01 σ
    threshold) and an absolute runbook_url the auditor serves; after Prometheus has scraped the fixed run's gauge (0) and evaluated the rules
    again, no alert of any kind names the fixed run. The scrape target is up."""
    server = ServerProcess(pg_url, tmp_path / "auditor.log", args=("--workers", "2"),
                           AUDITOR_GRACE_SECONDS="5", AUDITOR_SWEEP_INTERVAL_SECONDS="0.5")
    prom_port = free_port()
    try:
        server.start()
        with Prometheus(prometheus_config(server.port, prom_port), prom_port, tmp_path) as prom:
            prom._wait(lambda: any(t["health"] == "up" for t in prom.api("targets")["activeTargets"]
                                   if t["labels"]["job"] == "auditor"), 30, "scraping the auditor")

            prefix = f"e2e-{uuid.uuid4().hex[:8]}"
            result = run_demo(server.url, dp=1, cp=2, console=Console(file=io.StringIO()), prefix=prefix,
                              timeout=120)
            buggy, fixed = result.buggy_run_id, result.fixed_run_id
            assert all(r.delivered for r in result.ranks)
            assert result.reports[buggy]["consistent"] is False and result.reports[fixed]["consistent"] is True
            (stat,) = result.reports[buggy]["statistics"]
            sigma = stat["cp_disagreement_sigma"]
            assert sigma == pytest.approx(0.433154, abs=1e-3)

            firing = prom._wait(
                lambda: [a for a in prom.alerts(ALERT, buggy) if a["state"] == "firing"], 30, f"{ALERT} firing")
            (alert,) = firing
            assert alert["labels"]["statistic"] == stat["statistic"]
            assert alert["labels"]["severity"] == "critical"
            assert float(alert["value"]) == pytest.approx(sigma, rel=1e-9)
            assert buggy in alert["annotations"]["summary"]
            # the runbook link is absolute, built from the auditor_url external label, and the
            # auditor serves the section it points to
            runbook = alert["annotations"]["runbook_url"]
            assert runbook == f"{server.url}/runbook#{ALERT.lower()}"
            assert f'id="{ALERT.lower()}"' in httpx.get(runbook.split("#")[0], timeout=10).text

            # The fixed run has been scraped (its gauge is 0) and the rules evaluated since.
            prom._wait(lambda: prom.api("query", query=f'auditor_cp_disagreement_sigma{{run="{fixed}"}}')["result"],
                       30, "scraped the fixed run")
            seen = time.time()
            prom._wait(lambda: prom.last_evaluation("auditor.statistics") > seen + 1, 30, "re-evaluated the rules")
            (sample,) = prom.api("query", query=f'auditor_cp_disagreement_sigma{{run="{fixed}"}}')["result"]
            assert float(sample["value"][1]) == 0.0
            assert [a for a in prom.api("alerts")["alerts"] if a["labels"].get("run") == fixed] == []
            assert [a["state"] for a in prom.alerts(ALERT, buggy)] == ["firing"]
            (up,) = prom.api("query", query='up{job="auditor"}')["result"]
            assert up["value"][1] == "1"
    finally:
        server.stop()
