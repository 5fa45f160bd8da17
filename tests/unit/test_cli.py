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

from ascend_store.backends.local.launcher import ping
from ascend_store.ops import cli, pool_commands

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SUBCOMMANDS = [[], ["pool"], ["pool", "serve"], ["pool", "status"], ["pool", "inspect"], ["pool", "gc"],
               ["bench"]]


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ascend_store.ops.cli",
                           *args], capture_output=True, text=True,
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
            if not a.option_strings or a.help == argparse.SUPPRESS \
                    or isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
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
    pool = subprocess.Popen([sys.executable, "-m", "ascend_store.ops.cli", "pool", "serve", "--socket", sock,
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
    check, gib = pool_commands.check_capacity, pool_commands.GIB
    with pytest.raises(pool_commands.UserError) as exc:
        check("3GiB", force=False, memory=2 * gib)
    assert "3.0 GiB" in str(exc.value) and "2.0 GiB" in str(exc.value) and exc.value.code == 2
    assert check("3GiB", force=True, memory=2 * gib) == 3 * gib
    assert check("1GiB", force=False, memory=2 * gib) == gib


def test_version_is_the_installed_packages():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    out = _run("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"ascend-store {version}\n", "")


def _serve_until_it_answers_or_exits(sock: str) -> subprocess.CompletedProcess:
    """``pool serve`` on ``sock``: what it said if it exited, or the pool stopped once it answered."""
    proc = subprocess.Popen([sys.executable, "-m", "ascend_store.ops.cli", "pool", "serve", "--socket", sock,
                             "--capacity", "16MiB"], env={**os.environ, "PYTHONPATH": REPO},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while proc.poll() is None and not ping(sock) and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.terminate()
    out, err = proc.communicate(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("mode", [0o755, 0o500])
def test_serve_never_changes_the_mode_of_a_directory_it_did_not_create(sockdir, mode):
    d = os.path.join(sockdir, "mine")
    os.mkdir(d)
    os.chmod(d, mode)
    out = _serve_until_it_answers_or_exits(os.path.join(d, "pool.sock"))
    assert oct(os.stat(d).st_mode & 0o7777) == oct(mode)
    _assert_one_paragraph(out, 2, d, f"mode {mode:04o}", "chmod 700")
    assert os.listdir(d) == []


def test_serve_creates_a_missing_directory_private(sockdir):
    d = os.path.join(sockdir, "new", "dir")
    out = _serve_until_it_answers_or_exits(os.path.join(d, "pool.sock"))
    assert out.returncode == 0 and "pool serving on" in out.stderr, out.stderr  # until SIGTERM
    assert os.stat(d).st_mode & 0o777 == 0o700


def _stale_socket(path: str) -> None:
    """A socket file with no process behind it, as a pool killed with SIGKILL leaves."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()
    os.chmod(path, 0o600)


@pytest.mark.parametrize("cmd", ["status", "inspect"])
def test_a_stale_socket_is_no_pool(sockdir, cmd):
    sock = os.path.join(sockdir, "pool.sock")
    _stale_socket(sock)
    _assert_one_paragraph(_run("pool", cmd, "--socket", sock), 1, f"no pool at {sock}", "pool serve")


@pytest.mark.parametrize("path", ["none", "file"])
def test_gc_of_a_missing_directory_is_an_error(tmp_path, path):
    (tmp_path / "file").write_text("")
    _assert_one_paragraph(_run("pool", "gc", "--dir", str(tmp_path / path)), 2, "--dir", str(tmp_path / path))


@pytest.mark.parametrize("cmd", ["status", "inspect"])
def test_a_closed_pipe_is_quiet(pool, cmd):
    r, w = os.pipe()
    os.close(r)  # like `| head -c1` once head has exited
    try:
        out = subprocess.run([sys.executable, "-m", "ascend_store.ops.cli",
                              "pool", cmd, "--socket", pool.socket],
                             stdout=w, stderr=subprocess.PIPE, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": REPO})
    finally:
        os.close(w)
    assert (out.returncode, out.stderr) == (141, "")  # as a shell reports a tool SIGPIPE stopped


GOOD = {"kv_connector": "AscendStoreConnector", "kv_connector_module_path": "ascend_store.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": "local", "local": {"capacity": "1GiB"}}}


def _with(**extra) -> str:
    return json.dumps({**GOOD, "kv_connector_extra_config": {**GOOD["kv_connector_extra_config"], **extra}})


def _check(capsys, arg: str) -> tuple[int, str, str]:
    code = cli.main(["check-config", arg])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_config_prints_the_resolved_config(capsys, tmp_path):
    code, out, err = _check(capsys, json.dumps(GOOD))
    assert code == 0, err
    got = json.loads(out)
    assert got["kv_role"] == "kv_both" and got["kv_load_failure_policy"] == "recompute"
    extra = got["kv_connector_extra_config"]
    assert extra["local"]["capacity"] == 2**30  # parsed, and every key present with its default
    assert (extra["codec"], extra["use_layerwise"], extra["lookup_timeout_s"]) == ("raw", True, 0.2)
    # vLLM's own default policy ("fail") is what an engine would get when it is left out.
    no_policy = {k: v for k, v in GOOD.items() if k != "kv_load_failure_policy"}
    code, out, _ = _check(capsys, json.dumps(no_policy))
    assert code == 0 and json.loads(out)["kv_load_failure_policy"] == "fail"
    f = tmp_path / "ktc.json"
    f.write_text(json.dumps(GOOD))
    assert _check(capsys, f"@{f}")[:2] == (0, out.replace('"fail"', '"recompute"'))


CHECKS = [  # (JSON, exit code, words of the one message)
    (_with(local={"capasity": "1GiB"}), 1, ["local.capasity", "accepted keys in local", "capacity"]),
    (_with(codec="int4"), 1, ["codec", "int4", "int8"]),
    (_with(copy_path="batched", codec="zstd"), 1, ["copy_path", "zstd"]),
    (json.dumps({**GOOD, "kv_load_failure_policy": "fail",
                 "kv_connector_extra_config": {"copy_path": "batched"}}),
     1, ["kv_load_failure_policy", "recompute"]),
    (json.dumps({**GOOD, "kv_rol": "kv_both"}), 1, ["kv_rol"]),  # vLLM's own validation
    (json.dumps({**GOOD, "kv_role": "kv_bot"}), 1, ["kv_role", "kv_producer"]),
    (json.dumps({**GOOD, "kv_connector": "LMCacheConnectorV1"}), 1,
     ["AscendStoreConnector", "LMCacheConnectorV1"]),
    ('{"kv_connector": ', 2, ["not JSON"]),
    ('["AscendStoreConnector"]', 2, ["a JSON object"]),
    ("@{tmp}/none.json", 2, ["cannot read", "none.json"]),
]


@pytest.mark.parametrize("arg,code,words", CHECKS, ids=[f"check{i}" for i in range(len(CHECKS))])
def test_check_config_names_what_is_wrong(capsys, tmp_path, arg, code, words):
    got, out, err = _check(capsys, arg.replace("{tmp}", str(tmp_path)))
    assert (got, out) == (code, ""), err
    err = err.strip()
    assert err.startswith("ascend-store") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def test_check_config_as_a_command():
    """The installed command: JSON on stdout, nothing but vLLM's own start-up lines on stderr."""
    out = _run("check-config", json.dumps(GOOD))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kv_connector_extra_config"]["backend"] == "local"
    assert "Traceback" not in out.stderr


def test_commands_but_check_config_never_import_vllm(tmp_path):
    """vLLM's import takes seconds (torch); only check-config needs it, and only for valid JSON."""
    code = ("import sys; from ascend_store.ops import cli\n"
            "for argv in (['--version'], ['pool', 'gc', '--dir', sys.argv[1]], ['check-config', '{'],\n"
            "             ['pool', 'status', '--socket', sys.argv[1] + '/none.sock'],\n"
            "             ['pool', 'serve', '--capacity', '100TiB'], ['bench', '--url', 'http://127.0.0.1:1']):\n"
            "    try:\n"
            "        cli.main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", (out.stdout, out.stderr)
