"""The C++ fp16-weight linear kernel: exact against a float64 product with the same fp16
weight, batch and thread invariant bit for bit, and its fallback when it cannot build."""
from __future__ import annotations

import pytest
import torch

from specdec.kernels import linear, linear_cpu, reference

# (M, K, N): one row to a prefill chunk; row counts around the 4- and 12-row blocks; N off
# the 16-column tiles, and tiles per block leaving a tail of 1, 2 or 3 tiles.
SHAPES = [(1, 64, 96), (3, 37, 50), (4, 64, 80), (4, 64, 112), (5, 96, 17), (12, 64, 64), (13, 128, 200),
          (25, 64, 48), (100, 48, 160), (1, 576, 960)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_a_float64_product(m: int, k: int, n: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    weight, x = torch.randn(n, k, generator=gen) * 0.1, torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    out = linear_cpu.linear_fp16(x, linear_cpu.pack_fp16(weight), bias, n)
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
    expected = reference.linear(x, weight.half(), bias)  # the kernel's weight is the fp16 rounding
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


def test_rows_do_not_depend_on_the_batch_or_the_threads() -> None:
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(200, 96, generator=gen), torch.randn(40, 96, generator=gen)
    packed, bias = linear_cpu.pack_fp16(weight), torch.randn(200, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([linear_cpu.linear_fp16(x[i : i + 1], packed, bias, 200) for i in range(40)])
        for count in (2, 4):
            torch.set_num_threads(count)
            for rows in (2, 4, 5, 9, 13, 40):
                assert torch.equal(linear_cpu.linear_fp16(x[:rows], packed, bias, 200), alone[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


def test_strided_and_empty_inputs() -> None:
    gen = torch.Generator().manual_seed(6)
    weight, x = torch.randn(32, 64, generator=gen), torch.randn(3, 128, generator=gen)
    packed = linear_cpu.pack_fp16(weight)
    strided = x[:, ::2]
    assert torch.equal(linear_cpu.linear_fp16(strided, packed, None, 32),
                       linear_cpu.linear_fp16(strided.contiguous(), packed, None, 32))
    assert linear_cpu.linear_fp16(torch.zeros(0, 64), packed, None, 32).shape == (0, 32)
    with pytest.raises(ValueError, match="64 features"):
        linear_cpu.linear_fp16(x, packed, None, 32)


def test_default_falls_back_to_fbgemm_when_the_kernel_cannot_build(monkeypatch, tmp_path, caplog,
                                                                    fresh_build) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-c++")
    with caplog.at_level("WARNING"):
        assert not linear.LINEAR_BACKENDS["cpp-fp16"].is_available()
        assert linear.default_linear_backend() == "fp16"
    assert "no-such-c++" in caplog.text
    with pytest.raises(ValueError, match="not available"):
        linear.get_linear_backend("cpp-fp16")
