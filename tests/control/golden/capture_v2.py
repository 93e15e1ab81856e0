"""The protocol 2 frames of tests/control/golden/v2_frames.txt, captured with kvpush-prod
0.1.0's own code: run this with that release first on the path (the tag's tree installed
with ``pip install --no-deps --target DIR``, then ``PYTHONPATH=DIR python capture_v2.py``).
The tests rebuild the same messages with this build's Structs (``messages_v2``)."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def messages_v2(m: ModuleType) -> dict[str, Any]:
    """One message of every control kind, and a DONE, in protocol 2 (``m``: a release's
    ``kvpush_prod.core.messages``)."""
    region = m.Region(
        base=4096,
        block_stride=8192,
        block_len=8192,
        num_blocks=64,
        dev_id=0,
        tok_groups=2,
        tok_pattern=[(32, 4), (1, 128)],
    )
    layout = m.Layout(
        compat="0123456789abcdef",
        mem_type="DRAM",
        regions=[region],
        facts={"model": "tiny", "protocol": "2", "kvpush": "0.1.0"},
        tp_size=1,
        tp_rank=0,
        kv_heads=2,
        total_kv_heads=2,
        block_size=128,
    )
    d_full = m.PeerInfo(
        "decode-0", 12345678901, 0, "tcp://127.0.0.1:5601", "agent-d", b"\x00meta\xff", layout
    )
    d_slim = m.PeerInfo("decode-0", 12345678901, 0, "tcp://127.0.0.1:5601", "agent-d")
    slim = m.PeerInfo("prefill-0", 98765, 0, "tcp://127.0.0.1:5501", "agent-p")
    return {
        "register": m.Register(2, "req-1", d_full, [3, 4, 5], 1, 300, 77, 5000, 1700000000.5),
        "heartbeat": m.Heartbeat(
            2, slim, 12345678901, [("req-1", 77), ("req-2", 0)], 5000, 1700000001.25
        ),
        "cancel": m.Cancel(2, "req-1", 77, d_slim, "aborted"),
        "cancel_ack": m.CancelAck(2, "req-1", 77, slim),
        "failed": m.Failed(2, "req-1", 77, slim, "prefill_failed", "forward raised"),
        "fallback": m.Fallback(
            2,
            "req-1",
            77,
            slim,
            [7, 8, 9],
            1,
            "retries_exhausted",
            30000,
            123456,
            1700000002.0,
            b"\x01" * 32,
        ),
        "pull_done": m.PullDone(2, "req-1", 77, slim, True),
        "done_query": m.DoneQuery(2, "req-1", 77, slim, 1),
        "done_state": m.DoneState(2, "req-1", 77, slim, 1, "pending"),
        "done": m.Done(2, "req-1", 77, 3, 123456, 1, 64, b"\x02" * 32),
    }


def main() -> None:
    import kvpush_prod
    from kvpush_prod.control.codec import ControlCodec
    from kvpush_prod.core import messages as m

    codec = ControlCodec(1 << 20)
    print("# kvpush_prod from", kvpush_prod.__file__)
    for kind, msg in messages_v2(m).items():
        if kind == "done":
            print(f"{kind} {m.encode_done(msg).hex()}")
            continue
        (body,) = codec.seal(msg)
        assert codec.open([body]) == msg
        print(f"{kind} {body.hex()}")


if __name__ == "__main__":
    main()
