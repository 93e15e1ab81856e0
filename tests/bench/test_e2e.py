"""One tiny real run of ``kvpush bench`` (kvpush and vLLM push, two rounds): engines start,
the cell is measured with vLLM's client in both rounds and pooled, the KV transfer time comes
from the traces, vLLM's P thread that its connector moved is bound back, the report renders.
Part of the full run (KVPUSH_E2E_EXTRA=1; every benchmark in a closing note runs it for
real); CI checks the bench's planning, report and plots with the unit tests beside it."""

from __future__ import annotations

import json

import pytest

from kvpush_prod.bench.cli import main as bench_main

pytestmark = [pytest.mark.e2e, pytest.mark.full]


def test_bench_smoke_on_the_kvpush_side(tmp_path, capsys):
    rc = bench_main(
        [
            "--out",
            str(tmp_path),
            "--sides",
            "kvpush,vllm-push",
            "--rounds",
            "2",
            "--lengths",
            "256",
            "--concurrency",
            "1",
            "--requests",
            "2",
            "--warmup",
            "1",
            "--max-tokens",
            "8",
            "--no-progress",
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    cell = data["cells"]["kvpush"]["256x1"]
    assert cell["ok"] == 4 and cell["errors"] == 0, cell["first_error"]  # 2 rounds of 2
    assert cell["rounds"] == 2 and len(data["rounds"]["vllm-push"]["256x1"]) == 2
    transfer = cell["transfer"]
    assert transfer["decode_prompt_tokens_external"] > 0  # the KV came over NIXL
    assert transfer["kv_ready_to_d_knows_ms"]["n"] == 2  # the last round's
    assert data["sides"]["kvpush"]["spin"] == "neutralised"
    # vLLM's NIXL connector moved its P's forward thread onto the last core: bound back.
    assert data["sides"]["vllm-push"]["rebound_threads"]["prefill"] >= 1
    assert data["sides"]["kvpush"]["rebound_threads"] == {"prefill": 0, "decode": 0}
    assert "| 256 | 1 | kvpush |" in (tmp_path / "results.md").read_text()
