"""The `preheat` command: dispatches to the engine server, the operator or the router.

Each program parses its own flags, so `preheat serve --help` and
`preheat operator --help` are complete and owned by the program they describe.
"""

from __future__ import annotations

import sys

USAGE = """usage: preheat {serve,operator,router} [options]

  serve      run the inference engine (OpenAI-compatible server)
  operator   run the Kubernetes operator for InferenceService resources
  router     run the cache-aware router in front of one InferenceService's engines

Run `preheat serve --help`, `preheat operator --help` or `preheat router --help` for
their options."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from preheat import __version__

        print(f"preheat {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "serve":
        from preheat.engine.serve.server_main import main as serve_main

        return serve_main(rest)
    if command == "operator":
        from preheat.operator.main import main as operator_main

        return operator_main(rest)
    if command == "router":
        from preheat.router.main import main as router_main

        return router_main(rest)
    print(f"preheat: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
