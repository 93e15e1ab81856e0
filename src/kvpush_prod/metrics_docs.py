"""The catalogue of every series kvpush-prod exports (the connector's and the router's) and
``docs/metrics.md`` rendered from it, so the doc cannot drift (tests/ops/test_docs.py).

``python -m kvpush_prod.metrics_docs > docs/metrics.md`` regenerates it.
"""

from __future__ import annotations

import sys

from prometheus_client import CollectorRegistry

from kvpush_prod.metrics import (
    CONNECTOR_SERIES,
    LABELS,
    OUTCOME_GROUPS,
    ROUTER_LABELS,
    SCRAPE_LABELS,
    SECONDS_BUCKETS,
    TABLES,
    VLLM_LABELS,
    Series,
    exported_name,
)
from kvpush_prod.router.metrics import ROUTER_TABLES, Outcome, RouterMetrics
from kvpush_prod.router.types import Role


def router_series() -> tuple[Series, ...]:
    """The router's ``kvpush_router_*`` series, read from ``RouterMetrics`` itself."""
    rm = RouterMetrics(registry=CollectorRegistry())
    out = []
    for metric in vars(rm).values():
        kind = getattr(metric, "_type", None)
        if kind not in ("counter", "gauge", "histogram"):
            continue
        labels = tuple(metric._labelnames)
        values: dict[str, tuple[str, ...]] = {}
        if "outcome" in labels:
            values["outcome"] = tuple(o.value for o in Outcome)
        if "role" in labels:
            values["role"] = tuple(r.value for r in Role)
        if "table" in labels:
            values["table"] = tuple(ROUTER_TABLES)
        buckets = tuple(b for b in getattr(metric, "_upper_bounds", ()) if b != float("inf"))
        # Retries happen only when a backend failed; every other series has samples as
        # soon as the router has served a request (or probed its backends).
        healthy = metric._name != "kvpush_router_retries"
        out.append(
            Series(
                metric._name,
                kind,
                metric._documentation,
                labels,
                buckets or SECONDS_BUCKETS,
                tuple(values.items()),
                "router",
                healthy,
            )
        )
    return tuple(sorted(out, key=lambda s: s.name))


def all_series() -> tuple[Series, ...]:
    """Every series kvpush-prod exports: the connector's, then the router's."""
    return CONNECTOR_SERIES + router_series()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


EXAMPLE_QUERIES: tuple[tuple[str, str], ...] = (
    (
        "Transfers per second by outcome (decode side)",
        'sum by (outcome) (rate(kvpush_transfers_total{role="consumer"}[5m]))',
    ),
    (
        "Share of transfers that did not push (fallback, recompute, failure)",
        'sum(rate(kvpush_transfers_total{role="consumer",outcome!~"pushed|retried|prefix_hit"}'
        '[5m])) / sum(rate(kvpush_transfers_total{role="consumer"}[5m]))',
    ),
    ("KV bytes pushed per second", 'sum(rate(kvpush_transfer_bytes_total{role="producer"}[5m]))'),
    (
        "Transfer time p99 (producer: blocks ready to last WRITE done)",
        "histogram_quantile(0.99, sum by (le) "
        '(rate(kvpush_transfer_seconds_bucket{role="producer"}[5m])))',
    ),
    (
        "Decode prompt tokens that came over the wire vs computed locally",
        "sum by (source) (rate(vllm:prompt_tokens_by_source_total[5m]))",
    ),
    (
        "Router TTFT p99",
        "histogram_quantile(0.99, sum by (le) (rate(kvpush_router_ttft_seconds_bucket[5m])))",
    ),
)


def _codes(names: tuple[str, ...]) -> str:
    return " and ".join(f"`{n}`" for n in names)


METRICS_INTRO = f"""\
Every series is named in `src/kvpush_prod/metrics.py` (`CONNECTOR_SERIES`) or
`src/kvpush_prod/router/metrics.py` (`RouterMetrics`); `all_series()` in
`src/kvpush_prod/metrics_docs.py` lists both.
Names follow `kvpush_<noun>_<unit>`; labels are few and bounded (never a request id).

**Where they appear.** The connector's series are on each vLLM engine's own `/metrics`
(the API server): the connector buffers observations in its engine processes, vLLM carries
them to the API server, and `MetricsSink` writes them. vLLM adds its labels
({_codes(VLLM_LABELS)}) to every connector series, and Prometheus adds
{_codes(SCRAPE_LABELS)} to every series. The router's series are on the router's
`/metrics`. vLLM carries the connector's observations with the outputs of an engine step,
so an idle engine (no request for a while) publishes nothing new: its gauges (held
blocks, table sizes, `kvpush_link_slow`, link bandwidth) keep the values of its last
step until a request makes it step again. Read a gauge together with the engine's
`vllm:num_requests_running` (0 and unchanged: the value is as old as the last request).

**How they are named on a scrape.** Counters gain `_total` (`kvpush_transfers` is scraped
as `kvpush_transfers_total`); histograms are scraped as `_bucket`, `_sum` and `_count`.
The tables give the scraped name.

**When they have samples.** A labelled series has no samples until its first observation.
The `samples` column says which series have samples on every healthy run (`every run`:
checked by `tests/e2e/test_metrics.py`) and which only after a fault or bad input
(`on faults`: retries, fallbacks, breaker trips, expired leases, rejected messages; absent
means zero). Alert rules in
`configs/prometheus/alerts.yaml` are written so that an absent series never fires; see
`docs/operations.md` for what each alert means and what to do.
"""


ACCOUNTING = f"""\
## Accounting: every transfer ends once

Per engine and role, once the engine is quiet (nothing in flight):

```
kvpush_transfers_started_total == sum over outcome of kvpush_transfers_total
                                  + kvpush_transfers_active
```

While transfers run, the two sides differ by at most the transfers in flight (times the
tensor-parallel size: see below). What counts:

- **Started.** P: a request whose kv_transfer_params ask for a push (`do_remote_decode`)
  and pass every check, when it arrives. D: a request whose params ask for a pull
  (`do_remote_prefill`) and pass every check, at its first admission ask, before any
  credit. A request whose params are refused (`kvpush_kv_params_rejected_total`: bad
  signature, replayed, a transfer id another live request holds, ...) never starts; a
  direct request (no params, or a probe) has no transfer.
- **Ended.** Each started transfer ends once in one `outcome` of `kvpush_transfers_total`.
  On D, a prefix hit (`prefix_hit`) or a transfer past the credit budget (`recompute`)
  ends at admission, a request aborted before its blocks were allocated ends `aborted`;
  a receive ends when the workers report it (with vLLM's `kv_load_failure_policy:
  recompute` a failed receive is counted `recompute`, else `failed`). On P, a request that
  ends before its prompt is computed ends `aborted`; a push ends when its send lease does.
- **Ranks.** A transfer handed to the engine's workers is ended by each tensor-parallel
  rank (each counts its outcome), so it is counted started once per rank.
- **Groups** (the chaos nemesis checks `started = pushed + pulled + recomputed + failed`):
{chr(10).join(f"  - {g}: " + ", ".join(f"`{o}`" for o in outs) for g, outs in OUTCOME_GROUPS.items())}
"""

TABLES_INTRO = """\
`kvpush_table_entries{role,table}` is the number of entries of each table an engine keeps
per request, transfer, peer or key; `kvpush_table_capacity` its bound where it has one of
its own. Scheduler-side tables are measured at each engine step, worker-side ones (per
rank; with tensor parallelism the rank that reported last) at least once a second and at
each step with nothing in flight. On a long run each should be flat across quiet windows;
one that grows with time (not with load) is a leak.
"""


def _series_row(s: Series) -> str:
    labels = ", ".join(f"`{label}`" for label in s.labels) or "-"
    meaning = s.doc
    closed = [(label, vals) for label, vals in s.values if label not in ("role", "table")]
    if closed:
        meaning += (
            " "
            + "; ".join(
                f"`{label}`: " + ", ".join(f"`{v}`" for v in vals) for label, vals in closed
            )
            + "."
        )
    samples = "every run" if s.healthy else "on faults"
    return f"| `{exported_name(s)}` | {s.kind} | {labels} | {samples} | {_cell(meaning)} |"


def render_metrics_doc() -> str:
    """docs/metrics.md, from the series tables."""
    series = all_series()
    out = [
        "# Metrics",
        "",
        "<!-- Generated from src/kvpush_prod/metrics.py by "
        "`python -m kvpush_prod.metrics_docs > docs/metrics.md`.",
        "     tests/ops/test_docs.py keeps this file equal to that output: edit the series "
        "tables, then regenerate. -->",
        "",
        METRICS_INTRO,
        "## Labels",
        "",
        "Connector series:",
        "",
        "| label | meaning |",
        "|---|---|",
    ]
    out += [f"| `{k}` | {_cell(v)} |" for k, v in LABELS.items()]
    out += ["", "Router series:", "", "| label | meaning |", "|---|---|"]
    out += [f"| `{k}` | {_cell(v)} |" for k, v in ROUTER_LABELS.items()]
    for title, where, source in (
        ("Connector series", "on each engine's vLLM `/metrics`", "connector"),
        ("Router series", "on the router's `/metrics`", "router"),
    ):
        out += [
            "",
            f"## {title}",
            "",
            f"Exported {where}.",
            "",
            "| series | type | labels | samples | meaning |",
            "|---|---|---|---|---|",
        ]
        out += [_series_row(s) for s in series if s.source == source]
    out += ["", ACCOUNTING, "## Tables", "", TABLES_INTRO, "| table | one entry is |", "|---|---|"]
    out += [f"| `{name}` | {_cell(meaning)} |" for name, meaning in TABLES.items()]
    out += ["", "The router's (`kvpush_router_table_entries{table}`):", ""]
    out += ["| table | one entry is |", "|---|---|"]
    out += [f"| `{name}` | {_cell(meaning)} |" for name, meaning in ROUTER_TABLES.items()]
    out += ["", "## Example queries", ""]
    for title, query in EXAMPLE_QUERIES:
        out += [f"{title}:", "", "```promql", query, "```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render_metrics_doc())
