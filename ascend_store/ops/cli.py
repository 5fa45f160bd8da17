"""ascend-store: run and inspect a standalone local KV pool, check a --kv-transfer-config,
and benchmark an OpenAI server.

Exit codes: 0 done; 1 the command could not do its job (no pool or server answers, a
missing optional package, an invalid config); 2 bad command line or input file; 130
interrupted; 141 its output went to a pipe that was closed (| head). Every failure a user
can cause prints one paragraph to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict

from ascend_store.backends.local.pool_config import DISK_CODECS
from ascend_store.common.config import ConfigError, StoreConfig, default_socket_path
from ascend_store.ops.pool_commands import gc, query_pool, serve
from ascend_store.ops.user_error import EXIT_BROKEN_PIPE, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UserError


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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ascend-store")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        return "unknown (not installed)"


def _parser() -> _Parser:
    p = _Parser(prog="ascend-store", description=__doc__)
    p.add_argument("--version", action="version", version=f"ascend-store {_version()}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    pool = sub.add_parser("pool", help="run, inspect and clean up a standalone local pool",
                          description="A standalone local pool: one process that engines on this host "
                          "share through a Unix socket (engines with start: auto launch an embedded "
                          "one themselves when none answers).")
    pool_sub = pool.add_subparsers(dest="pool_cmd", metavar="POOL_COMMAND", parser_class=_Parser)

    serve = pool_sub.add_parser("serve", help="run a standalone pool in the foreground",
                                description="Run a standalone pool in the foreground until SIGTERM or "
                                "Ctrl-C. Its arena lives in /dev/shm (or beside the socket when "
                                "/dev/shm is too small); it logs to stderr. The socket's directory is "
                                "created 0700; an existing one must be this user's, with mode 0700.")
    _socket_arg(serve)
    serve.add_argument("--capacity", default="8GiB", metavar="SIZE",
                       help="arena size, like 64GiB or 512MB; refused above the machine's memory "
                       "unless --force")
    serve.add_argument("--lease-ttl", type=_seconds, default=30.0, metavar="SECONDS",
                       help="a reader's lease on an object expires after this long, once the "
                       "reader's process is gone (a live reader keeps it until it releases it)")
    serve.add_argument("--idle-exit", type=_seconds, default=None, metavar="SECONDS",
                       help="exit this long after the last client process has gone (how engines "
                       "run the pool they start; default: run until stopped)")
    serve.add_argument("--disk-path", default=None, metavar="DIR",
                       help="a disk tier: objects evicted from memory go to files in this directory "
                       "(created 0700; one pool per directory) and are read back when hit; they "
                       "survive a restart (default: no disk tier)")
    serve.add_argument("--disk-capacity", default="64GiB", metavar="SIZE",
                       help="how much the disk tier may hold, like 500GiB")
    serve.add_argument("--disk-codec", default="raw", choices=DISK_CODECS,
                       help="how the disk tier stores attention pages: as they are, or as INT8 with "
                       "a scale per 32 values (a quarter of fp32, half of bf16; lossy: engines that "
                       "ask for lossless KV refuse what comes back; docs/codecs.md)")
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

    check = sub.add_parser(
        "check-config", help="validate a --kv-transfer-config as an engine's start-up does",
        description="Validate the value an engine gets as --kv-transfer-config with the checks vLLM "
        "runs at start-up when this connector is installed (vLLM's own fields, then "
        "kv_connector_extra_config), for this machine's device. Prints the resolved config as "
        "JSON, every key with its value or default (exit 0), or the one error message (exit 1; "
        "2 when the JSON cannot be read). Loads vLLM's config code, which takes seconds.")
    check.add_argument("config", metavar="JSON", help="the whole --kv-transfer-config value, or @FILE "
                       "to read it from a file")

    from ascend_store.ops.bench.workloads import WORKLOADS, Shape

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


def _read_config(arg: str) -> dict:
    """``check-config``'s JSON: given inline, or ``@FILE``."""
    where, text = (arg[1:], None) if arg.startswith("@") else ("the argument", arg)
    try:
        if text is None:
            with open(where) as f:
                text = f.read()
        raw = json.loads(text)
    except OSError as exc:
        raise UserError(f"ascend-store check-config: cannot read {where}: {exc.strerror}", EXIT_USAGE) \
            from None
    except ValueError as exc:  # a file that is not text, too
        raise UserError(f"ascend-store check-config: {where} is not JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(raw, dict):
        raise UserError(f"ascend-store check-config: {where} must be a JSON object like "
                        f"{{\"kv_connector\": ...}}, got {type(raw).__name__}", EXIT_USAGE)
    return raw


def _check_config(args) -> int:
    from ascend_store.ops.plugin import check_engine_args, names_this_connector

    raw = _read_config(args.config)
    logging.getLogger("vllm").setLevel(logging.ERROR)  # its import's notes are not about the config
    if not names_this_connector(raw):
        raise UserError(f"ascend-store check-config: kv_connector {raw.get('kv_connector')!r} (module "
                        f"{raw.get('kv_connector_module_path')!r}) is not AscendStoreConnector of "
                        "ascend_store: an engine would not load this connector")
    try:
        check_engine_args(raw)  # what the plugin runs in vLLM's start-up
    except ConfigError as exc:
        raise UserError(" ".join(str(exc).split())) from None  # pydantic's message spans lines
    from vllm.config import KVTransferConfig  # imported by the check: vLLM's defaults, resolved

    ktc = KVTransferConfig(**raw)
    out = {k: getattr(ktc, k) for k in ("kv_connector", "kv_connector_module_path", "kv_role",
                                        "kv_load_failure_policy")}
    out["kv_connector_extra_config"] = asdict(StoreConfig.parse(ktc.kv_connector_extra_config))
    print(json.dumps(out, indent=2))
    from vllm.platforms import current_platform  # copy_path auto's rules depend on the device

    print(f"ascend-store check-config: valid for an engine on this machine ({current_platform.device_type})",
          file=sys.stderr)
    return 0


def _bench(args) -> int:
    from ascend_store.ops.bench import report
    from ascend_store.ops.bench.client import BenchError, Server, run
    from ascend_store.ops.bench.workloads import WORKLOADS, Shape, WorkloadError

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
            choices = "serve, status, inspect or gc" if args.cmd else "pool, check-config or bench"
            raise UserError(f"{prog}: choose a command: {choices} (see '{prog} --help')", EXIT_USAGE)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        run = {"bench": _bench, "check-config": _check_config}.get(args.cmd) \
            or {"serve": serve, "gc": gc}.get(args.pool_cmd, query_pool)
        code = run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in Python's own flush at exit
        return code
    except BrokenPipeError:  # the reader went (| head): stop quietly, as tools stopped by SIGPIPE do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
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
