"""The disk tier's INT8 form (backends/local/spill_int8.py) on objects the worker's own
writers seal: accuracy per cache dtype and layout (keys with outlier channels), what stays
byte for byte, the decoded headers readers check, and a DiskTier storing and reopening it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascend_store.backends.local import spill_int8
from ascend_store.backends.local.disk import DiskError, DiskTier, file_name
from ascend_store.common.checksum import wsum_rows
from ascend_store.common.codecs import RAW, get_codec
from ascend_store.common.header import FLAG_LOSSY, FLAG_WSUM, HEADER_RECORD
from ascend_store.common.transfer import HEADER_BYTES, LayerLayout, seal, write_object
from tests.unit.objects import header_faults
from tests.unit.test_codecs import KEY, NB, D, H, T, cpu_cache, flash_cache, nhd_cache, rel_rms, with_outliers

LAYERS = 3


def chunk_object(layout: LayerLayout, blocks: list[int], codec=RAW, checksum: bool = True) -> torch.Tensor:
    """A chunk object as the host writer makes it: one sealed part per layer, back to back."""
    part = HEADER_BYTES + codec.payload_bytes(layout, len(blocks))
    obj = torch.zeros(LAYERS * part, dtype=torch.uint8)
    for i in range(LAYERS):
        write_object(obj[i * part:(i + 1) * part], layout, blocks, KEY, checksum, codec)
    return obj


def through_disk_form(obj: torch.Tensor) -> tuple[bytes | None, torch.Tensor]:
    form = spill_int8.encode(memoryview(obj.numpy()))
    back = bytearray(obj.numel())
    if form is not None:
        assert spill_int8.decode(form, back)
    return form, torch.frombuffer(back, dtype=torch.uint8)


def pages(obj: torch.Tensor, dtype) -> torch.Tensor:
    return obj.view(LAYERS, -1)[:, HEADER_BYTES:].contiguous().view(dtype).float()


@pytest.mark.parametrize("make", [cpu_cache, flash_cache, nhd_cache])
@pytest.mark.parametrize("dtype,ratio", [(torch.float32, 0.27), (torch.bfloat16, 0.54),
                                         (torch.float16, 0.54)])
def test_attention_pages_come_back_close_and_marked_lossy(make, dtype, ratio):
    gen = torch.Generator().manual_seed(0)
    cache = make(dtype, gen)
    layout = LayerLayout.of(cache, NB, (H, T, D))
    plain = chunk_object(layout, [1, 2])
    with_outliers(cache, layout)
    spiky = chunk_object(layout, [1, 2])
    for obj, bar in ((plain, 0.008), (spiky, 0.02)):
        form, back = through_disk_form(obj)
        assert form is not None and len(form) / obj.numel() < ratio
        err = rel_rms(pages(back, dtype), pages(obj, dtype))
        assert 0 < err < bar, err
        heads = back.view(LAYERS, -1)[:, :HEADER_BYTES].contiguous().numpy().view(HEADER_RECORD)[:, 0]
        assert (heads["flags"] == FLAG_WSUM | FLAG_LOSSY).all()
        # Readers check the decoded parts like any object: fingerprint, size, word checksum.
        part = obj.numel() // LAYERS
        faults, _ = header_faults(back.numpy(), [i * part for i in range(LAYERS)], [part] * LAYERS,
                                  [KEY] * LAYERS, layout, 2, True, RAW)
        assert faults == [None] * LAYERS
        # Spilled again after a promotion: the same values, nothing more lost.
        assert torch.equal(through_disk_form(back)[1], back)


def test_a_flipped_byte_in_a_decoded_payload_fails_its_checksum():
    layout = LayerLayout.of(flash_cache(torch.bfloat16, torch.Generator().manual_seed(0)), NB, (H, T, D))
    obj = chunk_object(layout, [0, 3])
    _, back = through_disk_form(obj)
    back[HEADER_BYTES + 100] ^= 1
    part = obj.numel() // LAYERS
    faults, _ = header_faults(back.numpy(), [0], [part], [KEY], layout, 2, True, RAW)
    assert faults[0] is not None and "checksum" in faults[0]


def _fp8_layout():
    cache = torch.randn(2, NB, T, H, D).to(torch.float8_e4m3fn)
    return LayerLayout.of(cache, NB, (H, T, D))


@pytest.mark.parametrize("case", ["int8 codec", "zstd codec", "no kv dims", "fp8 cache", "not finite",
                                  "parts differ", "not an object"])
def test_other_objects_stay_byte_for_byte(case):
    gen = torch.Generator().manual_seed(0)
    cache = flash_cache(torch.bfloat16, gen)
    layout = LayerLayout.of(cache, NB, (H, T, D))
    if case == "int8 codec":
        obj = chunk_object(layout, [1, 2], get_codec("int8"))
    elif case == "zstd codec":
        zstd = get_codec("zstd")
        payload = torch.frombuffer(bytearray(zstd.encode_bytes(layout, [1, 2])), dtype=torch.uint8)
        obj = torch.cat([torch.zeros(HEADER_BYTES, dtype=torch.uint8), payload])
        seal(obj, payload.numel(), layout, KEY, zstd, True)
    elif case == "no kv dims":  # recurrent state, tuple caches: axes unknown
        obj = chunk_object(LayerLayout.of(cache, NB), [1, 2])
    elif case == "fp8 cache":  # an 8-bit cache is stored as its own bytes
        obj = chunk_object(_fp8_layout(), [1, 2])
    elif case == "not finite":
        cache.view(-1)[7] = float("inf")
        obj = chunk_object(layout, [0, 1])
    elif case == "parts differ":  # a part of two blocks, then one of one
        one = torch.zeros(HEADER_BYTES + layout.page_bytes, dtype=torch.uint8)
        write_object(one, layout, [3], KEY, True, RAW)
        obj = torch.cat([chunk_object(layout, [1, 2])[:HEADER_BYTES + 2 * layout.page_bytes], one])
    else:
        obj = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    assert spill_int8.encode(memoryview(obj.numpy())) is None


def test_a_form_that_does_not_add_up_is_refused():
    layout = LayerLayout.of(flash_cache(torch.float32, torch.Generator().manual_seed(0)), NB, (H, T, D))
    obj = chunk_object(layout, [1])
    form = spill_int8.encode(memoryview(obj.numpy()))
    dest = bytearray(obj.numel())
    assert not spill_int8.decode(form[:-2], dest)
    assert not spill_int8.decode(form[:5], dest)


def test_the_disk_tier_stores_the_int8_form_and_reads_it_after_a_restart(tmp_path):
    layout = LayerLayout.of(cpu_cache(torch.bfloat16, torch.Generator().manual_seed(0)), NB, (H, T, D))
    obj = chunk_object(layout, [0, 1, 2])
    other = torch.randint(0, 256, (1000,), dtype=torch.uint8)  # not attention pages: as is
    tier = DiskTier(str(tmp_path / "d"), 2**30, codec="int8")
    assert tier.put("ns/a", memoryview(obj.numpy()))[0] and tier.put("ns/b", memoryview(other.numpy()))[0]
    st = tier.stats()
    assert st["int8_writes"] == 1 and st["writes"] == 2
    assert st["used_bytes"] < 0.6 * obj.numel() + other.numel() + 200
    tier.close()
    tier = DiskTier(str(tmp_path / "d"), 2**30)  # reopened with the default codec: reads both forms
    assert tier.size("ns/a") == obj.numel() and tier.size("ns/b") == other.numel()
    back, raw = bytearray(obj.numel()), bytearray(other.numel())
    assert tier.read_into("ns/a", memoryview(back)) and tier.read_into("ns/b", memoryview(raw))
    assert bytes(raw) == other.numpy().tobytes()
    assert bytes(back) != obj.numpy().tobytes()
    assert rel_rms(pages(torch.frombuffer(back, dtype=torch.uint8), torch.bfloat16),
                   pages(obj, torch.bfloat16)) < 0.008
    # A flipped byte in the stored form is a miss (the file's CRC), never a wrong page.
    path = tmp_path / "d" / file_name("ns/a")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not tier.read_into("ns/a", memoryview(bytearray(obj.numel())))
    tier.close()


def test_unknown_disk_codec_is_refused(tmp_path):
    with pytest.raises(DiskError, match="disk tier codec"):
        DiskTier(str(tmp_path / "d"), 2**20, codec="int4")


def test_payload_sums_match_the_writers():
    """The pool server's numpy word checksum equals the one every writer seals."""
    layout = LayerLayout.of(flash_cache(torch.float32, torch.Generator().manual_seed(3)), NB, (H, T, D))
    obj = chunk_object(layout, [0, 1])
    part = obj.numel() // LAYERS
    rows = obj.view(LAYERS, part)[:, HEADER_BYTES:].numpy()
    heads = obj.view(LAYERS, part)[:, :HEADER_BYTES].contiguous().numpy().view(HEADER_RECORD)[:, 0]
    assert np.array_equal(wsum_rows(rows), heads["crc"].astype(np.int64))
