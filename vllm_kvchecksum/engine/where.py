"""`python -m vllm_kvchecksum.engine.where --consumer LOG [--producer LOG ...]`: where each
KV checksum mismatch happened, joined from the servers' logs (incident.py)."""

import sys

from vllm_kvchecksum.engine.incident import where_main

if __name__ == "__main__":
    sys.exit(where_main())
