"""Our ZAP handler: it answers every request (a REP that skips one never receives again),
admits only allow-listed CURVE keys on our domain, and gives the key as User-Id."""

from __future__ import annotations

import zmq
from zmq.utils import z85

from kvpush_prod.control.security import ZAP_DOMAIN, ZAP_ENDPOINT, AllowListAuthenticator
from tests.control.helpers import keypair


def request(
    key: bytes, domain: bytes = ZAP_DOMAIN.encode(), mechanism: bytes = b"CURVE", rid: bytes = b"7"
) -> list[bytes]:
    return [b"1.0", rid, domain, b"127.0.0.1", b"", mechanism, z85.decode(key)]


def test_answers_follow_the_allow_list_domain_and_mechanism() -> None:
    ok, other = keypair("d"), keypair("x")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    auth = AllowListAuthenticator(ctx, {ok.public: "d"})
    try:
        assert auth.answer(request(ok.public)) == [b"1.0", b"7", b"200", b"OK", ok.public, b""]
        assert auth.answer(request(other.public))[2:5] == [b"400", b"refused", b""]
        assert auth.allow_list.last_refused[0] == "127.0.0.1"
        assert auth.answer(request(ok.public, domain=b"other"))[2] == b"400"
        assert auth.answer(request(ok.public, mechanism=b"PLAIN"))[2] == b"400"
        assert auth.answer([b"1.0", b"8"])[:3] == [b"1.0", b"8", b"500"]
        assert auth.answer([])[2] == b"500"
        assert auth.answer([b"2.0", *request(ok.public)[1:]])[2] == b"500"
        assert auth.answered == {b"200": 1, b"400": 3, b"500": 3}
    finally:
        auth.stop()
        ctx.term()


def test_the_thread_answers_a_malformed_request_and_then_the_next_one() -> None:
    ok = keypair("d")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    auth = AllowListAuthenticator(ctx, {ok.public: "d"})
    auth.start()
    client = ctx.socket(zmq.REQ)
    client.setsockopt(zmq.LINGER, 0)
    client.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        client.connect(ZAP_ENDPOINT)
        client.send_multipart([b"junk"])
        assert client.recv_multipart()[2] == b"500"
        client.send_multipart(request(ok.public, rid=b"9"))
        assert client.recv_multipart()[1:3] == [b"9", b"200"]
    finally:
        client.close(0)
        auth.stop()
        auth.stop()  # twice is fine
        ctx.term()
