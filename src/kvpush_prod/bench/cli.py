"""``kvpush bench``: side-by-side serving benchmark (default), ``report`` (redo the tables and
plots from results.json) and ``transfer`` (NIXL loopback push vs memcpy microbenchmark)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush_prod.bench.sides import DEFAULT_SIDES, FRONTENDS, SIDES

if TYPE_CHECKING:
    from kvpush_prod.bench.runner import BenchSettings

USAGE = """usage: kvpush bench [run options]        run the side-by-side benchmark (see --help)
       kvpush bench report --out DIR      rewrite DIR/results.md and DIR/plots/ from DIR/results.json
       kvpush bench transfer [options]    NIXL loopback push bandwidth/latency vs memcpy
"""


# --model-shape keys -> TinyModelSpec fields.
SHAPE_KEYS = {
    "layers": "num_layers",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
}


def _shape(text: str) -> dict[str, int]:
    """``layers=32,hidden=64``: TinyModelSpec fields; intermediate defaults to 2 x hidden."""
    out: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in SHAPE_KEYS or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r}: give KEY=N with N >= 1 and KEY one of "
                f"{', '.join(SHAPE_KEYS)} (e.g. layers=32,hidden=64)"
            )
        out[SHAPE_KEYS[key]] = int(value)
    if "hidden_size" in out:
        out.setdefault("intermediate_size", 2 * out["hidden_size"])
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 4,8, got {text!r}") from None
    if any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"rates must be > 0 requests per second, got {text!r}")
    return out


def _sides(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in SIDES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown side(s) {bad}; choose from {', '.join(SIDES)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpush bench",
        description="The same workload against a single engine, vLLM's NixlConnector (pull) "
        "and NixlPushConnector (push), each as shipped and with NIXL's busy-spinning progress "
        "thread neutralised, and kvpush. Cells already in OUT/results.json are skipped "
        "(resume), unless --force.",
    )
    _workload_args(p)
    _engine_args(p)
    _run_args(p)
    return p


def _workload_args(p: argparse.ArgumentParser) -> None:
    """Where results go, which sides, and the cells: lengths, concurrency, rates, requests."""
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="results folder: results.json, results.md, plots/ (default %(default)s)",
    )
    p.add_argument(
        "--sides",
        type=_sides,
        default=list(DEFAULT_SIDES),
        help=f"comma list (default all: {','.join(DEFAULT_SIDES)})",
    )
    p.add_argument(
        "--lengths",
        type=_ints,
        default=[256, 1024, 1900],
        help="prompt lengths in tokens (default 256,1024,1900)",
    )
    p.add_argument(
        "--concurrency", type=_ints, default=[1, 4, 16], help="concurrency levels (default 1,4,16)"
    )
    p.add_argument(
        "--rates",
        type=_floats,
        default=[],
        help="open-loop cells too: requests per second on a fixed schedule, the same for "
        "every side (e.g. 4,8); compares TPOT at the same offered load (default none)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=32,
        help="requests per cell, at least 2x the concurrency (default 32)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens (default 64)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up requests per prompt length")


def _engine_args(p: argparse.ArgumentParser) -> None:
    """How each side's engines are started and placed."""
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="start each side this many times, sides interleaved, and pool the requests of "
        "every round per cell: on a small box where the OS puts the engines' unpinned "
        "frontends moves TPOT by up to ~30%% from one start to the next (default 1)",
    )
    p.add_argument(
        "--frontends",
        choices=sorted(FRONTENDS),
        default="own",
        help="where each engine's API server and EngineCore run (its worker always runs on "
        "the engine's core): own = beside its worker, as if each engine had its own host; "
        "crossed = on the other engine's core (P's on 1, D's on 0); os = wherever the OS "
        "puts them (default %(default)s)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=32,
        help="engines' --max-num-seqs: above the top concurrency so it measures "
        "transfers, not queueing (default 32)",
    )
    p.add_argument("--block-size", type=int, default=None, help="KV block size (engine default)")
    p.add_argument(
        "--model-shape",
        type=_shape,
        default=None,
        metavar="KEY=N,...",
        help="the generated model's shape, e.g. layers=32,hidden=64,heads=4,kv_heads=2,"
        "head_dim=16 (keys: " + ", ".join(SHAPE_KEYS) + "; default: the lab's tiny Llama, "
        "2 layers)",
    )
    p.add_argument(
        "--fragment",
        type=int,
        default=0,
        metavar="N",
        help="before the measured cells, churn the KV cache that receives (D's, or the "
        "single engine's) N times over with requests of mixed lengths that end in scattered "
        "order, so its free blocks are no longer contiguous (default 0: a fresh cache)",
    )
    p.add_argument(
        "--staging-mib",
        type=int,
        default=0,
        metavar="MIB",
        help="kvpush's decode lands pushes in a staging area of this many MiB and copies "
        "them into its KV blocks (staging.receive_mib), and its prefill gathers scattered "
        "blocks into an area of this size before a WRITE (staging.send_mib); default 0: off",
    )
    p.add_argument(
        "--pthr-delay-us",
        type=int,
        default=1000,
        help="NIXL progress-thread delay given to vLLM's neutralised sides (default 1000)",
    )


def _run_args(p: argparse.ArgumentParser) -> None:
    """The client, the work folder, and what to run."""
    p.add_argument(
        "--client",
        choices=["vllm", "own"],
        default="vllm",
        help="vllm: vLLM bench serve's request function (default); own: kvpush_prod.lab.client",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="engine logs, traces and the model (default: OUT/work)",
    )
    p.add_argument("--force", action="store_true", help="rerun cells already in results.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the cells still to run and a wall-time estimate, run nothing",
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "report":
        return _report(args[1:])
    if args and args[0] == "transfer":
        from kvpush_prod.bench.transfer import main as transfer_main

        return transfer_main(args[1:])
    if args and args[0] in ("help",):
        print(USAGE)
        return 0
    a = build_parser().parse_args(args)
    from kvpush_prod.bench.runner import ResultStore, cell_key, estimate_wall_s, plan

    settings = _settings(a, args)
    if a.plan:
        todo = plan(ResultStore(a.out / "results.json"), settings)
        for side, cells in todo.items():
            print(f"{side}: {', '.join(cell_key(*c) for c in cells)}")
        print(f"about {estimate_wall_s(todo, settings.workload) / 60:.0f} min")
        return 0
    if a.rounds < 1:
        print(f"kvpush bench: --rounds {a.rounds}: give 1 or more", file=sys.stderr)
        return 2
    if a.fragment < 0:
        print(
            f"kvpush bench: --fragment {a.fragment}: give 0 (a fresh cache) or the number "
            "of times the decode's KV cache is churned",
            file=sys.stderr,
        )
        return 2
    if max(a.concurrency) > a.max_num_seqs:
        print(
            f"kvpush bench: --max-num-seqs {a.max_num_seqs} is below concurrency "
            f"{max(a.concurrency)}: that would measure queueing",
            file=sys.stderr,
        )
        return 2
    from kvpush_prod.bench.report import markdown, write_all
    from kvpush_prod.bench.runner import run

    store = run(settings)
    paths = write_all(store.data, a.out)
    print(markdown(store.data))
    print("wrote " + ", ".join(str(p) for p in [a.out / "results.json", *paths]))
    return 0


def _report(args: list[str]) -> int:
    """``kvpush bench report``: the tables and plots again from a results file."""
    rp = argparse.ArgumentParser(prog="kvpush bench report")
    rp.add_argument("--out", type=Path, default=Path("bench-results"))
    a = rp.parse_args(args)
    from kvpush_prod.bench.report import write_all

    data = json.loads((a.out / "results.json").read_text())
    for path in write_all(data, a.out):
        print(path)
    return 0


def _settings(a: argparse.Namespace, args: list[str]) -> BenchSettings:
    """The run's settings from the parsed command line (``args``, as given, for the record)."""
    from kvpush_prod.bench.runner import BenchSettings, Workload
    from kvpush_prod.bench.sides import SideSettings

    out: Path = a.out
    workdir = a.workdir or (out / "work")
    return BenchSettings(
        out=out,
        sides=a.sides,
        workload=Workload(
            lengths=a.lengths,
            concurrency=a.concurrency,
            requests=a.requests,
            max_tokens=a.max_tokens,
            warmup=a.warmup,
            rates=a.rates,
            rounds=a.rounds,
        ),
        side=SideSettings(
            workdir=workdir.resolve(),
            max_num_seqs=a.max_num_seqs,
            block_size=a.block_size,
            pthr_delay_us=a.pthr_delay_us,
            frontend_cores=dict(FRONTENDS[a.frontends]),
            model_shape=dict(a.model_shape or {}),
            fragment=a.fragment,
            kvpush_extra={"verify": {"checksums": False}}
            | (
                {"staging": {"receive_mib": a.staging_mib, "send_mib": a.staging_mib}}
                if a.staging_mib > 0
                else {}
            ),
        ),
        force=a.force,
        client=a.client,
        progress=not a.no_progress,
        command="kvpush bench " + " ".join(shlex.quote(x) for x in args),
    )
