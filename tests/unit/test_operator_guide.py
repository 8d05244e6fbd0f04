"""docs/operators.md documents every metric, label value and configuration key the code has.

Nothing here is a list typed by hand; every name comes from the code:
- metrics, their types, labels and label values: KVChecksumProm registers them
  into a real prometheus_client registry, as vLLM's PrometheusStatLogger does
  (with vLLM's labels model_name and engine), and the registry is read back;
- configuration keys: the KVTransferConfig fields the patches add (the hunks of
  vllm/config/kv_transfer.py in patches/), the kv_connector_extra_config keys
  the patches and the package read or tell the operator to set, the drills'
  section, and the environment variables the package names.

The guide is held to a shape, so a value cannot pass by appearing somewhere
else: each metric has a table row `| `name` | type | labels | ... |`; each
label value a row `| `value` | ... |` under a heading that names the label and
the metric; each configuration key a row under "Turn it on". Names the guide
gives that the code does not have fail too, so a renamed metric or value
cannot leave a stale entry behind.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import prometheus_client
import pytest

from vllm_kvchecksum.drills import fault_settings
from vllm_kvchecksum.engine.metrics import KVChecksumProm

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "operators.md"
VLLM_LABELS = ("model_name", "engine")

# A metric's row in the guide's metric tables: name, type, labels.
METRIC_ROW = re.compile(r"^\| `(vllm:kv_checksum_\w+)` \| (\w+) \|([^|]*)\|", re.M)
# A label value's row in a label section, and a configuration key's row.
CODE_ROW = re.compile(r"^\| `([^`|]+)` \|", re.M)
HEADING = re.compile(r"^(#{1,6}) (.*)$", re.M)


def guide_text() -> str:
    return GUIDE.read_text(encoding="utf-8")


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each section: from a heading to the next heading of any level."""
    marks = list(HEADING.finditer(text))
    return [(m.group(2), text[m.end():marks[i + 1].start() if i + 1 < len(marks) else len(text)])
            for i, m in enumerate(marks)]


def chapter(text: str, title: str) -> str:
    """A level-2 chapter of the guide with its subsections."""
    start = re.search(rf"^## {re.escape(title)}\s*$", text, re.M)
    assert start, f"docs/operators.md has no '## {title}' chapter"
    end = re.search(r"^## ", text[start.end():], re.M)
    return text[start.end():start.end() + end.start() if end else len(text)]


# -- what the code has ----------------------------------------------------------


@functools.cache
def registered() -> dict[str, tuple[str, frozenset[str], dict[str, frozenset[str]]]]:
    """Exposed metric name -> (type, label names, {label: values}), as a server's /metrics has them.

    Counters are exposed with Prometheus' `_total` suffix; labelled counters
    are shown at 0 for every label value from the start, so the registry
    holds every value.
    """
    registry = prometheus_client.CollectorRegistry()
    prom = KVChecksumProm(True, list(VLLM_LABELS), {0: ["model", "0"]},
                          functools.partial(prometheus_client.Counter, registry=registry),
                          functools.partial(prometheus_client.Gauge, registry=registry))
    assert prom.enabled
    out = {}
    for family in registry.collect():
        if family.type == "counter":
            exposed = f"{family.name}_total"
            samples = [s for s in family.samples if s.name == exposed]
        else:
            exposed = family.name
            samples = list(family.samples)
        labels: dict[str, set[str]] = {}
        for sample in samples:
            for label, value in sample.labels.items():
                if label not in VLLM_LABELS:
                    labels.setdefault(label, set()).add(value)
        out[exposed] = (family.type, frozenset(labels), {k: frozenset(v) for k, v in labels.items()})
    return out


def added_patch_lines(path_in_vllm: str | None = None) -> list[str]:
    """The lines the series adds, to one vLLM file or to all."""
    lines = []
    for patch in sorted((ROOT / "patches").glob("*.patch")):
        for diff in re.split(r"^diff --git ", patch.read_text(encoding="utf-8"), flags=re.M)[1:]:
            if path_in_vllm is not None and not diff.startswith(f"a/{path_in_vllm} "):
                continue
            lines += [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return lines


def config_fields() -> set[str]:
    """The KVTransferConfig fields the series adds."""
    return {m.group(1) for line in added_patch_lines("vllm/config/kv_transfer.py")
            if (m := re.match(r"    (\w+)\s*:\s*[^=]+=", line))}


_EXTRA_KEY = (re.compile(r"\bextra(?:_config)?\.get\(\s*[\"'](\w+)[\"']"),
              re.compile(r"\bextra(?:_config)?\[\s*[\"'](\w+)[\"']\s*\]"),
              re.compile(r"get_from_extra_config\(\s*[\"'](\w+)[\"']"),
              re.compile(r"\b(\w+) in kv_connector_extra_config"))


def package_sources() -> list[str]:
    return [f.read_text(encoding="utf-8") for f in sorted((ROOT / "vllm_kvchecksum").rglob("*.py"))]


def extra_config_keys() -> set[str]:
    """kv_connector_extra_config keys the series reads or names to the operator, and the drills' section."""
    keys = {fault_settings.FAULTS_SECTION}
    for text in [*added_patch_lines(), *package_sources()]:
        for pattern in _EXTRA_KEY:
            keys.update(pattern.findall(text))
    return keys


_ENV_VAR = (re.compile(r"\benvs\.([A-Z][A-Z0-9_]+)"),  # vLLM's envs module
            re.compile(r"\b(?:environ(?:\.get)?|getenv)\s*[(\[]\s*[\"']([A-Z][A-Z0-9_]+)[\"']"),
            re.compile(r"\b(NUMBA_[A-Z0-9_]+)\b"))  # numba reads its settings from the environment


def env_vars() -> set[str]:
    """The environment variables the package and the patches read (vLLM's envs, os.environ, numba's)."""
    return {name for text in [*package_sources(), *added_patch_lines()] for pattern in _ENV_VAR
            for name in pattern.findall(text)}


# -- the checks -----------------------------------------------------------------


def test_the_code_lists_are_not_empty():
    # A parser that finds nothing would make every check below pass.
    assert len(registered()) > 10
    assert any(labels for _, labels, _ in registered().values())
    assert config_fields() and extra_config_keys() and env_vars()


def test_every_metric_has_its_row_with_type_and_labels():
    rows = {}
    for name, kind, labels in METRIC_ROW.findall(guide_text()):
        assert name not in rows, f"docs/operators.md has two rows for {name}"
        rows[name] = (kind, frozenset(re.findall(r"`(\w+)`", labels)))
    missing = sorted(set(registered()) - set(rows))
    assert not missing, f"metrics registered by KVChecksumProm but without a row in docs/operators.md: {missing}"
    stale = sorted(set(rows) - set(registered()))
    assert not stale, f"docs/operators.md has rows for metrics the code does not register: {stale}"
    for name, (kind, labels, _) in registered().items():
        assert rows[name] == (kind, labels), (
            f"docs/operators.md says {name} is a {rows[name][0]} with labels {sorted(rows[name][1])}; "
            f"the code registers a {kind} with labels {sorted(labels)}")


def test_every_metric_the_guide_names_exists():
    named = set(re.findall(r"vllm:kv_checksum_\w+", guide_text()))
    unknown = sorted(named - set(registered()))
    assert not unknown, f"docs/operators.md names metrics the code does not register: {unknown}"


def test_every_label_value_is_explained_under_its_metric():
    parts = sections(guide_text())
    for name, (_, _, values) in sorted(registered().items()):
        for label, expected in sorted(values.items()):
            own = [body for heading, body in parts
                   if heading.startswith(f"`{label}` of ") and re.search(rf"`{re.escape(name)}`", heading)]
            assert own, f"docs/operators.md has no section headed '`{label}` of ... `{name}`'"
            documented = {value for body in own for value in CODE_ROW.findall(body)}
            missing = sorted(expected - documented)
            assert not missing, f"values of {name}{{{label}}} the code has and docs/operators.md does not: {missing}"
            stale = sorted(documented - expected)
            assert not stale, f"docs/operators.md explains values of {name}{{{label}}} the code does not have: {stale}"


@pytest.mark.parametrize("kind", ["kv_transfer_config fields", "kv_connector_extra_config keys",
                                  "environment variables"])
def test_every_config_key_has_its_row(kind):
    keys = {"kv_transfer_config fields": config_fields, "kv_connector_extra_config keys": extra_config_keys,
            "environment variables": env_vars}[kind]()
    documented = set(CODE_ROW.findall(chapter(guide_text(), "Turn it on")))
    missing = sorted(keys - documented)
    assert not missing, f"{kind} in the code without a row under 'Turn it on' in docs/operators.md: {missing}"


# Pages the issue has other sessions write at the same time as this one; a
# link to them is checked once they exist.
def slug(heading: str) -> str:
    """A heading's anchor, as GitHub and mkdocs make it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md", "docs/operators.md", "docs/workbench.md", "docs/install.md",
                                  "docs/alerts.md"])
def test_links_resolve(page):
    """Every relative link of the pages the README's split wrote reaches a file, and an anchor a heading."""
    source = ROOT / page
    text = source.read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        if not file.exists():
            broken.append(target)
            continue
        if anchor and file.suffix == ".md":
            anchors = {slug(h) for _, h in HEADING.findall(file.read_text(encoding="utf-8"))}
            if anchor not in anchors:
                broken.append(target)
    assert not broken, f"{page} links to what does not exist: {broken}"
