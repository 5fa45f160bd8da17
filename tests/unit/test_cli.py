"""The command line as a user meets it: every subcommand's --help, and every documented bad
input (docs/troubleshooting.md, "Command line") gives one paragraph on stderr, no
traceback, and the documented exit code."""

from __future__ import annotations

import argparse
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from ascend_store import cli
from ascend_store.backends.local.launcher import ping

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SUBCOMMANDS = [[], ["pool"], ["pool", "serve"], ["pool", "status"], ["pool", "inspect"], ["pool", "gc"],
               ["bench"]]


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ascend_store.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": REPO, **(env or {})})


def _assert_one_paragraph(out: subprocess.CompletedProcess, code: int, *words: str) -> None:
    err = out.stderr.strip()
    assert out.returncode == code, (out.returncode, err)
    assert out.stdout == ""
    assert "Traceback" not in err and err.startswith("ascend-store")
    assert "\n" not in err, err  # one paragraph: a single (long) line, wrapped by the terminal
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("sub", SUBCOMMANDS, ids=lambda s: " ".join(s) or "top")
def test_help(sub):
    out = _run(*sub, "--help")
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith(f"usage: {' '.join(['ascend-store', *sub])} ")


def _subparsers(p: argparse.ArgumentParser):
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for child in a.choices.values():
                yield from _subparsers(child)


def test_every_option_has_help_and_shows_its_default():
    for p in _subparsers(cli._parser()):
        assert p.description, p.prog
        for a in p._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            assert a.help, (p.prog, a.option_strings)
            shown = p.formatter_class(p.prog)._get_help_string(a) % {"default": a.default}
            # Options without a value to show (flags, outputs written only when asked) say so in words.
            if a.default is not None and a.default is not False and a.default != "":
                assert f"(default: {a.default})" in shown, (p.prog, a.option_strings)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_error(404, "no such page")  # a multi-line HTML body

    def log_message(self, *args):
        pass


@pytest.fixture
def not_openai():
    """An HTTP server that answers 404 to everything (a wrong --url)."""
    srv = http.server.HTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


BAD = [  # (arguments, exit code, words the message must contain)
    ([], 2, ["choose a command"]),
    (["frob"], 2, ["invalid choice", "--help"]),
    (["pool"], 2, ["choose a command", "serve"]),
    (["pool", "serve", "--capacity", "lots"], 2, ["--capacity", "8GiB"]),
    (["pool", "serve", "--disk-capacity", "lots"], 2, ["--disk-capacity", "8GiB"]),
    (["pool", "serve", "--capacity", "100TiB"], 2, ["102400.0 GiB", "GiB of memory", "--force"]),
    (["pool", "serve", "--lease-ttl", "-1"], 2, ["--lease-ttl", "positive"]),
    (["pool", "status", "--socket", "{tmp}/none.sock"], 1, ["no pool", "pool serve"]),
    (["pool", "inspect", "--socket", "{tmp}/none.sock"], 1, ["no pool"]),
    (["bench", "--url", "http://127.0.0.1:{port}"], 1, ["cannot reach an OpenAI server", "refused"]),
    (["bench", "--url", "{not_openai}"], 1, ["HTTP 404", "no such page"]),
    (["bench", "--url", "localhost:8000"], 2, ["--url", "http://"]),
    (["bench", "--docs", "0"], 2, ["--docs", "at least 1"]),
    (["bench", "--workload", "nope"], 2, ["--workload", "long-doc-qa"]),
    (["bench", "--json", "{tmp}/no/such/dir/x.json"], 2, ["--json", "directory does not exist"]),
    (["bench", "--workload", "multi-turn"], 2, ["--conversations FILE"]),
    (["bench", "--workload", "multi-turn", "--conversations", "{tmp}/none.json"], 2, ["cannot read"]),
    (["bench", "--workload", "multi-turn", "--conversations", "{tmp}/bad.json"], 2, ["not JSON"]),
    (["bench", "--workload", "multi-turn", "--conversations", "{tmp}/shape.json"], 2,
     ["conversation c7", "'messages'"]),
]


@pytest.mark.parametrize("args,code,words", BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_input_is_one_paragraph(args, code, words, tmp_path, not_openai):
    (tmp_path / "bad.json").write_text("[{")
    (tmp_path / "shape.json").write_text(json.dumps([{"id": "c7", "messages": [{"role": "user"}]}]))
    fill = {"tmp": str(tmp_path), "port": str(_free_port()), "not_openai": not_openai}
    _assert_one_paragraph(_run(*[a.format(**fill) for a in args]), code, *words)


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    hidden = tmp_path / "hide" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    out = _run("bench", "--plot", str(tmp_path / "x.png"),
               env={"PYTHONPATH": os.pathsep.join([str(tmp_path / "hide"), REPO])})
    _assert_one_paragraph(out, 1, "matplotlib", "pip install 'ascend-store[bench]'")


def test_serve_refuses_a_socket_a_pool_answers_on(tmp_path):
    sock = str(tmp_path / "p" / "pool.sock")
    pool = subprocess.Popen([sys.executable, "-m", "ascend_store.cli", "pool", "serve", "--socket", sock,
                             "--capacity", "16MiB"], env={**os.environ, "PYTHONPATH": REPO},
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not ping(sock):
            assert pool.poll() is None and time.monotonic() < deadline, "pool did not start"
            time.sleep(0.05)
        _assert_one_paragraph(_run("pool", "serve", "--socket", sock, "--capacity", "16MiB"), 1,
                              "already answers", str(pool.pid))
        assert ping(sock)  # the running pool kept its socket
    finally:
        pool.terminate()
        pool.wait(10)


def test_capacity_check_names_both_numbers_and_force_overrides():
    with pytest.raises(cli.UserError) as exc:
        cli.check_capacity("3GiB", force=False, memory=2 * cli.GIB)
    assert "3.0 GiB" in str(exc.value) and "2.0 GiB" in str(exc.value) and exc.value.code == 2
    assert cli.check_capacity("3GiB", force=True, memory=2 * cli.GIB) == 3 * cli.GIB
    assert cli.check_capacity("1GiB", force=False, memory=2 * cli.GIB) == cli.GIB
