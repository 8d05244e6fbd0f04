#!/usr/bin/env python
"""Real-engine check: corruption outside a sliding window is caught.

    .venv/bin/python scripts/pd_window_check.py            # the fixed rule: every check passes, exit 0
    .venv/bin/python scripts/pd_window_check.py --old-rule # the old rule: phase 2 falsely verifies, exit 1

Reproduces a defect in the KV checksums' block rule. A Gemma-2 alternates
sliding-window (64 tokens) and full-attention layers; with
disable_hybrid_kv_cache_manager=True vLLM merges them into one KV cache
group whose spec is full attention carrying `sliding_window`, and NIXL sends
every block of the request. The old rule clipped the checksummed blocks of
any spec with a `sliding_window` to its last cdiv(64, 32) + 1 = 3 blocks, so
corruption in the earlier blocks of a 5-block load came back "verified".

Runs a producer and a consumer vLLM engine in this process (NixlConnector,
UCX loopback, kv_buffer_device cpu, block_size 32, checksums on,
kv_checksum_fail_closed, kv_load_failure_policy "fail"), on a tiny random
Gemma-2 written to build/tiny-gemma2 (4 layers, sliding window 64 / full
alternating). The consumer uses scripts/kvcs_fault_connector.py, a
NixlConnector that flips one bit in every KV cache tensor of the blocks at
positions 0 and 1 of each finished load while its switch file exists.

Phase 1 (clean): the consumer's greedy 8 tokens equal a single-engine
reference and the consumer logs the load verified.
Phase 2 (fault on, another prompt): the request ends with finish_reason
"error" and a stop_reason "kv_checksum_mismatch..." naming group 0 and
block positions including 0 and 1.

--old-rule puts the old rule back in this process and in the engine core
processes (it replaces vllm_kvchecksum.scheduler.transfer_layouts when this
module is imported: a spawned engine core imports it as __mp_main__, a
forked one inherits it), to show the check fails on the defect: phase 2
then reports the load verified. Prints one line per check and a summary;
exits non-zero on any failed check. Takes a few minutes on 2 cores
(engine start ~30 s each).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
OLD_RULE_ENV = "KVCS_OLD_RULE"
BLOCK_SIZE = 32
WINDOW = 64
PROMPT_WORDS = 150


def install_old_rule() -> None:
    """Replace the checksums' block rule with the old one, in this process."""
    import vllm_kvchecksum.scheduler as sched
    from vllm_kvchecksum.blocks import GroupLayout, cdiv

    if getattr(sched.transfer_layouts, "_old_rule", False):
        return

    def old_transfer_layouts(vllm_config, kv_cache_config):
        layouts = []
        for gid, group in zip(kv_cache_config.transfer_group_ids, kv_cache_config.transfer_groups, strict=True):
            spec = group.kv_cache_spec
            bs, w = spec.block_size, getattr(spec, "sliding_window", None)
            layouts.append(GroupLayout(gid, bs, cdiv(w, bs) + 1 if w else 0))
        sched.logger.warning("--old-rule: the old block rule is in use in pid %d: %s", os.getpid(), layouts)
        return layouts

    old_transfer_layouts._old_rule = True
    sched.transfer_layouts = old_transfer_layouts


if os.environ.get(OLD_RULE_ENV) == "1":
    # Runs again in a spawned engine core, which imports this file as __mp_main__.
    install_old_rule()


def make_tiny_gemma2(path: Path) -> Path:
    """The tiny Gemma-2 of make_tiny_model (sliding window WINDOW / full alternating)."""
    sys.path.insert(0, str(SCRIPTS))
    from make_tiny_model import GEMMA2_WINDOW, make_gemma2

    assert GEMMA2_WINDOW == WINDOW
    return make_gemma2(path)


def engine(model: str, role: str, port: int, fault: bool):
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    from vllm import LLM

    kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
          "enable_kv_checksum": True, "kv_checksum_fail_closed": True, "kv_load_failure_policy": "fail"}
    if fault:
        kv.update(kv_connector="KVCSFaultConnector", kv_connector_module_path="kvcs_fault_connector")
    return LLM(model=model, dtype="bfloat16", max_model_len=512, enforce_eager=True, gpu_memory_utilization=0.1,
               block_size=BLOCK_SIZE, disable_hybrid_kv_cache_manager=True, kv_transfer_config=kv, seed=0)


class Checks:
    def __init__(self):
        self.lines: list[str] = []
        self.failed = 0

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)

    def check(self, ok: bool, line: str) -> None:
        self.failed += not ok
        self.say(f"{'PASS' if ok else 'FAIL'}: {line}")


def new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    text = path.read_text() if path.exists() else ""
    return text[offset:].splitlines(), len(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "build" / "tiny-gemma2"))
    parser.add_argument("--old-rule", action="store_true",
                        help="put the old block rule back (window from any spec's sliding_window)")
    args = parser.parse_args()
    t0 = time.monotonic()

    work = Path(tempfile.mkdtemp(prefix="pd_window_check."))
    switch, verdict_log = work / "fault", work / "verdicts.log"
    # The engine core processes inherit these (the connector module is imported there).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(SCRIPTS))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["KVCS_FAULT"] = str(switch)
    os.environ["KVCS_VERDICT_LOG"] = str(verdict_log)
    if args.old_rule:
        os.environ[OLD_RULE_ENV] = "1"
        install_old_rule()
    else:
        os.environ.pop(OLD_RULE_ENV, None)

    model = str(make_tiny_gemma2(Path(args.model)).resolve())
    from vllm import SamplingParams

    c = Checks()
    c.say(f"model {model}; rule: {'OLD (--old-rule)' if args.old_rule else 'fixed'}; work dir {work}")
    prompts = [" ".join(f"w{(i * k + 11) % 500 + 4}" for i in range(PROMPT_WORDS)) for k in (37, 53)]

    producer = engine(model, "kv_producer", 5621, fault=False)
    tok = producer.get_tokenizer()
    n = len(tok(prompts[0])["input_ids"])
    c.check(n > 4 * BLOCK_SIZE and n > WINDOW,
            f"prompt has {n} tokens: {-(-n // BLOCK_SIZE)} blocks of {BLOCK_SIZE}, more than the {WINDOW}-token window")

    def prefill(prompt):
        out = producer.generate([prompt], SamplingParams(max_tokens=1, temperature=0, extra_args={
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}))[0]
        return out.kv_transfer_params

    params = [prefill(p) for p in prompts]
    c.check(all(p and "kv_checksums" in p for p in params), "the producer returned kv_checksums for both prompts")
    reference = producer.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    t_prod = time.monotonic()

    consumer = engine(model, "kv_consumer", 5721, fault=True)
    offset = 0

    # Phase 1: clean.
    switch.unlink(missing_ok=True)
    got = consumer.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0, extra_args={
        "kv_transfer_params": params[0]}))[0].outputs[0]
    lines, offset = new_lines(verdict_log, offset)
    verdicts = [ln for ln in lines if "KV checksum" in ln and "request" in ln]
    c.say(f"phase 1 consumer: finish_reason={got.finish_reason} stop_reason={got.stop_reason} text={got.text!r}")
    rule_lines = [ln for ln in lines if "old block rule" in ln]
    for ln in rule_lines + verdicts:
        c.say(f"phase 1 consumer log: {ln}")
    c.check(bool(rule_lines) == args.old_rule,
            f"the consumer's engine core uses the {'old' if args.old_rule else 'fixed'} block rule")
    c.check(got.finish_reason != "error" and got.text == reference,
            f"phase 1: the consumer's output equals the single-engine reference {reference!r}")
    c.check(len(verdicts) == 1 and "verified" in verdicts[0] and "mismatch" not in verdicts[0],
            "phase 1: the consumer logged the load verified")
    c.check(not any("fault connector: flipped" in ln for ln in lines), "phase 1: no fault injected")

    # Phase 2: the fault connector flips a bit in blocks 0 and 1 of the load.
    switch.write_text("0,1")
    got = consumer.generate([prompts[1]], SamplingParams(max_tokens=8, temperature=0, extra_args={
        "kv_transfer_params": params[1]}))[0].outputs[0]
    switch.unlink(missing_ok=True)
    lines, offset = new_lines(verdict_log, offset)
    verdicts = [ln for ln in lines if "KV checksum" in ln and "request" in ln]
    faults = [ln for ln in lines if "fault connector: flipped" in ln]
    c.say(f"phase 2 consumer: finish_reason={got.finish_reason} stop_reason={got.stop_reason} text={got.text!r}")
    for ln in faults + verdicts:
        c.say(f"phase 2 consumer log: {ln}")
    c.check(len(faults) == 1 and "group 0 blocks [0, 1]" in faults[0],
            "phase 2: the fault connector flipped bits in blocks 0 and 1 of group 0")
    stop = str(got.stop_reason or "")
    m = re.search(r"group 0 blocks \[([\d, ]*)\]", stop)
    positions = {int(p) for p in m.group(1).split(",") if p.strip()} if m else set()
    c.check(got.finish_reason == "error" and stop.startswith("kv_checksum_mismatch") and {0, 1} <= positions,
            "phase 2: the request failed with kv_checksum_mismatch naming group 0 blocks 0 and 1")
    c.check(len(verdicts) == 1 and "mismatch" in verdicts[0],
            "phase 2: the consumer logged a mismatch, not a verified load")

    t_end = time.monotonic()
    c.say(f"wall time: {t_end - t0:.0f} s (model + producer {t_prod - t0:.0f} s, consumer and phases "
          f"{t_end - t_prod:.0f} s)")
    # Stop both engines now, so their shutdown logs come before the summary.
    for llm in (consumer, producer):
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # the summary matters more than a clean shutdown
            print(f"(engine shutdown raised {type(exc).__name__}: {exc})")
    print("\n== summary ==")
    for line in c.lines:
        print(line)
    print(f"{'OK' if not c.failed else f'{c.failed} check(s) FAILED'}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
