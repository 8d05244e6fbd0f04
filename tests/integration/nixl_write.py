"""Two real NIXL agents (UCX, CPU memory, loopback) in this process: the
producer WRITEs 4 KiB into the consumer's memory with the notif given as
hex on the command line. Prints one JSON line: the notifs the consumer
agent received (hex) and whether the bytes arrived.

Run as a child process by test_push_carrier.py: NIXL/UCX agents crash the
interpreter at exit (SIGSEGV in their teardown, even after deregistering
and removing the remote agents), so this script leaves with os._exit
after printing, and the test process never holds an agent.
"""

import json
import os
import sys
import time
import uuid

import torch
from nixl._api import nixl_agent, nixl_agent_config


def main() -> None:
    notif = bytes.fromhex(sys.argv[1])
    config = nixl_agent_config(backends=["UCX"])
    p = nixl_agent(f"P-{uuid.uuid4().hex[:8]}", config)
    d = nixl_agent(f"D-{uuid.uuid4().hex[:8]}", config)
    src = torch.arange(1024, dtype=torch.int32)
    dst = torch.zeros(1024, dtype=torch.int32)
    p.register_memory(p.get_reg_descs(src))
    d.register_memory(d.get_reg_descs(dst))
    p.add_remote_agent(d.get_agent_metadata())
    d.add_remote_agent(p.get_agent_metadata())
    handle = p.initialize_xfer("WRITE", p.get_xfer_descs(src), p.get_xfer_descs(dst), d.name, notif)
    state = p.transfer(handle)
    received: list[bytes] = []
    deadline = time.monotonic() + 30
    while not received and time.monotonic() < deadline and state != "ERR":
        state = p.check_xfer_state(handle)
        for notifs in d.get_new_notifs().values():
            received.extend(notifs)
    print(json.dumps({"notifs": [n.hex() for n in received], "data_equal": bool(torch.equal(src, dst)),
                      "state": state}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
