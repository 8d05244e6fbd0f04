"""Read a server's Prometheus counters: scrape /metrics, sum, subtract.

The demo scrapes each vLLM server before and after its requests and reports
`delta(after, before)` of the kv_checksum counters, e.g.

    before = scrape(consumer.url)
    ...  # requests
    d = delta(scrape(consumer.url), before)
    counter(d, "vllm:kv_checksum_loads_verified")
    by_label(d, "vllm:kv_checksum_loads_unverified", "reason")

Samples are keyed by (sample name, sorted label items). A counter `x` is
exposed as samples `x_total` (and `x_created`, dropped here: a timestamp, not
a count); `counter()` and `by_label()` accept the name with or without
`_total`. Labels not asked for (vLLM's `model_name`, `engine`) are summed over.
"""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Samples", "ScrapeError", "scrape", "parse", "counter", "delta", "by_label"]

Key = tuple[str, tuple[tuple[str, str], ...]]
Samples = dict[Key, float]

# Families whose `<name>_created` samples are creation timestamps.
_CREATED_TYPES = {"counter", "histogram", "summary", "gaugehistogram"}
_no_proxy_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ScrapeError(RuntimeError):
    """/metrics could not be read or parsed."""


def parse(text: str) -> Samples:
    """Samples of a Prometheus text exposition, `_created` timestamps dropped."""
    families = list(text_string_to_metric_families(text))
    # In the 0.0.4 text format `x_created` comes as a family of its own (a
    # gauge), so it is recognised by the counter `x` it belongs to.
    timestamped = {f.name for f in families if f.type in _CREATED_TYPES}
    samples: Samples = {}
    for family in families:
        for s in family.samples:
            if s.name.endswith("_created") and s.name[: -len("_created")] in timestamped:
                continue
            samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return samples


def scrape(url: str, timeout: float = 10) -> Samples:
    """GET `{url}/metrics` (url: a server's base URL) and parse it."""
    metrics_url = f"{url.rstrip('/')}/metrics"
    request = urllib.request.Request(metrics_url, headers={"Accept": "text/plain"})
    try:
        with _no_proxy_opener.open(request, timeout=timeout) as resp:
            text = resp.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        raise ScrapeError(f"{metrics_url} answered HTTP {e.code}") from e
    except (urllib.error.URLError, OSError) as e:
        raise ScrapeError(f"cannot read {metrics_url}: {getattr(e, 'reason', e)}; "
                          "is the server up?") from e
    try:
        return parse(text)
    except ValueError as e:
        raise ScrapeError(f"{metrics_url} is not Prometheus text format: {e}") from e


def _names(samples: Samples, name: str) -> set[str]:
    """The sample name(s) `name` stands for: `x_total` if present, else `x`."""
    base = name[: -len("_total")] if name.endswith("_total") else name
    present = {key[0] for key in samples}
    if f"{base}_total" in present:
        return {f"{base}_total"}
    return {base} if base in present else set()


def _matches(key: Key, names: set[str], labels: dict[str, str]) -> bool:
    if key[0] not in names:
        return False
    have = dict(key[1])
    return all(have.get(k) == v for k, v in labels.items())


def counter(samples: Samples, name: str, **labels: object) -> float:
    """Sum of the samples of `name` whose labels include `labels`.

    0.0 when there is none: a labelled vLLM counter has no sample until it is
    first incremented. Check a name you are unsure of in `samples` first; a
    typo reads as 0 too.
    """
    want = {k: str(v) for k, v in labels.items()}
    names = _names(samples, name)
    return sum(v for key, v in samples.items() if _matches(key, names, want))


def by_label(samples: Samples, name: str, label: str, **labels: object) -> dict[str, float]:
    """Sums of `name` grouped by the values of `label` (optionally filtered by
    `labels`); samples without `label` are left out."""
    want = {k: str(v) for k, v in labels.items()}
    names = _names(samples, name)
    out: dict[str, float] = {}
    for key, v in samples.items():
        if _matches(key, names, want):
            value = dict(key[1]).get(label)
            if value is not None:
                out[value] = out.get(value, 0.0) + v
    return out


def delta(after: Samples, before: Samples) -> Samples:
    """after - before per key (a key missing in `before` counts as 0).

    Keys only in `before` are left out. A server restarted in between makes
    its counters start again from 0: the delta goes negative.
    """
    return {key: v - before.get(key, 0.0) for key, v in after.items()}
