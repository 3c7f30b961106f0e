"""The C++ RMSNorm against kernels/reference.py, row by row invariant, and where it steps aside."""
from __future__ import annotations

import pytest
import torch

from specdec.kernels import reference, rms_norm_cpu
from specdec.models.llama import rms_norm


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 17), (2, 5, 64), (300, 576)])
def test_matches_torch(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x, weight = torch.randn(shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
    assert rms_norm_cpu.supports(x, weight)
    out = rms_norm_cpu.rms_norm_cpu(x, weight, 1e-5)
    torch.testing.assert_close(out.double(), reference.rms_norm(x, weight, 1e-5), atol=1e-6, rtol=1e-5)
    assert torch.equal(rms_norm(x, weight, 1e-5), out)  # the model's norm takes this path


def test_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(2000, 64, generator=gen), torch.randn(64, generator=gen)
    alone = torch.cat([rms_norm_cpu.rms_norm_cpu(x[i : i + 1], weight, 1e-6) for i in range(0, 2000, 97)])
    assert torch.equal(rms_norm_cpu.rms_norm_cpu(x, weight, 1e-6)[::97], alone)  # threads on the big batch


def test_autograd_strided_and_other_dtypes_keep_torch() -> None:
    x, weight = torch.randn(4, 64), torch.randn(64)
    assert not rms_norm_cpu.supports(x.requires_grad_(), weight)
    assert not rms_norm_cpu.supports(torch.randn(4, 128)[:, ::2], weight)
    assert not rms_norm_cpu.supports(torch.randn(4, 64, dtype=torch.bfloat16), weight.bfloat16())
    trained = torch.randn(64, requires_grad=True)
    rms_norm(torch.randn(4, 64), trained, 1e-6).sum().backward()
    assert trained.grad is not None
