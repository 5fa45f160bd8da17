"""A minimal prefill/decode proxy for OpenAI completions (example, not for production).

Each request goes to the prefill instance with max_tokens=1 (it computes the prompt and
saves its KV to the pool), then to the decode instance (which loads the KV from the pool
and generates), marked ``kv_transfer_params: {"ascend_store_prefilled": true}`` (read by
a decode instance with ``consumer_wait_s``; docs/pd-disaggregation.md). Standard library only.

    python deploy/proxy.py --prefill http://prefill:8000 --decode http://decode:8000 --port 9000
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(prefill: str, decode: str, timeout: float):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            warm = {**body, "max_tokens": 1, "stream": False}
            self._forward(prefill, warm).read()
            # Tell decode that a producer computed this prompt: with ``consumer_wait_s`` it
            # waits for objects still being committed instead of recomputing them.
            params = {**(body.get("kv_transfer_params") or {}), "ascend_store_prefilled": True}
            with self._forward(decode, {**body, "kv_transfer_params": params}) as r:
                self.send_response(r.status)
                self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
                self.end_headers()
                for chunk in r:
                    self.wfile.write(chunk)

        def _forward(self, base: str, body: dict):
            req = urllib.request.Request(base.rstrip("/") + self.path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            return urllib.request.urlopen(req, timeout=timeout)

        def do_GET(self):  # /v1/models and the like come from the decode instance
            with urllib.request.urlopen(decode.rstrip("/") + self.path, timeout=timeout) as r:
                self.send_response(r.status)
                self.end_headers()
                self.wfile.write(r.read())

    return Handler


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args()
    ThreadingHTTPServer((a.host, a.port), make_handler(a.prefill, a.decode, a.timeout)).serve_forever()
