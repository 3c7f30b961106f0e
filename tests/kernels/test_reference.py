"""The oracles themselves, on cases small enough to work out by hand."""
from __future__ import annotations

import torch

from specdec.kernels import reference
from specdec.kernels.kv_cache import FP8, PagedKV
from tests.helpers import single_request_meta


def test_attention_over_one_key_is_its_value_and_equal_scores_average() -> None:
    kv = PagedKV.zeros(2, 2, 1, 2, torch.float32)
    reference.store_kv(torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]]), torch.tensor([[[2.0, 4.0]], [[6.0, 8.0]]]), kv,
                       torch.tensor([2, 3]))  # block 1, both slots
    meta = single_request_meta(0, 2, [1], 2)
    query = torch.zeros(2, 3, 2)  # 3 query heads on 1 kv head; zero scores: plain averages
    out = reference.paged_attention(query, kv, meta, 1.0)
    assert out.dtype == torch.float64
    assert out[0].tolist() == [[2.0, 4.0]] * 3  # the first token sees itself only
    assert out[1].tolist() == [[4.0, 6.0]] * 3


def test_tree_mask_is_taken_literally() -> None:
    kv = PagedKV.zeros(1, 4, 1, 1, torch.float32)
    reference.store_kv(torch.zeros(3, 1, 1), torch.tensor([1.0, 10.0, 100.0]).view(3, 1, 1), kv, torch.arange(3))
    sees = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)  # row 1 skips its parent
    out = reference.paged_attention(torch.zeros(3, 1, 1), kv, single_request_meta(0, 3, [0], 4, sees), 1.0)
    assert out.flatten().tolist() == [1.0, 10.0, 50.5]


def test_fp8_store_keeps_a_scale_per_slot_and_head() -> None:
    kv = PagedKV.zeros(1, 2, 2, 2, FP8)
    key = torch.tensor([[[448.0, -224.0], [3.5, 1.75]]])  # [1, 2, 2]: amax 448 and 3.5, both exact in e4m3
    reference.store_kv(key, key, kv, torch.tensor([1]))
    assert kv.k_scale is not None and kv.k_scale[0, 1].tolist() == [1.0, 1 / 128]
    assert torch.equal(reference.read_kv(kv.k, kv.k_scale, torch.tensor([0]), 2)[1], key[0].double())


def test_rms_norm_and_linear() -> None:
    x = torch.tensor([[3.0, -3.0], [0.0, 0.0]])
    assert reference.rms_norm(x, torch.tensor([1.0, 2.0]), 0.0)[0].tolist() == [1.0, -2.0]
    assert reference.linear(x, torch.eye(2) * 2, torch.ones(2)).tolist() == [[7.0, -5.0], [1.0, 1.0]]
