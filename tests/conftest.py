"""Offline Hugging Face configs for the tests that build vLLM configs.

`make setup` writes config-only cache entries (tests/upstream/hf-configs)
into build/hf-home; nothing is downloaded at run time.
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HOME", str(ROOT / "build" / "hf-home"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
