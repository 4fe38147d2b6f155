"""Observability on a real Prometheus: the rules pass promtool, and every query of the chart's
Grafana dashboard and of the rules returns data from a live local run.

Needs Debian's `prometheus` package (`/usr/bin/prometheus`, `/usr/bin/promtool`; `.ci/run`
installs it). Without it the tests skip with a message, except under CI (`$CI` set), where a
missing binary is a failure: this is the only test of the dashboard against real data.

The live run: one syncer and two learners (tests/faults/cluster.py) with `--metrics-port`, and
the operator's metrics (diloco.operator.metrics.OperatorMetrics, the same class the operator
serves) exported from this test process and fed from the syncer's Status the way the operator
feeds them (ready learners, learner-time goodput, a loss and a re-admission when the test
SIGKILLs a learner and restarts it). Prometheus runs as a plain process on 127.0.0.1 with its
own config and data directory, scraping every second and evaluating the rule file every
second. Targets carry the labels the chart's PodMonitor gives real pods (`namespace`,
`diloco_job`, `diloco_component`, `diloco_group`, `pod`).

The dashboard's queries run as written: their [1m] to [1h] windows return data on a
40-second history, because rate() and increase() work from whatever samples fall inside the
window (two 1 s scrapes are enough); only Grafana's variables are substituted, with the values
its own `label_values` queries return. Over a window longer than the history those rates are
underestimates (the increase is spread over the whole window), so the copy of the rule file
this Prometheus evaluates has its windows shortened to [10s] (the one test-time substitution),
which makes the recorded goodput a real figure the test can check. Alert expressions run from
the rule file as written, twice: as they are (LearnerLost and SyncerDown are made true by
killing a learner and then the syncer, and Prometheus itself holds them pending), and with
every comparison turned into a `bool` comparison, so an alert whose condition is false today
must still select existing series. Thresholds and `for:` durations are tested by promtool.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.apps.local.procs import free_port
from tests.faults.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "decoupled-diloco"
RULES = CHART / "files" / "prometheus-rules.yaml"
RULE_TESTS = CHART / "files" / "prometheus-rules-tests.yaml"
JOB = "prom-e2e"
NAMESPACE = "default"
ALERTS = {"LearnerLost", "SyncerDown", "GoodputLow", "QuorumStarved", "IntegrityRefusals",
          "JobFailed", "OperatorDown", "OperatorReplicaDown", "OperatorReconcileErrors", "ChildWritesRefused", "PodsUnschedulable"}
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}


def binary(name: str) -> str:
    path = shutil.which(name) or f"/usr/bin/{name}"
    if not Path(path).exists():
        message = f"{name} is not installed: `apt-get install prometheus` (Debian's package; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run this test")
        pytest.skip(message)
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent)


def test_promtool_check_rules() -> None:
    done = promtool("check", "rules", RULES.name)
    assert done.returncode == 0, done.stdout + done.stderr
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert {r["alert"] for g in groups for r in g["rules"] if "alert" in r} == ALERTS


@pytest.mark.slow
def test_promtool_test_rules() -> None:
    done = promtool("test", "rules", RULE_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


# ---------------------------------------------------------------------------------------
# Queries of the dashboard and the rules
# ---------------------------------------------------------------------------------------


def dashboards() -> list[dict[str, Any]]:
    files = sorted(CHART.rglob("*.json"))
    assert files, f"the chart ships no Grafana dashboard JSON under {CHART}"
    return [json.loads(p.read_text()) for p in files]


def dashboard_queries(dash: dict[str, Any]) -> list[str]:
    out: list[str] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            if isinstance(o.get("expr"), str) and o["expr"].strip():
                out.append(o["expr"])
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(dash.get("panels", []))
    return out


def rule_queries() -> tuple[list[str], list[tuple[str, str]]]:
    """(recorded series names, [(alert name, expression)])."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    return [r["record"] for r in rules if "record" in r], [(r["alert"], r["expr"]) for r in rules if "alert" in r]


def as_bool(expr: str) -> str:
    """Turn every comparison outside label matchers and strings into a `bool` comparison, so the
    expression returns its series (0 or 1) whether or not the alert's condition holds."""
    out, i, depth, quote = [], 0, 0, ""
    while i < len(expr):
        ch = expr[i]
        if quote:
            out.append(ch)
            if ch == "\\":
                out.append(expr[i + 1])
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'`":
            quote = ch
            out.append(ch)
        elif ch == "{":
            depth += 1
            out.append(ch)
        elif ch == "}":
            depth -= 1
            out.append(ch)
        elif depth == 0 and (m := re.match(r"(==|!=|>=|<=|>|<)(\s*bool\b)?", expr[i:])):
            out.append(m.group(0) if m.group(2) else m.group(1) + " bool")
            i += len(m.group(0))
            continue
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def test_as_bool_leaves_matchers_alone() -> None:
    assert (as_bool('up{a!="x", b=~"y"} == 0 or (m{c!~"z"} - n) > 0')
            == 'up{a!="x", b=~"y"} == bool 0 or (m{c!~"z"} - n) > bool 0')
    assert as_bool("a >= bool 1") == "a >= bool 1"


# ---------------------------------------------------------------------------------------
# A live run scraped by a real Prometheus
# ---------------------------------------------------------------------------------------


class Prometheus:
    def __init__(self, root: Path, targets: dict[str, tuple[int, dict[str, str]]], operator_port: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        static = [{"targets": [f"127.0.0.1:{port}"], "labels": labels} for port, labels in targets.values()]
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "diloco-jobs", "static_configs": static},
                {"job_name": "diloco-operator",
                 # The labels the chart's ServiceMonitor gives the operator's target.
                 "static_configs": [{"targets": [f"127.0.0.1:{operator_port}"],
                                     "labels": {"namespace": "diloco-system", "diloco_component": "operator"}}]},
            ],
        }
        # The rule file with its rate windows shortened to what a short run can fill (see above).
        rules = re.sub(r"\[(1m|5m|15m|1h)\]", "[10s]", RULES.read_text())
        (root / "rules.yaml").write_text(rules)
        config["rule_files"] = [str(root / "rules.yaml")]
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = root / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [binary("prometheus"), f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def get(self, path: str, **params: Any) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expr)["result"]

    def alerts(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for a in self.get("/api/v1/alerts")["alerts"]:
            out.setdefault(a["labels"]["alertname"], set()).add(a["state"])
        return out

    def rule_health(self) -> list[str]:
        bad = []
        for g in self.get("/api/v1/rules")["groups"]:
            for r in g["rules"]:
                if r.get("health") != "ok" and r.get("lastEvaluation", "").startswith("0001"):
                    continue  # not evaluated yet
                if r.get("health") != "ok":
                    bad.append(f"{r['name']}: {r.get('health')} {r.get('lastError', '')}")
        return bad

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


class OperatorExporter:
    """The operator's metrics, fed from the syncer's Status the way the operator feeds them."""

    def __init__(self, cluster: Cluster):
        from prometheus_client import start_http_server

        from diloco.operator.metrics import OperatorMetrics

        self.cluster, self.metrics = cluster, OperatorMetrics()
        self.port = free_port()
        self.server, _ = start_http_server(self.port, addr="127.0.0.1", registry=self.metrics.registry)
        self.desired = len(cluster.learners)
        # A kind the operator writes, refused 0 times so far (a refusal adds the series; the
        # operator does not make one up front for every kind and reason).
        self.metrics.refused_writes.labels("StatefulSet", "QuotaExceeded")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        """The job's status as the operator computes it (operator/status/goodput.py), every half second."""
        from diloco.operator.status import goodput
        from diloco.operator.status.job import Observation, RegionView, SyncerView
        from diloco.spec import parse_job

        spec = parse_job(self.cluster.manifest).spec
        status: dict[str, Any] = {}
        while not self.stop.wait(0.5):
            s = self.cluster.latest_status()
            fresh = s is not None and time.time() - s.t < 2.0
            active = min(s.active_learners, self.desired) if fresh else 0  # type: ignore[union-attr]
            view = None
            if fresh and s is not None:
                region = RegionView(region=spec.learner_groups[0].region, learners=self.desired, active_learners=active,
                                    tokens_merged=s.tokens_merged, bytes_received=0, contributions=0,
                                    mean_staleness=0.0, step_seconds=s.step_seconds)
                view = SyncerView(incarnation=s.incarnation, outer_version=sum(s.versions), tokens_merged=s.tokens_merged,
                                  active_learners=active, readmissions=0, regions=(region,), refused=s.refused)
            acc = goodput.advance(spec, status, Observation(now=time.time(), syncer=view), desired=self.desired,
                                  active=active, counting=True)
            status = {"accounting": acc, **goodput.figures(spec, acc), "desiredLearners": self.desired,
                      "readyLearners": active, "phase": "Running" if active else "Pending"}
            self.metrics.job_status(NAMESPACE, JOB, status, goodput.capacity_tokens(spec, acc))
            self.metrics.capacity_wait(NAMESPACE, JOB, 0, 0.0)  # every pod placed (local processes)

    def lost(self, group: str) -> None:
        self.metrics.losses.labels(NAMESPACE, JOB, group, "Failed").inc()
        self.metrics.chaos_kills.labels(NAMESPACE, JOB).inc()

    def readmitted(self, group: str) -> None:
        self.metrics.readmissions.labels(NAMESPACE, JOB, group).inc()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[Cluster, Prometheus, OperatorExporter]]:
    binary("prometheus")
    cluster = Cluster(tmp_path / "job", JOB, 2)
    exporter = prom = None
    try:
        exporter = OperatorExporter(cluster)
        base = {"namespace": NAMESPACE, "diloco_job": JOB}
        targets = {"syncer": (cluster.procs["syncer"].metrics_port,
                              {**base, "diloco_component": "syncer", "pod": f"{JOB}-syncer-0"})}
        for name in cluster.learners:
            targets[name] = (cluster.procs[name].metrics_port,
                             {**base, "diloco_component": "learner", "diloco_group": "local", "pod": f"{JOB}-{name}"})
        prom = Prometheus(tmp_path, targets, exporter.port)
        cluster.wait_for(prom.ready, 30, "Prometheus to be ready")
        cluster.start_syncer()
        for i in range(len(cluster.learners)):
            cluster.start_learner(i)
        yield cluster, prom, exporter
    finally:
        cluster.close()
        if exporter is not None:
            exporter.close()
        if prom is not None:
            prom.close()


def has_data(prom: Prometheus, expr: str) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in prom.query(expr))


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_every_dashboard_and_rule_query_returns_data(live: tuple[Cluster, Prometheus, OperatorExporter]) -> None:
    c, prom, exporter = live
    for name in c.learners:
        c.wait_event(name, "joined", timeout=150)
    c.wait_for(lambda: has_data(prom, "diloco_job:learner_steps:rate1m > 0")
               and has_data(prom, "diloco_job:syncer_merges:rate1m > 0"), 60, "recorded step and merge rates")

    # A learner dies: its target goes down, the operator counts a loss, LearnerLost turns true.
    t_kill = c.kill("local-1")
    exporter.lost("local")
    learner_lost = dict(rule_queries()[1])["LearnerLost"]
    c.wait_for(lambda: has_data(prom, learner_lost), 30, "LearnerLost's condition to hold")
    c.wait_for(lambda: "pending" in prom.alerts().get("LearnerLost", set()), 30, "Prometheus to hold LearnerLost pending")
    c.restart("local-1")
    c.wait_event("local-1", "joined", after=t_kill, timeout=90)
    exporter.readmitted("local")
    c.wait_for(lambda: has_data(prom, f'up{{pod="{JOB}-local-1"}} == 1'), 30, "the restarted learner to be scraped")

    # Grafana's variables, from the dashboard's own label_values() queries.
    failures: list[str] = []
    queries: list[str] = []
    for dash in dashboards():
        values = dict(GRAFANA_BUILTINS)
        for var in dash.get("templating", {}).get("list", []):
            query = var.get("query")
            if var.get("type") != "query" or not isinstance(query, str):
                continue
            m = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\)\s*", query)
            assert m, f"variable {var['name']}: unsupported query {query!r}"
            selector = substitute(m.group(1), values)
            found = prom.get(f"/api/v1/label/{m.group(2)}/values", **{"match[]": selector})
            expected = {"namespace": NAMESPACE, "job": JOB}.get(var["name"])
            if expected not in found:
                failures.append(f"variable {var['name']}: {query} gave {found}, not {expected!r}")
            values[var["name"]] = expected or (found[0] if found else "")
        queries += [substitute(q, values) for q in dashboard_queries(dash)]
    records, alerts = rule_queries()
    queries += records + [as_bool(expr) for _, expr in alerts]
    assert len(queries) > 20

    answered: set[str] = set()

    def missing() -> list[str]:
        answered.update(q for q in queries if q not in answered and has_data(prom, q))
        return [q for q in dict.fromkeys(queries) if q not in answered]

    try:  # counters created late (the loss, the re-admission) need a few scrapes for rate()
        c.wait_for(lambda: not missing(), 40, "every query to return data")
    except AssertionError:
        pass
    failures += [f"no data: {q}" for q in missing()]
    failures += prom.rule_health()
    assert not failures, "\n".join(failures)

    # Recorded figures are real ones: both learners step, and most of their time is training
    # the syncer accepted (a 10 s window; the learner restarted above has been back a while).
    def value(expr: str) -> float:
        result = prom.query(expr)
        return float(result[0]["value"][1]) if result else math.nan
    c.wait_for(lambda: 0.3 < value("diloco_job:learner_goodput:ratio_rate5m") <= 1.05, 30, "a goodput over 30%")
    assert value("diloco_job:learner_steps:rate1m") > 1.0
    assert 0.0 <= value("diloco_job:contributions_refused:ratio_rate5m") <= 1.0

    # The syncer dies: SyncerDown's condition holds and Prometheus holds the alert pending.
    c.kill("syncer")
    syncer_down = dict(alerts)["SyncerDown"]
    c.wait_for(lambda: has_data(prom, syncer_down), 30, "SyncerDown's condition to hold")
    c.wait_for(lambda: "pending" in prom.alerts().get("SyncerDown", set()), 30, "Prometheus to hold SyncerDown pending")


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variable syntax: ${name}, ${name:format} and $name."""
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return values.get(name, m.group(0))
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)
