"""A real Prometheus beside the demo's servers, with the project's alert rules.

`make demo DEMO_ARGS=--alerts` starts Debian's `prometheus` binary (`make
setup` installs it, ci/setup.sh) with a config written into the demo's --out
directory: one scrape job per checked server (job "<setup>-producer" or
"<setup>-consumer"), scraped and evaluated every second, and
deploy/prometheus/kvchecksum-rules.yml loaded as an operator loads it
(docs/alerts.md). After some phases the demo reads Prometheus' own
/api/v1/alerts for the setup's two jobs:

- after `clean`: nothing fires, and no alert but the held-state ones (whose
  `for:` is 15 minutes) is even pending. Read once Prometheus has scraped both
  servers after the phase ended and evaluated the rules after that scrape.
- after the first fault that the consumer's check must catch:
  KVChecksumMismatch{cause="corrupt"} fires for the consumer;
- after `drop_checksums`: KVChecksumUnverified{reason="no_producer_checksums"}
  is pending for the consumer (its `for:` is 5 minutes);
- after `producer_flip_bit`: KVChecksumProducerChanged fires for the producer.

An expected alert is waited for (bounded by ALERT_WAIT_S); one that does not
come is a failed check of the run, as a stray one is.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvcs_demo.servers import ServerSpec

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "kvchecksum-rules.yml"
INTERVAL = "1s"  # scrape and evaluation interval
ALERT_WAIT_S = 30.0  # an expected alert: it fires within a few intervals
SETTLE_WAIT_S = 30.0  # a scrape and an evaluation after a phase's end
# The alerts whose `for:` outlasts any demo: pending is all they can be here.
HELD_ALERTS = ("KVChecksumLoadsHeld", "KVChecksumSendsHeld", "KVChecksumHeldBlocks")
# The consumer faults whose load must fail its check (the others verify, are
# unverified, or are the producer's).
NOT_A_CONSUMER_MISMATCH = ("change_tail", "drop_checksums", "producer_flip_bit")

_no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class AlertsError(RuntimeError):
    """Prometheus is missing, or does not answer as it must."""


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise AlertsError("--alerts needs the `prometheus` binary on PATH: `make setup` installs Debian's "
                          "prometheus package (ci/setup.sh; as root: apt-get install prometheus)")
    return path


def job_name(setup: str, side: str) -> str:
    return f"{setup}-{side}"


def config(targets: dict[str, str], rules: Path = RULES) -> dict:
    """prometheus.yml: `targets` maps a job name to its server's host:port."""
    return {"global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL, "scrape_timeout": INTERVAL},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                               for job, target in sorted(targets.items())]}


def server_spec(binary: str, work: Path, port: int, targets: dict[str, str]) -> ServerSpec:
    """Prometheus as one of the demo's processes (stopped with the servers), ready at /-/ready."""
    path = work / "prometheus.yml"
    path.write_text(json.dumps(config(targets), indent=2))  # JSON is YAML
    data = work / "prometheus-data"
    shutil.rmtree(data, ignore_errors=True)
    return ServerSpec("prometheus", [binary, f"--config.file={path}", f"--storage.tsdb.path={data}",
                                     f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
                                     "--log.level=warn"],
                      {}, port, work / "prometheus.log", health_path="/-/ready")


def parse_time(text: str) -> float:
    """An RFC 3339 time from Prometheus' API ("2026-12-07T13:55:01.123456789Z") as a Unix time."""
    head, _, frac = text.rstrip("Z").partition(".")
    frac = "".join(c for c in frac if c.isdigit())
    return datetime.fromisoformat(head + "+00:00").timestamp() + (float(f"0.{frac}") if frac else 0.0)


@dataclass(frozen=True)
class Expect:
    """An alert a phase must show: name, the job's side, one label's value, the states that pass."""

    alertname: str
    side: str
    label: str | None  # None: no label but the job's
    value: str | None
    states: tuple[str, ...]

    def met_by(self, alert: dict) -> bool:
        labels = alert.get("labels", {})
        return (labels.get("alertname") == self.alertname and alert.get("state") in self.states
                and (self.label is None or labels.get(self.label) == self.value)
                and labels.get("job", "").endswith("-" + self.side))

    def __str__(self) -> str:
        label = f"{{{self.label}={self.value!r}}}" if self.label else ""
        return f"{self.alertname}{label} {'/'.join(self.states)} on the {self.side}"


def expected(phase: str, kinds: list[str]) -> list[Expect] | None:
    """What `phase` must show; [] for clean (nothing), None for phases not checked."""
    if phase == "clean":
        return []
    first_mismatch = next((k for k in kinds if k not in NOT_A_CONSUMER_MISMATCH), None)
    if phase == first_mismatch:
        return [Expect("KVChecksumMismatch", "consumer", "cause", "corrupt", ("firing",))]
    if phase == "drop_checksums":
        return [Expect("KVChecksumUnverified", "consumer", "reason", "no_producer_checksums",
                       ("pending", "firing"))]
    if phase == "producer_flip_bit":
        return [Expect("KVChecksumProducerChanged", "producer", None, None, ("firing",))]
    return None


class Prometheus:
    """Prometheus' HTTP API, as far as the demo reads it."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def get(self, path: str, **params: str) -> dict | list:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with _no_proxy.open(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise AlertsError(f"Prometheus at {self.url} did not answer {path}: {e}") from e
        if body.get("status") != "success":
            raise AlertsError(f"Prometheus {path}: {body.get('error') or body}")
        return body["data"]

    def alerts(self, jobs: tuple[str, ...]) -> list[dict]:
        """The alerts (pending or firing) of these jobs: labels and state."""
        return [{"labels": a.get("labels", {}), "state": a.get("state")}
                for a in self.get("/api/v1/alerts")["alerts"] if a.get("labels", {}).get("job") in jobs]

    def settle(self, jobs: tuple[str, ...], since: float, timeout: float = SETTLE_WAIT_S) -> None:
        """Wait until every job was scraped (and up) after `since` and the rules were evaluated after those scrapes."""
        deadline = time.monotonic() + timeout
        while True:
            targets = [t for t in self.get("/api/v1/targets")["activeTargets"]
                       if t.get("labels", {}).get("job") in jobs]
            ends = [parse_time(t["lastScrape"]) + float(t.get("lastScrapeDuration") or 0) for t in targets
                    if t.get("health") == "up" and parse_time(t["lastScrape"]) > since]
            if len(ends) == len(jobs):
                evaluated = [parse_time(g["lastEvaluation"]) for g in self.get("/api/v1/rules")["groups"]
                             if g.get("lastEvaluation")]
                if evaluated and min(evaluated) > max(ends):
                    return
            if time.monotonic() > deadline:
                states = {t.get("labels", {}).get("job"): (t.get("health"), t.get("lastScrape"), t.get("lastError"))
                          for t in targets}
                raise AlertsError(f"Prometheus did not scrape {', '.join(jobs)} and evaluate its rules within "
                                  f"{timeout:g} s of the phase's end: {states}")
            time.sleep(0.2)


def check_phase(prom: Prometheus, setup: str, phase: str, kinds: list[str], since: float) -> dict | None:
    """The alerts of `setup` after `phase` (None: a phase not checked), judged.

    {"expected": [str], "seen": [{"alertname", "state", "job", labels...}], "problems": [str],
     "wait_s": the seconds the check took (what --alerts adds to the phase)}
    """
    want = expected(phase, kinds)
    if want is None:
        return None
    t0 = time.monotonic()
    jobs = (job_name(setup, "producer"), job_name(setup, "consumer"))
    problems: list[str] = []
    if not want:
        prom.settle(jobs, since)
        seen = prom.alerts(jobs)
        for a in seen:
            name = a["labels"].get("alertname")
            if a["state"] == "firing" or name not in HELD_ALERTS:
                problems.append(f"{name} {a['state']} for {a['labels'].get('job')} after the clean phase")
    else:
        deadline = time.monotonic() + ALERT_WAIT_S
        while True:
            seen = prom.alerts(jobs)
            missing = [e for e in want if not any(e.met_by(a) for a in seen)]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        problems += [f"expected {e} within {ALERT_WAIT_S:g} s; Prometheus had "
                     f"{[(a['labels'].get('alertname'), a['state']) for a in seen] or 'none'}" for e in missing]
    return {"expected": [str(e) for e in want] or ["nothing pending or firing"],
            "seen": [{"state": a["state"], **a["labels"]} for a in seen], "problems": problems,
            "wait_s": round(time.monotonic() - t0, 1)}


def summary(check: dict | None) -> str:
    """One phase's alerts, short: "KVChecksumMismatch(corrupt) firing" or "none"."""
    if check is None:
        return ""
    seen = [f"{a.get('alertname')}({a.get('cause') or a.get('reason') or a.get('job')}) {a.get('state')}"
            for a in check["seen"]]
    return ", ".join(sorted(set(seen))) or "none"
