"""The soak's push abort: both legs at once under one request id, the consumer's leg cut after the producer answered."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from kvcs_demo.proxy import PushTarget
from kvcs_soak import soak


class Recorder(BaseHTTPRequestHandler):
    """Records each request; the consumer's leg never answers (a decode that
    is still waiting for its KV), until the client hangs up."""

    events: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        role = "consumer" if body["kv_transfer_params"].get("do_remote_prefill") else "producer"
        self.events.append((role, self.headers["X-Request-Id"], body, time.monotonic()))
        if role == "consumer":
            # Wait for the client to hang up: a read returns b"" then.
            self.connection.settimeout(10)
            hung_up = self.rfile.read(1) == b""
            self.events.append(("consumer hung up" if hung_up else "consumer still there", None, None,
                                time.monotonic()))
            return
        out = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": None}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def test_both_legs_share_the_request_id_and_the_consumer_leg_is_cut_after_the_producer_answered():
    Recorder.events = []
    servers = {side: ThreadingHTTPServer(("127.0.0.1", 0), Recorder) for side in ("producer", "consumer")}
    for server in servers.values():
        threading.Thread(target=server.serve_forever, daemon=True).start()
    urls = {side: f"http://127.0.0.1:{server.server_address[1]}" for side, server in servers.items()}
    urls["push"] = PushTarget("producer-engine", "10.0.0.1", 5601, 2)
    urls["proxy"] = "http://127.0.0.1:9"  # not used: the client runs the legs itself
    req = soak.Planned(7, "a prompt", 16, 0.05, 0.0, abort_in_transfer=True)
    try:
        with httpx.Client() as client:
            answer = soak.send(client, urls, req)
        deadline = time.monotonic() + 10
        while not any(e[0].startswith("consumer hung") for e in Recorder.events) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        for server in servers.values():
            server.shutdown()

    assert answer.status is None and answer.disconnected and answer.error is None
    legs = {e[0]: e for e in Recorder.events}
    assert legs["consumer"][1] == legs["producer"][1] == "soak-7"
    assert legs["consumer"][2]["kv_transfer_params"] == PushTarget(
        "producer-engine", "10.0.0.1", 5601, 2).decode_params("soak-7")
    assert legs["producer"][2]["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert legs["producer"][2]["max_tokens"] == 1 and legs["consumer"][2]["max_tokens"] == 16
    assert "consumer hung up" in legs
    # Cut after the producer answered (the server threads' order of the
    # two arrivals is the machine's, and not asserted).
    assert legs["producer"][3] <= legs["consumer hung up"][3]

