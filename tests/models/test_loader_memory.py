"""The loader's host memory (specdec/models/loader.py): a bf16 checkpoint loads into
parameters already in bf16 on the target device, through one chunk of the file at a time
(safetensors' `safe_open` reopened every MAP_BYTES), never a float32 copy of a weight; the
host's peak grows by less than 1.5x the file, and by more with one handle held over the whole
load. Chunked reads give the same weights as whole ones, safetensors and GGUF alike."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from specdec.models import loader
from specdec.models.config import ModelConfig
from specdec.models.loader import SafetensorsShard, load_model
from tests.models.test_gguf_load import write_gguf

ROOT = Path(__file__).resolve().parents[2]
# A checkpoint big enough for the RSS to show a whole extra copy (~190 MB of bf16).
LARGE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=5, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, vocab_size=32000)
# Peak RSS growth over the load, in MiB, measured in a fresh process; `device` and the CUDA
# context are set up before the baseline, so only the load is counted. argv[3]: MAP_BYTES.
MEASURE = """
import json, sys, torch
from specdec.models import loader
from specdec.models.loader import load_model
device = torch.device(sys.argv[2])
loader.MAP_BYTES = int(sys.argv[3])
if device.type == "cuda":
    torch.zeros(1, device=device)
def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":")) / 1024
try:
    open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
except OSError:
    pass
before = status("VmRSS")
model = load_model(sys.argv[1], dtype=torch.bfloat16, device=device)
if device.type == "cuda":
    torch.cuda.synchronize()
growth = status("VmHWM") - before
sums = {name: float(p.sum(dtype=torch.float64)) for name, p in model.named_parameters()}
print(json.dumps({"growth": growth, "sums": sums}))
"""


def write_bf16_checkpoint(path: Path, seed: int = 0, **shape: int) -> Path:
    """A random llama checkpoint stored in bf16 (config.json and one safetensors file)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", **shape}
    (path / "config.json").write_text(json.dumps(config))
    hidden, inter, heads = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"]
    q_rows, kv_rows = heads * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def random(*dims: int) -> torch.Tensor:  # straight in bf16: no float32 copy in the test process either
        return torch.empty(dims, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)

    tensors = {"model.embed_tokens.weight": random(shape["vocab_size"], hidden), "model.norm.weight": random(hidden)}
    for i in range(shape["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        for name, dims in {"input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
                           "self_attn.q_proj": (q_rows, hidden), "self_attn.k_proj": (kv_rows, hidden),
                           "self_attn.v_proj": (kv_rows, hidden), "self_attn.o_proj": (hidden, q_rows),
                           "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                           "mlp.down_proj": (hidden, inter)}.items():
            tensors[f"{layer}{name}.weight"] = random(*dims)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def large_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bf16_checkpoint(tmp_path_factory.mktemp("large-bf16"), **LARGE)


@pytest.fixture(scope="module")
def tiny_bf16(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test checkpoint stored in bf16."""
    path = tmp_path_factory.mktemp("tiny-bf16") / "model"
    shutil.copytree(tiny_model_dir, path)
    weights = path / "model.safetensors"
    save_file({name: t.to(torch.bfloat16) for name, t in load_file(str(weights)).items()}, str(weights))
    return path


def measure_load(model_dir: Path, device: str, map_bytes: int = loader.MAP_BYTES) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(model_dir), device, str(map_bytes)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def file_mib(model_dir: Path) -> float:
    return (model_dir / "model.safetensors").stat().st_size / 2**20


def test_a_bf16_load_onto_the_cpu_grows_the_host_by_less_than_1_5x_the_file(large_bf16: Path) -> None:
    """The model itself is on the host here (1.0x): what is left is MAP_BYTES of the file."""
    measured = measure_load(large_bf16, "cpu")
    assert measured["growth"] < 1.5 * file_mib(large_bf16), (measured["growth"], file_mib(large_bf16))


def test_one_safe_open_held_over_the_whole_load_exceeds_the_bound(large_bf16: Path) -> None:
    """The control: a handle never reopened keeps every page it read, the model plus the
    whole file (about 2x), so the measurement above can fail; same weights either way."""
    held, reopened = measure_load(large_bf16, "cpu", map_bytes=1 << 62), measure_load(large_bf16, "cpu")
    assert held["growth"] > 1.5 * file_mib(large_bf16), (held["growth"], file_mib(large_bf16))
    assert held["sums"] == reopened["sums"]


@pytest.mark.cuda
def test_a_bf16_load_onto_the_gpu_grows_the_host_by_less_than_1_5x_the_file(large_bf16: Path) -> None:
    """On the GPU the host holds only chunks of the file (the bound the issue set is 1.5x),
    and the weights arrive as on the CPU."""
    on_gpu, on_cpu = measure_load(large_bf16, "cuda"), measure_load(large_bf16, "cpu")
    assert on_gpu["growth"] < 1.5 * file_mib(large_bf16), (on_gpu["growth"], file_mib(large_bf16))
    assert on_gpu["sums"] == on_cpu["sums"]


# ---- chunks --------------------------------------------------------------------------------------


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_reads_give_the_same_weights_as_whole_ones(tiny_model_dir: Path, tiny_bf16: Path,
                                                            tmp_path: Path, dtype: torch.dtype,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = write_gguf(tmp_path / "tiny.gguf", tiny_model_dir)
    for model_dir in (tiny_model_dir, tiny_bf16, gguf):
        whole = parameters(load_model(model_dir, dtype=dtype))
        with monkeypatch.context() as patch:
            patch.setattr(loader, "CHUNK_BYTES", 1000)  # a few rows a chunk, rows split unevenly
            patch.setattr(loader, "MAP_BYTES", 1000)  # the shard reopened every chunk or so
            chunked = parameters(load_model(model_dir, dtype=dtype))
        assert whole.keys() == chunked.keys()
        assert all(torch.equal(whole[name], chunked[name]) for name in whole), model_dir


def test_the_weights_are_the_files(tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "CHUNK_BYTES", 1000)
    model = load_model(tiny_bf16, dtype=torch.bfloat16)
    stored = load_file(str(tiny_bf16 / "model.safetensors"))
    layer = "model.layers.1."
    qkv = torch.cat([stored[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.get_parameter("layers.1.qkv_proj.weight"), qkv)
    assert torch.equal(model.get_parameter("embed_tokens"), stored["model.embed_tokens.weight"])


class FloatTensors(TorchDispatchMode):
    """The largest float32 tensor any op took or made, in elements."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in (*args, *(kwargs or {}).values(), out):
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                self.largest = max(self.largest, value.numel())
        return out


def largest_float32_while_copying(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Load in bf16 and watch the weights' copies (model construction's float32 RoPE tables
    are no weight)."""
    watch = FloatTensors()
    copy_into = loader._Rows.copy_into

    def watched(self: Any, dest: torch.Tensor, broadcast: bool) -> None:
        with watch:
            copy_into(self, dest, broadcast)

    monkeypatch.setattr(loader._Rows, "copy_into", watched)
    monkeypatch.setattr(loader, "CHUNK_BYTES", 1000)
    load_model(model_dir, dtype=torch.bfloat16)
    return watch.largest


def test_a_bf16_checkpoint_loads_without_any_float32_tensor(tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert largest_float32_while_copying(tiny_bf16, monkeypatch) == 0


def test_a_gguf_loaded_in_bf16_holds_float32_one_chunk_at_a_time(tiny_model_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Its blocks dequantize to float32, never a whole weight at once (the smallest weight
    of the tiny model, k_proj, is 32 x 64 = 2,048 floats; a chunk of 1,000 bytes is 250)."""
    gguf = write_gguf(tmp_path / "tiny.gguf", tiny_model_dir)
    largest = largest_float32_while_copying(gguf, monkeypatch)
    assert 0 < largest <= 1000 // 4


# ---- the shard reader ----------------------------------------------------------------------------------


def chunks(shard: SafetensorsShard, name: str, max_rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    for first, rows in shard.chunks(name, max_rows):
        yield first, rows.clone()  # a view of the map: copied, as the loader does


def test_the_reader_gives_each_tensor_in_row_ranges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {"matrix": torch.arange(70, dtype=torch.float32).reshape(7, 10), "vector": torch.arange(5.0),
               "scalar": torch.tensor(3, dtype=torch.int64), "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
               "half": torch.randn(5, 3).to(torch.float16)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    monkeypatch.setattr(loader, "MAP_BYTES", 100)  # reopened within "matrix" (280 bytes) too
    shard = SafetensorsShard(tmp_path / "t.safetensors")
    got = list(chunks(shard, "matrix", 3))
    assert [first for first, _ in got] == [0, 3, 6] and [rows.shape[0] for _, rows in got] == [3, 3, 1]
    assert torch.equal(torch.cat([rows for _, rows in got]), tensors["matrix"])
    for name in ("vector", "scalar", "empty"):  # whole, whatever max_rows
        (first, whole), = chunks(shard, name, 1)
        assert first == 0 and whole.dtype == tensors[name].dtype and torch.equal(whole, tensors[name])
    assert torch.equal(torch.cat([rows for _, rows in chunks(shard, "half", 2)]), tensors["half"])
    assert shard.shape("matrix") == (7, 10) and set(shard.keys()) == set(tensors)
    shard.close()


def count_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    opened: list[str] = []
    real = loader.safe_open

    def counted(path: str, framework: str) -> Any:
        opened.append(path)
        return real(path, framework=framework)

    monkeypatch.setattr(loader, "safe_open", counted)
    return opened


def test_a_shard_is_reopened_per_map_bytes_read_not_per_tensor(tiny_bf16: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reopening reads the header again: the tiny model (well under MAP_BYTES) takes one
    for the names and shapes and one for all its tensors; with MAP_BYTES at a byte, one more
    per tensor (each read whole: CHUNK_BYTES is far larger)."""
    opened = count_opens(monkeypatch)
    load_model(tiny_bf16, dtype=torch.bfloat16)
    assert len(opened) == 2
    opened.clear()
    monkeypatch.setattr(loader, "MAP_BYTES", 1)
    load_model(tiny_bf16, dtype=torch.bfloat16)
    plan = loader.weight_plan(ModelConfig.from_dir(tiny_bf16))
    assert len(opened) == 1 + len({piece.hf_name for pieces in plan.values() for piece in pieces})


def test_a_file_that_is_no_safetensors_or_is_cut_short_is_a_clear_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="junk.safetensors is not a readable safetensors file: .*header"):
        SafetensorsShard(junk)
    whole = tmp_path / "whole.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(whole))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole.read_bytes()[:-100])
    with pytest.raises(ValueError, match="cut.safetensors is not a readable safetensors file: .*incomplete"):
        SafetensorsShard(cut)


def test_a_dtype_the_loader_does_not_read_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "scales.safetensors"
    save_file({"w": torch.ones(4, 4, dtype=torch.complex64)}, str(path))
    shard = SafetensorsShard(path)
    with pytest.raises(ValueError, match="scales.safetensors: tensor w has dtype C64, which the loader does not read"):
        shard.shape("w")


def test_a_shard_rewritten_during_the_load_is_an_error_naming_file_and_tensor(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "shard.safetensors"
    save_file({"w": torch.randn(8, 8)}, str(path))
    monkeypatch.setattr(loader, "MAP_BYTES", 32)  # a new handle for each row
    shard = SafetensorsShard(path)
    rows = shard.chunks("w", 1)
    next(rows)
    save_file({"other": torch.randn(8, 8)}, str(path))  # the next row reopens the new file
    with pytest.raises(ValueError, match="shard.safetensors: cannot read tensor w: "):
        next(rows)
