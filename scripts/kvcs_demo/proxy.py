"""The demo's prefill/decode proxy: one completion = a producer leg + a consumer leg.

Run as its own process (with `scripts/` on PYTHONPATH):

    python -m kvcs_demo.proxy --port 8000 \\
        --pair a=http://127.0.0.1:8100,http://127.0.0.1:8200 [--pair b=...]

Routes:
- `POST /pairs/{name}/v1/completions`: through pair `name`;
- `POST /v1/completions`: through the first pair;
- `GET /health`: 200 once it serves.

A completion (non-streaming only) goes first to the producer with
`max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true, ...}`,
so the producer prefills and keeps the KV for the consumer; then the client's
original request goes to the consumer with the `kv_transfer_params` the
producer returned (the NIXL handle and, with checksums on, `kv_checksums`),
so the consumer pulls the KV instead of prefilling. The consumer's answer is
the client's answer.

`--mode push` (NixlPushConnector on both servers; one `--push-target` per
pair) sends both legs at once, with the same `X-Request-Id`: the consumer
leg carries the producer's NIXL coordinates (`do_remote_prefill`,
`remote_engine_id`, `remote_host`, `remote_port`, `tp_size`, `pp_size`; no
block ids), so the consumer allocates its blocks and registers them with the
producer (a PUSH_REG notification) while the producer prefills; the
producer's NIXL writer pairs that registration with its finished request by
the request id and WRITEs the KV into the consumer's blocks. Nothing of the
producer's answer reaches the consumer (push-mode checksums ride the
WRITE's notification). The producer's answer is checked (200, a push
producer with the engine id the consumer registered with); if it is not
right the consumer leg is cancelled, which aborts its request.

`--mode mooncake` (MooncakeConnector on both servers, P2P; one `--bootstrap`
per pair: the producer's bootstrap server, which its worker starts on
VLLM_MOONCAKE_BOOTSTRAP_PORT) follows upstream's router
(examples/disaggregated/mooncake_connector/mooncake_connector_proxy.py).
At startup the proxy asks each producer's bootstrap server
(`GET <bootstrap>/query`) for the engine id of DP rank 0, again and again
until the producer's worker has registered (it may not have right after
/health); a completion that comes first waits for it (at most `--timeout`,
then 503 for the prefill leg, no leg sent). Per completion it picks a
transfer id `xfer-<uuid>` and sends both legs at once, with the same
`X-Request-Id`: the producer's with `do_remote_decode` and the transfer id,
the consumer's with `do_remote_prefill`, `remote_bootstrap_addr`,
`remote_engine_id` and the transfer id. The consumer asks the producer's
worker for the transfer by that id; the producer sends the KV (and the
checksums, on the transfer's response) once its request finished by length
(`max_tokens: 1`), and returns no kv_transfer_params. The producer's answer
is checked (200, finish_reason "length"): if it is not right the consumer
leg is cancelled, which aborts its request (else it would wait for KV that
is never sent until VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT).

Response headers: `X-KVCS-Request-Id` (the id both legs carry; in pull mode
the producer leg's `X-Request-Id` is `<id>-prefill`, in push and mooncake
mode `<id>`),
and `X-KVCS-Failed-Leg: prefill|decode` when a leg failed. Errors the proxy
makes itself are OpenAI-style JSON `{"error": {"message", "type", "code"}}`
and name the leg and the URL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import uuid
from dataclasses import dataclass, replace

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

log = logging.getLogger("kvcs_demo.proxy")

MAX_BODY_BYTES = 1024 * 1024
# A producer's answer carries kv_checksums (~87 KB for a 128K-token prompt);
# anything near this bound is not a completion.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
LEG_TIMEOUT_S = 120.0
# Seconds an idle pooled connection to a server is kept: below vLLM's
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s), after which its server closes it. Past
# that, a leg could be sent on a connection the server is closing and fail
# with "Server disconnected" (aiohttp's default keeps them 15 s).
KEEPALIVE_S = 2.0
# Mooncake bootstrap /query: pauses between attempts (doubling up to the
# second value), each attempt's timeout, and the largest answer read.
BOOTSTRAP_RETRY_S = (0.25, 1.0)
BOOTSTRAP_QUERY_TIMEOUT_S = 5.0
MAX_BOOTSTRAP_ANSWER_BYTES = 1024 * 1024

REQUEST_ID = "X-Request-Id"
KVCS_REQUEST_ID = "X-KVCS-Request-Id"
FAILED_LEG = "X-KVCS-Failed-Leg"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
MODES = ("pull", "push", "mooncake")


@dataclass(frozen=True)
class PushTarget:
    """What a push consumer needs to register its blocks with the producer
    before the producer answers: the producer's NIXL engine id (its
    kv_transfer_config "engine_id"), NIXL side channel host and port
    (VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT), and its TP and PP sizes."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1

    def decode_params(self, request_id: str) -> dict:
        """The consumer leg's kv_transfer_params (upstream's push proxy,
        examples/disaggregated/disaggregated_serving/
        disagg_proxy_pushconnector_demo.py): no remote_block_ids, the
        producer picks its blocks when it matches the registration."""
        return {"do_remote_decode": False, "do_remote_prefill": True,
                "remote_engine_id": self.engine_id, "remote_host": self.host,
                "remote_port": self.port, "tp_size": self.tp_size, "pp_size": self.pp_size,
                # For the consumer's lease heartbeats to the producer.
                "remote_request_id": request_id}


@dataclass(frozen=True)
class Pair:
    """A producer (prefill) server and a consumer (decode) server, by base URL;
    in push mode also the producer's NIXL coordinates, in mooncake mode the
    base URL of the producer's bootstrap server."""

    name: str
    producer: str
    consumer: str
    push: PushTarget | None = None
    bootstrap: str | None = None


def parse_pair(text: str) -> Pair:
    """`NAME=PRODUCER_URL,CONSUMER_URL` -> Pair (ValueError saying what is wrong)."""
    name, sep, urls = text.partition("=")
    parts = [u.strip().rstrip("/") for u in urls.split(",")]
    if not sep or len(parts) != 2 or not all(parts):
        raise ValueError(f"--pair {text!r}: expected NAME=PRODUCER_URL,CONSUMER_URL")
    if not _NAME_RE.match(name):
        raise ValueError(f"--pair {text!r}: name {name!r} must match {_NAME_RE.pattern}")
    for url in parts:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--pair {text!r}: {url!r} is not an http(s) URL")
    return Pair(name, parts[0], parts[1])


def _positive(text: str, what: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--push-target {spec!r}: {what} {text!r} is not a positive integer")
    return value


def parse_push_target(text: str) -> tuple[str, PushTarget]:
    """`NAME=ENGINE_ID,HOST:PORT[,TP_SIZE[,PP_SIZE]]` -> (pair name, PushTarget)."""
    name, sep, rest = text.partition("=")
    parts = [p.strip() for p in rest.split(",")]
    usage = f"--push-target {text!r}: expected NAME=ENGINE_ID,HOST:PORT[,TP_SIZE[,PP_SIZE]]"
    if not sep or not 2 <= len(parts) <= 4 or not all(parts):
        raise ValueError(usage)
    if not _NAME_RE.match(name):
        raise ValueError(f"--push-target {text!r}: name {name!r} must match {_NAME_RE.pattern}")
    host, colon, port = parts[1].rpartition(":")
    if not colon or not host:
        raise ValueError(f"{usage} (no HOST:PORT in {parts[1]!r})")
    port_num = _positive(port, "port", text)
    if port_num > 65535:
        raise ValueError(f"--push-target {text!r}: port {port_num} is above 65535")
    tp = _positive(parts[2], "TP size", text) if len(parts) > 2 else 1
    pp = _positive(parts[3], "PP size", text) if len(parts) > 3 else 1
    return name, PushTarget(parts[0], host, port_num, tp, pp)


def _attach(pairs: list[Pair], items: list[tuple[str, object]], field: str, flag: str, what: str,
            mode: str) -> list[Pair]:
    """The pairs with `field` set from (pair name, value) items, one per pair."""
    by_name: dict[str, object] = {}
    for name, value in items:
        if name in by_name:
            raise ValueError(f"{flag}: two {what} for pair {name!r}")
        by_name[name] = value
    unknown = sorted(set(by_name) - {p.name for p in pairs})
    if unknown:
        raise ValueError(f"{flag} for unknown pair(s) {unknown}; pairs: {[p.name for p in pairs]}")
    missing = [p.name for p in pairs if p.name not in by_name]
    if missing:
        raise ValueError(f"--mode {mode} needs a {flag} for every pair; missing: {missing}")
    return [replace(p, **{field: by_name[p.name]}) for p in pairs]


def with_push_targets(pairs: list[Pair], targets: list[tuple[str, PushTarget]]) -> list[Pair]:
    """The pairs, each with its push target (every pair needs exactly one)."""
    return _attach(pairs, targets, "push", "--push-target", "targets", "push")


def parse_bootstrap(text: str) -> tuple[str, str]:
    """`NAME=BOOTSTRAP_URL` -> (pair name, the URL without a trailing slash)."""
    name, sep, url = text.partition("=")
    url = url.strip().rstrip("/")
    if not sep or not url:
        raise ValueError(f"--bootstrap {text!r}: expected NAME=BOOTSTRAP_URL (http://HOST:PORT)")
    if not _NAME_RE.match(name):
        raise ValueError(f"--bootstrap {text!r}: name {name!r} must match {_NAME_RE.pattern}")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--bootstrap {text!r}: {url!r} is not an http(s) URL")
    return name, url


def with_bootstraps(pairs: list[Pair], bootstraps: list[tuple[str, str]]) -> list[Pair]:
    """The pairs, each with its producer's bootstrap URL (every pair needs exactly one)."""
    return _attach(pairs, bootstraps, "bootstrap", "--bootstrap", "bootstrap servers", "mooncake")


def engine_id_of(answer: object) -> str | None:
    """The engine id of DP rank 0 in a bootstrap server's /query answer
    ({"0": {"engine_id": ..., "worker_addr": {...}}}), None if none yet."""
    entry = answer.get("0") if isinstance(answer, dict) else None
    engine_id = entry.get("engine_id") if isinstance(entry, dict) else None
    return engine_id if isinstance(engine_id, str) and engine_id else None


# ------------------------------------------------------------------ responses


def _error(status: int, message: str, *, leg: str | None = None,
           request_id: str | None = None) -> web.Response:
    headers = {}
    if leg:
        headers[FAILED_LEG] = leg
    if request_id:
        headers[KVCS_REQUEST_ID] = request_id
    kind = "invalid_request_error" if status < 500 else "proxy_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}},
        status=status, headers=headers,
    )


def _passthrough(status: int, body: bytes, content_type: str | None,
                 request_id: str, leg: str | None) -> web.Response:
    headers = {KVCS_REQUEST_ID: request_id,
               "Content-Type": content_type or "application/json"}
    if leg:
        headers[FAILED_LEG] = leg
    return web.Response(status=status, body=body, headers=headers)


class _LegFailed(Exception):
    """A leg got no HTTP answer (connection error, timeout, oversized body)."""

    def __init__(self, response: web.Response):
        self.response = response


# ---------------------------------------------------------------------- proxy


class Proxy:
    """The aiohttp handlers; one ClientSession for every leg, made on startup."""

    def __init__(self, pairs: list[Pair], *, leg_timeout: float = LEG_TIMEOUT_S,
                 max_body_bytes: int = MAX_BODY_BYTES,
                 max_response_bytes: int = MAX_RESPONSE_BYTES, mode: str = "pull"):
        if not pairs:
            raise ValueError("the proxy needs at least one --pair")
        names = [p.name for p in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"pair names must be unique, got {names}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "push" and any(p.push is None for p in pairs):
            raise ValueError("push mode needs the producer's NIXL coordinates (--push-target) of pairs "
                             f"{[p.name for p in pairs if p.push is None]}")
        if mode != "push" and any(p.push is not None for p in pairs):
            raise ValueError("--push-target is for --mode push only")
        if mode == "mooncake" and any(p.bootstrap is None for p in pairs):
            raise ValueError("mooncake mode needs the producer's bootstrap server (--bootstrap) of pairs "
                             f"{[p.name for p in pairs if p.bootstrap is None]}")
        if mode != "mooncake" and any(p.bootstrap is not None for p in pairs):
            raise ValueError("--bootstrap is for --mode mooncake only")
        self.mode = mode
        self.pairs = {p.name: p for p in pairs}
        self.default = pairs[0]
        self.leg_timeout = leg_timeout
        self.max_body_bytes = max_body_bytes
        self.max_response_bytes = max_response_bytes
        self.session: ClientSession | None = None
        # Mooncake mode: each pair's producer engine id (DP rank 0), set once
        # its bootstrap server names it; what the last /query gave until then.
        self.engines: dict[str, str] = {}
        self._engine_known: dict[str, asyncio.Event] = {}
        self._bootstrap_state: dict[str, str] = {}

    async def session_ctx(self, app: web.Application):
        # No trust_env: the servers are local, an http_proxy variable must not
        # route the legs elsewhere.
        self.session = ClientSession(connector=TCPConnector(limit=256, keepalive_timeout=KEEPALIVE_S),
                                     timeout=ClientTimeout(total=self.leg_timeout))
        lookups = []
        if self.mode == "mooncake":
            for pair in self.pairs.values():
                self._engine_known[pair.name] = asyncio.Event()
                self._bootstrap_state[pair.name] = "not asked yet"
                lookups.append(asyncio.ensure_future(self._find_engine(pair)))
        yield
        for task in lookups:
            task.cancel()
        await asyncio.gather(*lookups, return_exceptions=True)
        await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        if self.mode == "mooncake":
            # Each pair's producer engine id, null until its bootstrap server named it.
            return web.json_response({"status": "ok", "pairs": list(self.pairs),
                                      "engines": {n: self.engines.get(n) for n in self.pairs}})
        return web.json_response({"status": "ok", "pairs": list(self.pairs)})

    async def _find_engine(self, pair: Pair) -> None:
        """Mooncake mode: ask the producer's bootstrap server for its engine id
        until it names one (the producer's worker registers once its KV caches
        are set up; the server may not even listen before that)."""
        assert self.session is not None and pair.bootstrap is not None
        url = f"{pair.bootstrap}/query"
        pause, longest = BOOTSTRAP_RETRY_S
        while True:
            try:
                async with self.session.get(url, timeout=ClientTimeout(total=BOOTSTRAP_QUERY_TIMEOUT_S)) as resp:
                    raw = await resp.content.read(MAX_BOOTSTRAP_ANSWER_BYTES + 1)
                    if resp.status != 200:
                        state = f"HTTP {resp.status}"
                    else:
                        try:
                            engine_id = engine_id_of(json.loads(raw))
                        except (ValueError, UnicodeDecodeError, RecursionError):
                            engine_id = None
                        if engine_id is not None:
                            self.engines[pair.name] = engine_id
                            self._engine_known[pair.name].set()
                            log.info("pair %s: producer engine %s (DP rank 0), from %s", pair.name, engine_id,
                                     url)
                            return
                        state = f"no engine for DP rank 0 yet (answer {raw[:200].decode('utf-8', 'replace')!r})"
            except asyncio.CancelledError:
                raise
            except (ClientError, asyncio.TimeoutError, OSError) as e:
                state = f"no answer ({type(e).__name__}: {e})"
            except Exception as e:  # keep asking: the pair is useless without it
                log.exception("pair %s: asking %s failed", pair.name, url)
                state = f"error ({e!r})"
            self._bootstrap_state[pair.name] = state
            await asyncio.sleep(pause)
            pause = min(pause * 2, longest)

    async def _engine_of(self, pair: Pair, request_id: str) -> str:
        """Mooncake mode: the pair's producer engine id, waiting for it at most
        the leg timeout (_LegFailed with a 503 for the prefill leg)."""
        known = self.engines.get(pair.name)
        if known is not None:
            return known
        try:
            await asyncio.wait_for(self._engine_known[pair.name].wait(), self.leg_timeout)
        except asyncio.TimeoutError:
            raise _LegFailed(_error(
                503, f"prefill leg: the Mooncake bootstrap server of pair {pair.name!r} "
                     f"({pair.bootstrap}/query) named no producer engine for DP rank 0 within "
                     f"{self.leg_timeout:g} s (--timeout); last: {self._bootstrap_state[pair.name]}. Is the "
                     "producer a MooncakeConnector kv_producer started with VLLM_MOONCAKE_BOOTSTRAP_PORT of "
                     "that URL?", leg="prefill", request_id=request_id)) from None
        return self.engines[pair.name]

    async def completions_default(self, request: web.Request) -> web.Response:
        return await self._completion(request, self.default)

    async def completions_pair(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        pair = self.pairs.get(name)
        if pair is None:
            return _error(404, f"no pair named {name!r}; known pairs: {sorted(self.pairs)}")
        return await self._completion(request, pair)

    async def _completion(self, request: web.Request, pair: Pair) -> web.Response:
        request_id = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        legs = {"push": self._push_legs, "mooncake": self._mooncake_legs}.get(self.mode, self._two_legs)
        try:
            response = await legs(request, pair, request_id)
        except _LegFailed as e:
            response = e.response
        except Exception as e:  # never let one request take the proxy down
            log.exception("request %s through pair %s failed", request_id, pair.name)
            response = _error(500, f"proxy error on pair {pair.name!r}: {e!r}",
                              request_id=request_id)
        # One line per completion, to find a request in the servers' logs.
        failed = response.headers.get(FAILED_LEG)
        log.info("request %s via pair %s: %d%s", request_id, pair.name, response.status,
                 f" (failed leg: {failed})" if failed else "")
        return response

    async def _read_completion(self, request: web.Request,
                               request_id: str) -> dict | web.Response:
        """The client's completion request, or the error response to give."""
        try:
            raw = await request.read()  # bounded by client_max_size
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body larger than {self.max_body_bytes} "
                               "bytes (--max-body-bytes)", request_id=request_id)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            return _error(400, f"request body is not valid JSON: {e}", request_id=request_id)
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object (a completion request)",
                          request_id=request_id)
        if body.get("stream"):
            return _error(400, 'the kvcs demo proxy serves non-streaming completions only; '
                               'send "stream": false', request_id=request_id)
        return body

    @staticmethod
    def _prefill_request(body: dict) -> dict:
        """The producer leg: prefill only, keeping the KV for the consumer."""
        prefill = dict(body)
        prefill.update(max_tokens=1, stream=False,
                       kv_transfer_params={"do_remote_decode": True,
                                           "do_remote_prefill": False})
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        # min_tokens > 1 would be rejected next to max_tokens 1; it only
        # matters to the decode leg anyway.
        prefill.pop("min_tokens", None)
        prefill.pop("stream_options", None)
        return prefill

    async def _two_legs(self, request: web.Request, pair: Pair,
                        request_id: str) -> web.Response:
        body = await self._read_completion(request, request_id)
        if isinstance(body, web.Response):
            return body

        # Leg 1: prefill on the producer, which keeps the KV for the consumer.
        prefill = self._prefill_request(body)
        p_url = f"{pair.producer}/v1/completions"
        status, p_body, p_type = await self._post(
            "prefill", p_url, prefill, f"{request_id}-prefill", request_id)
        if status != 200:
            return _passthrough(status, p_body, p_type, request_id, "prefill")
        try:
            params = json.loads(p_body).get("kv_transfer_params")
        except (ValueError, UnicodeDecodeError, AttributeError):
            return _error(502, f"producer of pair {pair.name!r} ({p_url}) answered 200 "
                               "with a body that is not a JSON object",
                          leg="prefill", request_id=request_id)
        if not params:
            return _error(502, f"producer of pair {pair.name!r} ({p_url}) returned no "
                               "kv_transfer_params: start it with a NixlConnector "
                               'kv_transfer_config whose kv_role produces KV ("kv_producer" '
                               'or "kv_both")', leg="prefill", request_id=request_id)

        # Leg 2: the client's own request, loading the producer's KV.
        decode = dict(body)
        decode["kv_transfer_params"] = params
        c_url = f"{pair.consumer}/v1/completions"
        status, c_body, c_type = await self._post(
            "decode", c_url, decode, request_id, request_id)
        return _passthrough(status, c_body, c_type, request_id,
                            None if status == 200 else "decode")

    async def _push_legs(self, request: web.Request, pair: Pair,
                         request_id: str) -> web.Response:
        """Push mode: both legs at once, with the same X-Request-Id.

        The consumer registers its blocks with the producer while the
        producer prefills; the producer's NIXL writer pairs the two by
        request id (exactly, else with vLLM's per-engine random suffix
        stripped: nixl/push_worker.py _pop_matching_registration) and
        WRITEs. Either may come first, so the order of the legs does not
        matter; sending them together overlaps the registration with the
        prefill (upstream's push proxy does the same).
        """
        body = await self._read_completion(request, request_id)
        if isinstance(body, web.Response):
            return body
        assert pair.push is not None
        prefill = self._prefill_request(body)
        decode = dict(body)
        decode["kv_transfer_params"] = pair.push.decode_params(request_id)
        return await self._legs_at_once(pair, request_id, prefill, decode, self._push_producer_problem)

    async def _mooncake_legs(self, request: web.Request, pair: Pair,
                             request_id: str) -> web.Response:
        """Mooncake mode: both legs at once, with the same X-Request-Id and
        one transfer id (upstream's mooncake_connector_proxy.py).

        The consumer asks the producer's worker (found through the bootstrap
        server at remote_bootstrap_addr) for the transfer by its id and
        waits; the producer's worker sends the KV once the producer's
        request finished by length. Either leg may come first.
        """
        body = await self._read_completion(request, request_id)
        if isinstance(body, web.Response):
            return body
        assert pair.bootstrap is not None
        engine_id = await self._engine_of(pair, request_id)
        transfer_id = f"xfer-{uuid.uuid4().hex}"
        prefill = self._prefill_request(body)
        prefill["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                         "transfer_id": transfer_id}
        decode = dict(body)
        decode["kv_transfer_params"] = {"do_remote_decode": False, "do_remote_prefill": True,
                                        "remote_bootstrap_addr": pair.bootstrap,
                                        "remote_engine_id": engine_id, "transfer_id": transfer_id}
        return await self._legs_at_once(pair, request_id, prefill, decode, self._mooncake_producer_problem)

    async def _legs_at_once(self, pair: Pair, request_id: str, prefill: dict, decode: dict,
                            producer_problem) -> web.Response:
        """Push and mooncake mode: the consumer leg goes out together with the
        producer leg; the producer's answer is checked by
        `producer_problem(pair, url, body)` (a reason the KV will not reach
        the consumer, or None)."""
        p_url = f"{pair.producer}/v1/completions"
        c_url = f"{pair.consumer}/v1/completions"
        decode_leg = asyncio.ensure_future(self._post(
            "decode", c_url, decode, request_id, request_id))
        try:
            status, p_body, p_type = await self._post(
                "prefill", p_url, prefill, request_id, request_id)
            if status != 200:
                return _passthrough(status, p_body, p_type, request_id, "prefill")
            problem = producer_problem(pair, p_url, p_body)
            if problem:
                return _error(502, problem, leg="prefill", request_id=request_id)
            status, c_body, c_type = await decode_leg
            return _passthrough(status, c_body, c_type, request_id,
                                None if status == 200 else "decode")
        finally:
            # A consumer leg still waiting for KV that will not come (the
            # prefill failed) is cancelled: its connection closes and the
            # consumer aborts the request. Its outcome, if any, is
            # collected so no exception is left unretrieved.
            decode_leg.cancel()
            await asyncio.gather(decode_leg, return_exceptions=True)

    @staticmethod
    def _mooncake_producer_problem(pair: Pair, p_url: str, p_body: bytes) -> str | None:
        """Why the producer's 200 answer means its worker sends no KV for the
        transfer (None: it does). A Mooncake producer returns no
        kv_transfer_params, so what tells is how the request finished:
        Mooncake sends only for requests that finished by length."""
        try:
            answer = json.loads(p_body)
            choices = answer.get("choices")
        except (ValueError, UnicodeDecodeError, AttributeError):
            return (f"producer of pair {pair.name!r} ({p_url}) answered 200 with a body that "
                    "is not a JSON object")
        where = f"producer of pair {pair.name!r} ({p_url})"
        first = choices[0] if isinstance(choices, list) and choices else None
        finish = first.get("finish_reason") if isinstance(first, dict) else None
        if finish != "length":
            return (f"{where} finished its prefill with finish_reason {finish!r}, not 'length': "
                    "MooncakeConnector sends the KV only of a request that stopped at max_tokens (the "
                    "prefill leg's 1), so the consumer would wait for it until "
                    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT")
        return None

    @staticmethod
    def _push_producer_problem(pair: Pair, p_url: str, p_body: bytes) -> str | None:
        """Why the producer's 200 answer means no WRITE will reach the
        consumer (None: it will)."""
        assert pair.push is not None
        try:
            params = json.loads(p_body).get("kv_transfer_params")
        except (ValueError, UnicodeDecodeError, AttributeError):
            return (f"producer of pair {pair.name!r} ({p_url}) answered 200 with a body that "
                    "is not a JSON object")
        where = f"producer of pair {pair.name!r} ({p_url})"
        if not isinstance(params, dict) or not params:
            return (f"{where} returned no kv_transfer_params: start it with a NixlPushConnector "
                    'kv_transfer_config whose kv_role produces KV ("kv_producer" or "kv_both")')
        if params.get("transfer_mode") != "push":
            return (f"{where} is not a push producer (transfer_mode "
                    f"{params.get('transfer_mode')!r}): start it with NixlPushConnector, or run "
                    "the proxy in --mode pull")
        if params.get("remote_engine_id") != pair.push.engine_id:
            return (f"{where} has NIXL engine id {params.get('remote_engine_id')!r}, but the "
                    f"consumer registered its blocks with {pair.push.engine_id!r} (--push-target); "
                    'set "engine_id" in the producer\'s kv_transfer_config')
        return None

    async def _post(self, leg: str, url: str, payload: dict, header_id: str,
                    request_id: str) -> tuple[int, bytes, str | None]:
        """POST one leg; (status, body, content type), or _LegFailed with a 502/504."""
        assert self.session is not None
        try:
            async with self.session.post(url, json=payload,
                                         headers={REQUEST_ID: header_id}) as resp:
                body = await resp.content.read(self.max_response_bytes + 1)
                if len(body) > self.max_response_bytes:
                    raise _LegFailed(_error(
                        502, f"{leg} leg: {url} answered more than "
                             f"{self.max_response_bytes} bytes", leg=leg,
                        request_id=request_id))
                return resp.status, body, resp.headers.get("Content-Type")
        except asyncio.TimeoutError:
            raise _LegFailed(_error(
                504, f"{leg} leg: no answer from {url} within {self.leg_timeout:g} s "
                     "(--timeout)", leg=leg, request_id=request_id)) from None
        except ClientError as e:
            raise _LegFailed(_error(
                502, f"{leg} leg: cannot reach {url}: {e}; is that server running?",
                leg=leg, request_id=request_id)) from None


def build_app(pairs: list[Pair], *, leg_timeout: float = LEG_TIMEOUT_S,
              max_body_bytes: int = MAX_BODY_BYTES,
              max_response_bytes: int = MAX_RESPONSE_BYTES,
              mode: str = "pull") -> web.Application:
    """The proxy's aiohttp application (for `web.run_app` or a test server)."""
    proxy = Proxy(pairs, leg_timeout=leg_timeout, max_body_bytes=max_body_bytes,
                  max_response_bytes=max_response_bytes, mode=mode)
    app = web.Application(client_max_size=max_body_bytes)
    app.cleanup_ctx.append(proxy.session_ctx)
    app.router.add_get("/health", proxy.health)
    app.router.add_post("/v1/completions", proxy.completions_default)
    app.router.add_post("/pairs/{name}/v1/completions", proxy.completions_pair)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvcs_demo.proxy",
                                 description="The kvcs demo's prefill/decode proxy.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pair", action="append", required=True, metavar="NAME=P_URL,C_URL",
                    help="a producer and a consumer base URL; repeat for more pairs "
                         "(the first also serves /v1/completions)")
    ap.add_argument("--timeout", type=float, default=LEG_TIMEOUT_S,
                    help="seconds per leg (default %(default)s)")
    ap.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                    help="largest client body accepted (default %(default)s)")
    ap.add_argument("--mode", choices=MODES, default="pull",
                    help="connector mode of the servers: pull (NixlConnector: producer leg, then "
                         "the consumer leg with the producer's kv_transfer_params), push "
                         "(NixlPushConnector: both legs at once; needs --push-target) or mooncake "
                         "(MooncakeConnector: both legs at once with one transfer id; needs --bootstrap)")
    ap.add_argument("--push-target", action="append", default=[],
                    metavar="NAME=ENGINE_ID,HOST:PORT[,TP[,PP]]",
                    help="push mode, once per pair: the producer's NIXL engine id "
                         "(kv_transfer_config engine_id), side channel host and port, "
                         "TP and PP sizes (default 1)")
    ap.add_argument("--bootstrap", action="append", default=[], metavar="NAME=URL",
                    help="mooncake mode, once per pair: the producer's bootstrap server "
                         "(http://HOST:VLLM_MOONCAKE_BOOTSTRAP_PORT)")
    args = ap.parse_args(argv)
    try:
        pairs = [parse_pair(p) for p in args.pair]
        if args.mode == "push":
            pairs = with_push_targets(pairs, [parse_push_target(t) for t in args.push_target])
        elif args.push_target:
            raise ValueError("--push-target is for --mode push only")
        if args.mode == "mooncake":
            pairs = with_bootstraps(pairs, [parse_bootstrap(b) for b in args.bootstrap])
        elif args.bootstrap:
            raise ValueError("--bootstrap is for --mode mooncake only")
        app = build_app(pairs, leg_timeout=args.timeout, max_body_bytes=args.max_body_bytes,
                        mode=args.mode)
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    routes = ", ".join(f"{p.name}: {p.producer} -> {p.consumer}" + (
        f" (push: engine {p.push.engine_id} at {p.push.host}:{p.push.port}, TP {p.push.tp_size}, "
        f"PP {p.push.pp_size})" if p.push else "") + (
        f" (mooncake: bootstrap {p.bootstrap})" if p.bootstrap else "") for p in pairs)
    # shutdown_timeout: on SIGTERM (the demo's stop) in-flight legs get 5 s,
    # well inside the demo's 20 s before SIGKILL.
    # handler_cancellation: a client that hangs up cancels its legs, so the
    # servers abort the request (mid-prefill, mid-transfer or mid-decode) as
    # they would behind a production proxy; the soak relies on it.
    web.run_app(app, host=args.host, port=args.port, shutdown_timeout=5, handler_cancellation=True,
                print=lambda _: log.info("listening on http://%s:%d (%s)",
                                         args.host, args.port, routes))


if __name__ == "__main__":
    main()
