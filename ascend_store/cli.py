"""ascend-store: run and inspect a standalone local KV pool, and benchmark an OpenAI server.

Exit codes: 0 done; 1 the command could not do its job (no pool or server answers, a
missing optional package); 2 bad command line or input file; 130 interrupted. Every
failure a user can cause prints one paragraph to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ascend_store.config import ConfigError, LocalPoolConfig, default_socket_path, parse_size

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
GIB = 2**30


class UserError(Exception):
    """A failure the user can fix: printed as one paragraph, exit ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


class _Formatter(argparse.HelpFormatter):
    """Shows every option's default (when it has one) and keeps the description's paragraphs."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if action.option_strings and not (d is None or d is False or d == "" or d is argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text

    def _fill_text(self, text, width, indent):
        return "\n\n".join(super(_Formatter, self)._fill_text(para, width, indent)
                           for para in text.strip().split("\n\n"))


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's usage + error, folded into one paragraph
        raise UserError(f"{self.prog}: {message} (see '{self.prog} --help')", EXIT_USAGE)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _count_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else _count(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _socket_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", default=default_socket_path(), metavar="PATH",
                   help="the pool's Unix socket (engines use the same default)")


def _parser() -> _Parser:
    p = _Parser(prog="ascend-store", description=__doc__)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    pool = sub.add_parser("pool", help="run, inspect and clean up a standalone local pool",
                          description="A standalone local pool: one process that engines on this host "
                          "share through a Unix socket (engines with start: auto launch an embedded "
                          "one themselves when none answers).")
    pool_sub = pool.add_subparsers(dest="pool_cmd", metavar="POOL_COMMAND", parser_class=_Parser)

    serve = pool_sub.add_parser("serve", help="run a standalone pool in the foreground",
                                description="Run a standalone pool in the foreground until SIGTERM or "
                                "Ctrl-C. Its arena lives in /dev/shm (or beside the socket when "
                                "/dev/shm is too small); it logs to stderr.")
    _socket_arg(serve)
    serve.add_argument("--capacity", default="8GiB", metavar="SIZE",
                       help="arena size, like 64GiB or 512MB; refused above the machine's memory "
                       "unless --force")
    serve.add_argument("--lease-ttl", type=_seconds, default=30.0, metavar="SECONDS",
                       help="a reader's lease on an object expires after this long")
    serve.add_argument("--disk-path", default=None, metavar="DIR",
                       help="a disk tier: objects evicted from memory go to files in this directory "
                       "(created 0700; one pool per directory) and are read back when hit; they "
                       "survive a restart (default: no disk tier)")
    serve.add_argument("--disk-capacity", default="64GiB", metavar="SIZE",
                       help="how much the disk tier may hold, like 500GiB")
    serve.add_argument("--force", action="store_true",
                       help="create an arena larger than the machine's memory")
    serve.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)

    status = pool_sub.add_parser("status", help="print the pool's occupancy and counters as JSON",
                                 description="Print the pool's occupancy, evictions, leases and "
                                 "request counters as JSON.")
    _socket_arg(status)
    inspect = pool_sub.add_parser("inspect", help="list stored objects as JSON",
                                  description="List stored objects (key, bytes, ready, leases) as "
                                  "JSON, at most 10000.")
    _socket_arg(inspect)
    inspect.add_argument("--prefix", default="", help="only keys starting with this (default: all)")
    gc = pool_sub.add_parser("gc", help="remove arenas left by pools that are no longer running",
                             description="Remove arena files whose pool process is gone (a pool "
                             "killed with SIGKILL leaves its arena in /dev/shm) and print their paths.")
    gc.add_argument("--dir", default=None, metavar="DIR",
                    help="look only in this directory (default: where pools put arenas)")

    from ascend_store.bench.workloads import WORKLOADS, Shape

    d = Shape()
    bench = sub.add_parser(
        "bench", help="run a named workload against an OpenAI server and report TTFT and pool hits",
        description="Send a named workload to an OpenAI-compatible server one request at a time "
        "(streaming), print a progress bar and a summary table (per phase, pool hits vs misses), and "
        "optionally write JSON and a PNG plot. Pool tokens come from the server's "
        "vllm:external_prefix_cache_hits_total counter.")
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    bench.add_argument("--workload", choices=list(WORKLOADS), default="shared-prefix",
                       help="shared-prefix: documents each asked several questions; long-doc-qa and "
                       "multi-round-qa: LMCache's shapes; multi-turn: vLLM's conversation JSON")
    bench.add_argument("--json", metavar="PATH", help="write the summary and every request's numbers here")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG of TTFT per request and per phase "
                       "(needs ascend-store[bench])")
    bench.add_argument("--timeout", type=_seconds, default=300.0, metavar="SECONDS",
                       help="per HTTP request")
    shape = bench.add_argument_group("workload shape (each workload reads the options it names)")
    for flag, help_text in (
            ("--docs", "documents (shared-prefix, long-doc-qa)"),
            ("--doc-tokens", "tokens per document (shared-prefix, long-doc-qa)"),
            ("--questions", "questions per document (shared-prefix)"),
            ("--question-tokens", "tokens per question (all but multi-turn)"),
            ("--repeat-count", "times each document is queried after the warm-up (long-doc-qa)"),
            ("--users", "users (multi-round-qa)"),
            ("--rounds", "rounds (multi-round-qa)"),
            ("--system-tokens", "shared system prompt tokens (multi-round-qa)"),
            ("--user-tokens", "per-user context tokens (multi-round-qa)"),
            ("--output-tokens", "max_tokens of every request; also the answer length in a "
             "multi-round-qa history"),
            ("--vocab", "prompt token ids are drawn from [2, VOCAB)")):
        shape.add_argument(flag, type=_count, default=getattr(d, flag[2:].replace("-", "_")),
                           metavar="N", help=help_text)
    shape.add_argument("--repeat-mode", choices=("tile", "interleave", "random"), default=d.repeat_mode,
                       help="query order (long-doc-qa)")
    shape.add_argument("--conversations", metavar="FILE",
                       help="vLLM multi-turn JSON: [{\"id\": ..., \"messages\": [{\"role\", \"content\"}]}] "
                       "(multi-turn; required there)")
    shape.add_argument("--max-turns", type=_count_or_zero, default=d.max_turns, metavar="N",
                       help="user turns per conversation, 0 for all (multi-turn)")
    shape.add_argument("--seed", type=int, default=d.seed, metavar="N", help="seed of the drawn token ids")
    return p


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_capacity(text: str, force: bool, memory: int | None) -> int:
    """The arena size in bytes; refused above ``memory`` bytes unless ``force``."""
    try:
        capacity = parse_size(text, "--capacity")
    except ConfigError as exc:
        raise UserError(f"ascend-store pool serve: {exc}", EXIT_USAGE) from None
    if memory and capacity > memory and not force:
        raise UserError(f"ascend-store pool serve: --capacity {text} is {capacity / GIB:.1f} GiB but this "
                        f"machine has {memory / GIB:.1f} GiB of memory; the pool would swap or be killed "
                        "when it fills. Give a smaller --capacity, or pass --force to create it anyway.",
                        EXIT_USAGE)
    return capacity


def _serve(args) -> int:
    from ascend_store.backends.local.launcher import ping
    from ascend_store.backends.local.server import serve

    capacity = check_capacity(args.capacity, args.force, _mem_total())
    try:
        disk_capacity = parse_size(args.disk_capacity, "--disk-capacity")
    except ConfigError as exc:
        raise UserError(f"ascend-store pool serve: {exc}", EXIT_USAGE) from None
    running = ping(args.socket)
    if running:
        raise UserError(f"ascend-store pool serve: a pool already answers at {args.socket} "
                        f"(pid {running.get('pid', '?')}); stop it first or give another --socket.")
    try:
        serve(args.socket, capacity, lease_ttl_s=args.lease_ttl, parent_pid=args.parent_pid,
              disk_path=args.disk_path, disk_capacity=disk_capacity)
    except OSError as exc:
        raise UserError(f"ascend-store pool serve: cannot create the pool at {args.socket}: {exc}") from None
    return 0


def _query_pool(args) -> int:
    from ascend_store.backends.base import BackendUnavailable
    from ascend_store.backends.local.client import LocalBackend

    client = LocalBackend(LocalPoolConfig(socket=args.socket, start="never"), timeout_s=2.0, map_arena=False)
    try:
        out = client.stats() if args.pool_cmd == "status" else [
            {"key": k, "bytes": n, "ready": r, "leases": le} for k, n, r, le in client.list(args.prefix)]
    except BackendUnavailable as exc:
        raise UserError(f"ascend-store pool {args.pool_cmd}: {exc}. Start one with 'ascend-store pool "
                        f"serve --socket {args.socket}', or give the --socket an engine uses.") from None
    finally:
        client.close()
    print(json.dumps(out, indent=2))
    return 0


def _gc(args) -> int:
    from ascend_store.backends.local.launcher import gc_arenas

    try:
        removed = gc_arenas(args.dir)
    except OSError as exc:
        raise UserError(f"ascend-store pool gc: {exc}") from None
    for path in removed:
        print(path)
    print(f"removed {len(removed)} arena(s)", file=sys.stderr)
    return 0


def _bench(args) -> int:
    from ascend_store.bench import report
    from ascend_store.bench.client import BenchError, Server, run
    from ascend_store.bench.workloads import WORKLOADS, Shape, WorkloadError

    if not args.url.startswith(("http://", "https://")):
        raise UserError(f"ascend-store bench: --url must start with http:// or https://, got {args.url!r}",
                        EXIT_USAGE)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UserError(f"ascend-store bench: {flag} {path}: its directory does not exist", EXIT_USAGE)
    if args.plot and (why := report.check_plot_support()):
        raise UserError(f"ascend-store bench: {why}")
    shape = Shape(**{k: getattr(args, k) for k in Shape.__dataclass_fields__})
    try:
        workload = WORKLOADS[args.workload](shape)
    except WorkloadError as exc:
        raise UserError(f"ascend-store bench: {exc}", EXIT_USAGE) from None
    try:
        server = Server(args.url, timeout_s=args.timeout)
        samples = run(server, workload)
    except BenchError as exc:
        raise UserError(f"ascend-store bench: {exc}") from None
    rows = report.summarize(samples)
    print(f"{workload.name} against {server.base} ({server.model})")
    print(report.table(rows))
    if args.json:
        meta = {"workload": workload.name, "url": server.base, "model": server.model, "shape": vars(shape)}
        report.write_json(args.json, meta, rows, samples)
        print(f"JSON written to {args.json}")
    if args.plot:
        report.plot(samples, rows, f"{workload.name}: {server.model}", args.plot)
        print(f"plot written to {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.cmd is None or (args.cmd == "pool" and args.pool_cmd is None):
            prog = "ascend-store" + (" pool" if args.cmd else "")
            choices = "serve, status, inspect or gc" if args.cmd else "pool or bench"
            raise UserError(f"{prog}: choose a command: {choices} (see '{prog} --help')", EXIT_USAGE)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        if args.cmd == "bench":
            return _bench(args)
        return {"serve": _serve, "gc": _gc}.get(args.pool_cmd, _query_pool)(args)
    except UserError as exc:
        print(str(exc), file=sys.stderr)
        return exc.code
    except OSError as exc:  # an output path (--json, --plot) that cannot be written
        print(f"ascend-store: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
