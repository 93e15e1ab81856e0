"""Our connector implements every hook vLLM's connector base class declares abstract, in the
installed vLLM (0.32, the CPU build) and in vLLM 0.33 (what ``pip install kvpush-prod[gpu]``
brings), and answers the sleep-mode hooks 0.33 adds instead of inheriting their defaults
(``supports_sleep_mode`` True, and no-op unregister/restore: they would claim kvpush follows
the KV cache remap while its NIXL registrations go stale).

0.33's base class is read from its wheel on PyPI (only the zip directory and that one file,
by HTTP range requests: no CUDA import, no 300 MB download). Without network access that
part is skipped, saying so; a mismatch always fails."""

from __future__ import annotations

import ast
import inspect
import io
import os
import zipfile
from urllib.parse import urljoin

import httpx
import pytest

from kvpush_prod.connector.connector import PushConnector

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
SLEEP_HOOKS = ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")
FUTURE = "0.33.0"


def declared(source: str, cls: str = "KVConnectorBase_V1") -> tuple[set[str], set[str]]:
    """(abstract methods, all methods) of ``cls`` in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
            abstract = {
                m.name
                for m in methods
                if any(
                    (isinstance(d, ast.Name) and d.id == "abstractmethod")
                    or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod")
                    for d in m.decorator_list
                )
            }
            return abstract, {m.name for m in methods}
    raise AssertionError(f"no class {cls} in the source")


def ours() -> set[str]:
    return {name for name, _ in vars(PushConnector).items()}


def missing(source: str) -> list[str]:
    abstract, methods = declared(source)
    need = abstract | (set(SLEEP_HOOKS) & methods)
    return sorted(need - ours())


class _Ranged(io.RawIOBase):
    """A remote file read by HTTP range requests (enough for zipfile)."""

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client, self.url, self.pos = client, url, 0
        head = client.head(url)
        head.raise_for_status()
        self.size = int(head.headers["content-length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buf: bytearray) -> int:  # type: ignore[override]
        if self.pos >= self.size:
            return 0
        end = min(self.pos + len(buf), self.size) - 1
        r = self.client.get(self.url, headers={"Range": f"bytes={self.pos}-{end}"})
        assert r.status_code == 206, f"{self.url}: no range request support ({r.status_code})"
        buf[: len(r.content)] = r.content
        self.pos += len(r.content)
        return len(r.content)


def future_base_source() -> str:
    verify: str | bool = os.environ.get("SSL_CERT_FILE") or os.environ.get("PIP_CERT") or True
    try:
        with httpx.Client(timeout=30, follow_redirects=True, verify=verify) as client:
            index = "https://pypi.org/pypi/vllm/json"
            files = client.get(index).raise_for_status().json()["releases"][FUTURE]
            (wheel,) = [
                f["url"] for f in files if f["filename"].endswith("manylinux_2_28_x86_64.whl")
            ]
            remote = _Ranged(client, urljoin(index, wheel))
            with zipfile.ZipFile(io.BufferedReader(remote, buffer_size=1 << 16)) as z:
                return z.read(BASE).decode()
    except (httpx.HTTPError, OSError, KeyError, ValueError) as exc:
        pytest.skip(
            f"vLLM {FUTURE}'s wheel is out of reach here ({type(exc).__name__}: "
            f"{exc}); the installed vLLM is still checked"
        )


def test_every_abstract_hook_of_the_installed_vllm_is_ours() -> None:
    import vllm.distributed.kv_transfer.kv_connector.v1.base as base

    assert missing(inspect.getsource(base)) == []


def test_every_abstract_and_sleep_mode_hook_of_vllm_0_33_is_ours() -> None:
    source = future_base_source()
    abstract, methods = declared(source)
    assert set(SLEEP_HOOKS) <= methods, "0.33's base class has the sleep-mode hooks"
    assert missing(source) == []


def test_the_checker_sees_a_hook_we_lack() -> None:
    fake = (
        "from abc import abstractmethod\nclass KVConnectorBase_V1:\n"
        "    @abstractmethod\n    def brand_new_hook(self): ...\n"
        "    def restore_kv_caches(self): ...\n"
    )
    assert missing(fake) == ["brand_new_hook"]


def test_kvpush_declines_sleep_mode() -> None:
    assert PushConnector.supports_sleep_mode(None) is False


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("pipeline_parallel_size", "--pipeline-parallel-size"),
        ("decode_context_parallel_size", "--decode-context-parallel-size"),
    ],
)
def test_unsupported_parallelism_is_refused_at_start_up_naming_the_flag(
    field: str, flag: str
) -> None:
    from types import SimpleNamespace

    from kvpush_prod.connector.connector import unsupported_topology
    from kvpush_prod.errors import ConfigError

    ok = SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1)
    unsupported_topology(ok)
    with pytest.raises(ConfigError, match=f"{flag} 2") as info:
        unsupported_topology(SimpleNamespace(**{**vars(ok), field: 2}))
    assert f"{flag} 1" in str(info.value)
