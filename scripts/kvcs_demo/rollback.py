"""What a bad block costs, on real servers: recompute from it, and keep it private.

    .venv/bin/python -m kvcs_demo.rollback [--out DIR] [--position K]   (scripts/ on PYTHONPATH)

One producer and two consumers (the tiny Llama, NIXL pull, UCX on
loopback), each consumer behind the drill connector (flip_bit at request
block position K, switched on by its control file):

- "recompute" (fail-closed, kv_load_failure_policy "recompute"): a clean
  load gives the reference output; after its prefix cache is reset, the
  same request with a bit flipped in block K must fail its check and be
  recomputed from block K only (vllm:kv_checksum_recomputed_tokens_total;
  vLLM's own prompt token counters do not see a rollback), keeping blocks
  0..K-1, with the reference output.
- "open" (fail-open): a clean load, then the same prompt as a local request
  hits every full block (vllm:prefix_cache_hits_total). After a reset, a
  load with block K flipped is used by its own request (fail-open), and
  the same local request then hits blocks 0..K-1 only, never the bad one,
  and gives the reference output.

Writes OUT/report.json (figures and checks); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import httpx

from kvcs_demo import prom
from kvcs_demo.demo import checksum_counts, completion, diff, set_faults, text_of
from kvcs_demo.servers import ProcessGroup, ServerSpec, free_port_block
from kvcs_demo.setups import BLOCK_SIZE, ROOT, Setup, kv_transfer_config, make_models, server_argv, server_env
from kvcs_demo.summary import log

STARTUP_TIMEOUT_S = 900.0
NUM_BLOCKS = 9  # the prompt's blocks: 8 full ones and a partial one
PROMPT_TOKENS = (NUM_BLOCKS - 1) * BLOCK_SIZE + 5
DEFAULT_POSITION = 5
# The stats reach /metrics with the engine's next stats interval.
METRICS_WAIT_S = 15.0


def prompt_tokens(seed: int = 23) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(PROMPT_TOKENS)]


def server_specs(work: Path, python: str, position: int) -> tuple[dict[str, Setup], list[ServerSpec]]:
    """The producer and the two consumers' command lines, on free ports."""
    model = make_models(ROOT / "build")["llama"]
    setups = {"recompute": Setup("rollback-recompute", model, policy="recompute"),
              "open": Setup("rollback-open", model, policy="open")}
    specs = []
    producer_port, producer_side = free_port_block(1), free_port_block(8)
    producer = kv_transfer_config(setups["recompute"], "kv_producer", "cpu")
    specs.append(ServerSpec("rollback-producer", server_argv(python, setups["recompute"], "kv_producer",
                                                             producer_port, "cpu", producer),
                            server_env("cpu", producer_side) | {"PYTHONUNBUFFERED": "1"}, producer_port,
                            work / "producer.log"))
    for name, s in setups.items():
        port, side = free_port_block(1), free_port_block(8)
        s.urls = {"producer": f"http://127.0.0.1:{producer_port}", "consumer": f"http://127.0.0.1:{port}"}
        s.control_path = work / f"{name}.faults.json"
        s.injections_path = work / f"{name}.injections.jsonl"
        s.injections_path.write_text("")
        set_faults(s, None)
        kv = kv_transfer_config(s, "kv_consumer", "cpu", control_path=s.control_path,
                                injections_path=s.injections_path)
        kv["kv_connector_extra_config"]["kv_checksum_faults"]["position"] = position
        s.logs["consumer"] = work / f"{name}.consumer.log"
        # VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache between the cases.
        specs.append(ServerSpec(f"rollback-{name}", server_argv(python, s, "kv_consumer", port, "cpu", kv),
                                server_env("cpu", side) | {"PYTHONUNBUFFERED": "1", "VLLM_SERVER_DEV_MODE": "1"},
                                port, s.logs["consumer"]))
    return setups, specs


def pd_request(client: httpx.Client, setup: Setup, prompt: list[int]) -> tuple[int, str | None, str]:
    """Both legs, as a P/D proxy runs them: (consumer's status, its text, error)."""
    status, body = completion(client, setup.urls["producer"], prompt, max_tokens=1,
                              kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    params = body.get("kv_transfer_params") if status == 200 else None
    if not params:
        return status, None, f"prefill leg: {json.dumps(body)[:300]}"
    status, body = completion(client, setup.urls["consumer"], prompt, kv_transfer_params=params)
    return status, text_of(body), "" if status == 200 else json.dumps(body)[:300]


def reset_prefix_cache(client: httpx.Client, url: str) -> None:
    r = client.post(f"{url}/reset_prefix_cache", timeout=30)
    r.raise_for_status()


def vllm_counts(url: str) -> dict[str, float]:
    """The vLLM counters this drill reads, besides the checksum ones."""
    samples = prom.scrape(url)
    return {"prefix_cache_hits": prom.counter(samples, "vllm:prefix_cache_hits"),
            "prefix_cache_queries": prom.counter(samples, "vllm:prefix_cache_queries")}


def settled(url: str, before: tuple[dict, dict], want) -> tuple[dict, dict]:
    """(checksum counter delta, vLLM counter delta) once `want(checksums, vllm)` holds or the wait ends."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        got = diff(checksum_counts(url), before[0]), diff(vllm_counts(url), before[1])
        if want(*got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def counts(url: str) -> tuple[dict, dict]:
    return checksum_counts(url), vllm_counts(url)


def load_once(client: httpx.Client, s: Setup, prompt: list[int], *, flip: bool, settled_when) -> dict:
    """One P/D request (block K flipped on its load if `flip`): its answer and the consumer's checksum deltas."""
    url = s.urls["consumer"]
    if flip:
        set_faults(s, "flip_bit")
    before = counts(url)
    status, text, error = pd_request(client, s, prompt)
    set_faults(s, None)
    checksums, _ = settled(url, before, settled_when)
    return {"status": status, "text": text, "error": error, "checksums": checksums}


def local_once(client: httpx.Client, url: str, prompt: list[int]) -> dict:
    """The same prompt as a local request (no P/D): its answer and vLLM's prefix-cache deltas."""
    before = counts(url)
    status, body = completion(client, url, prompt)
    _, hits = settled(url, before, lambda c, v: v.get("prefix_cache_queries"))
    return {"status": status, "text": text_of(body), "vllm": hits}


def run_recompute(client: httpx.Client, s: Setup, prompt: list[int], position: int) -> dict:
    clean = load_once(client, s, prompt, flip=False, settled_when=lambda c, v: c.get("loads_verified"))
    reset_prefix_cache(client, s.urls["consumer"])
    flipped = load_once(client, s, prompt, flip=True, settled_when=lambda c, v: c.get("recomputed_tokens"))
    return {"position": position, "clean": clean, "reference": clean["text"], "flipped": flipped,
            "recomputed_tokens": flipped["checksums"].get("recomputed_tokens", 0),
            # vLLM's rollback of any failed load: to token 0, the whole load.
            "whole_prompt_tokens": PROMPT_TOKENS}


def run_open(client: httpx.Client, s: Setup, prompt: list[int], position: int) -> dict:
    url = s.urls["consumer"]
    clean = load_once(client, s, prompt, flip=False, settled_when=lambda c, v: c.get("loads_verified"))
    local_after_clean = local_once(client, url, prompt)
    reset_prefix_cache(client, url)
    flipped = load_once(client, s, prompt, flip=True, settled_when=lambda c, v: c.get("loads_mismatched"))
    return {"position": position, "clean": clean, "reference": clean["text"], "local_after_clean": local_after_clean,
            "flipped": flipped, "local_after_flip": local_once(client, url, prompt)}


def judge(recompute: dict, open_: dict, position: int) -> list[str]:
    failures = []
    kept = position * BLOCK_SIZE
    r = recompute
    if r["clean"]["checksums"].get("loads_verified") != 1:
        failures.append(f"recompute: the clean load was not verified: {r['clean']}")
    fl = r["flipped"]
    if fl["status"] != 200 or fl["checksums"].get("loads_mismatched") != 1:
        failures.append(f"recompute: the flipped load was not a mismatch answered 200: {fl}")
    if fl["checksums"].get("loads_recomputed/from_first_bad_block") != 1:
        failures.append(f"recompute: not recomputed from the first bad block: {fl['checksums']}")
    if r["recomputed_tokens"] != PROMPT_TOKENS - kept:
        failures.append(f"recompute: {r['recomputed_tokens']} tokens recomputed, expected "
                        f"{PROMPT_TOKENS - kept} (the load's {PROMPT_TOKENS} less the {kept} before block "
                        f"{position})")
    if fl["text"] is None or fl["text"] != r["reference"]:
        failures.append(f"recompute: output {fl['text']!r} differs from the reference {r['reference']!r}")
    o = open_
    full = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    if o["local_after_clean"]["vllm"].get("prefix_cache_hits") != full:
        failures.append(f"open: after a clean load the same prompt hit {o['local_after_clean']['vllm']} tokens, "
                        f"expected {full}")
    ob = o["flipped"]
    if ob["status"] != 200 or ob["checksums"].get("loads_mismatched") != 1:
        failures.append(f"open: the flipped load was not a mismatch used and answered 200: {ob}")
    hits = o["local_after_flip"]["vllm"].get("prefix_cache_hits", 0)
    if hits != kept:
        failures.append(f"open: after the flipped load the same prompt hit {hits} tokens, expected {kept} (the "
                        f"blocks before block {position}): the bad block {'was' if hits > kept else 'was not'} "
                        f"reused")
    if o["local_after_flip"]["text"] != o["reference"]:
        failures.append(f"open: the local request after the flip gave {o['local_after_flip']['text']!r}, the "
                        f"reference is {o['reference']!r}")
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcs_demo.rollback", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "rollback")
    p.add_argument("--position", type=int, default=DEFAULT_POSITION,
                   help=f"the block flipped (0..{NUM_BLOCKS - 2}; default {DEFAULT_POSITION})")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    if not 0 <= args.position < NUM_BLOCKS - 1:
        p.error(f"--position must be a full block of the prompt, 0..{NUM_BLOCKS - 2}")
    t0 = time.monotonic()
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    setups, specs = server_specs(work, args.python, args.position)
    prompt = prompt_tokens()
    with ProcessGroup() as group, httpx.Client(trust_env=False) as client:
        servers = [group.start(s) for s in specs]
        (work / "process_groups.json").write_text(json.dumps({m.name: m.pgid for m in servers}))
        group.wait_healthy(servers, timeout=STARTUP_TIMEOUT_S)
        log(f"producer and two consumers up after {time.monotonic() - t0:.0f} s")
        recompute = run_recompute(client, setups["recompute"], prompt, args.position)
        open_ = run_open(client, setups["open"], prompt, args.position)
    failures = judge(recompute, open_, args.position)
    report = {"prompt_tokens": PROMPT_TOKENS, "block_size": BLOCK_SIZE, "position": args.position,
              "recompute": recompute, "open": open_, "failures": failures, "ok": not failures,
              "wall_s": round(time.monotonic() - t0, 1)}
    (work / "report.json").write_text(json.dumps(report, indent=2))
    log(f"recompute: a bit flipped in block {args.position} of {NUM_BLOCKS}: {recompute['recomputed_tokens']} "
        f"loaded tokens recomputed (vLLM's rollback to token 0: {recompute['whole_prompt_tokens']}); output "
        f"{'equal to' if recompute['flipped']['text'] == recompute['reference'] else 'DIFFERENT from'} the reference")
    log(f"open: same prompt after a clean load hit {open_['local_after_clean']['vllm'].get('prefix_cache_hits', 0):.0f}"
        f" tokens; after the flipped load (used, fail-open) "
        f"{open_['local_after_flip']['vllm'].get('prefix_cache_hits', 0):.0f}")
    log("every check passed" if not failures else "\n".join(f"FAIL {f}" for f in failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
