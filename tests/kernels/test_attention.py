"""Attention backends by name (kernels/attention.py): what each name resolves to, the
fallbacks, and the refusals. The numerics of each backend have their own test files."""
from __future__ import annotations

import pytest
import torch

from specdec.kernels import attention_cpu, cpu_build
from specdec.kernels.attention import check_attention_backend, make_attention_backend
from specdec.kernels.attention_cpu import CppAttention
from specdec.kernels.attention_torch import TorchAttention
from tests.helpers import attend, make_meta, random_inputs, tree_mask_from_parents


def test_names_resolve_once_to_backend_objects() -> None:
    assert isinstance(make_attention_backend("torch", "cpu"), TorchAttention)
    assert isinstance(make_attention_backend("cpp", "cpu"), CppAttention)
    assert isinstance(make_attention_backend("auto", "cpu"), CppAttention)  # g++ is here (tests need it)
    assert type(make_attention_backend("triton", "cpu")).__name__ == "TritonAttention"  # TRITON_INTERPRET=1


def test_each_backend_computes_its_own_path() -> None:
    gen = torch.Generator().manual_seed(9)
    meta, num_blocks = make_meta([(30, 1), (4, 5)], 16, gen)
    q, kv = random_inputs(meta, num_blocks, 16, 4, 2, 64, gen)
    cpp = attention_cpu.paged_attention_cpu(q, kv, attention_cpu.plan_rows(meta, 2), 0.1)
    torch_out = attend(TorchAttention(), q, kv, meta, 0.1)
    assert not torch.equal(cpp, torch_out)  # so the checks below tell the paths apart
    for name, expected in (("auto", cpp), ("cpp", cpp), ("torch", torch_out)):
        assert torch.equal(attend(make_attention_backend(name, "cpu"), q, kv, meta, 0.1), expected), name


def test_cpp_takes_the_torch_code_for_what_its_kernel_lacks() -> None:
    gen = torch.Generator().manual_seed(10)
    meta, num_blocks = make_meta([(30, 1), (4, 5)], 16, gen)
    cpp, torch_backend = CppAttention(), TorchAttention()
    q, kv = random_inputs(meta, num_blocks, 16, 4, 2, 24, gen)  # a head dim the kernel is not built for
    assert cpp.plan(meta, kv).rows is None
    assert torch.equal(attend(cpp, q, kv, meta, 0.1), attend(torch_backend, q, kv, meta, 0.1))
    q, kv = random_inputs(meta, num_blocks, 16, 4, 2, 64, gen, dtype=torch.bfloat16)  # non-fp32 queries
    assert torch.equal(attend(cpp, q, kv, meta, 0.1), attend(torch_backend, q, kv, meta, 0.1))


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="attention_backend 'fast'"):
        check_attention_backend("fast")
    with pytest.raises(ValueError, match="attention_backend 'fast'"):
        make_attention_backend("fast", "cpu")


def test_backends_refuse_devices_they_cannot_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="'cpp' runs on the CPU"):
        make_attention_backend("cpp", "cuda")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="'triton' needs CUDA"):
        make_attention_backend("triton", "cpu")


def test_auto_falls_back_to_torch_with_a_warning(monkeypatch, tmp_path, caplog,
                                                  fresh_build) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-c++")
    with caplog.at_level("WARNING"):
        backend = make_attention_backend("auto", "cpu")
    assert isinstance(backend, TorchAttention)
    assert "C++ kernel paged_attention unavailable" in caplog.text and "no-such-c++" in caplog.text
    with pytest.raises(cpu_build.KernelBuildError):
        check_attention_backend("cpp")
    with pytest.raises(cpu_build.KernelBuildError):
        make_attention_backend("cpp", "cpu")


@pytest.mark.parametrize("name", ["torch", "cpp", "triton"])
def test_a_chain_tree_mask_is_bitwise_the_causal_mask(name: str) -> None:
    """A chain (parent = previous node) computes exactly what no mask (causal) does: the
    model runner leaves the mask out when every draft is a chain."""
    backend = make_attention_backend(name, "cpu")
    gen = torch.Generator().manual_seed(7)
    specs = [(5, 6), (0, 3), (12, 1)]
    chains = [tree_mask_from_parents(list(range(-1, q - 1))) for _, q in specs]
    meta, num_blocks = make_meta(specs, 8, gen, chains)
    q, kv = random_inputs(meta, num_blocks, 8, 4, 2, 64, gen)
    tree_out = attend(backend, q, kv, meta, 0.125)
    meta.tree_mask = None
    assert torch.equal(tree_out, attend(backend, q, kv, meta, 0.125))
