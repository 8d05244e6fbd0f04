"""kvcs_demo.proxy, run as a real process, between stand-in producer/consumer servers.

The stand-ins are aiohttp servers in a background thread of the test process:
they record what each leg sends them and answer what a test sets.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from kvcs_demo.proxy import parse_pair
from kvcs_demo.servers import ProcessGroup, ServerSpec, free_port_block

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SAFETY_S = 30  # bounds, not expectations
MAX_BODY = 4096

NO_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}


def producer_params(name: str) -> dict:
    """What a NIXL producer returns, checksums included (opaque to the proxy)."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [[3, 4, 5]], "remote_engine_id": f"engine-{name}",
            "remote_request_id": f"{name}-req", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1, "kv_checksums": "gqlhbGdvcml0aG0BpnZhbHVlcw=="}


class StandIn:
    """A stand-in vLLM server: records requests, answers `self.reply`."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop):
        self.name = name
        self.loop = loop
        self.received: list[dict] = []
        self.reset()
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        # handler_cancellation: a hanging reply ends when the proxy hangs up.
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
        self.url = asyncio.run_coroutine_threadsafe(self._start(), loop).result(SAFETY_S)

    async def _start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def reset(self) -> None:
        self.received.clear()
        if self.name.endswith("producer"):
            self.reply = (200, {"id": f"cmpl-{self.name}", "choices": [{"text": "x"}],
                                "kv_transfer_params": producer_params(self.name)})
        else:
            self.reply = (200, {"id": f"cmpl-{self.name}",
                                "choices": [{"text": f"decoded by {self.name}"}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.received.append({"path": request.path, "headers": request.headers.copy(),  # case-insensitive
                              "json": json.loads(await request.read())})
        if self.reply == "hang":
            await asyncio.sleep(SAFETY_S)
        status, body = self.reply
        if isinstance(body, bytes):
            return web.Response(status=status, body=body, content_type="text/plain")
        return web.json_response(body, status=status)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(SAFETY_S)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(SAFETY_S)


def _start_proxy(group: ProcessGroup, tmp: Path, pairs: list[str], *extra: str) -> str:
    port = free_port_block()
    argv = [sys.executable, "-m", "kvcs_demo.proxy", "--port", str(port), *extra]
    for pair in pairs:
        argv += ["--pair", pair]
    proxy = group.start(ServerSpec("proxy", argv, {"PYTHONPATH": str(SCRIPTS)}, port,
                                   tmp / f"proxy-{port}.log"))
    group.wait_healthy(proxy, timeout=SAFETY_S)
    return proxy.url


@pytest.fixture(scope="module")
def env(loop, tmp_path_factory):
    """Stand-ins for pairs a, b, deadc (dead consumer); deadp has no producer;
    one proxy process over all four pairs."""
    servers = {n: StandIn(n, loop) for n in
               ["a-producer", "a-consumer", "b-producer", "b-consumer", "deadc-producer"]}
    nobody = f"http://127.0.0.1:{free_port_block()}"  # handed out, never listened on
    tmp = tmp_path_factory.mktemp("proxy")
    with ProcessGroup(log=lambda line: None) as group:
        url = _start_proxy(group, tmp, [
            f"a={servers['a-producer'].url},{servers['a-consumer'].url}",
            f"b={servers['b-producer'].url},{servers['b-consumer'].url}",
            f"deadp={nobody},{servers['a-consumer'].url}",
            f"deadc={servers['deadc-producer'].url},{nobody}",
        ], "--max-body-bytes", str(MAX_BODY))
        yield {"url": url, "servers": servers, "nobody": nobody, "group": group, "tmp": tmp}
    for s in servers.values():
        s.close()


@pytest.fixture
def proxy(env):
    for s in env["servers"].values():
        s.reset()
    with httpx.Client(base_url=env["url"], trust_env=False, timeout=SAFETY_S) as client:
        yield client


def got(env, name: str) -> list[dict]:
    return env["servers"][name].received


def _no_leg_reached(env) -> bool:
    return not any(s.received for s in env["servers"].values())


# ------------------------------------------------------------------- the legs


def test_prefill_leg_then_decode_leg(env, proxy):
    body = {"model": "m", "prompt": "hello there", "max_tokens": 7, "min_tokens": 2,
            "temperature": 0, "kv_transfer_params": {"client": "ignored on prefill"}}
    r = proxy.post("/pairs/a/v1/completions", json=body, headers={"X-Request-Id": "req-1"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "decoded by a-consumer"
    assert r.headers["X-KVCS-Request-Id"] == "req-1"
    assert "X-KVCS-Failed-Leg" not in r.headers

    [prefill] = got(env, "a-producer")
    assert prefill["path"] == "/v1/completions"
    assert prefill["headers"]["X-Request-Id"] == "req-1-prefill"
    assert prefill["json"]["max_tokens"] == 1 and prefill["json"]["stream"] is False
    assert prefill["json"]["kv_transfer_params"] == NO_DECODE
    assert "min_tokens" not in prefill["json"]  # would clash with max_tokens 1
    assert prefill["json"]["prompt"] == "hello there"

    [decode] = got(env, "a-consumer")
    assert decode["headers"]["X-Request-Id"] == "req-1"
    assert decode["json"] == {**body, "kv_transfer_params": producer_params("a-producer")}
    assert not got(env, "b-producer") and not got(env, "b-consumer")


def test_default_route_is_the_first_pair_and_ids_are_generated(env, proxy):
    r = proxy.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    request_id = r.headers["X-KVCS-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    assert got(env, "a-producer")[0]["headers"]["X-Request-Id"] == f"{request_id}-prefill"
    assert got(env, "a-consumer")[0]["headers"]["X-Request-Id"] == request_id


def test_two_pairs_route_to_their_own_servers(env, proxy):
    for name in ["b", "a", "b"]:
        r = proxy.post(f"/pairs/{name}/v1/completions", json={"prompt": name, "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == f"decoded by {name}-consumer"
    assert [x["json"]["prompt"] for x in got(env, "a-producer")] == ["a"]
    assert [x["json"]["prompt"] for x in got(env, "b-producer")] == ["b", "b"]
    assert [x["json"]["kv_transfer_params"] for x in got(env, "b-consumer")] == [
        producer_params("b-producer")] * 2


def test_unknown_pair_is_404(env, proxy):
    r = proxy.post("/pairs/zz/v1/completions", json={"prompt": "x"})
    assert r.status_code == 404 and "'zz'" in r.json()["error"]["message"]
    assert _no_leg_reached(env)


# --------------------------------------------------------------------- errors


@pytest.mark.parametrize("status, body", [
    (400, {"object": "error", "message": "prompt is too long", "code": 400}),
    (500, b"engine died"),
])
def test_producer_error_is_passed_through_with_the_leg(env, proxy, status, body):
    env["servers"]["a-producer"].reply = (status, body)
    r = proxy.post("/pairs/a/v1/completions", json={"prompt": "x"},
                   headers={"X-Request-Id": "bad-1"})
    assert r.status_code == status
    assert r.content == (body if isinstance(body, bytes) else json.dumps(body).encode())
    assert r.headers["X-KVCS-Failed-Leg"] == "prefill"
    assert r.headers["X-KVCS-Request-Id"] == "bad-1"
    assert not got(env, "a-consumer")


def test_consumer_error_is_passed_through_with_the_leg(env, proxy):
    error = {"object": "error", "message": "KV load failed", "code": 503}
    env["servers"]["a-consumer"].reply = (503, error)
    r = proxy.post("/pairs/a/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json() == error
    assert r.headers["X-KVCS-Failed-Leg"] == "decode"


@pytest.mark.parametrize("reply", [{"choices": []}, {"kv_transfer_params": None}])
def test_producer_without_kv_transfer_params_is_502(env, proxy, reply):
    env["servers"]["a-producer"].reply = (200, reply)
    r = proxy.post("/pairs/a/v1/completions", json={"prompt": "x"})
    assert r.status_code == 502
    message = r.json()["error"]["message"]
    assert env["servers"]["a-producer"].url in message and "kv_role" in message
    assert r.headers["X-KVCS-Failed-Leg"] == "prefill"
    assert not got(env, "a-consumer")


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_invalid_body_is_400_and_the_proxy_keeps_serving(env, proxy, content):
    r = proxy.post("/pairs/a/v1/completions", content=content,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "error" in r.json()
    assert _no_leg_reached(env)
    assert proxy.get("/health").status_code == 200
    assert proxy.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_deeply_nested_json_within_the_size_bound_is_400(env, proxy):
    r = proxy.post("/pairs/a/v1/completions", content=b"[" * (MAX_BODY - 10))
    assert r.status_code == 400, r.text
    assert _no_leg_reached(env)


def test_streaming_is_400(env, proxy):
    r = proxy.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 400 and "non-streaming" in r.json()["error"]["message"]
    assert _no_leg_reached(env)


def test_oversized_body_is_413(env, proxy):
    r = proxy.post("/v1/completions", json={"prompt": "x" * (MAX_BODY + 1)})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    assert _no_leg_reached(env)


@pytest.mark.parametrize("pair, leg", [("deadp", "prefill"), ("deadc", "decode")])
def test_unreachable_server_is_502_naming_leg_and_url(env, proxy, pair, leg):
    r = proxy.post(f"/pairs/{pair}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 502
    assert r.headers["X-KVCS-Failed-Leg"] == leg
    message = r.json()["error"]["message"]
    assert message.startswith(f"{leg} leg") and env["nobody"] in message


def test_leg_timeout_is_504(env, loop):
    hanging = StandIn("slow-producer", loop)
    hanging.reply = "hang"
    try:
        url = _start_proxy(env["group"], env["tmp"],
                           [f"s={hanging.url},{env['servers']['a-consumer'].url}"],
                           "--timeout", "0.5")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, trust_env=False,
                       timeout=SAFETY_S)
        assert r.status_code == 504
        assert r.headers["X-KVCS-Failed-Leg"] == "prefill"
        assert "within 0.5 s" in r.json()["error"]["message"]
    finally:
        hanging.close()


# ---------------------------------------------------------------- arguments


def test_parse_pair():
    assert parse_pair("a=http://h:1/,http://h:2").consumer == "http://h:2"
    for bad in ["a", "a=http://h:1", "a b=http://h:1,http://h:2", "a=h:1,http://h:2"]:
        with pytest.raises(ValueError, match="--pair"):
            parse_pair(bad)
