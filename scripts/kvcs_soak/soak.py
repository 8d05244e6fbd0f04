"""make soak: real P/D servers under load and real races, judged against ground truth.

    .venv/bin/python -m kvcs_soak [--requests N] [--concurrency C] ...   (scripts/ on PYTHONPATH)

Starts a real producer and consumer (vLLM OpenAI servers of the patched tree;
NIXL pull over UCX on loopback by default, or NIXL push, or Mooncake; the
tiny Llama or Gemma-2; checksums on, consumer fail-closed with policy
"fail") and a P/D proxy (the demo's, or vLLM's own toy proxy with streaming
clients), with small KV caches so both sides preempt and reuse blocks. Both
servers wrap their connector in the drill connector
(vllm_kvchecksum.drills.fault_connector) with no faults, only its ground truth
(witness_path: digests of the bytes each producer request sent and each load
received) and, on the consumer, stalls switched on per phase.

Phases: two equal waves of load; the race (a stalled consumer engine posts
its reads late and sends no lease heartbeats, so the producer's short KV
lease runs out and its blocks go to new requests before the consumer reads
them: the read-after-reuse race, made by vLLM's own mechanisms); and,
unless --no-kill-producer, the producer's death (SIGKILL with requests in
flight, then a restart). Traffic: `--concurrency` requests in flight,
random arrivals, prompts of 1 to many blocks in families sharing long
prefixes, varied max_tokens, clients that hang up at a random point or
mid-transfer.

At the end: every ground-truth victim must be a mismatch (or a load its
connector failed), no clean load may be one, the consumer's and producer's
counters must reconcile exactly, both engines must be alive and every
request answered. Prints progress lines and a table, writes
build/soak/report.json (docs/soak.md), exits non-zero when a check fails.
"""


from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from kvcs_demo import prom
from kvcs_demo.demo import checksum_counts, completion, diff
from kvcs_demo.proxy import Proxy, PushTarget, parse_push_target
from kvcs_demo.servers import ProcessGroup, ServerSpec, free_port_block
from kvcs_demo.setups import (BLOCK_SIZE, CONNECTORS, MAX_MODEL_LEN, MODES, MOONCAKE_PROTOCOL, ROOT, Setup,
                              make_models, mooncake_bootstrap, producer_engine_id, push_target, server_argv,
                              server_env)
from kvcs_demo.summary import log
from kvcs_demo.client import completion as one_completion
from kvcs_demo.client import text_of
from kvcs_soak import outputs, plots, truth
from vllm_kvchecksum.engine import incident, metrics

STARTUP_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 240.0  # an answer later than this is a hang (reported, not waited for)
SETTLE_S = 5.0  # counters unchanged this long: every verdict is in
SETTLE_MAX_S = 120.0
WORDS_PER_BLOCK = BLOCK_SIZE  # the tiny Llama's tokenizer: about one token per "wNNN" word
CI_PRESET = {"requests": 300, "concurrency": 32}
# The run's phases and their shares of the requests: two equal waves of load
# (memory after each must stay flat), then the race (consumer stalls on).
PHASES = (("wave1", 0.4, False), ("wave2", 0.4, False), ("race", 0.2, True))
# With --kill-producer: then the producer is SIGKILLed while requests are in
# flight and restarted, the traffic going on.
PHASES_WITH_DEATH = (("wave1", 0.35, False), ("wave2", 0.35, False), ("race", 0.15, True), ("death", 0.15, False))
# The death phase: its first third runs while the producer is killed (once
# half of that third was sent) and restarted; the rest after it is back.
KILL_AFTER_SENT = 1 / 6


# ----------------------------------------------------------------- traffic

def words_of(key: str, n: int) -> list[str]:
    rng = random.Random(key)
    return [f"w{rng.randrange(4, 504)}" for _ in range(n)]


@dataclass
class Planned:
    """One client request of the run."""

    index: int
    prompt: str
    max_tokens: int
    disconnect_after_s: float | None  # the client hangs up after this long (None: waits for the answer)
    delay_s: float  # arrival: after this long from its worker's last request
    # The client runs the two legs itself and hangs up on the consumer's
    # leg after disconnect_after_s (short): an abort while its load is in flight.
    abort_in_transfer: bool = False
    # Streams its answer (behind vLLM's toy proxy; the demo's proxy serves
    # non-streaming completions only).
    stream: bool = False


def plan_traffic(n: int, seed: int, *, families: int = 6, disconnect_rate: float = 0.1,
                 abort_rate: float = 0.05, max_len: int = MAX_MODEL_LEN) -> list[Planned]:
    """n requests: 60% extend one of `families` long shared prefixes (so the
    consumer hits its own prefix cache and loads only the rest), 40% stand
    alone; prompt lengths from 1 word to about 12 blocks; max_tokens 1-96 (decodes that outgrow their blocks);
    `disconnect_rate` of the clients hang up at a random point (through the
    proxy: during the producer's prefill, the transfer or the decode), and
    `abort_rate` right after the consumer's leg starts (mid-transfer)."""
    rng = random.Random(seed)
    prefixes = [words_of(f"family-{seed}-{f}", rng.randrange(2 * WORDS_PER_BLOCK, 8 * WORDS_PER_BLOCK))
                for f in range(families)]
    out = []
    for i in range(n):
        max_tokens = rng.choice([1, 2, 4, 8, 16, 32, 64, 96])
        budget = max_len - max_tokens - 8
        if rng.random() < 0.6:
            words = rng.choice(prefixes) + words_of(f"tail-{seed}-{i}", rng.randrange(0, 3 * WORDS_PER_BLOCK))
        else:
            words = words_of(f"alone-{seed}-{i}", rng.choice([1, rng.randrange(1, WORDS_PER_BLOCK + 2),
                                                              rng.randrange(1, 12 * WORDS_PER_BLOCK)]))
        draw = rng.random()
        abort = draw < abort_rate
        if abort:
            disconnect = rng.uniform(0.0, 0.3)
        else:
            disconnect = rng.uniform(0.05, 4.0) if draw < abort_rate + disconnect_rate else None
        out.append(Planned(i, " ".join(words[:budget]), max_tokens, disconnect, rng.expovariate(4.0), abort,
                           rng.random() < 0.5))
    return out


@dataclass
class Answer:
    index: int
    status: int | None  # None: no HTTP answer (the client hung up, or the connection failed)
    error: str | None
    disconnected: bool
    latency_s: float
    started_s: float = 0.0  # time.monotonic() when it was sent
    text: str | None = None  # the completion's text of a 200 answer (non-streaming)


def send(client: httpx.Client, urls: dict[str, str], req: Planned) -> Answer:
    body = {"model": "", "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0}
    timeout = req.disconnect_after_s or REQUEST_TIMEOUT_S
    t0 = time.monotonic()
    url, headers = f"{urls['proxy']}/v1/completions", {"X-Request-Id": f"soak-{req.index}"}
    if req.abort_in_transfer and urls.get("push") is not None:
        return abort_push_write(client, urls, req, body, t0)
    try:
        if req.abort_in_transfer:
            # The proxy's two legs, run here: the consumer's leg is cut short.
            prefill = Proxy._prefill_request(body)
            p = client.post(f"{urls['producer']}/v1/completions", json=prefill, timeout=REQUEST_TIMEOUT_S,
                            headers={"X-Request-Id": f"soak-{req.index}-prefill"})
            params = p.json().get("kv_transfer_params") if p.status_code == 200 else None
            if not params:
                return Answer(req.index, p.status_code, f"prefill leg: {p.text[:300]}", False,
                              time.monotonic() - t0)
            body = dict(body, kv_transfer_params=params)
            url = f"{urls['consumer']}/v1/completions"
        if req.stream and urls.get("streams") and not req.abort_in_transfer:
            return read_stream(client, url, dict(body, stream=True), headers, req, t0)
        r = client.post(url, json=body, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        return Answer(req.index, None, None if req.disconnect_after_s else "timed out",
                      req.disconnect_after_s is not None, time.monotonic() - t0)
    except httpx.HTTPError as exc:
        return Answer(req.index, None, f"{type(exc).__name__}: {exc}", False, time.monotonic() - t0)
    error, text = None, None
    if r.status_code != 200:
        try:
            error = str(r.json().get("error", {}).get("message") or r.text[:300])
        except ValueError:
            error = r.text[:300]
    else:
        try:
            text = r.json()["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            text = None
    return Answer(req.index, r.status_code, error, False, time.monotonic() - t0, text=text)


def abort_push_write(client: httpx.Client, urls: dict, req: Planned, body: dict, t0: float) -> Answer:
    """Push mode's abort while the WRITE is in flight: the proxy's two legs,
    run here at once under one X-Request-Id (the producer pairs the consumer's
    registration with its request by that id). The consumer's leg is cut
    `disconnect_after_s` (short) after the producer answered, which is when
    the producer's writer starts the WRITE into the consumer's blocks."""
    rid = f"soak-{req.index}"
    push: PushTarget = urls["push"]
    host, port = urls["consumer"].removeprefix("http://").rsplit(":", 1)
    decode = dict(body, kv_transfer_params=push.decode_params(rid))
    prefill = Proxy._prefill_request(body)  # the proxy's own producer leg
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(decode),
                     headers={"Content-Type": "application/json", "X-Request-Id": rid})
        p = client.post(f"{urls['producer']}/v1/completions", json=prefill, headers={"X-Request-Id": rid},
                        timeout=REQUEST_TIMEOUT_S)
        if p.status_code != 200:
            return Answer(req.index, p.status_code, f"prefill leg: {p.text[:300]}", False, time.monotonic() - t0)
        time.sleep(req.disconnect_after_s or 0.0)
    except (OSError, httpx.HTTPError) as exc:
        return Answer(req.index, None, f"{type(exc).__name__}: {exc}", False, time.monotonic() - t0)
    finally:
        conn.close()  # the client hangs up on the consumer's leg
    return Answer(req.index, None, None, True, time.monotonic() - t0)


def read_stream(client: httpx.Client, url: str, body: dict, headers: dict, req: Planned, t0: float) -> Answer:
    """A streaming client: reads the server-sent events to the end, or hangs
    up after req.disconnect_after_s. An error arrives as an event (the status
    is already 200), or as a connection the proxy cuts mid-answer."""
    error = None
    try:
        with client.stream("POST", url, json=body, headers=headers, timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code != 200:
                return Answer(req.index, r.status_code, r.read().decode(errors="replace")[:300], False,
                              time.monotonic() - t0)
            for line in r.iter_lines():
                if req.disconnect_after_s is not None and time.monotonic() - t0 > req.disconnect_after_s:
                    return Answer(req.index, None, None, True, time.monotonic() - t0)
                if line.startswith("data:") and '"error"' in line:
                    error = line[5:].strip()[:300]
    except httpx.TimeoutException:
        return Answer(req.index, None, "timed out", False, time.monotonic() - t0)
    except httpx.HTTPError as exc:
        error = f"stream cut: {type(exc).__name__}: {exc}"
    return Answer(req.index, 200 if error is None else 599, error, False, time.monotonic() - t0)


def run_traffic(urls: dict[str, str], planned: list[Planned], concurrency: int,
                sent_enough: tuple[int, threading.Event] | None = None) -> list[Answer]:
    """Each of `concurrency` clients sends its share, one request at a time,
    after its random arrival delay; a progress line every 10 s. sent_enough
    (n, event): the event is set once n requests were sent."""
    answers: list[Answer] = []
    lock = threading.Lock()
    queue = list(reversed(planned))
    done = threading.Event()
    sent = [0]

    def client_loop():
        with httpx.Client() as client:
            while True:
                with lock:
                    if not queue:
                        return
                    req = queue.pop()
                time.sleep(req.delay_s)
                with lock:
                    sent[0] += 1
                    if sent_enough is not None and sent[0] >= sent_enough[0]:
                        sent_enough[1].set()
                started = time.monotonic()
                answer = send(client, urls, req)
                answer.started_s = started
                with lock:
                    answers.append(answer)

    def progress():
        t0 = time.monotonic()
        while not done.wait(10.0):
            with lock:
                n, ok = len(answers), sum(a.status == 200 for a in answers)
            width = 30
            bar = "#" * (width * n // len(planned))
            log(f"[{bar:<{width}}] {n}/{len(planned)} answered ({ok} ok) after {time.monotonic() - t0:.0f} s")

    reporter = threading.Thread(target=progress, daemon=True)
    reporter.start()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client_loop) for _ in range(concurrency)]:
            f.result()
    done.set()
    return sorted(answers, key=lambda a: a.index)


# ----------------------------------------------------------------- servers

def kv_config(role: str, witness: Path | None, args, control: Path | None = None, setup: Setup | None = None,
              checksums: bool = True) -> dict:
    """Both servers: the mode's connector inside the drill connector (no
    faults; ground truth; on the consumer, stalls switched by `control`, the
    drill's control file), a short KV lease, checksums on. checksums False:
    the same stack with checksums off and no ground truth (the cost baseline)."""
    mode = getattr(args, "mode", "pull")
    child = {"kv_connector": CONNECTORS[mode], "kv_role": role}
    if mode == "mooncake":
        # Its lease is VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (server_specs).
        child["kv_connector_extra_config"] = {"mooncake_protocol": MOONCAKE_PROTOCOL}
    else:
        child["kv_connector_extra_config"] = {"kv_lease_duration": args.lease_s}
        if getattr(args, "device", "cpu") == "cpu":
            child["kv_buffer_device"] = "cpu"
    drill = {"kinds": [], "rate": 0.0, "seed": args.seed}
    if witness is not None:
        drill["witness_path"] = str(witness)
    if role == "kv_consumer":
        drill.update(stall_rate=0.0, stall_s=args.stall_s)
        if control is not None:
            drill["control_path"] = str(control)
    config = {"kv_connector": "KVChecksumFaultConnector", "kv_connector_module_path": "vllm_kvchecksum.drills.fault_connector",
              "kv_role": role, "kv_load_failure_policy": "fail",
              "kv_connector_extra_config": {"connectors": [child], "kv_checksum_faults": drill}}
    if checksums:
        config.update(enable_kv_checksum=True, kv_checksum_fail_closed=True)
        if role == "kv_producer":
            # Every transfer's completion re-checks the producer's blocks:
            # where a victim went bad, and, as the soak changes no producer
            # KV, a false-alarm check of the re-check itself.
            config["kv_checksum_producer_recheck"] = True
    if mode == "push" and role == "kv_producer" and setup is not None:
        config["engine_id"] = producer_engine_id(setup)  # the consumers register with it by this id
    return config


def server_specs(setup: Setup, args, work: Path, checksums: bool = True) -> dict[str, ServerSpec]:
    specs = {}
    for role, side in (("kv_producer", "producer"), ("kv_consumer", "consumer")):
        port, side_port = free_port_block(1), free_port_block(8)
        bootstrap = free_port_block(1) if setup.mode == "mooncake" and role == "kv_producer" else None
        if bootstrap is not None:
            setup.bootstrap_port = bootstrap
        setup.side_ports[side] = side_port
        witness = work / f"{side}.witness.jsonl" if checksums else None
        if witness is not None:
            witness.write_text("")
        kv = kv_config(role, witness, args, control_path(work), setup, checksums)
        argv = server_argv(args.python, setup, role, port, args.device, kv)
        # Small KV caches: both sides preempt and reuse blocks all the time.
        argv += ["--num-gpu-blocks-override", str(args.blocks)]
        # On a GPU host: one GPU each, the producer's first.
        gpus = ([0] if role == "kv_producer" else [1]) if args.device == "cuda" else None
        env = server_env(args.device, side_port, gpus, mode=setup.mode, bootstrap_port=bootstrap) | {
            "PYTHONUNBUFFERED": "1"}
        if setup.mode == "mooncake":
            env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(args.lease_s)
        setup.logs[side] = work / f"{side}{'' if checksums else '-off'}.log"
        setup.urls[side] = f"http://127.0.0.1:{port}"
        specs[side] = ServerSpec(f"soak-{side}" + ("" if checksums else "-off"), argv, env, port, setup.logs[side])
    return specs


def proxy_argv(setup: Setup, python: str, port: int, which: str = "project") -> list[str]:
    """The demo's proxy over the pair, in the pair's mode; or vLLM's own toy
    proxy (pull mode)."""
    if which == "vllm":
        from kvcs_soak.vllm_pd_tests import toy_proxy_argv

        return toy_proxy_argv(python, port, int(setup.urls["producer"].rsplit(":", 1)[1]),
                              int(setup.urls["consumer"].rsplit(":", 1)[1]))
    argv = [python, "-m", "kvcs_demo.proxy", "--port", str(port),
            f"--pair={setup.name}={setup.urls['producer']},{setup.urls['consumer']}"]
    if setup.mode == "push":
        argv += ["--mode=push", f"--push-target={push_target(setup)}"]
    elif setup.mode == "mooncake":
        argv += ["--mode=mooncake", f"--bootstrap={mooncake_bootstrap(setup)}"]
    return argv


def proxy_spec(setup: Setup, args, port: int, name: str, log_path: Path) -> ServerSpec:
    """The pair's proxy process (--proxy), healthy when its health path answers."""
    return ServerSpec(name, proxy_argv(setup, args.python, port, args.proxy),
                      {"PYTHONPATH": str(ROOT / "scripts"), "PYTHONUNBUFFERED": "1"}, port, log_path,
                      health_path="/healthcheck" if args.proxy == "vllm" else "/health")


def control_path(work: Path) -> Path:
    return work / "consumer.control.json"


def set_stalls(work: Path, rate: float) -> None:
    """The consumer's stall rate from now on (the drill's control file, replaced atomically)."""
    tmp = work / "consumer.control.tmp"
    tmp.write_text(json.dumps({"kinds": [], "rate": 0.0, "stall_rate": rate}))
    os.replace(tmp, control_path(work))


def scrape_counts(url: str) -> dict[str, float]:
    """The checksum counters, plus vLLM's preemptions and finished requests."""
    counts = checksum_counts(url)
    for (name, labels), value in prom.scrape(url).items():
        if name == "vllm:num_preemptions_total":
            counts["preemptions"] = counts.get("preemptions", 0) + value
        elif name == "vllm:request_success_total":
            counts["finished"] = counts.get("finished", 0) + value
    return counts


HELD_GAUGES = tuple(metrics.GAUGES)


def held_state(urls: dict[str, str], client: httpx.Client) -> dict[str, dict[str, float]]:
    """What each server's checksum scheduler still holds once the traffic has stopped (its gauges).

    The gauges reach /metrics with the first step after they change; one
    local request per server (no P/D, so no counter moves but the server's
    finished requests, read before) makes sure that step has run. Polled
    until every gauge reads 0, or SETTLE_MAX_S: a gauge that stays up is a
    leak.
    """
    for url in urls.values():
        try:
            completion(client, url, "flush", max_tokens=1)
        except httpx.HTTPError:
            pass  # judged by the gauges
    deadline = time.monotonic() + SETTLE_MAX_S
    while True:
        held = {}
        for side, url in urls.items():
            samples = prom.scrape(url)
            names = {name for name, _ in samples}
            # A gauge the server does not export reads None (a failure), not 0.
            held[side] = {g: prom.counter(samples, metrics.metric_name(g))
                          if metrics.metric_name(g) in names else None for g in HELD_GAUGES}
        if not any(v != 0 for gauges in held.values() for v in gauges.values()) or time.monotonic() > deadline:
            return held
        time.sleep(1.0)


SAMPLE_S = 2.0


class Sampler(threading.Thread):
    """Every SAMPLE_S seconds, each server's verdict counters and gauges
    (/metrics) and RSS: the rows of report["timeline"], for the plots.

    servers: side -> Managed, read at each sample (the producer's process
    changes when it is killed and restarted); a server that does not answer
    gives no values for that row.
    """

    def __init__(self, urls: dict[str, str], servers: dict, t0: float):
        super().__init__(name="soak-sampler", daemon=True)
        self.urls, self.servers, self.t0 = urls, servers, t0
        self.rows: list[dict] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(SAMPLE_S):
            row: dict = {"t": round(time.monotonic() - self.t0, 1)}
            for side, url in self.urls.items():
                try:
                    samples = prom.scrape(url, timeout=5)
                except prom.ScrapeError:
                    row[side] = None
                    continue
                values = {k: prom.counter(samples, metrics.metric_name(k)) for k in (*truth.LOAD_VERDICTS,
                                                                                      *HELD_GAUGES)}
                values["rss_mb"] = round(rss_mb(self.servers[side].pgid), 1)
                row[side] = values
            self.rows.append(row)

    def stop(self) -> list[dict]:
        self._stop_event.set()
        self.join(timeout=30)
        return self.rows


def latencies(answers: list[Answer], cost: dict | None) -> dict[str, list[float]]:
    """Latency (s) samples for the plots: answered 200 against failed by a mismatch, and cost's on and off."""
    out = {"answered 200": [a.latency_s for a in answers if a.status == 200],
           "failed by a mismatch (503)": [a.latency_s for a in answers
                                          if a.status == 503 and "kv_checksum_mismatch" in (a.error or "")]}
    for side, values in ((cost or {}).get("latencies_s") or {}).items():
        out[f"cost run, checksums {side}"] = values
    return out


def settle(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Counters once they stopped moving for SETTLE_S (bounded by SETTLE_MAX_S)."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + SETTLE_MAX_S
    while True:
        now = {side: scrape_counts(url) for side, url in urls.items()}
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= SETTLE_S or time.monotonic() > deadline:
            return now
        time.sleep(1.0)


def rss_mb(pgid: int) -> float:
    """Resident memory of every process of a process group, in MiB."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            continue
    return total / 1024


# ----------------------------------------------------------------- report

def latency_summary(answers: list[Answer], wall_s: float) -> dict:
    ok = sorted(a.latency_s for a in answers if a.status == 200)
    if not ok:
        return {"ok": 0}
    return {"ok": len(ok), "p50_ms": 1000 * ok[len(ok) // 2], "p99_ms": 1000 * ok[min(len(ok) - 1, int(len(ok) * 0.99))],
            "throughput_rps": len(ok) / wall_s}


COST_ROUNDS = 4


def cost_setup(setup: Setup) -> Setup:
    """The cost baseline: the soak's pair again (server_specs turns the checksums off)."""
    return Setup("soak-off", setup.model, policy="fail", faults=False, mode=setup.mode, producer_tp=setup.producer_tp)


def measure_cost(args, group: ProcessGroup, setup: Setup, servers: dict, proxy, work: Path) -> dict:
    """Latency and throughput under the same load with checksums on and off.

    A second pair runs the same stack with checksums off. After the same
    warm-up requests on each, the --cost requests (no hang-ups, no stalls)
    go in COST_ROUNDS rounds, each round's share first to one pair, then to
    the other, alternating which goes first. One pair is loaded at a time,
    and the two see the same history, so drift cancels out. The ratios are
    on / off.
    """
    plan = plan_traffic(args.cost, args.seed + 1, disconnect_rate=0.0, abort_rate=0.0)
    warm = plan_traffic(min(40, args.cost), args.seed + 2, disconnect_rate=0.0, abort_rate=0.0)
    set_stalls(work, 0.0)
    off = cost_setup(setup)
    specs = server_specs(off, args, work, checksums=False)
    started = [group.start(spec) for spec in specs.values()]
    port = free_port_block(1)
    off_proxy = group.start(proxy_spec(off, args, port, "soak-proxy-off", work / "proxy-off.log"))
    (work / "process_groups.json").write_text(json.dumps({f"{m.name}-{m.pgid}": m.pgid for m in group.managed}))
    group.wait_healthy([*started, off_proxy], timeout=STARTUP_TIMEOUT_S)
    urls = {"on": {"proxy": proxy.url, **setup.urls, "streams": False},
            "off": {"proxy": off_proxy.url, **off.urls, "streams": False}}
    for side in ("on", "off"):
        run_traffic(urls[side], warm, args.concurrency)
    got = {"on": [], "off": []}
    wall = {"on": 0.0, "off": 0.0}
    size = -(-len(plan) // COST_ROUNDS)
    for r in range(COST_ROUNDS):
        part = plan[r * size:(r + 1) * size]
        for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
            t = time.monotonic()
            got[side] += run_traffic(urls[side], part, args.concurrency)
            wall[side] += time.monotonic() - t
    out = {side: latency_summary(got[side], wall[side]) for side in ("on", "off")}
    out["latencies_s"] = {side: [a.latency_s for a in got[side] if a.status == 200] for side in ("on", "off")}
    if out["on"].get("ok") and out["off"].get("ok"):
        out["ratios"] = {k: out["on"][k] / out["off"][k] for k in ("p50_ms", "p99_ms", "throughput_rps")}
    log(f"cost under load ({args.cost} requests each, {args.concurrency} in flight): {out}")
    for m in [*started, off_proxy]:
        group.stop(m)
    return out


def kill_and_restart(group: ProcessGroup, servers: dict, spec: ServerSpec) -> tuple[float, float]:
    """SIGKILL the producer's whole process group (engine core and workers
    too, no shutdown), start it again on the same ports, wait until it is
    healthy; (killed at, healthy at), time.monotonic()."""
    victim = servers["producer"]
    killed_at = time.monotonic()
    os.killpg(victim.pgid, signal.SIGKILL)
    victim.popen.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            servers["producer"] = group.start(spec)
            break
        except Exception:  # its port or side channel not released yet
            time.sleep(1.0)
    group.wait_healthy(servers["producer"], timeout=STARTUP_TIMEOUT_S)
    return killed_at, time.monotonic()


NO_INCIDENT = "no incident line"


def where_of_victims(truths, consumer_log: Path, producer_log: Path) -> dict[str, int]:
    """Where each caught victim's KV went bad, joined from both servers' logs (vllm_kvchecksum.engine.incident)."""
    places = {inc.get("request_id"): place for inc, place in incident.attribute(
        [consumer_log.read_text(errors="replace")], [producer_log.read_text(errors="replace")])}
    return dict(Counter(places.get(t.request_id, NO_INCIDENT) for t in truths
                        if t.truth == "victim" and t.verdict == "mismatch"))


def judge_where(report: dict, mode: str, died: bool = False) -> None:
    """Every caught victim wrote an incident line; in pull mode, every one is
    placed on the producer: a read of blocks it had released (its lease ran
    out, and its line of the read after the release), which is how the
    soak's race makes victims. A killed producer takes the lines of the
    reads it saw last with it: then a release with no read logged after it
    (unknown) is allowed too."""
    where = report["where"]
    allowed = {incident.RELEASED_BEFORE_READ} | ({incident.UNKNOWN_RELEASED} if died else set())
    if where.get(NO_INCIDENT):
        report["failures"].append(f"{where[NO_INCIDENT]} caught victims wrote no incident line")
    elif mode == "pull" and set(where) - allowed:
        report["failures"].append(f"victims not attributed to the producer's release before the read: {where}")
    report["ok"] = not report["failures"]


def producer_rechecks(producer_log: Path) -> dict[str, int]:
    """The producer's re-check lines (vllm_kvchecksum.engine.incident) by result: intact, changed, not_rechecked."""
    return dict(Counter(str(line.get("verdict")) for line in
                        incident.read_incidents(producer_log.read_text(errors="replace"))
                        if line.get("side") == "producer" and line.get("verdict") != incident.READ_AFTER_RELEASE))


def producer_reads_after_release(producer_log: Path) -> set[str]:
    """The producer requests whose KV a consumer read after the producer released it (their incident lines)."""
    return {str(line.get("request_id")) for line in incident.read_incidents(producer_log.read_text(errors="replace"))
            if line.get("side") == "producer" and line.get("verdict") == incident.READ_AFTER_RELEASE}


def judge_reads_after_release(report: dict, truths, late: set[str], counted: float, mode: str, died: bool) -> None:
    """The producer's count of reads after the release matches its lines, and,
    in pull mode, every victim's producer request is among them: the race
    makes victims only by reading released blocks. A killed producer takes
    the lines of reads it saw last with it, so then nothing is required."""
    victims = [t for t in truths if t.truth == "victim"]
    without = sorted(t.request_id for t in victims if t.remote_request_id not in late)
    report["producer_read_after_release"] = {
        "reads": len(late), "counted": counted, "victims": len(victims) - len(without),
        "victims_without": without[:20]}
    if died:
        return
    if counted != len(late):
        report["failures"].append(f"the producer counted {counted:.0f} reads after the release but logged "
                                  f"{len(late)}")
    if mode == "pull" and without:
        report["failures"].append(f"{len(without)} victims whose producer saw no read after the release: "
                                  f"{without[:10]}")
    report["ok"] = not report["failures"]


def judge_rechecks(report: dict, rechecks: dict[str, int], sent: int, died: bool) -> None:
    """No producer re-check finds changed KV (the soak changes none); some
    re-check judged a send (intact or changed: a run whose every re-check is
    not_rechecked has tested nothing); and, unless the producer was killed,
    every send was re-checked once."""
    report["producer_rechecks"] = rechecks
    if rechecks.get("changed"):
        report["failures"].append(f"the producer's re-check found its KV changed {rechecks['changed']} times, "
                                  f"but the soak changes no producer KV (false alarms)")
    judged = rechecks.get("intact", 0) + rechecks.get("changed", 0)
    if (sent or sum(rechecks.values())) and not judged:
        report["failures"].append(f"the producer's re-checks judged none of its {sent} sends ({rechecks}): "
                                  f"kv_checksum_producer_recheck off, or every re-check failed to compare "
                                  f"(the producer's log says why, at debug level)")
    if not died and sum(rechecks.values()) != sent:
        report["failures"].append(f"{sum(rechecks.values())} producer re-checks {rechecks} for {sent} sends")
    report["ok"] = not report["failures"]



def kv_truth_by_client(truths) -> dict[int, str]:
    """Each client's load ground truth for its answer: "victim" when any of
    its loads was one, "clean" when every one was clean, else what they were
    (e.g. "unknown"); clients with no witnessed load are absent."""
    seen: dict[int, set[str]] = {}
    for t in truths:
        index = truth.client_index(t.request_id)
        if index is not None:
            seen.setdefault(index, set()).add(t.truth)
    return {i: "victim" if "victim" in s else "clean" if s == {"clean"} else "+".join(sorted(s))
            for i, s in seen.items()}


def check_outputs(producer_url: str, planned: list[Planned], answers: list[Answer], truths, limit: int,
                  proxy_url: str | None = None) -> dict:
    """The answers' texts against the producer's one-at-a-time reference, each
    differing one classified by its evidence (kvcs_soak.outputs): its load's
    witness digests, and the same prompt on the producer alone and batched.

    Runs after the traffic, with nothing else sent to the producer: the
    first `limit` answers with a text (200, not streamed), one at a time."""
    kv = kv_truth_by_client(truths)
    chosen = [a for a in answers if a.status == 200 and a.text is not None][:limit]
    # Companions for the batched runs: prompts of the run that leave room for 96 more tokens.
    room = [p for p in planned if len(p.prompt.split()) + 96 + 8 <= MAX_MODEL_LEN]
    with httpx.Client(trust_env=False) as client:
        def complete(prompt: str, max_tokens: int) -> str | None:
            try:
                status, body = one_completion(client, producer_url, prompt, max_tokens=max_tokens)
            except httpx.HTTPError:
                return None
            return text_of(body) if status == 200 else None

        evidence = []
        for a in chosen:
            req = planned[a.index]
            evidence.append(outputs.OutputEvidence(f"soak-{a.index}", a.text, complete(req.prompt, req.max_tokens),
                                                   kv.get(a.index)))
        for ev in evidence:
            if ev.output != ev.reference and ev.kv == "clean":
                req = planned[int(ev.request_id.removeprefix("soak-"))]
                companions = [(p.prompt, 96) for p in room if p.index != req.index][:outputs.BATCH_COMPANIONS]
                ev.alone, ev.batched = outputs.probe(complete, req.prompt, req.max_tokens, ev.reference, companions,
                                                    seed=req.index)
                try:  # the reference again, with its top choices: how close the two were where they part
                    r = client.post(f"{producer_url}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                                    json={"model": "", "prompt": req.prompt, "max_tokens": req.max_tokens,
                                          "temperature": 0, "logprobs": outputs.LOGPROBS})
                    ev.margin = outputs.margin_of(r.json(), ev.output) if r.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    ev.margin = None
                if proxy_url is not None:  # the same request through the same P/D path, alone
                    try:
                        r = client.post(f"{proxy_url}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                                        json={"model": "", "prompt": req.prompt, "max_tokens": req.max_tokens,
                                              "temperature": 0}, headers={"X-Request-Id": f"soak-{req.index}-alone"})
                        ev.pd_alone = text_of(r.json()) if r.status_code == 200 else None
                    except (httpx.HTTPError, ValueError):
                        ev.pd_alone = None
    judged = outputs.judge(evidence)
    for d in judged["differing"]:
        d["max_tokens"] = planned[int(d["request_id"].removeprefix("soak-"))].max_tokens
    judged["texts"] = [[ev.request_id, ev.output, ev.reference] for ev in evidence]
    log(f"outputs: {outputs.summary_line(judged)}")
    return judged


def judge_outputs(report: dict) -> None:
    """An answer whose load's bytes were the producer's yet whose output
    differs from the reference for no reason shown (no batch effect on the
    producer) fails the run: that is what a verify must rule out."""
    judged = report.get("outputs")
    if judged and judged.get(outputs.UNEXPLAINED):
        ids = [d["request_id"] for d in judged["differing"] if d["verdict"] == outputs.UNEXPLAINED]
        report["failures"].append(f"{len(ids)} outputs differ from the one-at-a-time reference with the same KV "
                                  f"bytes and no batch effect shown on the producer: {ids[:10]}")
    report["ok"] = not report["failures"]

# The most a server's RSS may grow in the second wave, as a share of its RSS
# after the first: the second wave repeats the first's traffic, so a steady
# server stays flat (0 to 4 MiB of about 2.4 GiB in the runs of 2026-12-05);
# allocator noise and warm-up stay far below it, a per-request leak does not.
RSS_GROWTH_LIMIT = 0.10

# What vLLM's MooncakeConnector adds to its abort timeout for the consumer's
# receive from a producer (zmq.RCVTIMEO in receive_kv_from_single_worker).
MOONCAKE_RECEIVE_GRACE_S = 60


def build_report(args, answers, planned, counts, truths, started, alive, rss, wall, death=None,
                 held=None) -> dict:
    consumer, producer = counts["consumer"], counts["producer"]
    hung_up = {a.index for a in answers if a.disconnected}
    # vLLM's toy proxy gives the servers ids of its own (uuid): a load names
    # no client, so hung-up clients and failed answers are matched by count.
    by_count = getattr(args, "proxy", "project") == "vllm"
    det = truth.detection(truths, None if by_count else hung_up)
    # Reported beside the excuses, which rest on each load's own line: the
    # loads the drill saw end unjudged, and the consumer's count of them.
    det["loads_ended_unjudged"] = {"witnessed": sum(t.ended_unjudged for t in truths),
                                   "counted": int(consumer.get("loads_not_compared/request_ended", 0))}
    answered = {"ok": sum(a.status == 200 for a in answers),
                "mismatch_503": sum(a.status == 503 and "kv_checksum_mismatch" in (a.error or "") for a in answers),
                "disconnected": sum(a.disconnected for a in answers)}
    # A load the connector itself reported failed ends its request with an
    # error (policy "fail"): expected, and counted apart.
    connector_failed = {truth.client_index(t.request_id) for t in truths if t.truth == "load_failed"}
    answered["failed_by_the_connector"] = sum(a.status is not None and a.status >= 500 and
                                              a.index in connector_failed for a in answers)
    unexpected = [asdict(a) for a in answers if not a.disconnected and a.status != 200
                  and not (a.status == 503 and "kv_checksum_mismatch" in (a.error or ""))
                  and a.index not in connector_failed]
    if death is not None:
        # Requests in flight while the producer was down fail: expected.
        killed_at, healthy_at = death
        if getattr(args, "mode", "pull") == "mooncake":
            # Mooncake's consumer waits VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT
            # + 60 s on a request sent to the dead producer before failing it
            # (its ZMQ receive timeout); until then those loads hold the
            # consumer's blocks, and requests that came after the restart wait
            # for blocks past their own leases.
            healthy_at += args.lease_s + MOONCAKE_RECEIVE_GRACE_S
        down = [a for a in unexpected if a["started_s"] <= healthy_at
                and a["started_s"] + a["latency_s"] >= killed_at]
        answered["failed_by_the_producers_death"] = len(down)
        unexpected = [a for a in unexpected if a not in down]
    if by_count:
        # Behind the toy proxy a failed load cuts the stream (or answers a
        # bare error): at most one failed answer per mismatched or
        # connector-failed load, those of direct-leg clients aside.
        explained = det["victims_caught"] + det["load_failed"] + sum(
            t.verdict == "mismatch" for t in truths if t.truth == "clean")
        direct = [a for a in unexpected if planned[a["index"]].abort_in_transfer]
        rest = [a for a in unexpected if not planned[a["index"]].abort_in_transfer]
        unexpected = direct + rest[explained:]
    rec_c = truth.reconcile_consumer(consumer, started)
    rec_p = truth.reconcile_producer(producer, producer.get("finished", 0))
    failures = []
    if not all(alive.values()):
        failures.append(f"an engine died: {alive}")
    if len(answers) != len(planned):
        failures.append(f"{len(planned) - len(answers)} requests got no answer")
    if unexpected:
        failures.append(f"{len(unexpected)} requests failed for another reason than a KV checksum mismatch, "
                        f"e.g. {unexpected[0]}")
    if det["victims_missed"]:
        failures.append(f"ground-truth victims not reported mismatched: {det['victims_missed'][:10]}")
    if det["false_alarms"]:
        failures.append(f"false mismatches on clean loads: {det['false_alarms'][:10]}")
    if rec_c["difference"]:
        failures.append(f"consumer counters do not reconcile: {rec_c}")
    if rec_p["difference"]:
        failures.append(f"producer counters do not reconcile: {rec_p}")
    # A floor on loads judged against the ground truth (clean or victim), not
    # on clean ones: how many clean loads a lease expiry turns into victims
    # depends on the machine's speed, as a slow consumer's queue outlasts the
    # lease in the waves too; their sum does not. A load the connector failed
    # is not judged: its bytes were never used, and a run whose loads all
    # fail (a push or Mooncake lease too short) has shown nothing.
    judged = det["clean"] + det["victim"]
    if judged < args.min_judged:
        failures.append(f"only {judged} loads judged against the ground truth ({det['clean']} clean, "
                        f"{det['victim']} victims; {det['load_failed']} failed by the connector and "
                        f"{det['unknown']} unknown are not judged; at least {args.min_judged} needed)")
    if det["clean"] < args.min_clean:
        failures.append(f"only {det['clean']} clean loads (at least {args.min_clean} needed)")
    if not consumer.get("preemptions") and not producer.get("preemptions"):
        failures.append("no preemption on either side: the KV caches were not under pressure (--blocks)")
    growth = {side: rss["wave2"][side] - rss["wave1"][side] for side in rss["wave1"]}
    grown = {side: round(mb) for side, mb in growth.items() if mb > RSS_GROWTH_LIMIT * rss["wave1"][side]}
    if grown:
        failures.append(f"RSS grew in the second wave, which repeats the first, by more than "
                        f"{RSS_GROWTH_LIMIT:.0%} (MiB): {grown}; a leak, ours or vLLM's")
    leaks = {side: {g: v for g, v in gauges.items() if v != 0} for side, gauges in (held or {}).items()}
    if any(leaks.values()):
        failures.append(f"checksum state still held after the traffic stopped (a leak; None: not exported): "
                        f"{leaks}")
    return {
        "command": " ".join(sys.argv), "wall_s": wall,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "python")},
        "answers": answered, "unexpected": unexpected[:20], "detection": det,
        "answer_list": [[a.index, a.status, a.disconnected] for a in answers],
        "consumer": rec_c, "producer": rec_p,
        "preemptions": {"consumer": consumer.get("preemptions", 0), "producer": producer.get("preemptions", 0)},
        "unverified": {k: v for k, v in consumer.items() if k.startswith("loads_unverified")},
        "not_compared": {k: v for k, v in consumer.items() if k.startswith("loads_not_compared")},
        "victims": [asdict(t) for t in truths if t.truth == "victim"][:50],
        "engines_alive": alive, "rss_mb": rss, "held_after_traffic": held,
        "producer_death": None if death is None else {
            "down_s": death[1] - death[0],
            "killed_process": truth.reconcile_producer(counts.get("producer_killed", {}),
                                                       counts.get("producer_killed", {}).get("finished", 0))},
        "rss_growth_wave2_mb": growth,
        "failures": failures, "ok": not failures,
    }


def print_table(report: dict) -> None:
    d, c, p = report["detection"], report["consumer"], report["producer"]
    a = report["answers"]
    rows = [
        ("requests", f"{len(report['answer_list'])}: {a['ok']} ok, {a['mismatch_503']} failed by a KV checksum "
                     f"mismatch, {a['failed_by_the_connector']} by a load the connector failed, "
                     f"{a['disconnected']} clients hung up"),
        *([("producer's death", f"down {report['producer_death']['down_s']:.0f} s; "
                                f"{a.get('failed_by_the_producers_death', 0)} requests failed meanwhile; the killed "
                                f"process: {report['producer_death']['killed_process']}")]
          if report.get("producer_death") else []),
        ("preemptions", f"consumer {report['preemptions']['consumer']:.0f}, "
                        f"producer {report['preemptions']['producer']:.0f}"),
        ("loads (ground truth)", f"{d['loads']}: {d['clean']} clean, {d['victim']} victims, {d['unknown']} unknown, "
                                 f"{d['load_failed']} failed by the connector"),
        ("victims caught", f"{d['victims_caught']} of {d['victim']}" + (
            f" ({len(d['victims_ended_unjudged'])} more ended before their verdict: clients hung up)"
            if d["victims_ended_unjudged"] else "")),
        ("false mismatches", f"{len(d['false_alarms'])} on {d['clean']} clean loads"),
        ("where (victims)", ", ".join(f"{n} {k}" for k, n in sorted((report.get("where") or {}).items()))
         or "no victim caught"),
        ("reads after the release", "{reads} on the producer; {victims} victims among them".format(
            **report.get("producer_read_after_release", {"reads": 0, "victims": 0}))),
        ("producer re-checks", ", ".join(f"{n} {k}" for k, n in sorted((report.get("producer_rechecks") or {}).items()))
         or "none"),
        ("consumer counters", f"started {c['loads_started']} = verified {c['loads_verified']} + mismatched "
                              f"{c['loads_mismatched']} + unverified {c['loads_unverified']} + not compared "
                              f"{c['loads_not_compared']} (difference {c['difference']})"),
        ("producer counters", f"finished {p['finished']:.0f} = sent {p['sent']} + not sent {p['not_sent']} "
                              f"(difference {p['difference']:.0f})"),
        ("engines alive", ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in report["engines_alive"].items())),
        ("held after traffic", "; ".join(f"{side} " + ", ".join(f"{g} {v}" for g, v in gauges.items())
                                         for side, gauges in (report.get("held_after_traffic") or {}).items())),
        ("RSS", ", ".join(f"{side} {report['rss_mb']['wave1'][side]:.0f} MiB after wave 1, "
                          f"{growth:+.0f} MiB in wave 2" for side, growth in report["rss_growth_wave2_mb"].items())),
    ]
    if report.get("outputs"):
        rows.append(("outputs", outputs.summary_line(report["outputs"])))
    ratios = (report.get("cost") or {}).get("ratios")
    if ratios:
        rows.append(("cost, on / off", f"latency p50 {ratios['p50_ms']:.2f}, p99 {ratios['p99_ms']:.2f}, throughput "
                                        f"{ratios['throughput_rps']:.2f} ({report['settings']['cost']} requests each)"))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        log(f"  {name:<{width}}  {value}")
    log(f"wall time {report['wall_s']:.0f} s; " + ("every check passed" if report["ok"] else
                                                  f"{len(report['failures'])} check(s) FAILED:"))
    for f in report["failures"]:
        log(f"  FAIL {f}")


# ----------------------------------------------------------------- main

# The KV cache pool of a server: this many blocks per KV cache group of the
# model (the hybrid manager's groups share one pool; 24 blocks of 32 tokens
# hold one request of the servers' 512-token limit per group, with some room).
BLOCKS_PER_GROUP = 24
KV_CACHE_GROUPS = {"llama": 1, "gemma2": 2, "granite-h": 2}


def soak_model(name: str) -> Path:
    """The tiny random model `name` (made once under build/, nothing downloaded)."""
    if name == "granite-h":
        sys.path.insert(0, str(ROOT / "scripts"))
        from make_tiny_model import make_granite_h

        return make_granite_h(ROOT / "build" / "tiny-granite-h").resolve()
    return make_models(ROOT / "build")[name]


def soak_setup(args, model: Path) -> Setup:
    """The soak's pair: fail-closed, policy "fail", the drill connector without faults."""
    return Setup("soak", model, policy="fail", faults=False, mode=args.mode, producer_tp=args.producer_tp)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="make soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="client requests in the run (default 1000)")
    p.add_argument("--concurrency", type=int, default=48, help="requests in flight (default 48)")
    p.add_argument("--blocks", type=int, default=None,
                   help=f"KV cache blocks of each server, of 32 tokens: small, so both sides preempt (default "
                        f"{BLOCKS_PER_GROUP} per KV cache group: {BLOCKS_PER_GROUP} for llama, "
                        f"{2 * BLOCKS_PER_GROUP} for gemma2 and granite-h, whose two groups share the pool)")
    p.add_argument("--lease-s", type=int, default=5,
                   help="the producer's KV lease (NIXL kv_lease_duration, seconds; vLLM's default is 30)")
    p.add_argument("--stall-rate", type=float, default=0.1,
                   help="in the race phase, the share of consumer loads whose start stalls the consumer's engine "
                        "(default 0.1)")
    p.add_argument("--stall-s", type=float, default=6.0, help="seconds each stall lasts (default 6, past the lease)")
    p.add_argument("--disconnect-rate", type=float, default=0.1,
                   help="share of clients that hang up at a random point (default 0.1)")
    p.add_argument("--abort-rate", type=float, default=0.05,
                   help="share of clients that hang up mid-transfer: pull, as their consumer leg starts; push, "
                        "as the producer answers and WRITEs (default 0.05; Mooncake: none)")
    p.add_argument("--min-judged", type=int, default=None,
                   help="loads the run must judge against the ground truth: clean, victim or failed by the "
                        "connector (default: half the requests)")
    p.add_argument("--min-clean", type=int, default=1,
                   help="of those, clean loads (default 1: how many a slow machine's lease expiries turn into "
                        "victims varies)")
    p.add_argument("--mode", choices=MODES, default="pull",
                   help="the connector of both servers: NIXL pull (default), NIXL push, Mooncake P2P")
    p.add_argument("--model", choices=tuple(KV_CACHE_GROUPS), default="llama",
                   help="the tiny Llama (one KV cache group), the tiny Gemma-2 (sliding-window and full groups) "
                        "or the tiny granite-4.0-h style hybrid (a Mamba2 state group and an attention group)")
    p.add_argument("--producer-tp", type=int, choices=(1, 2), default=1,
                   help="the producer's tensor-parallel size (the consumer's is 1); each TP rank digests its "
                        "own KV heads for the ground truth")
    p.add_argument("--proxy", choices=("project", "vllm"), default="project",
                   help="the demo's P/D proxy (default), or vLLM's own toy proxy "
                        "(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py; pull mode; half the "
                        "clients stream)")
    p.add_argument("--kill-producer", action=argparse.BooleanOptionalAction, default=True,
                   help="a last phase in which the producer is SIGKILLed with requests in flight and restarted "
                        "(default on; off in --ci)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default: the tiny models here) or cuda: the GPU-host flow, one GPU per server "
                        "(make soak VLLM_DEVICE=cuda MODEL=...)")
    p.add_argument("--model-path", type=Path, default=None,
                   help="serve this model directory instead of a tiny one (the GPU flow's MODEL)")
    p.add_argument("--cost", type=int, default=0,
                   help="then this many requests against the pair and against the same stack with checksums off, "
                        "one pair at a time: latency p50/p99 and throughput, on / off (default 0: not measured)")
    p.add_argument("--outputs", type=int, default=0,
                   help="after the traffic, compare the texts of this many answers with the producer's greedy "
                        "output for the same prompt computed alone, and classify each that differs: kv_differs "
                        "(its load's bytes differ from what was sent) or kv_same_output_differs: numerics (the "
                        "same bytes; the producer's own output for the prompt changes with the batch) "
                        "(default 0: not compared; about 1 s per answer here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ci", action="store_true",
                   help=f"the CI-sized run: {CI_PRESET['requests']} requests, {CI_PRESET['concurrency']} in flight, "
                        f"at least half of them judged")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "soak")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    if args.blocks is None:
        args.blocks = BLOCKS_PER_GROUP * KV_CACHE_GROUPS[args.model]
    if args.proxy == "vllm" and args.mode != "pull":
        p.error("--proxy vllm drives the pull layout only (vLLM's toy proxy runs the two pull legs)")
    if args.ci:
        args.requests, args.concurrency = CI_PRESET["requests"], CI_PRESET["concurrency"]
        args.kill_producer = False
    if args.min_judged is None:
        args.min_judged = args.requests // 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    for old in [*work.glob("*.log"), *work.glob("*.jsonl"), work / "report.json", work / "process_groups.json"]:
        if old.is_file():
            old.unlink()
    model = args.model_path or soak_model(args.model)
    setup = soak_setup(args, model)
    specs = server_specs(setup, args, work)
    # Mid-transfer aborts run the proxy's legs in the client: pull's one after
    # the other, push's at once (abort_push_write); Mooncake's are not run.
    planned = plan_traffic(args.requests, args.seed, disconnect_rate=args.disconnect_rate,
                           abort_rate=args.abort_rate if args.mode in ("pull", "push") else 0.0)
    with ProcessGroup() as group:
        servers = {side: group.start(spec) for side, spec in specs.items()}
        proxy_port = free_port_block(1)
        proxy = group.start(proxy_spec(setup, args, proxy_port, "soak-proxy", work / "proxy.log"))
        # Every process group the soak started, for checks that none outlives it.
        (work / "process_groups.json").write_text(json.dumps(
            {m.name: m.pgid for m in [*servers.values(), proxy]}))
        group.wait_healthy([*servers.values(), proxy], timeout=STARTUP_TIMEOUT_S)
        log(f"producer and consumer healthy after {time.monotonic() - t0:.0f} s; {args.requests} requests, "
            f"{args.concurrency} in flight, {args.mode} mode, {args.model}, producer TP {args.producer_tp}, "
            f"{args.blocks} KV blocks per server, "
            f"lease {args.lease_s} s "
            f"(logs in {work})")
        before = {side: scrape_counts(setup.urls[side]) for side in servers}
        rss = {"start": {side: rss_mb(m.pgid) for side, m in servers.items()}}
        sampler = Sampler({side: setup.urls[side] for side in servers}, servers, time.monotonic())
        sampler.start()
        answers, first, death, producer_lost = [], 0, None, {}
        phases = PHASES_WITH_DEATH if args.kill_producer else PHASES
        for phase, share, race in phases:
            part = planned[first:] if phase == phases[-1][0] else planned[first:first + int(share * len(planned))]
            first += len(part)
            set_stalls(work, args.stall_rate if race else 0.0)
            log(f"{phase}: {len(part)} requests" + (f", consumer stalls {args.stall_rate:.0%} x {args.stall_s:g} s"
                                                    if race else "") +
                (f"; the producer is killed with a sixth of them sent, and restarted" if phase == "death" else ""))
            traffic_urls = {"proxy": proxy.url, **setup.urls, "streams": args.proxy == "vllm",
                            "push": parse_push_target(push_target(setup))[1] if args.mode == "push" else None}
            if phase == "death":
                got: list = []
                enough = threading.Event()
                during, after_restart = part[:len(part) // 3], part[len(part) // 3:]
                runner = threading.Thread(target=lambda: got.extend(run_traffic(
                    traffic_urls, during, args.concurrency, (max(1, int(len(part) * KILL_AFTER_SENT)), enough))))
                runner.start()
                enough.wait(timeout=REQUEST_TIMEOUT_S)
                # Its counters until now: the restarted process counts from zero.
                producer_lost = diff(scrape_counts(setup.urls["producer"]), before["producer"])
                death = kill_and_restart(group, servers, specs["producer"])
                before["producer"] = scrape_counts(setup.urls["producer"])
                log(f"producer killed and healthy again after {death[1] - death[0]:.0f} s")
                (work / "process_groups.json").write_text(json.dumps(
                    {m.name + ("" if m is servers["producer"] else f"-{m.pgid}"): m.pgid for m in group.managed}))
                runner.join()
                answers += got + run_traffic(traffic_urls, after_restart, args.concurrency)
            else:
                answers += run_traffic(traffic_urls, part, args.concurrency)
            settle({side: setup.urls[side] for side in servers})
            rss[phase] = {side: rss_mb(m.pgid) for side, m in servers.items()}
            log(f"{phase} done after {time.monotonic() - t0:.0f} s")
        after = settle({side: setup.urls[side] for side in servers})
        alive = {side: m.returncode is None for side, m in servers.items()}
        with httpx.Client(trust_env=False) as client:
            held = held_state({side: setup.urls[side] for side in servers if alive[side]}, client)
        # Drained (held_state): every transfer's re-check is in the log.
        rechecks = producer_rechecks(setup.logs["producer"])
        late_reads = producer_reads_after_release(setup.logs["producer"])
        # An idle producer reads the notifications of late reads only when it
        # steps again: held_state's request made it step, after `after`.
        late_counted = (checksum_counts(setup.urls["producer"]).get(metrics.PRODUCER_READ_AFTER_RELEASE, 0)
                        - before["producer"].get(metrics.PRODUCER_READ_AFTER_RELEASE, 0)) if alive["producer"] else 0
        timeline = sampler.stop()
        # The ground truth of the run, before the cost phase adds loads of its own.
        sends = truth.read_lines(work / "producer.witness.jsonl")
        consumer_lines = truth.read_lines(work / "consumer.witness.jsonl")
        judged_outputs = None
        if args.outputs:
            judged_outputs = check_outputs(setup.urls["producer"], planned, answers, truth.judge_loads(
                sends, consumer_lines, truth.mismatched_requests(setup.logs["consumer"].read_text(errors="replace"))),
                args.outputs, proxy.url if args.proxy == "project" else None)
        cost = measure_cost(args, group, setup, servers, proxy, work) if args.cost else None
    counts = {side: diff(after[side], before[side]) for side in after}
    if producer_lost:
        # The killed process's counts, up to its last scrape: what it counted
        # after that went with it, so they are reported, not reconciled.
        counts["producer_killed"] = producer_lost
    started = sum(1 for r in consumer_lines if r.get("event") == "load_started" and r.get("skipped") is None)
    mismatched = truth.mismatched_requests(setup.logs["consumer"].read_text(errors="replace"))
    truths = truth.judge_loads(sends, consumer_lines, mismatched)
    report = build_report(args, answers, planned, counts, truths, started, alive, rss, time.monotonic() - t0,
                          death, held)
    report["where"] = where_of_victims(truths, setup.logs["consumer"], setup.logs["producer"])
    judge_where(report, args.mode, death is not None)
    judge_rechecks(report, rechecks, int(counts["producer"].get("sent", 0)), death is not None)
    judge_reads_after_release(report, truths, late_reads, late_counted, args.mode, death is not None)
    report["outputs"] = judged_outputs
    judge_outputs(report)
    report["cost"] = cost
    report["timeline"] = timeline
    report["latencies"] = latencies(answers, cost)
    (work / "report.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    log(f"report: {work / 'report.json'}")
    try:
        log("plots: " + ", ".join(str(p) for p in plots.write_plots(report, work)))
    except Exception as exc:  # the pictures never fail the run
        log(f"plots not drawn: {type(exc).__name__}: {exc}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
