"""The C++ kernel over GGUF blocks (q8_0, q4_0, q4_1, and q4_k, q5_k, q6_k repacked) and
the backends and tensor built on it: the float32 product with gguf's dequantized weights
(kernels/reference.py) at any thread count and odd shapes, batch invariant bit for bit,
its AVX2 and AVX-512 variants equal bit for bit, and bad input refused by name.

gguf quantizes to the first three only: K-quant matrices are random bytes with sane fp16
scales (every bit pattern of the rest is a valid block)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES

from specdec.kernels import linear_quant, reference
from specdec.kernels.gguf_blocks import BLOCK_TYPES, QUANTIZABLE, QuantizedMatrix, quantize
from specdec.kernels.linear import get_linear_backend
from specdec.kernels.linear_gguf import GgufLinear
from specdec.kernels.quantized_tensor import QuantizedTensor

QTYPES = sorted(QUANTIZABLE)
K_QUANTS = ["q4_k", "q5_k", "q6_k"]
# (M, K, N): one row to past the 64 rows of a verify; N odd and off the 4-row groups; K off
# the 32-weight blocks (the last block zero-padded); the default model's shapes. K-quant
# rows are whole 256-weight super-blocks.
SHAPES = [(1, 64, 96), (2, 37, 51), (3, 96, 17), (5, 100, 33), (6, 576, 960), (9, 64, 7), (13, 128, 130),
          (33, 50, 5), (64, 96, 45), (65, 70, 19), (1, 1536, 576)]
K_SHAPES = [(1, 256, 96), (2, 512, 51), (3, 256, 17), (6, 768, 45), (9, 256, 7), (64, 256, 33), (65, 512, 19)]
CASES = [(q, *shape) for q in QTYPES for shape in SHAPES] + [(q, *shape) for q in K_QUANTS for shape in K_SHAPES]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def threads() -> Iterator[None]:
    """Restores the thread count a test changes."""
    count = torch.get_num_threads()
    yield
    torch.set_num_threads(count)


def random_k_quants(qtype: str, rows: int, cols: int, gen: torch.Generator) -> QuantizedMatrix:
    """Random K-quant blocks whose fp16 d (and dmin) are small positive numbers."""
    block, size = GGML_QUANT_SIZES[BLOCK_TYPES[qtype]]
    raw = torch.randint(0, 256, (rows, cols // block, size), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(rows, cols // block, 2, generator=gen) * 0.01 + 1e-3).half().view(torch.uint8)
    if qtype == "q6_k":
        raw[..., 208:210] = scales[..., :2]  # d, after ql, qh and the int8 scales
    else:
        raw[..., :4] = scales  # d, dmin
    return QuantizedMatrix(qtype, raw.reshape(rows, -1).contiguous(), cols)


def _case(qtype: str, m: int, k: int, n: int, seed: int = 0) -> tuple[QuantizedMatrix, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + m * 1000 + n)
    weight, x = torch.randn(n, k, generator=gen) * 0.1, torch.randn(m, k, generator=gen)
    matrix = quantize(weight, qtype) if qtype in QUANTIZABLE else random_k_quants(qtype, n, k, gen)
    return matrix, x, torch.randn(n, generator=gen)


def _assert_float32_product(out: torch.Tensor, x: torch.Tensor, matrix: QuantizedMatrix,
                            bias: torch.Tensor | None) -> None:
    """out is x @ W.T (+ bias) for the dequantized W up to float32 rounding: within the
    bound of a float32 sum of K products, K * 2^-24 * sum |x_k w_k| (+ the bias's add)."""
    expected = reference.linear_gguf(x, matrix.blocks, matrix.ggml_type, bias)
    weight = reference.dequantize_gguf(matrix.blocks, matrix.ggml_type, x.shape[1])
    bound = x.shape[1] * 2.0**-24 * reference.linear(x.abs(), weight.abs()) + 2.0**-24 * expected.abs() + 1e-30
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), float((error / bound).max())


@pytest.mark.parametrize("qtype,m,k,n", CASES)
@pytest.mark.parametrize("num_threads", [1, 2, 4])
def test_matches_the_dequantized_product(qtype: str, m: int, k: int, n: int, num_threads: int, threads: None) -> None:
    torch.set_num_threads(num_threads)
    matrix, x, bias = _case(qtype, m, k, n)
    packed = linear_quant.pack(matrix)
    for b in (None, bias):
        out = linear_quant.linear_quant(x, packed, b)
        assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
        _assert_float32_product(out, x, matrix, b)


@pytest.mark.parametrize("qtype", QTYPES + K_QUANTS)
def test_rows_do_not_depend_on_the_batch_or_the_threads(qtype: str, threads: None) -> None:
    matrix, x, bias = _case(qtype, 65, 160 if qtype in QUANTIZABLE else 256, 203, seed=7)
    packed = linear_quant.pack(matrix)
    torch.set_num_threads(1)
    alone = torch.cat([linear_quant.linear_quant(x[i : i + 1], packed, bias) for i in range(65)])
    for count in (1, 2, 4):
        torch.set_num_threads(count)
        for rows in (1, 2, 3, 5, 6, 7, 9, 12, 13, 25, 64, 65):
            assert torch.equal(linear_quant.linear_quant(x[:rows], packed, bias), alone[:rows]), (count, rows)


@pytest.mark.skipif(not linear_quant.cpu_runs("avx512"), reason="the CPU has no AVX-512")
@pytest.mark.parametrize("qtype", QTYPES + K_QUANTS)
def test_avx2_and_avx512_variants_agree_bit_for_bit(qtype: str) -> None:
    for m, k, n in SHAPES if qtype in QUANTIZABLE else K_SHAPES:
        matrix, x, bias = _case(qtype, m, k, n, seed=3)
        packed = linear_quant.pack(matrix)
        assert torch.equal(linear_quant.linear_quant(x, packed, bias, isa="avx2"),
                           linear_quant.linear_quant(x, packed, bias, isa="avx512")), (m, k, n)


@pytest.mark.skipif("avx512f" not in linear_quant.cpu_build.cpu_flags().split(), reason="no AVX-512 to turn off")
def test_a_build_without_avx512_picks_the_avx2_variant() -> None:
    code = "from specdec.kernels import linear_quant as q; print(q.auto_isa(), q.cpu_runs('avx512'))"
    for flags, picked in (("-mno-avx512f", "avx2"), ("", "avx512")):
        run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SPECDEC_CXXFLAGS": flags}, cwd=ROOT,
                             capture_output=True, text=True, check=True)
        assert run.stdout.split() == [picked, "True"]  # either way, both variants are there to ask for


@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (2, 37, 51), (6, 576, 960), (13, 128, 130), (65, 70, 19)])
@pytest.mark.parametrize("num_threads", [1, 2, 4])
def test_float_headers_change_only_q4_1s_layout_not_a_bit_of_its_products(m: int, k: int, n: int, num_threads: int,
                                                                         threads: None) -> None:
    """Q4_1 packed with float32 headers (the K-quants' 32-weight layout) gives the same
    products bit for bit, in both activation modes, and the same embedding rows; the
    other block types ignore the option."""
    torch.set_num_threads(num_threads)
    matrix, x, bias = _case("q4_1", m, k, n)
    half, wide = linear_quant.pack(matrix), linear_quant.pack(matrix, float_headers=True)
    assert (half.qtype, half.format_id, wide.qtype, wide.format_id) == ("q4_1", 2, "q4_1", 3)
    for activations in linear_quant.ACTIVATIONS:
        assert torch.equal(linear_quant.linear_quant(x, wide, bias, activations=activations),
                           linear_quant.linear_quant(x, half, bias, activations=activations))
    rows = torch.arange(n)
    assert torch.equal(linear_quant.dequantize_rows(wide, rows), linear_quant.dequantize_rows(half, rows))
    for qtype in ("q8_0", "q4_0"):
        other = quantize(torch.randn(n, k), qtype)
        assert torch.equal(linear_quant.pack(other, float_headers=True).groups, linear_quant.pack(other).groups)


@pytest.mark.parametrize("qtype", QTYPES + K_QUANTS)
def test_embedding_rows_are_dequantized_exactly(qtype: str) -> None:
    """Also what proves the K-quant repack exact: every weight as gguf dequantizes it."""
    cols = 70 if qtype in QUANTIZABLE else 512
    matrix, _, _ = _case(qtype, 1, cols, 13)
    rows = torch.tensor([12, 0, 5, 5, 3])
    expected = reference.dequantize_gguf(matrix.blocks, matrix.ggml_type, cols)[rows]
    assert torch.equal(linear_quant.dequantize_rows(linear_quant.pack(matrix), rows), expected)
    with pytest.raises(ValueError, match=r"row ids must be in \[0, 13\)"):
        linear_quant.dequantize_rows(linear_quant.pack(matrix), torch.tensor([13]))


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_backend_takes_gguf_blocks_or_quantizes_a_float_weight(qtype: str) -> None:
    backend = get_linear_backend(qtype)
    assert backend.batch_invariant and backend.needs_fp32
    matrix, x, bias = _case(qtype, 4, 96, 40)
    float_weight = reference.dequantize_gguf(matrix.blocks, matrix.ggml_type, 96)
    from_blocks, from_floats = backend.prepare(QuantizedTensor([matrix]), bias), backend.prepare(float_weight, bias)
    # Quantizing the dequantized weight gives its blocks back, so both products are one.
    assert torch.equal(backend.apply(x, from_blocks), backend.apply(x, from_floats))
    other = next(q for q in QTYPES if q != qtype)
    with pytest.raises(ValueError, match=f"reads {qtype} blocks, got {other}"):
        backend.prepare(QuantizedTensor([quantize(float_weight, other)]))


def test_the_gguf_backend_multiplies_mixed_segments_into_their_columns() -> None:
    """A fused projection whose row segments have different block types (q, k, v); a
    float weight on the fp16 kernel."""
    gen = torch.Generator().manual_seed(11)
    matrices = [quantize(torch.randn(rows, 96, generator=gen), qtype)
                for rows, qtype in ((20, "q4_1"), (9, "q4_1"), (7, "q8_0"), (5, "q4_0"))]
    weight = QuantizedTensor(matrices)
    assert weight.shape == (41, 96) and weight.qtypes == ("q4_1", "q8_0", "q4_0")
    x, bias = torch.randn(3, 96, generator=gen), torch.randn(41, generator=gen)
    backend = GgufLinear()
    out = backend.apply(x, backend.prepare(weight, bias))
    for part, (start, stop) in zip(matrices, ((0, 20), (20, 29), (29, 36), (36, 41))):
        _assert_float32_product(out[:, start:stop], x, part, bias[start:stop])
    float_weight = torch.randn(4, 96, generator=gen)  # an F16 tensor, a drafter's head: on cpp-fp16
    fp16 = get_linear_backend("cpp-fp16")
    assert torch.equal(backend.apply(x, backend.prepare(float_weight)), fp16.apply(x, fp16.prepare(float_weight)))


def test_a_quantized_tensor_looks_up_rows_and_dequantizes_for_anything_else() -> None:
    gen = torch.Generator().manual_seed(12)
    matrices = [quantize(torch.randn(rows, 64, generator=gen), qtype) for rows, qtype in ((6, "q8_0"), (5, "q4_1"))]
    table = QuantizedTensor(matrices)
    dense = torch.cat([reference.dequantize_gguf(m.blocks, m.ggml_type, 64) for m in matrices])
    ids = torch.tensor([[10, 0], [5, 6]])
    assert torch.equal(F.embedding(ids, table), dense[ids])
    assert torch.equal(table[torch.tensor([7, 1])], dense[[7, 1]]) and torch.equal(table[[3]], dense[[3]])
    assert (table.shape, table.dtype, table.device, table.dim(), table.size(0)) == ((11, 64), torch.float32,
                                                                                    torch.device("cpu"), 2, 11)
    assert torch.equal(table.T, dense.T) and torch.equal(table.float() * 2, dense * 2)  # values, in full
    param = torch.nn.Parameter(table, requires_grad=False)
    assert param is table and isinstance(param, torch.nn.Parameter)
    with pytest.raises(TypeError, match="no float32 data for data_ptr"):
        table.data_ptr()
    with pytest.raises(ValueError, match=r"row ids must be in \[0, 11\)"):
        table.rows_of(torch.tensor([11]))


def test_bad_input_is_refused_by_name() -> None:
    packed = linear_quant.pack(quantize(torch.randn(8, 64), "q4_1"))
    with pytest.raises(ValueError, match=r"float32 x of shape \[M, 64\]"):
        linear_quant.linear_quant(torch.randn(2, 32), packed)
    with pytest.raises(ValueError, match=r"float32 x of shape \[M, 64\]"):
        linear_quant.linear_quant(torch.randn(2, 64, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="isa 'sse'"):
        linear_quant.linear_quant(torch.randn(2, 64), packed, isa="sse")
    with pytest.raises(ValueError, match=r"bias must be float32 of shape \[8\]"):
        linear_quant.linear_quant(torch.randn(2, 64), packed, torch.zeros(7))
    with pytest.raises(ValueError, match="cannot quantize to 'q5_0'"):
        quantize(torch.randn(8, 64), "q5_0")
    with pytest.raises(ValueError, match=r"\[rows, 40\] uint8 tensor"):
        QuantizedMatrix("q4_1", torch.zeros(8, 36, dtype=torch.uint8), 64)


def test_strided_and_empty_inputs() -> None:
    packed = linear_quant.pack(quantize(torch.randn(33, 64), "q8_0"))
    x = torch.randn(3, 128)
    assert torch.equal(linear_quant.linear_quant(x[:, ::2], packed), linear_quant.linear_quant(x[:, ::2].contiguous(),
                                                                                               packed))
    assert linear_quant.linear_quant(torch.zeros(0, 64), packed).shape == (0, 33)
