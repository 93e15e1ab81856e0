"""One side of a NIXL WRITE between two network namespaces (tests/lab/test_netns_nixl.py):
``p`` writes 1 MiB to ``d`` before, during and after a partition the test makes, and prints
each transfer's state; ``d`` prints the notifications it got. Files in DIR synchronise.

``p DIR reconnect``: the partition outlasts UCX_TCP_USER_TIMEOUT, so UCX closes the
connection; after healing ``p`` writes once more on it, then drops and re-adds ``d``'s agent
(what the driver does on REMOTE_DISCONNECT) and writes again."""

from __future__ import annotations

import pathlib
import sys
import time

import torch

from kvpush_prod.transport.nixl import make_agent

role, d = sys.argv[1], pathlib.Path(sys.argv[2])
reconnect = sys.argv[3:] == ["reconnect"]
ag = make_agent(f"x-{role}", "UCX", True, 1000)
buf = torch.full((1 << 20,), 7 if role == "p" else 0, dtype=torch.uint8)
reg = ag.register_memory(ag.get_reg_descs([buf]))
(d / f"{role}.md").write_bytes(ag.get_agent_metadata())
(d / f"{role}.addr").write_text(f"{buf.data_ptr()}")
other = "d" if role == "p" else "p"
while not (d / f"{other}.addr").exists():
    time.sleep(0.1)
time.sleep(0.3)
peer = ag.add_remote_agent((d / f"{other}.md").read_bytes())


def xfer(tag, limit):
    raddr = int((d / "d.addr").read_text())
    local = ag.get_xfer_descs([(buf.data_ptr(), buf.numel(), 0)], "DRAM")
    remote = ag.get_xfer_descs([(raddr, buf.numel(), 0)], "DRAM")
    t = time.monotonic()
    try:
        h = ag.initialize_xfer("WRITE", local, remote, peer, tag.encode())
        st = ag.transfer(h)
        while (st := ag.check_xfer_state(h)) == "PROC" and time.monotonic() - t < limit:
            time.sleep(0.01)
    except Exception as e:
        st = f"EXC {e!r}"[:200]
    print(tag, st, round(time.monotonic() - t, 2), flush=True)


if role == "p":
    xfer("before", 20)
    (d / "ready").write_text("1")
    while not (d / "cut").exists():
        time.sleep(0.05)
    xfer("during", 8 if reconnect else 4)
    while not (d / "healed").exists():
        time.sleep(0.05)
    if reconnect:
        xfer("after0", 10)
        ag.remove_remote_agent(peer)
        peer = ag.add_remote_agent((d / "d.md").read_bytes())
        for i in range(3):
            xfer(f"again{i}", 20)
    else:
        for i in range(3):
            xfer(f"after{i}", 20)
            time.sleep(1)
else:
    while not (d / "end").exists():
        time.sleep(0.2)
    print("d notifs", ag.get_new_notifs(), flush=True)
