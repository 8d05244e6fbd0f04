"""What a KV checksum drill is told to do: the kv_checksum_faults settings, and the control file that
changes kinds and rates while the servers run.

Validated here, once, with errors that name the config key; the fault-injecting connector
(fault_connector.py) acts on them. Imports no vLLM.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_kvchecksum.drills import faults

# A child of "vllm.kv_checksum": logs through vLLM's handlers, next to the
# checksum verdicts it is meant to provoke.
LOGGER_NAME = "vllm.kv_checksum.fault"
logger = logging.getLogger(LOGGER_NAME)

CONNECTORS_KEY = "kv_connector_extra_config.connectors"
FAULTS_SECTION = "kv_checksum_faults"
FAULTS_KEY = f"kv_connector_extra_config.{FAULTS_SECTION}"

# Carrier loss: the consumer's scheduler never sees the producer's checksums.
DROP_CHECKSUMS = "drop_checksums"
KNOWN_KINDS: tuple[str, ...] = (*faults.FAULT_KINDS, DROP_CHECKSUMS)
ALL_KINDS = "all"

_SETTING_KEYS = ("kinds", "rate", "seed", "log_path", "control_path", "witness_path", "stall_rate", "stall_s",
                 "position", "target")
# What the faults hit: the KV each load wrote (on a consumer), or the KV of
# each producer request after its checksums were taken and before its
# transfer completes (on a producer: what the producer's re-check finds).
TARGETS = ("loads", "sends")
# The longest stall a drill may ask for: a stall blocks the engine loop.
MAX_STALL_S = 60.0
_CONTROL_KEYS = ("kinds", "rate", "stall_rate")


# ----------------------------------------------------------------- settings

@dataclass(frozen=True)
class FaultSettings:
    """The kv_checksum_faults section, validated.

    kinds: the fault kinds drawn from (uniformly; a kind listed twice is
      drawn twice as often); empty: no faults.
    rate: the probability that a load gets a fault.
    seed: seeds the scheduler's draws, so a run is reproducible.
    log_path: JSON-lines file every injection is appended to, or None.
    control_path: file whose JSON overrides kinds and rate while it exists.
    witness_path: JSON-lines file for the ground truth (kv_witness): the
      digests of the blocks each producer request sends and each load
      receives, and one line per load started; None: no digests.
    stall_rate, stall_s: the probability that a load starting stalls this
      worker's engine for stall_s seconds before its transfer is posted (a
      slow consumer: its reads come late and it sends no lease heartbeats).
    position: the request block position the kinds that hit one block hit
      (a drill of what follows a bad block k); None: drawn per load. A load
      that holds no such position gets no fault (recorded as skipped).
    target: "loads" (default): faults hit the KV a load wrote, after the
      load. "sends": on a producer, faults hit a P/D request's prompt KV
      after its checksums were taken, while the connector holds the blocks
      for the transfer (a drill of the producer's re-check); loads get none.
      drop_checksums does not apply to sends (recorded as skipped).
    """

    kinds: tuple[str, ...] = KNOWN_KINDS
    rate: float = 1.0
    seed: int = 0
    log_path: str | None = None
    control_path: str | None = None
    witness_path: str | None = None
    stall_rate: float = 0.0
    stall_s: float = 0.0
    position: int | None = None
    target: str = "loads"


def parse_kinds(value: Any, where: str) -> tuple[str, ...]:
    """Fault kinds from config: "all" or a list of KNOWN_KINDS names."""
    if value == ALL_KINDS:
        return KNOWN_KINDS
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{where} must be \"all\" or a list of fault kinds, got {value!r}; "
                         f"known kinds: {', '.join(KNOWN_KINDS)}")
    unknown = [k for k in value if k not in KNOWN_KINDS]
    if unknown:
        raise ValueError(f"{where}: unknown fault kind(s) {', '.join(map(repr, unknown))}; "
                         f"known kinds: {', '.join(KNOWN_KINDS)} (or \"all\")")
    return tuple(value)


def parse_rate(value: Any, where: str) -> float:
    """A load's fault probability: a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= 1:
        raise ValueError(f"{where} must be a number in [0, 1] (the probability that a load gets a fault), "
                         f"got {value!r}")
    return float(value)


def _parse_seed(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    return value


def _parse_stall(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= MAX_STALL_S:
        raise ValueError(f"{where} must be a number of seconds in [0, {MAX_STALL_S:g}], got {value!r}")
    return float(value)


def _parse_position(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where} must be a block position (an integer >= 0) or null, got {value!r}")
    return value


def _parse_target(value: Any, where: str) -> str:
    if value not in TARGETS:
        raise ValueError(f"{where} must be one of {', '.join(TARGETS)}, got {value!r}")
    return value


def _parse_path(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty file path or null, got {value!r}")
    return value


def parse_fault_settings(extra_config: Mapping[str, Any]) -> FaultSettings:
    """The validated kv_checksum_faults section of kv_connector_extra_config.

    Raises ValueError naming the key at fault and what it accepts.
    """
    section = extra_config.get(FAULTS_SECTION, {})
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError(f"{FAULTS_KEY} must be a JSON object with keys {', '.join(_SETTING_KEYS)}, "
                         f"got {section!r}")
    unknown = sorted(set(section) - set(_SETTING_KEYS))
    if unknown:
        raise ValueError(f"{FAULTS_KEY}: unknown key(s) {', '.join(unknown)}; known keys: "
                         f"{', '.join(_SETTING_KEYS)}")
    defaults = FaultSettings()
    return FaultSettings(
        kinds=parse_kinds(section.get("kinds", ALL_KINDS), f"{FAULTS_KEY}.kinds"),
        rate=parse_rate(section.get("rate", defaults.rate), f"{FAULTS_KEY}.rate"),
        seed=_parse_seed(section.get("seed", defaults.seed), f"{FAULTS_KEY}.seed"),
        log_path=_parse_path(section.get("log_path"), f"{FAULTS_KEY}.log_path"),
        control_path=_parse_path(section.get("control_path"), f"{FAULTS_KEY}.control_path"),
        witness_path=_parse_path(section.get("witness_path"), f"{FAULTS_KEY}.witness_path"),
        stall_rate=parse_rate(section.get("stall_rate", defaults.stall_rate), f"{FAULTS_KEY}.stall_rate"),
        stall_s=_parse_stall(section.get("stall_s", defaults.stall_s), f"{FAULTS_KEY}.stall_s"),
        position=_parse_position(section.get("position"), f"{FAULTS_KEY}.position"),
        target=_parse_target(section.get("target", defaults.target), f"{FAULTS_KEY}.target"))


def check_connectors(extra_config: Mapping[str, Any]) -> None:
    """Exactly one wrapped connector, as a config object naming its class."""
    connectors = extra_config.get("connectors")
    if not isinstance(connectors, (list, tuple)) or len(connectors) != 1:
        count = len(connectors) if isinstance(connectors, (list, tuple)) else "no"
        raise ValueError(
            f"KVChecksumFaultConnector wraps exactly one connector: set {CONNECTORS_KEY} to a list of one "
            f"connector config, e.g. [{{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}}] "
            f"(got {count} connectors)")
    child = connectors[0]
    if not isinstance(child, Mapping) or not child.get("kv_connector"):
        raise ValueError(f"{CONNECTORS_KEY}[0] must be a connector config with a \"kv_connector\" name, "
                         f"got {child!r}")


# ----------------------------------------------------------------- control file

class ControlFile:
    """Kinds and rate for the next loads: the config's, or the control file's.

    The file is stat()ed at each call and re-read only when it changed
    (mtime, size, inode), so calling this per load is cheap. While the file
    exists its JSON object {"kinds": [...], "rate": x, "stall_rate": y}
    (each key optional) overrides the config; a missing file means the
    config's settings; an unreadable or invalid file means no faults and no
    stalls, with one warning per version of the file.
    """

    def __init__(self, path: str | None, kinds: tuple[str, ...], rate: float, stall_rate: float = 0.0):
        self.path = path
        self.config = (kinds, rate)
        self.config_stall_rate = stall_rate
        self._stamp: Any = "unread"
        self._current = self.config
        self._stall_rate = stall_rate

    def stall_rate(self) -> float:
        """The probability that a load starting stalls its step (see FaultSettings)."""
        self.settings()
        return self._stall_rate

    def settings(self) -> tuple[tuple[str, ...], float]:
        if self.path is None:
            return self.config
        try:
            st = os.stat(self.path)
            stamp: Any = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        except OSError as exc:
            stamp = ("error", str(exc))
        if stamp != self._stamp:
            self._stamp = stamp
            self._stall_rate = self.config_stall_rate
            self._current = self._read(stamp)
        return self._current

    def _read(self, stamp) -> tuple[tuple[str, ...], float]:
        if stamp is None:
            logger.info("KV checksum drill: control file %s absent: using the config's kinds %s, rate %s.",
                        self.path, list(self.config[0]), self.config[1])
            return self.config
        try:
            if isinstance(stamp, tuple) and stamp[0] == "error":
                raise OSError(stamp[1])
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            settings = self._parse(data)
        except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
            logger.warning("KV checksum drill: control file %s is unreadable or invalid (%s): no faults until "
                           "it is fixed or removed.", self.path, exc)
            self._stall_rate = 0.0
            return (), 0.0
        logger.info("KV checksum drill: control file %s: kinds %s, rate %s for the following loads.",
                    self.path, list(settings[0]), settings[1])
        return settings

    def _parse(self, data: Any) -> tuple[tuple[str, ...], float]:
        where = f"control file {self.path}"
        if not isinstance(data, dict):
            raise ValueError(f"{where} must hold a JSON object with keys kinds and/or rate")
        unknown = sorted(set(data) - set(_CONTROL_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(_CONTROL_KEYS)}")
        kinds = parse_kinds(data["kinds"], f"{where}: kinds") if "kinds" in data else self.config[0]
        rate = parse_rate(data["rate"], f"{where}: rate") if "rate" in data else self.config[1]
        if "stall_rate" in data:
            self._stall_rate = parse_rate(data["stall_rate"], f"{where}: stall_rate")
        return kinds, rate
