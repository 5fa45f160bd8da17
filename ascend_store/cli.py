"""``ascend-store`` command line: run and inspect a standalone local pool; benchmark a server."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ascend_store.config import ConfigError, LocalPoolConfig, default_socket_path, parse_size


def _pool_cfg(args) -> LocalPoolConfig:
    return LocalPoolConfig(socket=args.socket, start="never")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ascend-store", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pool = sub.add_parser("pool", help="the embedded local pool").add_subparsers(
        dest="pool_cmd", required=True)
    serve = pool.add_parser("serve", help="run a standalone pool in the foreground")
    serve.add_argument("--socket", default=default_socket_path())
    serve.add_argument("--capacity", default="8GiB")
    serve.add_argument("--lease-ttl", type=float, default=30.0)
    serve.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    for name, text in (("status", "occupancy and counters"), ("inspect", "list stored keys")):
        sp = pool.add_parser(name, help=text)
        sp.add_argument("--socket", default=default_socket_path())
        if name == "inspect":
            sp.add_argument("--prefix", default="")
    bench = sub.add_parser("bench", help="shared-prefix TTFT benchmark against a vLLM OpenAI server")
    bench.add_argument("--url", default="http://127.0.0.1:8000")
    bench.add_argument("--docs", type=int, default=4)
    bench.add_argument("--questions", type=int, default=3)
    bench.add_argument("--doc-tokens", type=int, default=1024)
    bench.add_argument("--vocab", type=int, default=500, help="token ids are drawn below this")
    bench.add_argument("--plot", default="ttft.png", help="PNG path ('' for none)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    if args.cmd == "bench":
        from ascend_store import bench as b

        prompts = b.shared_prefix_workload(args.docs, args.questions, args.doc_tokens, vocab=args.vocab)
        samples = b.run(args.url, prompts)
        print(b.summary(samples))
        if args.plot:
            b.plot(samples, args.plot)
            print(f"plot written to {args.plot}")
        return 0

    if args.pool_cmd == "serve":
        from ascend_store.backends.local.server import serve as run_server

        try:
            capacity = parse_size(args.capacity, "--capacity")
        except ConfigError as exc:
            p.error(str(exc))
        run_server(args.socket, capacity, lease_ttl_s=args.lease_ttl, parent_pid=args.parent_pid)
        return 0

    from ascend_store.backends.base import BackendUnavailable
    from ascend_store.backends.local.client import LocalBackend

    client = LocalBackend(_pool_cfg(args), timeout_s=2.0, map_arena=False)
    try:
        out = client.stats() if args.pool_cmd == "status" else [
            {"key": k, "bytes": n, "ready": r, "leases": le} for k, n, r, le in client.list(args.prefix)]
    except BackendUnavailable as exc:
        print(f"ascend-store: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
