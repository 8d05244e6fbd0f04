"""kvcs_demo.alerts against a real Prometheus: the demo's --alerts checks, without vLLM.

A stand-in /metrics (a tiny HTTP server whose kv_checksum counters the test
sets) takes the place of each vLLM server; the `prometheus` binary of Debian's
package (`make setup` installs it) scrapes them with the project's rules
(deploy/prometheus/kvchecksum-rules.yml), as in `make demo DEMO_ARGS=--alerts`.
Without the binary these tests fail, naming `make setup`
(KVCS_SKIP_PROMTOOL=1 skips them knowingly).
"""

from __future__ import annotations

import http.server
import os
import shutil
import threading
import time

import pytest

from kvcs_demo import alerts
from kvcs_demo.servers import ProcessGroup, free_port_block

LABELS = 'model_name="m",engine="0"'


class FakeServer:
    """/metrics in Prometheus' text format, with the counters `values` holds."""

    def __init__(self):
        self.values: dict[str, float] = {}
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = "".join(f"{name}{{{LABELS}{',' + extra if extra else ''}}} {value}\n"
                               for (name, extra), value in outer.samples().items()).encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def samples(self) -> dict[tuple[str, str], float]:
        base = {("vllm:kv_checksum_loads_verified_total", ""): 0.0,
                ("vllm:kv_checksum_producer_changed_total", ""): 0.0,
                ("vllm:kv_checksum_loads_in_flight", ""): 0.0}
        for cause in ("corrupt", "wrong_request"):
            base[("vllm:kv_checksum_loads_mismatched_by_cause_total", f'cause="{cause}"')] = 0.0
        base[("vllm:kv_checksum_loads_unverified_total", 'reason="no_producer_checksums"')] = 0.0
        return base | {k: v for k, v in self.values.items()}


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("KVCS_SKIP_PROMTOOL") == "1":
            pytest.skip("prometheus not installed and KVCS_SKIP_PROMTOOL=1")
        with pytest.raises(alerts.AlertsError, match="make setup"):
            alerts.prometheus_binary()
        pytest.fail("prometheus not found on PATH: `make setup` installs it (Debian's prometheus package)")
    servers = {"x-producer": FakeServer(), "x-consumer": FakeServer(), "y-consumer": FakeServer()}
    targets = {job: f"127.0.0.1:{s.port}" for job, s in servers.items()}
    with ProcessGroup(log=lambda line: None) as group:
        m = group.start(alerts.server_spec(alerts.prometheus_binary(), tmp_path, free_port_block(1), targets))
        group.wait_healthy(m, timeout=120)
        prom = alerts.Prometheus(m.url)
        # Every target scraped once at 0, as the demo's servers are (Prometheus
        # starts before them): a counter first seen at 1 has no increase.
        prom.settle(tuple(servers), since=0.0, timeout=120)
        yield prom, servers
    for s in servers.values():
        s.httpd.shutdown()


KINDS = ["flip_bit", "change_tail", "drop_checksums", "producer_flip_bit"]


def test_the_demos_alert_checks_on_a_real_prometheus(prometheus):
    prom, servers = prometheus
    # Clean: loads verified; nothing pending or firing.
    servers["x-consumer"].values[("vllm:kv_checksum_loads_verified_total", "")] = 1
    clean = alerts.check_phase(prom, "x", "clean", KINDS, time.time())
    assert clean["problems"] == [] and clean["seen"] == [] and clean["wait_s"] >= 0
    # A mismatch on another setup's consumer is not this setup's.
    servers["y-consumer"].values[("vllm:kv_checksum_loads_mismatched_by_cause_total", 'cause="corrupt"')] = 1
    assert alerts.check_phase(prom, "x", "clean", KINDS, time.time())["problems"] == []
    # flip_bit: the mismatch alert fires for the consumer, with its cause.
    servers["x-consumer"].values[("vllm:kv_checksum_loads_mismatched_by_cause_total", 'cause="corrupt"')] = 1
    flip = alerts.check_phase(prom, "x", "flip_bit", KINDS, time.time())
    assert flip["problems"] == [], flip
    assert {"alertname": "KVChecksumMismatch", "state": "firing", "cause": "corrupt", "job": "x-consumer",
            "instance": f"127.0.0.1:{servers['x-consumer'].port}", "model_name": "m",
            "severity": "critical"} in flip["seen"]
    assert alerts.summary(flip) == "KVChecksumMismatch(corrupt) firing"
    # A clean phase now would fail: the mismatch is still firing.
    late = alerts.check_phase(prom, "x", "clean", KINDS, time.time())
    assert late["problems"] == ["KVChecksumMismatch firing for x-consumer after the clean phase"]
    assert alerts.check_phase(prom, "x", "change_tail", KINDS, time.time()) is None  # not checked
    # drop_checksums: the unverified rate is pending (its for: is 5 minutes).
    servers["x-consumer"].values[("vllm:kv_checksum_loads_unverified_total", 'reason="no_producer_checksums"')] = 1
    drop = alerts.check_phase(prom, "x", "drop_checksums", KINDS, time.time())
    assert drop["problems"] == [], drop
    assert any(a["alertname"] == "KVChecksumUnverified" and a["state"] == "pending" for a in drop["seen"])
    # producer_flip_bit: the producer's re-check found its KV changed.
    servers["x-producer"].values[("vllm:kv_checksum_producer_changed_total", "")] = 1
    changed = alerts.check_phase(prom, "x", "producer_flip_bit", KINDS, time.time())
    assert changed["problems"] == [], changed
    assert any(a["alertname"] == "KVChecksumProducerChanged" and a["job"] == "x-producer" for a in changed["seen"])


def test_an_alert_that_does_not_come_is_a_problem(prometheus, monkeypatch):
    prom, servers = prometheus
    monkeypatch.setattr(alerts, "ALERT_WAIT_S", 3.0)
    # The producer's KV did not change: no KVChecksumProducerChanged to see.
    check = alerts.check_phase(prom, "x", "producer_flip_bit", KINDS, time.time())
    assert check["problems"] == ["expected KVChecksumProducerChanged firing on the producer within 3 s; "
                                 "Prometheus had none"]
    # A mismatch counted on the producer's job is not the consumer's.
    servers["x-producer"].values[("vllm:kv_checksum_loads_mismatched_by_cause_total", 'cause="corrupt"')] = 1
    deadline = time.monotonic() + 60  # a bound, not an expectation
    while not any(a["labels"]["alertname"] == "KVChecksumMismatch" and a["state"] == "firing"
                  for a in prom.alerts(("x-producer",))):
        assert time.monotonic() < deadline, "the producer's mismatch alert never fired"
        time.sleep(0.2)
    check = alerts.check_phase(prom, "x", "flip_bit", KINDS, time.time())
    assert check["problems"] and check["problems"][0].startswith(
        "expected KVChecksumMismatch{cause='corrupt'} firing on the consumer within 3 s"), check


def test_expected_per_phase():
    assert alerts.expected("clean", KINDS) == []
    assert [str(e) for e in alerts.expected("flip_bit", KINDS)] == [
        "KVChecksumMismatch{cause='corrupt'} firing on the consumer"]
    # The first fault the consumer must catch is the one checked.
    assert alerts.expected("swap_heads", ["change_tail", "swap_heads", "flip_bit"])[0].alertname == \
        "KVChecksumMismatch"
    assert alerts.expected("flip_bit", ["change_tail", "swap_heads", "flip_bit"]) is None
    assert alerts.expected("change_tail", KINDS) is None


def test_parse_time():
    assert alerts.parse_time("1970-01-01T00:00:01.5Z") == 1.5
    assert alerts.parse_time("1970-01-01T00:00:02.123456789Z") == pytest.approx(2.123456789)
    assert alerts.parse_time("1970-01-01T00:01:00Z") == 60.0


def test_config_loads_the_rules_and_scrapes_each_job():
    cfg = alerts.config({"a-consumer": "127.0.0.1:1", "a-producer": "127.0.0.1:2"})
    assert cfg["rule_files"] == [str(alerts.RULES)] and alerts.RULES.is_file()
    assert [(c["job_name"], c["static_configs"][0]["targets"]) for c in cfg["scrape_configs"]] == [
        ("a-consumer", ["127.0.0.1:1"]), ("a-producer", ["127.0.0.1:2"])]
