"""kvcs_demo.prom against a real prometheus_client registry served over HTTP,
with counters named and labelled like vLLM's kv_checksum ones."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kvcs_demo.prom import ScrapeError, by_label, counter, delta, parse, scrape
from kvcs_demo.servers import free_port_block

LABELS = ["model_name", "engine"]


@pytest.fixture
def server():
    """A registry with vLLM-like counters, served at {url}/metrics."""
    registry = CollectorRegistry()
    c = {
        "verified": Counter("vllm:kv_checksum_loads_verified", "loads verified",
                            LABELS, registry=registry),
        "unverified": Counter("vllm:kv_checksum_loads_unverified", "loads unverified",
                              [*LABELS, "reason"], registry=registry),
        "blocks": Counter("vllm:kv_checksum_mismatched_blocks", "blocks",
                          LABELS, registry=registry),
    }
    Gauge("vllm:num_requests_running", "running", LABELS, registry=registry).labels(
        "m", "0").set(2)
    httpd, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{httpd.server_port}", c
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


def test_scrape_counter_by_label_delta(server):
    url, c = server
    c["verified"].labels("m", "0").inc(3)
    c["verified"].labels("m", "1").inc(2)
    c["unverified"].labels("m", "0", "no_payload").inc()
    before = scrape(url)

    assert counter(before, "vllm:kv_checksum_loads_verified") == 5
    assert counter(before, "vllm:kv_checksum_loads_verified_total") == 5
    assert counter(before, "vllm:kv_checksum_loads_verified", engine="1") == 2
    assert counter(before, "vllm:kv_checksum_loads_verified", engine=0, model_name="m") == 3
    assert counter(before, "vllm:kv_checksum_loads_verified", engine="9") == 0
    # Never incremented: a labelled counter has no sample yet.
    assert counter(before, "vllm:kv_checksum_mismatched_blocks") == 0
    assert counter(before, "vllm:num_requests_running") == 2  # a gauge reads as is
    assert not any(name.endswith("_created") for name, _ in before)
    key = ("vllm:kv_checksum_loads_verified_total", (("engine", "0"), ("model_name", "m")))
    assert before[key] == 3

    c["verified"].labels("m", "0").inc()
    c["unverified"].labels("m", "0", "no_payload").inc(2)
    c["unverified"].labels("m", "1", "layers_differ").inc(4)
    c["unverified"].labels("m", "0", "layers_differ").inc(1)
    c["blocks"].labels("m", "0").inc(7)
    after = scrape(url + "/")

    assert by_label(after, "vllm:kv_checksum_loads_unverified", "reason") == {
        "no_payload": 3, "layers_differ": 5}
    assert by_label(after, "vllm:kv_checksum_loads_unverified", "reason", engine="0") == {
        "no_payload": 3, "layers_differ": 1}

    d = delta(after, before)
    assert counter(d, "vllm:kv_checksum_loads_verified") == 1
    assert counter(d, "vllm:kv_checksum_mismatched_blocks") == 7  # missing before: from 0
    assert by_label(d, "vllm:kv_checksum_loads_unverified", "reason") == {
        "no_payload": 2, "layers_differ": 5}
    assert counter(d, "vllm:num_requests_running") == 0


def test_parse_keeps_a_gauge_whose_name_ends_in_created():
    text = ("# TYPE jobs_created gauge\njobs_created 4\n"
            "# TYPE vllm:kv_checksum_sent counter\nvllm:kv_checksum_sent_total 2\n"
            "vllm:kv_checksum_sent_created 1.7e9\n")
    samples = parse(text)
    assert counter(samples, "jobs_created") == 4
    assert counter(samples, "vllm:kv_checksum_sent") == 2
    assert ("vllm:kv_checksum_sent_created", ()) not in samples


def test_scrape_errors_name_the_url():
    url = f"http://127.0.0.1:{free_port_block()}"  # nothing listens there
    with pytest.raises(ScrapeError, match=f"{url}/metrics"):
        scrape(url, timeout=5)
