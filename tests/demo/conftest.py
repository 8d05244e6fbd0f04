"""Tests of scripts/kvcs_demo: the demo's process, proxy and metrics tooling.

No vLLM server runs here: stand-in processes and servers take their place
(the real servers run in the demo's end-to-end test).
"""

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))
