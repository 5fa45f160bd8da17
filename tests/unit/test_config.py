"""StoreConfig / LocalPoolConfig parsing: defaults, unknown keys, bad values, sizes."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest

from ascend_store.common.config import (
    ConfigError,
    LocalPoolConfig,
    StoreConfig,
    check_transfer_config,
    default_socket_path,
    parse_size,
)


def test_defaults_from_none_and_empty():
    for raw in (None, {}):
        cfg = StoreConfig.parse(raw)
        assert cfg.backend == "local"
        assert cfg.use_layerwise is True
        assert cfg.chunk_size is None
        assert cfg.verify_checksum is True
        assert cfg.timeout_s > 0 and cfg.load_timeout_s > 0
        assert cfg.local.start == "auto"
        assert cfg.local.socket == os.path.abspath(default_socket_path())
        assert cfg.local.capacity > 0


def test_values_are_read():
    cfg = StoreConfig.parse({
        "use_layerwise": False, "chunk_size": 64, "timeout_s": 2, "load_timeout_s": 1.5,
        "verify_checksum": False, "async_load": False, "commit_before_reply": False,
        "save_decode_cache": True,
        "local": {"socket": "rel/pool.sock", "capacity": "1GiB", "start": "never", "lease_ttl_s": 3,
                  "idle_exit_s": 2, "trusted_uid": 1000},
    })
    assert cfg.use_layerwise is False
    assert cfg.chunk_size == 64
    assert cfg.timeout_s == 2.0 and isinstance(cfg.timeout_s, float)
    assert cfg.load_timeout_s == 1.5
    assert cfg.verify_checksum is False
    assert (cfg.async_load, cfg.commit_before_reply, cfg.save_decode_cache) == (False, False, True)
    assert (StoreConfig().async_load, StoreConfig().commit_before_reply, StoreConfig().save_decode_cache) \
        == (True, True, False)
    assert cfg.local.socket == os.path.abspath("rel/pool.sock")
    assert cfg.local.capacity == 2**30
    assert cfg.local.start == "never"
    assert cfg.local.lease_ttl_s == 3.0
    assert cfg.local.idle_exit_s == 2.0 and StoreConfig.parse({}).local.idle_exit_s == 10.0
    assert cfg.local.trusted_uid == 1000 and StoreConfig.parse({}).local.trusted_uid is None


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="expected an object"):
        StoreConfig.parse(["backend"])
    with pytest.raises(ConfigError, match="local"):
        StoreConfig.parse({"local": "somewhere"})


def test_unknown_top_level_key_names_key_and_lists_accepted():
    with pytest.raises(ConfigError) as ei:
        StoreConfig.parse({"use_layerwize": True})
    msg = str(ei.value)
    assert "use_layerwize" in msg
    for key in StoreConfig.KEYS:
        assert key in msg


def test_unknown_local_key_names_dotted_key_and_lists_accepted():
    with pytest.raises(ConfigError) as ei:
        StoreConfig.parse({"local": {"capasity": "8GiB"}})
    msg = str(ei.value)
    assert "local.capasity" in msg
    for key in LocalPoolConfig.KEYS:
        assert key in msg


def test_bad_backend_lists_accepted_values():
    with pytest.raises(ConfigError) as ei:
        StoreConfig.parse({"backend": "foo"})
    msg = str(ei.value)
    assert "backend" in msg and "'foo'" in msg
    assert "accepted values: local" in msg


@pytest.mark.parametrize("raw, key", [
    ({"use_layerwise": "yes"}, "use_layerwise"),
    ({"use_layerwise": 1}, "use_layerwise"),
    ({"verify_checksum": "true"}, "verify_checksum"),
    ({"async_load": 1}, "async_load"),
    ({"async_load_share": 0}, "async_load_share"),
    ({"async_load_share": 1.5}, "async_load_share"),
    ({"save_decode_cache": "yes"}, "save_decode_cache"),
    ({"timeout_s": -1}, "timeout_s"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": "5"}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"),
    ({"load_timeout_s": -0.5}, "load_timeout_s"),
    ({"consumer_wait_s": -1}, "consumer_wait_s"),
    ({"consumer_wait_s": "2s"}, "consumer_wait_s"),
    ({"chunk_size": -5}, "chunk_size"),
    ({"chunk_size": 1.5}, "chunk_size"),
    ({"chunk_size": True}, "chunk_size"),
    ({"backend": 3}, "backend"),
    ({"local": {"capacity": "lots"}}, "local.capacity"),
    ({"local": {"capacity": 0}}, "local.capacity"),
    ({"local": {"capacity": -4096}}, "local.capacity"),
    ({"local": {"capacity": True}}, "local.capacity"),
    ({"local": {"start": "sometimes"}}, "local.start"),
    ({"local": {"lease_ttl_s": 0}}, "local.lease_ttl_s"),
    ({"local": {"idle_exit_s": 0}}, "local.idle_exit_s"),
    ({"local": {"idle_exit_s": "10s"}}, "local.idle_exit_s"),
    ({"local": {"socket": 5}}, "local.socket"),
    ({"local": {"trusted_uid": -1}}, "local.trusted_uid"),
    ({"local": {"trusted_uid": "root"}}, "local.trusted_uid"),
])
def test_bad_value_names_key(raw, key):
    with pytest.raises(ConfigError) as ei:
        StoreConfig.parse(raw)
    assert str(ei.value).startswith(key + ":"), str(ei.value)


def test_bad_start_lists_accepted_values():
    with pytest.raises(ConfigError, match=r"accepted values: auto, never"):
        StoreConfig.parse({"local": {"start": "sometimes"}})


def test_parse_does_not_mutate_input():
    raw = {"backend": "local", "local": {"capacity": "1MiB"}}
    StoreConfig.parse(raw)
    assert raw == {"backend": "local", "local": {"capacity": "1MiB"}}


@pytest.mark.parametrize("value, expected", [
    ("8GiB", 8 * 2**30),
    ("512MB", 512 * 10**6),
    ("1.5GiB", 3 * 2**29),
    (1024, 1024),
    ("4MiB", 4 * 2**20),
    ("64 KiB", 64 * 2**10),
    ("2k", 2000),
    ("100", 100),
    ("100B", 100),
    ("1TiB", 2**40),
])
def test_parse_size(value, expected):
    assert parse_size(value, "x") == expected


@pytest.mark.parametrize("value", ["lots", "", "8 GiBs", "-1GiB", "1.5.2G", 0, -1, 1.5, None, True, [8]])
def test_parse_size_rejects(value):
    with pytest.raises(ConfigError, match=r"^the\.key:"):
        parse_size(value, "the.key")


def test_chunk_tokens():
    assert StoreConfig.parse({"chunk_size": 64}).chunk_tokens(16) == 64
    # Unset: 256 tokens in whole blocks; 0: one block.
    assert [StoreConfig.parse({}).chunk_tokens(b) for b in (16, 128, 384)] == [256, 256, 384]
    assert StoreConfig.parse({"chunk_size": 0}).chunk_tokens(16) == 16
    assert StoreConfig.parse({"chunk_size": 16}).chunk_tokens(16) == 16
    for bad in (24, 8, 65):
        with pytest.raises(ConfigError, match="chunk_size.*multiple of the block size 16"):
            StoreConfig.parse({"chunk_size": bad}).chunk_tokens(16)


def _transfer(role, extra=None):
    return SimpleNamespace(kv_role=role, kv_connector_extra_config=extra)


@pytest.mark.parametrize("role", ["kv_both", "kv_producer", "kv_consumer"])
def test_check_transfer_config_accepts_roles(role):
    cfg = check_transfer_config(_transfer(role, {"chunk_size": 32}))
    assert isinstance(cfg, StoreConfig)
    assert cfg.chunk_size == 32


@pytest.mark.parametrize("role", ["kv_both ", "producer", None, "KV_BOTH"])
def test_check_transfer_config_rejects_roles(role):
    with pytest.raises(ConfigError) as ei:
        check_transfer_config(_transfer(role))
    msg = str(ei.value)
    assert msg.startswith("kv_role:")
    assert "kv_both, kv_producer, kv_consumer" in msg


def test_check_transfer_config_validates_extra_config():
    with pytest.raises(ConfigError, match="local.capasity"):
        check_transfer_config(_transfer("kv_both", {"local": {"capasity": 1}}))


def _with_policy(policy, extra=None, role="kv_both"):
    return SimpleNamespace(kv_role=role, kv_load_failure_policy=policy, kv_connector_extra_config=extra)


@pytest.mark.parametrize("extra, device", [({"copy_path": "batched"}, "cpu"), ({}, "cuda"),
                                           ({"copy_path": "auto"}, "npu"), ({"copy_path": "batched"}, "npu")])
def test_the_batched_path_requires_recompute_on_load_failures(extra, device):
    # Its checksums are compared after the forward: only a recompute can undo a bad load.
    with pytest.raises(ConfigError) as ei:
        check_transfer_config(_with_policy("fail", extra), device)
    msg = str(ei.value)
    assert msg.startswith("kv_load_failure_policy:") and "'recompute'" in msg and "'fail'" in msg
    assert check_transfer_config(_with_policy("recompute", extra), device).copy_path == extra.get(
        "copy_path", "auto")
    check_transfer_config(_with_policy("fail", extra, "kv_producer"), device)  # a producer never loads


@pytest.mark.parametrize("extra, device", [({}, "cpu"), ({"copy_path": "per_block"}, "cuda"),
                                           ({"codec": "zstd"}, "cuda")])
def test_the_per_block_path_takes_either_load_failure_policy(extra, device):
    # It checks every object before copying it into the KV cache.
    assert check_transfer_config(_with_policy("fail", extra), device).backend == "local"


def test_batched_copy_path_takes_fixed_size_codecs_only():
    assert StoreConfig.parse({"copy_path": "batched", "codec": "int8"}).copy_path == "batched"
    with pytest.raises(ConfigError, match="copy_path.*zstd"):
        StoreConfig.parse({"copy_path": "batched", "codec": "zstd"})


def test_memcache_section_takes_memcache_hybrids_names():
    cfg = StoreConfig.parse({"backend": "memcache", "memcache": {
        "meta_service_url": "tcp://10.0.0.1:5000", "protocol": "host_shm", "dram_size": "1GiB",
        "device": 3, "preferred_services": [0, 2]}})
    m = cfg.memcache
    assert (m.meta_service_url, m.protocol, m.dram_size, m.device, m.preferred_services) == (
        "tcp://10.0.0.1:5000", "host_shm", 2**30, 3, (0, 2))
    assert StoreConfig.parse({}).memcache.device is None  # per rank unless set


@pytest.mark.parametrize("raw, needle", [
    ({"protocol": "tcp"}, "memcache.protocol: got 'tcp', accepted values: host_rdma"),
    ({"master": "127.0.0.1:5000"}, "unknown key(s) memcache.master"),
    ({"dram_size": "lots"}, "memcache.dram_size"),
    ({"device": -1}, "memcache.device"),
    ({"preferred_services": ["a"]}, "memcache.preferred_services"),
])
def test_memcache_section_rejects_names_from_elsewhere(raw, needle):
    with pytest.raises(ConfigError) as err:
        StoreConfig.parse({"memcache": raw})
    assert needle in str(err.value)


def test_disk_tier_keys():
    cfg = StoreConfig.parse({"local": {"disk_path": "rel/disk", "disk_capacity": "2GiB"}})
    assert cfg.local.disk_path == os.path.abspath("rel/disk") and cfg.local.disk_capacity == 2 * 2**30
    assert StoreConfig.parse(None).local.disk_path is None  # no disk tier unless asked
    with pytest.raises(ConfigError, match=r"local\.disk_capacity"):
        StoreConfig.parse({"local": {"disk_path": "/d", "disk_capacity": "lots"}})
    with pytest.raises(ConfigError, match=r"local\.disk_path"):
        StoreConfig.parse({"local": {"disk_path": 5}})
    assert StoreConfig.parse({"local": {"disk_path": "/d", "disk_codec": "int8"}}).local.disk_codec == "int8"
    assert StoreConfig.parse(None).local.disk_codec == "raw"
    with pytest.raises(ConfigError, match=r"local\.disk_codec: got 'int4', accepted values: raw, int8"):
        StoreConfig.parse({"local": {"disk_path": "/d", "disk_codec": "int4"}})
    with pytest.raises(ConfigError, match=r"local\.disk_codec: applies to a disk tier"):
        StoreConfig.parse({"local": {"disk_codec": "int8"}})


def test_lossless_key():
    assert StoreConfig.parse({"lossless": True}).lossless and not StoreConfig.parse(None).lossless
    with pytest.raises(ConfigError, match="lossless"):
        StoreConfig.parse({"lossless": "yes"})


@pytest.mark.parametrize("extra", [{}, {"use_layerwise": True}, {"use_layerwise": False}])
def test_vllm_keeps_its_full_graphs(platform_with_graphs, extra):
    # vLLM's own config resolution asks the connector class it loads whether it needs
    # PIECEWISE graphs; ours marks the steps a full graph may run instead (graph_steps.py),
    # so vLLM keeps FULL_AND_PIECEWISE (full hits then run as native's do).
    from vllm.config import CompilationConfig, CompilationMode, KVTransferConfig, VllmConfig

    ktc = KVTransferConfig(kv_connector="AscendStoreConnector", kv_role="kv_both",
                           kv_connector_module_path="ascend_store.connector", kv_connector_extra_config=extra)
    cfg = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                                          cudagraph_mode="FULL_AND_PIECEWISE"),
                     kv_transfer_config=ktc)
    assert cfg.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE"


def test_a_bad_key_fails_when_vllm_asks_for_the_graph_mode():
    from ascend_store.connector import AscendStoreConnector

    with pytest.raises(ConfigError, match="use_layerwize"):
        AscendStoreConnector.requires_piecewise_for_cudagraph({"use_layerwize": True})


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))


def _room(socket_dir: str) -> int:
    """Independently of the code: the most an arena can take, in /dev/shm or beside the
    socket (its nearest existing directory), each bounded by the memory available."""
    rooms = []
    for d in ("/dev/shm", socket_dir):
        while not os.path.isdir(d):
            d = os.path.dirname(d)
        st = os.statvfs(d)
        rooms.append(min(st.f_bavail * st.f_frsize, _mem_available()))
    return max(rooms)


def test_default_capacity_is_a_quarter_of_the_memory_free_for_the_arena(tmp_path):
    socket = str(tmp_path / "not-yet" / "pool.sock")
    before = _room(os.path.dirname(socket))
    cfg = StoreConfig.parse({"local": {"socket": socket}}).local
    after = _room(os.path.dirname(socket))
    # Other processes allocate meanwhile: within 2% of the readings around the parse.
    assert 0.25 * min(before, after) * 0.98 - 2**20 <= cfg.capacity <= 0.25 * max(before, after) * 1.02
    assert cfg.capacity % 2**20 == 0
    assert LocalPoolConfig(socket=socket).capacity == pytest.approx(cfg.capacity, rel=0.05)  # built directly


def test_a_given_capacity_is_kept_as_given(tmp_path):
    socket = str(tmp_path / "pool.sock")
    assert StoreConfig.parse({"local": {"socket": socket, "capacity": "3GiB"}}).local.capacity == 3 * 2**30


def test_a_given_capacity_that_does_not_fit_names_the_key_and_the_numbers(tmp_path):
    from ascend_store.backends.local.pool_config import check_pool_room

    socket = str(tmp_path / "pool.sock")
    too_big = StoreConfig.parse({"local": {"socket": socket, "capacity": "64TiB"}})
    with pytest.raises(ConfigError) as ei:
        check_pool_room(too_big.local)
    msg = str(ei.value)
    assert msg.startswith("local.capacity: 65536.0 GiB does not fit"), msg
    room_gib = float(re.search(r"has ([\d.]+) GiB", msg).group(1))
    assert room_gib == pytest.approx(_room(str(tmp_path)) / 2**30, rel=0.05)
    assert "leave local.capacity out" in msg and "--capacity" not in msg
    check_pool_room(StoreConfig.parse({"local": {"socket": socket, "capacity": "16MiB"}}).local)
    check_pool_room(StoreConfig.parse({"local": {"socket": socket}}).local)
