"""Recurrent state objects and the deferred state copy, on caches laid out like vLLM's.

vLLM 0.32 places every layer in one backing buffer, block-major: block b of layer l
starts at ``l * layer_stride + b * block_stride``; a GDN layer's conv and temporal
states are strided views into its page (tests/e2e shows the real thing end to end).
"""

from __future__ import annotations

import pytest
import torch

from ascend_store.common.codecs import get_codec
from ascend_store.common.transfer import HEADER_BYTES, CorruptObject, object_bytes, write_object
from ascend_store.worker.hybrid import DeferredStateCopies, state_layout
from tests.unit.objects import read_object

BLOCKS, PAGE = 6, 4096
CONV, SSM = (3, 64), (2, 8, 8)  # bf16 conv state, fp32 temporal state


def _buffer(layers: int = 2) -> torch.Tensor:
    return torch.zeros(BLOCKS * layers * PAGE, dtype=torch.int8)


def _gdn_views(buf: torch.Tensor, layer: int, layers: int = 2) -> list[torch.Tensor]:
    """A GDN layer's (conv, ssm) views, pages of all layers interleaved per block."""
    block_stride, base = layers * PAGE, layer * PAGE
    conv_elems = CONV[0] * CONV[1]
    conv = torch.as_strided(buf.view(torch.bfloat16), (BLOCKS, *CONV),
                            (block_stride // 2, CONV[1], 1), base // 2)
    ssm_off = base + conv_elems * 2
    ssm = torch.as_strided(buf.view(torch.float32), (BLOCKS, *SSM),
                           (block_stride // 4, SSM[1] * SSM[2], SSM[2], 1), ssm_off // 4)
    return [conv, ssm]


def test_state_layout_covers_exactly_one_blocks_states():
    buf = _buffer()
    conv, ssm = _gdn_views(buf, 1)
    layout = state_layout([conv, ssm], BLOCKS)
    used = CONV[0] * CONV[1] * 2 + SSM[0] * SSM[1] * SSM[2] * 4
    assert layout.page_bytes == used
    page = layout.page(4)
    assert page.data_ptr() == conv[4].data_ptr()
    assert page.data_ptr() + used == ssm[4].data_ptr() + ssm[4].numel() * 4


def test_state_object_round_trip_and_corruption():
    """A state object written from one buffer restores both states bit-exactly into
    another engine's buffer, at another block; a flipped byte is detected."""
    src_buf, dst_buf = _buffer(), _buffer()
    src, dst = _gdn_views(src_buf, 0), _gdn_views(dst_buf, 0)
    torch.manual_seed(0)
    src[0][2].copy_(torch.randn(CONV).to(torch.bfloat16))
    src[1][2].copy_(torch.randn(SSM))
    codec = get_codec("raw")
    layout, dst_layout = state_layout(src, BLOCKS), state_layout(dst, BLOCKS)
    obj = torch.zeros(object_bytes(layout, 1, codec), dtype=torch.uint8)
    write_object(obj, layout, [2], "k/L0/h", True, codec)
    read_object(obj, dst_layout, [5], 0, "k/L0/h", 1, True, codec)
    assert torch.equal(dst[0][5], src[0][2]) and torch.equal(dst[1][5], src[1][2])
    assert not dst[1][:5].any() and not dst[0][:5].any()
    obj[HEADER_BYTES + 10] ^= 1
    with pytest.raises(CorruptObject, match="checksum"):
        read_object(obj, dst_layout, [5], 0, "k/L0/h", 1, True, codec)


def test_state_layout_refuses_views_that_are_not_one_page_per_block():
    buf = _buffer()
    conv, _ = _gdn_views(buf, 0)
    other = _gdn_views(_buffer(), 0)[1]
    with pytest.raises(ValueError, match="one buffer"):
        state_layout([conv, other], BLOCKS)


def test_deferred_copies_run_per_layer_by_destination_address():
    """Copies are matched to the layer whose pages they write; running one layer's copies
    leaves the other layer's pending, and nothing runs before it is asked to."""
    buf = _buffer()
    views = {name: _gdn_views(buf, i) for i, name in enumerate(["l0", "l1"])}
    copies = DeferredStateCopies({n: state_layout(v, BLOCKS) for n, v in views.items()})
    for i, (conv, ssm) in enumerate(views.values()):
        conv[1].fill_(i + 1)
        ssm[1].fill_(10 * (i + 1))
    # The runner's plan: for each layer, conv and ssm of block 1 -> block 3.
    plan = [(t[1].data_ptr(), t[3].data_ptr(), t[1].numel() * t.element_size())
            for v in views.values() for t in v]
    src, dst, sizes = (torch.tensor([p[i] for p in plan], dtype=torch.uint64).numpy() for i in range(3))
    copies.take(src, dst, sizes)
    assert sorted(copies.pending) == ["l0", "l1"] and not views["l0"][0][3].any()
    assert copies.run("l1") == 2
    assert (views["l1"][0][3] == 2).all() and (views["l1"][1][3] == 20).all()
    assert not views["l0"][0][3].any()  # l0's copies still wait for l0's load
    assert copies.run_all() == 2 and not copies.pending
    assert (views["l0"][0][3] == 1).all() and (views["l0"][1][3] == 10).all()


def test_a_copy_outside_the_state_layers_is_refused():
    buf = _buffer()
    copies = DeferredStateCopies({"l0": state_layout(_gdn_views(buf, 0), BLOCKS)})
    far = buf.data_ptr() + PAGE + 8  # inside layer 1's page, which is not a state layer here
    with pytest.raises(ValueError, match="no registered state layer"):
        copies.take(torch.tensor([far]).numpy(), torch.tensor([far]).numpy(), torch.tensor([4]).numpy())
