"""Certificates for the router's TLS tests: the deployment's CA with a server and a client
certificate it signed, and a rogue CA's server certificate (made with the lab's openssl
helpers, fresh in each test's directory)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpush_prod.lab.launch import issue_cert, make_ca


@dataclass(frozen=True)
class Pki:
    ca: Path  # the router's --backend-ca-file
    ca_key: Path
    server_cert: Path  # for 127.0.0.1 and localhost, signed by ``ca``
    server_key: Path
    client_cert: Path  # the router's client certificate (mutual TLS), signed by ``ca``
    client_key: Path
    rogue_cert: Path  # for 127.0.0.1 and localhost too, but signed by another CA
    rogue_key: Path


def make_pki(directory: Path) -> Pki:
    d = directory / "pki"
    ca = make_ca(d, "deployment")
    server = issue_cert(ca, d, "engine")
    client = issue_cert(ca, d, "router", ("router",), client=True)
    rogue = issue_cert(make_ca(d, "rogue"), d, "rogue-engine")
    return Pki(
        ca[0], ca[1], server.cert, server.key, client.cert, client.key, rogue.cert, rogue.key
    )
