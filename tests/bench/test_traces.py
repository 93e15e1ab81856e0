"""KV transfer phases from kvpush's per-process traces."""

from __future__ import annotations

import json

import pytest

from kvpush_prod.bench.traces import read_events, transfer_times


def _write(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"cut off')


def test_transfer_phases_line_up_p_and_d_traces(tmp_path):
    _write(
        tmp_path / "kvpush-producer-1.jsonl",
        [
            {"t": 10.000, "e": "blocks_ready", "tid": "a"},
            {"t": 10.0002, "e": "post", "tid": "a"},
            {"t": 10.0005, "e": "transfer_done", "tid": "a"},
            {"t": 20.0, "e": "blocks_ready", "tid": "late"},
        ],
    )
    _write(
        tmp_path / "kvpush-consumer-2.jsonl",
        [
            {"t": 9.9, "e": "recv_spec", "tid": "a"},
            {"t": 10.0006, "e": "done_in", "tid": "a"},
            {"t": 10.0007, "e": "report", "tid": "a"},
        ],
    )
    events = read_events(tmp_path)
    times = transfer_times(events, since=0.0, until=15.0)
    assert set(times) == {"a"}  # the window keeps the cell's transfers only
    a = times["a"]
    assert a["kv_ready_to_d_knows"] == pytest.approx(0.0007)
    assert a["ready_to_post"] == pytest.approx(0.0002)
    assert a["post_to_done"] == pytest.approx(0.0003)
    assert a["done_to_report"] == pytest.approx(0.0001)
    assert a["register_lead"] == pytest.approx(0.1)


def test_missing_folder_has_no_events(tmp_path):
    assert read_events(tmp_path / "nope") == []
