"""The KV cache's size on CUDA, as vLLM sizes it: the engine may use
gpu_memory_utilization of the GPU's memory; the weights, the peak activations of the
largest step (measured by running it once, `profile_step`) and what lives outside torch's
allocator (the CUDA context, other processes) are taken first, and the KV cache gets the
rest, in whole blocks. A draft model, loaded later, has its weights and its KV cache
(one block per target block, plus max_num_seqs) counted in up front; Medusa heads are
small enough for the headroom.

`kv_cache_blocks` is the arithmetic (pure, tested on the CPU); `profile_step` runs on any
device; `measure_used_bytes` reads CUDA's memory counters (a `cuda`-marked test).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.config import EngineConfig
from specdec.drafters.factory import device_bytes
from specdec.executor import Executor, PythonLayers
from specdec.model_runner import KVCache, StepInputs, upload
from specdec.models import LlamaForCausalLM


def kv_cache_blocks(total_bytes: int, used_bytes: int, utilization: float, bytes_per_block: int) -> int:
    """KV blocks of bytes_per_block that fit in utilization * total_bytes once used_bytes
    are taken. ValueError, with the numbers, when not one does."""
    budget = int(total_bytes * utilization) - used_bytes
    if budget < bytes_per_block:
        raise ValueError(
            f"no room for the KV cache: gpu_memory_utilization={utilization} of {total_bytes} bytes leaves "
            f"{budget} bytes once the weights and the largest step take {used_bytes}, and one KV block needs "
            f"{bytes_per_block}; raise gpu_memory_utilization, lower max_num_batched_tokens, or set kv_cache_memory")
    return budget // bytes_per_block


def step_lengths(num_tokens: int, max_model_len: int) -> list[int]:
    """The profiled step: num_tokens prompt tokens as requests of at most max_model_len."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


@torch.inference_mode()
def profile_step(executor: Executor, config: EngineConfig, max_model_len: int, device: torch.device) -> None:
    """The step with the largest activations the engine will run: a prefill of
    max_num_batched_tokens tokens, on a throwaway KV cache just big enough for it, then
    the LM head and a softmax over as many rows as a full batch of verify steps needs."""
    model = executor.model
    mc = model.config
    inputs, num_blocks = prefill_inputs(step_lengths(config.max_num_batched_tokens, max_model_len), config.block_size)
    kv = KVCache(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                 config.kv_cache_torch_dtype, device)
    ids, positions, meta, _ = upload(inputs, device)
    hidden = executor.forward(ids, positions, kv.layers, meta)  # [T, H]
    spec = config.speculative_config
    rows = min(hidden.shape[0], config.max_num_seqs * (1 + (spec.num_lookahead_slots if spec else 0)))
    torch.softmax(model.compute_logits(hidden[-rows:]), dim=-1)


def prefill_inputs(lengths: list[int], block_size: int) -> tuple[StepInputs, int]:
    """Whole prompts of these lengths (token 0) in consecutive blocks, and the blocks used."""
    inputs = StepInputs([], [], [], [], [], [], [], None, [])
    next_block = 0
    for length in lengths:
        table = list(range(next_block, next_block + -(-length // block_size)))
        next_block += len(table)
        inputs.token_ids += [0] * length
        inputs.positions += range(length)
        inputs.slots += [table[p // block_size] * block_size + p % block_size for p in range(length)]
        inputs.query_lens.append(length)
        inputs.seq_lens.append(length)
        inputs.block_tables.append(table)
        inputs.num_rows.append(0)
    return inputs, next_block


def measure_used_bytes(run: Callable[[], None], device: torch.device) -> tuple[int, int]:
    """(total, used) bytes of the GPU around `run`: used = the peak torch allocated while
    it ran plus what is held outside torch's allocator. CUDA only."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)  # CUDA context, cuBLAS, other processes
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()  # what the profile cached goes back, for the KV cache and the graphs
    return total, peak + outside_torch


def draft_model_bytes(config: EngineConfig) -> tuple[int, int]:
    """(bytes per KV block, fixed bytes) the drafter takes once it is built, as
    drafters/factory.py's device_bytes says: a draft model's KV blocks (one per target
    block, plus max_num_seqs) and weights. (0, 0) without a draft model."""
    return device_bytes(config.speculative_config, config.block_size, config.dtype, config.max_num_seqs)


def gpu_kv_blocks(model: LlamaForCausalLM, config: EngineConfig, max_model_len: int, bytes_per_block: int,
                  device: torch.device) -> int:
    """The target's KV blocks on CUDA for gpu_memory_utilization (see the module docstring)."""
    draft_per_block, draft_fixed = draft_model_bytes(config)
    # Before the runner and its executor exist: the Python layers, what runs (or is captured) on CUDA.
    eager = PythonLayers(model)
    total, used = measure_used_bytes(lambda: profile_step(eager, config, max_model_len, device), device)
    return kv_cache_blocks(total, used + draft_fixed, config.gpu_memory_utilization,
                           bytes_per_block + draft_per_block)
