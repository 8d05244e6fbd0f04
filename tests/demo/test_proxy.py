"""kvcs_demo.proxy, run as a real process, between stand-in producer/consumer servers.

The stand-ins are aiohttp servers in a background thread of the test process:
they record what each leg sends them and answer what a test sets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from kvcs_demo.proxy import (Proxy, PushTarget, engine_id_of, parse_bootstrap, parse_pair, parse_push_target,
                             with_bootstraps, with_push_targets)
from kvcs_demo.proxy import main as proxy_main
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
        self.cancelled = threading.Event()
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
            try:
                await asyncio.sleep(SAFETY_S)
            except asyncio.CancelledError:
                # The proxy closed the leg's connection (its client hung up).
                self.cancelled.set()
                raise
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


@contextlib.contextmanager
def _fresh_client(env):
    """A client of env's proxy, its stand-ins reset (nothing received, default replies)."""
    for s in env["servers"].values():
        s.reset()
    with httpx.Client(base_url=env["url"], trust_env=False, timeout=SAFETY_S) as client:
        yield client


@pytest.fixture
def proxy(env):
    with _fresh_client(env) as client:
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


def test_idle_connections_are_dropped_before_a_vllm_server_closes_them():
    """vLLM's API server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    (5 s by default); a leg sent on one it is closing fails with "Server
    disconnected" (seen once in 200 requests of make soak)."""
    from kvcs_demo.proxy import Pair, Proxy

    async def keepalive():
        proxy = Proxy([Pair("a", "http://127.0.0.1:1", "http://127.0.0.1:2")], leg_timeout=1.0,
                      max_body_bytes=1, max_response_bytes=1, mode="pull")
        ctx = proxy.session_ctx(None)
        await ctx.__anext__()
        try:
            return proxy.session.connector._keepalive_timeout
        finally:
            with contextlib.suppress(StopAsyncIteration):
                await ctx.__anext__()

    # At most half of vLLM's: the server's idle clock starts when it has
    # written the answer, the proxy's when it has read it.
    assert 0 < asyncio.run(keepalive()) <= 5 / 2


def test_a_client_that_hangs_up_cancels_its_leg(env, loop):
    """The servers must see the client go (vLLM then aborts the request, as
    behind a production proxy): the soak's disconnects depend on it."""
    hanging = StandIn("slow-producer", loop)
    hanging.reply = "hang"
    try:
        url = _start_proxy(env["group"], env["tmp"], [f"h={hanging.url},{env['servers']['a-consumer'].url}"])
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, trust_env=False, timeout=1.0)
        assert hanging.cancelled.wait(SAFETY_S)
    finally:
        hanging.close()


# ---------------------------------------------------------------- arguments


def test_parse_pair():
    assert parse_pair("a=http://h:1/,http://h:2").consumer == "http://h:2"
    for bad in ["a", "a=http://h:1", "a b=http://h:1,http://h:2", "a=h:1,http://h:2"]:
        with pytest.raises(ValueError, match="--pair"):
            parse_pair(bad)


# ------------------------------------------------------------------ push mode
#
# NixlPushConnector: the consumer registers its blocks with the producer and
# the producer WRITEs into them, so the consumer leg cannot wait for the
# producer's answer. Both legs go out at once with the same X-Request-Id (the
# producer's writer pairs them by it), the consumer's kv_transfer_params are
# the producer's NIXL coordinates from --push-target.

PUSH_TARGET = "engine-p,localhost:5601,2"
PUSH_LEG_TIMEOUT_S = 8  # the push proxy's --timeout


def push_producer_params(engine_id: str = "engine-p") -> dict:
    """What a NixlPushConnector producer returns (push_scheduler.request_finished)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4, 5]],
            "remote_engine_id": engine_id, "remote_request_id": "cmpl-x-0-1234abcd",
            "remote_host": "localhost", "remote_port": 5601, "tp_size": 2, "pp_size": 1,
            "remote_num_tokens": 151, "transfer_mode": "push"}


def push_decode_params(request_id: str) -> dict:
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "engine-p",
            "remote_host": "localhost", "remote_port": 5601, "tp_size": 2, "pp_size": 1,
            "remote_request_id": request_id}


class PushStandIn(StandIn):
    """A stand-in push server. `gate` (set by a test on both servers of a
    pair): the consumer sets it when its leg arrives, the producer answers
    only once it is set, as a real producer's WRITE needs the consumer's
    registration. `cancelled` is set when the proxy hangs up on a leg."""

    def __init__(self, name, loop):
        self.gate: asyncio.Event | None = None
        self.cancelled = threading.Event()
        super().__init__(name, loop)

    def reset(self) -> None:
        super().reset()
        self.gate = None
        self.cancelled = threading.Event()
        if self.name.endswith("producer"):
            self.reply = (200, {"id": f"cmpl-{self.name}", "choices": [{"text": "x"}],
                                "kv_transfer_params": push_producer_params()})

    async def handle(self, request):
        producer = self.name.endswith("producer")
        try:
            if self.gate is not None and producer:
                await asyncio.wait_for(self.gate.wait(), SAFETY_S)
            self.received.append({"path": request.path, "headers": request.headers.copy(),
                                  "json": json.loads(await request.read())})
            if self.gate is not None and not producer:
                self.gate.set()
            if self.reply == "hang":
                await asyncio.sleep(SAFETY_S)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        status, body = self.reply
        if isinstance(body, bytes):
            return web.Response(status=status, body=body, content_type="text/plain")
        return web.json_response(body, status=status)


@contextlib.contextmanager
def _legs_at_once_env(tmp_path_factory, mode: str, servers: dict, pair: str, *extra: str):
    """One proxy in `mode` over `pair` and deadc (no consumer listens), the
    servers' `env` as a test sees it; the servers are closed after it."""
    nobody = f"http://127.0.0.1:{free_port_block()}"
    tmp = tmp_path_factory.mktemp(f"{mode}-proxy")
    with ProcessGroup(log=lambda line: None) as group:
        url = _start_proxy(group, tmp, [
            f"{pair}={servers[f'{pair}-producer'].url},{servers[f'{pair}-consumer'].url}",
            f"deadc={servers['deadc-producer'].url},{nobody}",
        ], "--mode", mode, *extra)
        yield {"url": url, "servers": servers, "nobody": nobody, "group": group, "tmp": tmp}
    for s in servers.values():
        s.close()


@pytest.fixture(scope="module")
def push_env(loop, tmp_path_factory):
    """Push stand-ins for pair p (and deadc: no consumer); one proxy in push mode."""
    servers = {n: PushStandIn(n, loop) for n in ["p-producer", "p-consumer", "deadc-producer"]}
    with _legs_at_once_env(tmp_path_factory, "push", servers, "p", "--push-target", f"p={PUSH_TARGET}",
                           "--push-target", "deadc=engine-p,localhost:5601,2",
                           "--timeout", str(PUSH_LEG_TIMEOUT_S)) as env:
        yield env


async def _event() -> asyncio.Event:
    return asyncio.Event()


def _wait(flag: threading.Event) -> bool:
    return flag.wait(SAFETY_S)


def test_parse_push_target():
    assert parse_push_target("a=eng-1,localhost:5600") == ("a", PushTarget("eng-1", "localhost", 5600, 1, 1))
    assert parse_push_target("a=e,::1:7000,2,3") == ("a", PushTarget("e", "::1", 7000, 2, 3))
    assert PushTarget("e", "h", 1, 2, 3).decode_params("r") == {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "h",
        "remote_port": 1, "tp_size": 2, "pp_size": 3, "remote_request_id": "r"}
    for bad in ["a", "a=e", "a=e,h", "a=e,:1", "a=e,h:0", "a=e,h:x", "a=e,h:70000", "a=e,h:1,0",
                "a=e,h:1,1,2,3", "a b=e,h:1", "a=,h:1"]:
        with pytest.raises(ValueError, match="--push-target"):
            parse_push_target(bad)


# -------------------------------------------------------------- mooncake mode
#
# MooncakeConnector (P2P): the consumer asks the producer's worker for the
# transfer by an id the proxy gives both legs, so both legs go out at once
# (same X-Request-Id). The consumer's kv_transfer_params name the producer's
# bootstrap server and its engine id, which the proxy asked that server for
# (GET /query) at startup, until it named one. The producer answers without
# kv_transfer_params; Mooncake sends only for a prefill finished by length.

MOONCAKE_LEG_TIMEOUT_S = 8  # the mooncake proxy's --timeout
ENGINE = "eng-mooncake-0"
TRANSFER_ID = re.compile(r"xfer-[0-9a-f]{32}")


def bootstrap_answer(engine_id: str = ENGINE) -> dict:
    """A bootstrap server's /query once the producer's worker registered."""
    return {"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": "tcp://127.0.0.1:5555"}}}}


class BootstrapStandIn:
    """A stand-in Mooncake bootstrap server: answers GET /query with the
    next of `self.answers` (the last one repeated) and counts the queries."""

    def __init__(self, loop: asyncio.AbstractEventLoop, answers: list):
        self.loop = loop
        self.answers = list(answers)
        self.queries = 0
        app = web.Application()
        app.router.add_get("/query", self.query)
        self.runner = web.AppRunner(app, shutdown_timeout=1)
        self.url = asyncio.run_coroutine_threadsafe(self._start(), loop).result(SAFETY_S)

    _start = StandIn._start

    def set(self, answers: list) -> None:
        self.answers = list(answers)

    async def query(self, request: web.Request) -> web.Response:
        self.queries += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, int):
            return web.Response(status=answer, text="not yet")
        if isinstance(answer, bytes):
            return web.Response(body=answer, content_type="application/json")
        return web.json_response(answer)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(SAFETY_S)


class MooncakeStandIn(PushStandIn):
    """A stand-in Mooncake server: the producer answers as vLLM does after a
    prefill capped at max_tokens 1 (finish_reason "length", no
    kv_transfer_params); the `gate` and `cancelled` of PushStandIn."""

    def reset(self) -> None:
        super().reset()
        if self.name.endswith("producer"):
            self.reply = (200, {"id": f"cmpl-{self.name}",
                                "choices": [{"text": "x", "finish_reason": "length"}],
                                "kv_transfer_params": None})


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", trust_env=False, timeout=SAFETY_S).json()


def _wait_for_engine(url: str, pair: str) -> dict:
    """The proxy's /health once it knows the pair's engine id (bounded)."""
    deadline = time.monotonic() + SAFETY_S
    while True:
        health = _health(url)
        if health["engines"][pair] is not None or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


@pytest.fixture(scope="module")
def mc_env(loop, tmp_path_factory):
    """Mooncake stand-ins for pair m (and deadc: no consumer) and their
    bootstrap servers; m's names no engine for its first 3 queries (not
    registered yet: an empty answer, a 503, a DP rank without an id). One
    proxy in mooncake mode."""
    servers = {n: MooncakeStandIn(n, loop) for n in ["m-producer", "m-consumer", "deadc-producer"]}
    boot = BootstrapStandIn(loop, [{}, 503, {"0": {"worker_addr": {}}}, bootstrap_answer()])
    boot_deadc = BootstrapStandIn(loop, [bootstrap_answer("eng-deadc")])
    with _legs_at_once_env(tmp_path_factory, "mooncake", servers, "m", "--bootstrap", f"m={boot.url}/",
                           "--bootstrap", f"deadc={boot_deadc.url}",
                           "--timeout", str(MOONCAKE_LEG_TIMEOUT_S)) as env:
        yield {**env, "boot": boot}
    for s in [boot, boot_deadc]:
        s.close()


def test_mooncake_startup_asks_the_bootstrap_server_until_it_names_the_engine(mc_env):
    # Asked at startup, before any completion; again after each answer that
    # named no engine; not again once it named one.
    # (Before the tests of both modes below, which send mc_env's servers completions.)
    health = _wait_for_engine(mc_env["url"], "m")
    assert health["engines"] == {"m": ENGINE, "deadc": "eng-deadc"}
    assert health["pairs"] == ["m", "deadc"]
    assert mc_env["boot"].queries == 4
    assert not any(s.received for s in mc_env["servers"].values())


def test_mooncake_completion_waits_for_a_late_engine(mc_env, loop):
    """A completion that comes before the producer registered waits for the
    bootstrap server to name the engine, then goes through."""
    producer, consumer = MooncakeStandIn("late-producer", loop), MooncakeStandIn("late-consumer", loop)
    boot = BootstrapStandIn(loop, [{}])  # nothing registered yet
    try:
        url = _start_proxy(mc_env["group"], mc_env["tmp"], [f"late={producer.url},{consumer.url}"],
                           "--mode", "mooncake", "--bootstrap", f"late={boot.url}", "--timeout", "20")
        assert _health(url)["engines"] == {"late": None}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": "x"}, trust_env=False,
                                  timeout=SAFETY_S)
            time.sleep(1.0)
            assert not pending.done() and not producer.received and not consumer.received
            boot.set([bootstrap_answer("eng-late")])
            r = pending.result(SAFETY_S)
        assert r.status_code == 200, r.text
        assert consumer.received[0]["json"]["kv_transfer_params"]["remote_engine_id"] == "eng-late"
        assert _health(url)["engines"] == {"late": "eng-late"}
    finally:
        for s in (producer, consumer, boot):
            s.close()


@pytest.mark.parametrize("answer", [{}, 503, {"1": {"engine_id": "dp1-only"}}, {"0": {"engine_id": ""}},
                                    b"not json", b"[]", None])
def test_mooncake_engine_never_named_is_503_and_no_leg_is_sent(mc_env, loop, answer):
    producer, consumer = MooncakeStandIn("nb-producer", loop), MooncakeStandIn("nb-consumer", loop)
    boot = BootstrapStandIn(loop, [answer if answer is not None else {}])
    # None: no bootstrap server listens there at all.
    boot_url = boot.url if answer is not None else f"http://127.0.0.1:{free_port_block()}"
    try:
        url = _start_proxy(mc_env["group"], mc_env["tmp"], [f"nb={producer.url},{consumer.url}"],
                           "--mode", "mooncake", "--bootstrap", f"nb={boot_url}", "--timeout", "1.5")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "nb-1"},
                       trust_env=False, timeout=SAFETY_S)
        assert r.status_code == 503, r.text
        assert r.headers["X-KVCS-Failed-Leg"] == "prefill" and r.headers["X-KVCS-Request-Id"] == "nb-1"
        message = r.json()["error"]["message"]
        assert f"{boot_url}/query" in message and "within 1.5 s" in message, message
        assert ("no answer" if answer is None else "HTTP 503" if answer == 503 else "no engine") in message
        assert not producer.received and not consumer.received
        assert boot.queries >= (0 if answer is None else 2)  # asked again and again
    finally:
        for s in (producer, consumer, boot):
            s.close()


def test_engine_id_of():
    assert engine_id_of(bootstrap_answer("e")) == "e"
    assert engine_id_of({"1": {"engine_id": "x"}, "0": {"engine_id": "y"}}) == "y"
    for answer in [{}, [], None, "x", {"0": None}, {"0": {}}, {"0": {"engine_id": ""}}, {"0": {"engine_id": 3}},
                   {0: {"engine_id": "int key"}}]:
        assert engine_id_of(answer) is None, answer


def test_parse_bootstrap():
    assert parse_bootstrap("a=http://127.0.0.1:8998/") == ("a", "http://127.0.0.1:8998")
    for bad in ["a", "a=", "a=127.0.0.1:8998", "a b=http://h:1", "=http://h:1"]:
        with pytest.raises(ValueError, match="--bootstrap"):
            parse_bootstrap(bad)


# ------------------------------------------------- push and mooncake: legs at once
#
# What both modes share: both legs go out at once with the request's id, a
# producer error cancels the consumer leg that waits for KV, consumer errors
# and timeouts name the decode leg. Each test runs once per mode (the `mode`
# fixture, or a parametrize of `mode` with the mode's own cases); where the
# modes differ (push: the producer's NIXL coordinates and engine ids;
# mooncake: the transfer id and the bootstrap server), a branch says so.

LEGS_AT_ONCE = {"push": ("push_env", "p", PUSH_LEG_TIMEOUT_S),
                "mooncake": ("mc_env", "m", MOONCAKE_LEG_TIMEOUT_S)}


@pytest.fixture(params=list(LEGS_AT_ONCE))
def mode(request) -> str:
    # Function scope: pytest keeps the file's order (mc_env's startup test first).
    return request.param


@dataclass
class LegsAtOnce:
    """One mode's proxy as a test uses it: its env, a client, the pair (p or
    m) and the proxy's --timeout."""

    mode: str
    env: dict
    client: httpx.Client
    pair: str
    leg_timeout_s: int
    loop: asyncio.AbstractEventLoop

    @property
    def producer(self) -> PushStandIn:
        return self.env["servers"][f"{self.pair}-producer"]

    @property
    def consumer(self) -> PushStandIn:
        return self.env["servers"][f"{self.pair}-consumer"]

    def post(self, json: dict, request_id: str | None = None, pair: str | None = None) -> httpx.Response:
        headers = {"X-Request-Id": request_id} if request_id else {}
        return self.client.post(f"/pairs/{pair or self.pair}/v1/completions", json=json, headers=headers)

    def gate(self) -> None:
        """The producer answers once its consumer got the consumer leg."""
        gate = asyncio.run_coroutine_threadsafe(_event(), self.loop).result(SAFETY_S)
        self.producer.gate = self.consumer.gate = gate


@pytest.fixture
def legs(mode, request, loop):
    env_fixture, pair, leg_timeout_s = LEGS_AT_ONCE[mode]
    env = request.getfixturevalue(env_fixture)
    with _fresh_client(env) as client:
        yield LegsAtOnce(mode, env, client, pair, leg_timeout_s, loop)


def test_both_legs_at_once_with_one_request_id(legs):
    if legs.mode == "mooncake":
        _wait_for_engine(legs.env["url"], legs.pair)
        queries = legs.env["boot"].queries
    # The producer answers only once the consumer leg reached the consumer:
    # a proxy that waited for the producer's answer first would get no
    # answer within its --timeout here.
    legs.gate()
    body = {"model": "m", "prompt": "hello there", "max_tokens": 7, "min_tokens": 2, "temperature": 0,
            "stream_options": {"include_usage": True}, "kv_transfer_params": {"client": "replaced"}}
    request_id = f"req-{legs.pair}1"
    r = legs.post(body, request_id)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == f"decoded by {legs.pair}-consumer"
    assert r.headers["X-KVCS-Request-Id"] == request_id and "X-KVCS-Failed-Leg" not in r.headers

    [prefill] = legs.producer.received
    [decode] = legs.consumer.received
    # The same id on both legs: the producer pairs the consumer's
    # registration (push) or transfer (mooncake) with its own request by it.
    assert prefill["headers"]["X-Request-Id"] == decode["headers"]["X-Request-Id"] == request_id
    assert prefill["json"]["max_tokens"] == 1 and prefill["json"]["stream"] is False
    assert "min_tokens" not in prefill["json"] and "stream_options" not in prefill["json"]
    assert prefill["json"]["prompt"] == "hello there"
    if legs.mode == "push":
        assert prefill["json"]["kv_transfer_params"] == NO_DECODE
        # The producer's coordinates, not its answer (no block ids, no checksums).
        assert decode["json"] == {**body, "kv_transfer_params": push_decode_params(request_id)}
    else:
        transfer_id = prefill["json"]["kv_transfer_params"]["transfer_id"]
        assert TRANSFER_ID.fullmatch(transfer_id)
        assert prefill["json"]["kv_transfer_params"] == {**NO_DECODE, "transfer_id": transfer_id}
        # The client's request, with the producer's bootstrap server (as given,
        # without the trailing slash), engine id and the same transfer id.
        assert decode["json"] == {**body, "kv_transfer_params": {
            "do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": legs.env["boot"].url,
            "remote_engine_id": ENGINE, "transfer_id": transfer_id}}
        assert legs.env["boot"].queries == queries  # the engine id is not asked per request


def test_default_route_and_generated_id(legs):
    r = legs.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    request_id = r.headers["X-KVCS-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    [prefill] = legs.producer.received
    [decode] = legs.consumer.received
    assert prefill["headers"]["X-Request-Id"] == decode["headers"]["X-Request-Id"] == request_id
    if legs.mode == "push":
        assert decode["json"]["kv_transfer_params"] == push_decode_params(request_id)


@pytest.mark.parametrize("mode", ["mooncake"])
def test_mooncake_each_completion_has_its_own_transfer_id(legs):
    for _ in range(3):
        r = legs.post({"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
    ids = [x["json"]["kv_transfer_params"]["transfer_id"] for x in legs.producer.received]
    assert len(set(ids)) == 3
    assert sorted(ids) == sorted(x["json"]["kv_transfer_params"]["transfer_id"] for x in legs.consumer.received)


def _consumer_leg_was_cancelled(legs: LegsAtOnce, r: httpx.Response) -> None:
    # The consumer got its leg, and the proxy hung up on it at once (vLLM
    # then aborts the request) instead of leaving it waiting.
    assert len(legs.consumer.received) == 1
    assert _wait(legs.consumer.cancelled)
    assert r.elapsed.total_seconds() < legs.leg_timeout_s - 2


@pytest.mark.parametrize("status, body", [
    (400, {"object": "error", "message": "prompt is too long", "code": 400}),
    (500, b"engine died"),
])
def test_producer_error_cancels_the_waiting_consumer_leg(legs, status, body):
    legs.gate()
    legs.producer.reply = (status, body)
    legs.consumer.reply = "hang"  # waits for KV (a WRITE, a transfer) that will not come
    r = legs.post({"prompt": "x"}, f"bad-{legs.pair}")
    assert r.status_code == status
    assert r.content == (body if isinstance(body, bytes) else json.dumps(body).encode())
    assert r.headers["X-KVCS-Failed-Leg"] == "prefill" and r.headers["X-KVCS-Request-Id"] == f"bad-{legs.pair}"
    _consumer_leg_was_cancelled(legs, r)


def _push_reply(params) -> dict:
    return {"choices": [{"text": "x"}], "kv_transfer_params": params}


@pytest.mark.parametrize("mode, reply, words", [
    # push: a producer whose answer does not let it WRITE to the consumer.
    pytest.param("push", _push_reply(None), ["returned no kv_transfer_params", "NixlPushConnector"],
                 id="push-no-params"),
    pytest.param("push", _push_reply({**push_producer_params(), "transfer_mode": "pull"}),
                 ["not a push producer", "'pull'", "--mode pull"], id="push-pull-producer"),
    pytest.param("push", _push_reply({k: v for k, v in push_producer_params().items() if k != "transfer_mode"}),
                 ["not a push producer"], id="push-no-transfer-mode"),
    pytest.param("push", _push_reply(push_producer_params("random-engine")),
                 ["'random-engine'", "'engine-p'", "engine_id"], id="push-other-engine"),
    # mooncake: EOS as the first token: the request finished by stop, Mooncake sends nothing.
    pytest.param("mooncake", {"choices": [{"text": "", "finish_reason": "stop"}], "kv_transfer_params": None},
                 ["finish_reason 'stop'", "'length'", "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"],
                 id="mooncake-stop"),
    pytest.param("mooncake", {"choices": []}, ["finish_reason None"], id="mooncake-no-choice"),
    pytest.param("mooncake", {"id": "no choices"}, ["finish_reason None"], id="mooncake-no-choices"),
    pytest.param("mooncake", b"not json", ["not a JSON object"], id="mooncake-not-json"),
    pytest.param("mooncake", b"[1]", ["not a JSON object"], id="mooncake-json-list"),
])
def test_producer_that_sends_no_kv_is_502(legs, reply, words):
    legs.gate()
    legs.producer.reply = (200, reply)
    legs.consumer.reply = "hang"
    r = legs.post({"prompt": "x"})
    assert r.status_code == 502 and r.headers["X-KVCS-Failed-Leg"] == "prefill"
    message = r.json()["error"]["message"]
    assert legs.producer.url in message
    for word in words:
        assert word in message, (word, message)
    _consumer_leg_was_cancelled(legs, r)


def test_consumer_error_is_passed_through_with_the_leg_at_once(legs):
    error = {"object": "error", "message": "kv_checksum_mismatch: corrupt (group 0 blocks [3])", "code": 503}
    legs.consumer.reply = (503, error)
    r = legs.post({"prompt": "x"})
    assert r.status_code == 503 and r.json() == error
    assert r.headers["X-KVCS-Failed-Leg"] == "decode"
    assert len(legs.producer.received) == 1


def test_unreachable_consumer_is_502_naming_the_leg(legs):
    r = legs.post({"prompt": "x"}, pair="deadc")
    assert r.status_code == 502 and r.headers["X-KVCS-Failed-Leg"] == "decode"
    assert legs.env["nobody"] in r.json()["error"]["message"]
    [prefill] = legs.env["servers"]["deadc-producer"].received
    if legs.mode == "mooncake":
        assert TRANSFER_ID.fullmatch(prefill["json"]["kv_transfer_params"]["transfer_id"])


def test_consumer_timeout_is_504(legs):
    legs.consumer.reply = "hang"  # the KV (a WRITE, a transfer) never arrives
    r = legs.post({"prompt": "x"})
    assert r.status_code == 504 and r.headers["X-KVCS-Failed-Leg"] == "decode"
    assert f"within {legs.leg_timeout_s} s" in r.json()["error"]["message"]


def test_invalid_and_streaming_requests_reach_no_server(legs):
    assert legs.client.post("/v1/completions", content=b"{nope",
                            headers={"Content-Type": "application/json"}).status_code == 400
    assert legs.client.post("/v1/completions", json={"prompt": "x", "stream": True}).status_code == 400
    assert not any(s.received for s in legs.env["servers"].values())


def test_proxy_modes_need_matching_pairs():
    """Push pairs need a push target, mooncake pairs a bootstrap server; each only in its mode."""
    pull = parse_pair("a=http://h:1,http://h:2")
    for mode in ("push", "mooncake"):
        with pytest.raises(ValueError, match=f"{mode} mode needs"):
            Proxy([pull], mode=mode)
    with pytest.raises(ValueError, match="push only"):
        Proxy([with_push_targets([pull], [parse_push_target("a=e,h:5")])[0]])
    with pytest.raises(ValueError, match="mode must be one of"):
        Proxy([pull], mode="lmcache")
    mooncake = with_bootstraps([pull], [parse_bootstrap("a=http://h:5")])[0]
    for mode in ("pull", "push"):
        with pytest.raises(ValueError, match="mooncake only"):
            Proxy([replace(mooncake, push=PushTarget("e", "h", 5))] if mode == "push" else [mooncake], mode=mode)
    with pytest.raises(ValueError, match="push only"):
        Proxy([replace(mooncake, push=PushTarget("e", "h", 5))], mode="mooncake")
    assert Proxy([mooncake], mode="mooncake").mode == "mooncake"


@pytest.mark.parametrize("parse, attach, b, a, other_a, c, of_pair, want, two", [
    pytest.param(parse_push_target, with_push_targets, "b=eb,h:6,2", "a=ea,h:5", "a=eb,h:6", "c=ec,h:7",
                 lambda p: (p.name, p.push.engine_id, p.push.port, p.push.tp_size),
                 [("a", "ea", 5, 1), ("b", "eb", 6, 2)], "two targets", id="push"),
    pytest.param(parse_bootstrap, with_bootstraps, "b=http://h:6", "a=http://h:5", "a=http://h:6", "c=http://h:5",
                 lambda p: (p.name, p.bootstrap, p.push),
                 [("a", "http://h:5", None), ("b", "http://h:6", None)], "two bootstrap servers", id="mooncake"),
])
def test_push_targets_and_bootstraps_match_the_pairs(parse, attach, b, a, other_a, c, of_pair, want, two):
    """--push-target (push) and --bootstrap (mooncake): one for each pair, in the pairs' order."""
    pairs = [parse_pair("a=http://h:1,http://h:2"), parse_pair("b=http://h:3,http://h:4")]
    assert [of_pair(p) for p in attach(pairs, [parse(b), parse(a)])] == want
    with pytest.raises(ValueError, match="missing: \\['b'\\]"):
        attach(pairs, [parse(a)])
    with pytest.raises(ValueError, match="unknown pair"):
        attach(pairs, [parse(a), parse(b), parse(c)])
    with pytest.raises(ValueError, match=two):
        attach(pairs, [parse(a), parse(other_a)])


@pytest.mark.parametrize("argv, message", [
    (["--mode", "push", "--pair", "a=http://h:1,http://h:2"], "needs a --push-target for every pair"),
    (["--pair", "a=http://h:1,http://h:2", "--push-target", "a=e,h:5"], "for --mode push only"),
    (["--mode", "push", "--pair", "a=http://h:1,http://h:2", "--push-target", "a=e,h"], "--push-target"),
    (["--mode", "mooncake", "--pair", "a=http://h:1,http://h:2"], "needs a --bootstrap for every pair"),
    (["--pair", "a=http://h:1,http://h:2", "--bootstrap", "a=http://h:5"], "for --mode mooncake only"),
    (["--mode", "push", "--pair", "a=http://h:1,http://h:2", "--push-target", "a=e,h:5",
      "--bootstrap", "a=http://h:5"], "for --mode mooncake only"),
    (["--mode", "mooncake", "--pair", "a=http://h:1,http://h:2", "--bootstrap", "a=http://h:5",
      "--push-target", "a=e,h:5"], "for --mode push only"),
    (["--mode", "mooncake", "--pair", "a=http://h:1,http://h:2", "--bootstrap", "a=h:5"], "--bootstrap"),
])
def test_mode_arguments_are_checked(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        proxy_main(["--port", "1", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
