"""The alerting rules and the Grafana dashboard (deploy/), checked with Prometheus' own promtool.

- `promtool check rules` on deploy/prometheus/kvchecksum-rules.yml;
- `promtool test rules` on its unit tests (kvchecksum-rules.test.yml: each
  alert fires on a series that should trigger it, and not on a clean one);
- every `expr` of deploy/grafana/kvchecksum-dashboard.json parses: written as
  one recording rule each into a rules file that `promtool check rules` reads
  (no server needed), Grafana's variables replaced by values;
- every vllm:kv_checksum_* name and label they use is one the servers export
  (vllm_kvchecksum/engine/metrics.py), and the dashboard shows every one.

promtool comes from Debian's `prometheus` package, which `make setup`
installs (ci/setup.sh). Without it these tests fail, naming `make setup`;
KVCS_SKIP_PROMTOOL=1 skips the promtool tests knowingly (the rest still run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from vllm_kvchecksum.engine import metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "kvchecksum-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvchecksum-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvchecksum-dashboard.json"
ALERTS_DOC = ROOT / "docs" / "alerts.md"

# vLLM's labels on every checksum metric (PrometheusStatLogger), and the ones
# Prometheus adds to every scraped series.
VLLM_LABELS = {"model_name", "engine"}
TARGET_LABELS = {"job", "instance"}
# Values for Grafana's variables, so that an expr is plain PromQL.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$model_name": "m"}

_NAME = re.compile(r"vllm:kv_checksum_[a-z_]+")
# `by (labels) (rate|increase(name` in an expr.
_BY_OF = re.compile(r"by\s*\(([^)]*)\)\s*\(\s*(?:rate|increase)\((vllm:kv_checksum_[a-z_]+)")
# The label names of a selector `{a="x", b=~"y"}`.
_SELECTOR = re.compile(r"(vllm:kv_checksum_[a-z_]+)\{([^}]*)\}")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("KVCS_SKIP_PROMTOOL") == "1":
            pytest.skip("promtool not installed and KVCS_SKIP_PROMTOOL=1")
        pytest.fail("promtool not found on PATH: `make setup` installs it (Debian's prometheus package, "
                    "ci/setup.sh; as root: apt-get install prometheus). KVCS_SKIP_PROMTOOL=1 skips these tests.")
    return path


def run(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard, rows included."""
    out = []

    def walk(panels):
        for p in panels:
            out.extend((p.get("title", ""), t["expr"]) for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))
    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


def plain(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


def known_metrics() -> dict[str, str | None]:
    """Every exported checksum series name -> the counter's own label (None: none; gauges none)."""
    out: dict[str, str | None] = {metrics.metric_name(k) + "_total": label
                                  for k, (_, label, _) in metrics.COUNTERS.items()}
    out.update({metrics.metric_name(k): None for k in metrics.GAUGES})
    return out


# ------------------------------------------------------------------- promtool

def test_rules_pass_promtool_check(promtool):
    res = run(promtool, "check", "rules", RULES.name, cwd=RULES.parent)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules())} rules found" in res.stdout, res.stdout


def test_rules_pass_their_promtool_unit_tests(promtool):
    res = run(promtool, "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout, res.stdout


def test_every_dashboard_expr_parses(promtool, tmp_path):
    targets = dashboard_targets()
    assert targets
    recording = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"kvcs:dashboard_expr_{i}", "expr": plain(expr)} for i, (_, expr) in enumerate(targets)]}]}
    path = tmp_path / "dashboard-exprs.yml"
    path.write_text(yaml.safe_dump(recording))
    res = run(promtool, "check", "rules", path.name, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(targets)} rules found" in res.stdout, res.stdout


def test_the_expr_check_finds_a_broken_expr(promtool, tmp_path):
    """The check above fails on an expr that does not parse (so its pass means something)."""
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [
        {"record": "kvcs:broken", "expr": plain('sum by(cause) (rate(vllm:kv_checksum_loads_mismatched_total'
                                                '{model_name="$model_name"}[$__rate_interval])')}]}]}))
    assert run(promtool, "check", "rules", path.name, cwd=tmp_path).returncode != 0


# ------------------------------------------------------- names and labels

def all_exprs() -> list[tuple[str, str]]:
    return [(r["alert"], r["expr"]) for r in rules()] + dashboard_targets()


def test_every_metric_name_is_one_the_servers_export():
    known = known_metrics()
    for where, expr in all_exprs():
        names = _NAME.findall(expr)
        for name in names:
            assert name in known, f"{where}: {name} is not exported (metrics.py has {sorted(known)})"


def test_every_label_is_one_the_metric_carries():
    known = known_metrics()
    for where, expr in all_exprs():
        for labels, name in _BY_OF.findall(expr):
            allowed = VLLM_LABELS | TARGET_LABELS | ({known[name]} if known.get(name) else set())
            used = {x.strip() for x in labels.split(",") if x.strip()}
            assert used <= allowed, f"{where}: by ({labels}) of {name}; it carries {sorted(allowed)}"
        for name, selector in _SELECTOR.findall(expr):
            allowed = VLLM_LABELS | TARGET_LABELS | ({known[name]} if known.get(name) else set())
            used = {m.split("=")[0].strip().rstrip("!~") for m in selector.split(",") if m.strip()}
            assert used <= allowed, f"{where}: {{{selector}}} of {name}; it carries {sorted(allowed)}"


def test_the_dashboard_shows_every_checksum_metric():
    shown = {n for _, expr in dashboard_targets() for n in _NAME.findall(expr)}
    assert set(known_metrics()) - shown == set()


def test_the_dashboard_follows_vllms_conventions():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["model_name"]["type"] == "query" and "model_name" in variables["model_name"]["definition"]
    for title, expr in dashboard_targets():
        # Every checksum series is of the chosen model.
        for name, selector in _SELECTOR.findall(expr):
            assert 'model_name="$model_name"' in selector, (title, expr)
        assert all(f"{n}{{" in expr for n in _NAME.findall(expr)), (title, expr)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


# ------------------------------------------------------------- the alerts

def test_each_alert_says_what_it_means_and_what_to_do():
    doc = ALERTS_DOC.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", doc, re.M)}
    for r in rules():
        ann = r["annotations"]
        assert ann["summary"] and len(ann["description"]) > 80, r["alert"]
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        path, _, anchor = ann["runbook_url"].partition("#")
        assert path == "docs/alerts.md" and anchor == r["alert"].lower() and anchor in anchors, \
            (r["alert"], ann["runbook_url"])


def test_each_alert_has_a_firing_and_a_silent_case():
    cases = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t["alert_rule_test"]]
    for r in rules():
        mine = [c for c in cases if c["alertname"] == r["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{r['alert']}: no case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{r['alert']}: no case where it stays silent"
