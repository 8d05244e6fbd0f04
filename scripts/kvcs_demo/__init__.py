"""Tooling under `make demo`: the processes, the proxy and the metrics it reads.

- `kvcs_demo.servers`: start vLLM servers (and any other process) so that they
  never outlive the demo, wait until they answer /health, free ports.
- `kvcs_demo.proxy`: the demo's prefill/decode proxy, run as its own process
  (`python -m kvcs_demo.proxy --port P --pair NAME=PRODUCER_URL,CONSUMER_URL`).
- `kvcs_demo.prom`: scrape a server's Prometheus /metrics and sum counters.

Run with `scripts/` on sys.path / PYTHONPATH. The modules import nothing from
each other at import time, so `servers` and `prom` work without aiohttp.
"""
