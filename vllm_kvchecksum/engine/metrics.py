"""KV checksum counters: what the scheduler counts, and their Prometheus form.

The checksum scheduler counts each verdict and each producer payload as it
happens (KVChecksumScheduler.take_metrics returns the counts since the last
call); vLLM's Scheduler.make_stats puts them in SchedulerStats.kv_checksum_stats
(a flat dict of str -> int, so it crosses the engine-core process boundary as
the other stats do); the API server's PrometheusStatLogger hands them to
KVChecksumProm.observe, which adds them to these counters on /metrics:

  vllm:kv_checksum_loads_verified_total           loads whose KV matched
  vllm:kv_checksum_loads_mismatched_total         loads whose KV differed
  vllm:kv_checksum_loads_unverified_total{reason} loads that could not be compared
  vllm:kv_checksum_loads_not_compared_total{reason}
      loads the checksums never judged: the connector reported the load
      failed ("load_failed"), or the request ended before its load finished
      ("request_ended")
  vllm:kv_checksum_loads_mismatched_by_cause_total{cause}
      the same loads by cause: "wrong_request" when the producer's tokens
      differ from the request's (another request's KV: the binding of the
      checksums, core/binding.py), else "corrupt" (this request's KV,
      changed on the way)
  vllm:kv_checksum_mismatched_blocks_total        block positions that differed
  vllm:kv_checksum_loads_recomputed_total{rollback}
      failed loads recomputed (kv_load_failure_policy "recompute"): from
      their first bad block, keeping the verified prefix
      ("from_first_bad_block"), or from the start ("whole_prompt": several
      KV cache groups, a Mamba state or a sliding window, an unverified load)
  vllm:kv_checksum_recomputed_tokens_total        loaded tokens those rollbacks
      dropped (the load's end minus what was kept)
  vllm:kv_checksum_sent_total                     producer payloads sent
  vllm:kv_checksum_not_sent_total{reason}         producer payloads not sent: the sum
      failed ("sum_failed"), the connector carries nothing for the request
      ("not_carried"), or NIXL push would pair it with another live request
      of the same X-Request-Id ("duplicate_request_id", push_ids.py)
  vllm:kv_checksum_producer_intact_total          sends re-checked when their transfer
                                                  completed: the KV was as sent
  vllm:kv_checksum_producer_changed_total         sends whose KV changed on the producer
                                                  before their transfer completed
  vllm:kv_checksum_producer_changed_blocks_total  block positions that changed so
  vllm:kv_checksum_producer_read_after_release_total
      producer requests whose KV a consumer read after the connector had
      released the blocks (NIXL pull: the read's notification came after
      the lease expired): the producer's fault, as a change before the
      transfer completed is, counted apart because it is found later
  vllm:kv_checksum_producer_not_rechecked_total{reason}
      sends not re-checked at their transfer's completion: the request no
      longer held the blocks its checksums were sent for ("blocks_moved"),
      or the re-check could not be summed ("sum_failed")
  vllm:kv_checksum_offloaded_loads_verified_total, ..._mismatched_total,
  ..._unverified_total{reason}, vllm:kv_checksum_offloaded_mismatched_blocks_total
      the same verdicts for KV loaded back from offloading (checked against
      the checksums stored with it, offload.py), kept apart from P/D loads
  vllm:kv_checksum_offloaded_loads_not_checked_total{reason}
      loads from offloading not checked: synchronous loads with several KV
      cache groups ("sync_load"), a tier the connector stores no checksums
      for ("tier_not_covered"), or groups the workers keep no entries for
      ("no_groups")

And three gauges, the checksum state a scheduler holds now (reported with
the first stats update after they change, so they read 0 once the traffic
has stopped and nothing is held; a value that stays up is a leak):

  vllm:kv_checksum_loads_in_flight   loads started and not yet judged or dropped
  vllm:kv_checksum_sends_in_flight   producer requests checksummed whose transfer has
                                     not completed (and been re-checked) yet
  vllm:kv_checksum_held_blocks       blocks of synchronous loads no other request
                                     may hit until their verdict

A producer whose connector released a request's KV before the consumer read
it (vLLM NIXL's lease expiry) counts the expiry in the connector's own
vllm:nixl_num_kv_expired_reqs, and the read that came after it in
producer_read_after_release above; `python -m vllm_kvchecksum.engine.where` joins
either's log line with the consumer's mismatch (incident.py). NIXL's
vllm:nixl_num_notifications_after_expiry is no count of such reads: it also
counts the second notification a consumer sends for a load that failed its
check.

A mismatch is only ever counted as mismatched: a cache miss is no load at all
(vLLM's external prefix cache counters), and a connector failure is
not_compared{reason="load_failed"} (and the connector's own counters, e.g.
vllm:nixl_num_failed_transfers).

Every counter carries vLLM's labels (model_name, engine). Imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_kvchecksum.core.verdicts import UnverifiedReason

# The stats keys: a name, or "name/label value" for labelled counters.
VERIFIED = "loads_verified"
MISMATCHED = "loads_mismatched"
UNVERIFIED = "loads_unverified"
NOT_COMPARED = "loads_not_compared"
MISMATCHED_BLOCKS = "mismatched_blocks"
MISMATCH_CAUSES = "loads_mismatched_by_cause"
SENT = "sent"
NOT_SENT = "not_sent"
LOADS_RECOMPUTED = "loads_recomputed"
RECOMPUTED_TOKENS = "recomputed_tokens"
# Loads of offloaded KV: the verdict keys above with this prefix.
OFFLOADED = "offloaded_"
OFFLOADED_NOT_CHECKED = "offloaded_loads_not_checked"
PRODUCER_INTACT = "producer_intact"
PRODUCER_CHANGED = "producer_changed"
PRODUCER_CHANGED_BLOCKS = "producer_changed_blocks"
PRODUCER_NOT_RECHECKED = "producer_not_rechecked"
PRODUCER_READ_AFTER_RELEASE = "producer_read_after_release"

# Label values of the labelled counters (the unverified reasons are
# UnverifiedReason's values). Bounded: a label never takes a value from
# outside the process.
NOT_COMPARED_REASONS = ("load_failed", "request_ended")
CAUSES = ("corrupt", "wrong_request")
NOT_SENT_REASONS = ("sum_failed", "not_carried", "duplicate_request_id")
ROLLBACKS = ("from_first_bad_block", "whole_prompt")
OFFLOADED_NOT_CHECKED_REASONS = ("sync_load", "tier_not_covered", "no_groups")
NOT_RECHECKED_REASONS = ("blocks_moved", "sum_failed")

# name -> (documentation, label name or None, known label values).
COUNTERS: dict[str, tuple[str, str | None, tuple[str, ...]]] = {
    VERIFIED: ("Loads of KV from a producer whose KV checksums matched.", None, ()),
    MISMATCHED: ("Loads of KV from a producer whose KV checksums differed (corrupt or misplaced KV).", None, ()),
    UNVERIFIED: ("Loads of KV from a producer that could not be compared, by reason.", "reason",
                 tuple(r.value for r in UnverifiedReason)),
    NOT_COMPARED: ("Loads of KV never compared: the connector reported the load failed, or the request ended "
                   "before it finished.", "reason", NOT_COMPARED_REASONS),
    MISMATCH_CAUSES: ("Loads of KV from a producer whose KV checksums differed, by cause: another request's KV "
                      "(wrong_request: the producer's tokens differ from the request's) or corrupt KV.", "cause",
                      CAUSES),
    MISMATCHED_BLOCKS: ("Block positions whose KV checksums differed, over all mismatched loads.", None, ()),
    LOADS_RECOMPUTED: ("Failed loads recomputed, from their first bad block (the verified prefix kept) or from "
                       "the start of the prompt.", "rollback", ROLLBACKS),
    RECOMPUTED_TOKENS: ("Loaded tokens dropped by recomputing failed loads.", None, ()),
    SENT: ("Producer requests whose KV checksums were sent with their KV.", None, ()),
    NOT_SENT: ("Producer requests whose KV checksums were not sent, by reason.", "reason", NOT_SENT_REASONS),
    PRODUCER_INTACT: ("Producer requests whose KV, checksummed again when its transfer completed, was as sent.",
                      None, ()),
    PRODUCER_CHANGED: ("Producer requests whose KV changed before its transfer completed (the consumer's check "
                       "fails; the fault is the producer's).", None, ()),
    PRODUCER_CHANGED_BLOCKS: ("Block positions whose KV changed on the producer before their transfer completed.",
                              None, ()),
    PRODUCER_READ_AFTER_RELEASE: ("Producer requests whose KV a consumer read after the connector had released "
                                  "its blocks (a lease that expired first): that load may hold other requests' KV.",
                                  None, ()),
    PRODUCER_NOT_RECHECKED: ("Producer requests whose KV was not checksummed again at the transfer's completion, "
                             "by reason.", "reason", NOT_RECHECKED_REASONS),
    OFFLOADED + VERIFIED: ("Loads of offloaded KV whose stored KV checksums matched.", None, ()),
    OFFLOADED + MISMATCHED: ("Loads of offloaded KV whose stored KV checksums differed (corrupt, misplaced or "
                             "another prefix's KV in the store).", None, ()),
    OFFLOADED + UNVERIFIED: ("Loads of offloaded KV that could not be compared, by reason.", "reason",
                             tuple(r.value for r in UnverifiedReason)),
    OFFLOADED + MISMATCHED_BLOCKS: ("Block positions of offloaded KV whose KV checksums differed.", None, ()),
    OFFLOADED_NOT_CHECKED: ("Loads of offloaded KV not checked, by reason.", "reason",
                            OFFLOADED_NOT_CHECKED_REASONS),
}

# Gauges: stats keys whose value is the current state, set rather than added.
LOADS_IN_FLIGHT = "loads_in_flight"
SENDS_IN_FLIGHT = "sends_in_flight"
HELD_BLOCKS = "held_blocks"
GAUGES: dict[str, str] = {
    LOADS_IN_FLIGHT: "KV loads started whose checksums are not yet compared (or dropped).",
    SENDS_IN_FLIGHT: "Producer requests whose KV was checksummed and whose transfer has not completed and been "
                     "re-checked yet.",
    HELD_BLOCKS: "Blocks of synchronous loads of offloaded KV that no other request may hit until their verdict.",
}

METRIC_PREFIX = "vllm:kv_checksum_"


def metric_name(key: str) -> str:
    """The Prometheus name of a counter (Prometheus adds _total on exposition)."""
    return METRIC_PREFIX + key


def labelled(name: str, value: str) -> str:
    """The stats key of one label value of a labelled counter."""
    return f"{name}/{value}"


class KVChecksumProm:
    """The KV checksum counters of one PrometheusStatLogger.

    Built by vLLM's PrometheusStatLogger with its own counter class and
    labels; registers nothing when KV checksums are off, so servers without
    them show no such metrics. observe() runs once per scheduler stats
    update, with that update's counts.
    """

    def __init__(self, enabled: bool, labelnames: list[str],
                 per_engine_labelvalues: Mapping[int, list[Any]], counter_cls, gauge_cls=None):
        self._counters: dict[str, dict[int, Any]] = {}
        self._labelled: dict[str, Any] = {}
        self._gauges: dict[str, dict[int, Any]] = {}
        self._per_engine = {idx: list(values) for idx, values in per_engine_labelvalues.items()}
        if not enabled:
            return
        if gauge_cls is not None:
            for key, doc in GAUGES.items():
                gauge = gauge_cls(name=metric_name(key), documentation=doc, labelnames=labelnames,
                                  multiprocess_mode="mostrecent")
                self._gauges[key] = {idx: gauge.labels(*lv) for idx, lv in self._per_engine.items()}
        for key, (doc, label, values) in COUNTERS.items():
            if label is None:
                counter = counter_cls(name=metric_name(key), documentation=doc, labelnames=labelnames)
                self._counters[key] = {idx: counter.labels(*lv) for idx, lv in self._per_engine.items()}
            else:
                counter = counter_cls(name=metric_name(key), documentation=doc,
                                      labelnames=[*labelnames, label])
                self._labelled[key] = counter
                # Shown at 0 from the start, so a rate() has a baseline.
                for lv in self._per_engine.values():
                    for value in values:
                        counter.labels(*lv, value)

    @property
    def enabled(self) -> bool:
        return bool(self._counters)

    def observe(self, stats: Mapping[str, int] | None, engine_idx: int = 0) -> None:
        """Add one stats update's counts. Keys this version does not know are ignored."""
        if not stats or not self.enabled:
            return
        for key, count in stats.items():
            if key in self._gauges:
                if count >= 0:
                    self._gauges[key][engine_idx].set(count)
                continue
            if count <= 0:
                continue
            name, _, value = key.partition("/")
            if value:
                known = COUNTERS.get(name)
                if name in self._labelled and known is not None and value in known[2]:
                    self._labelled[name].labels(*self._per_engine[engine_idx], value).inc(count)
            elif name in self._counters:
                self._counters[name][engine_idx].inc(count)
