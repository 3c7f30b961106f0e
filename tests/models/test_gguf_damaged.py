"""A damaged .gguf given by path fails when it is first opened, before any tensor is read,
with one GGUFFileError naming the file, whether it is truncated or corrupt, and the field
(issue 41); `LLM(model=path)` and `specdec serve path` show exactly that message.

The copies are made from one tiny GGUF (test_gguf_load's writer) by cutting it short or
overwriting a field of its header or metadata in place."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.llm import LLM
from specdec.models import load_model, load_tokenizer
from specdec.models.gguf_file import GGUFFileError, GGUFTruncatedError, check_gguf
from specdec.models.gguf_loader import open_gguf
from tests.models.test_gguf_load import write_gguf

# The fixed header: magic, version, tensor count, metadata key count; the first key follows.
HEADER = struct.Struct("<4sIQQ")


@pytest.fixture(scope="module")
def intact(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "intact.gguf", tiny_model_dir).read_bytes()


def _copy(tmp_path: Path, data: bytes | bytearray) -> Path:
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    return path


def _with_header(data: bytes, **changes: object) -> bytearray:
    fields = dict(zip(("magic", "version", "tensors", "keys"), HEADER.unpack_from(data)))
    damaged = bytearray(data)
    HEADER.pack_into(damaged, 0, *{**fields, **changes}.values())
    return damaged


def _message(path: Path) -> str:
    with pytest.raises(GGUFFileError) as info:
        check_gguf(path)
    message = str(info.value)
    assert message.startswith(f"{path} is not a readable GGUF file: it is "), message
    return message


def test_the_intact_file_passes(intact: bytes, tmp_path: Path) -> None:
    check_gguf(_copy(tmp_path, intact))


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_a_file_cut_in_its_tensor_data_names_the_first_tensor_cut_off(intact: bytes, tmp_path: Path,
                                                                      keep: float) -> None:
    size = int(len(intact) * keep)
    message = _message(_copy(tmp_path, intact[:size]))
    found = re.search(r"it is truncated \(tensor data\): tensor '([\w.]+)' needs bytes up to (\d+) but the file "
                      r"has (\d+)$", message)
    assert found and found[1].startswith(("blk.", "output")) and int(found[2]) > size == int(found[3]), message


def test_a_file_cut_in_its_metadata_names_the_key(intact: bytes, tmp_path: Path) -> None:
    message = _message(_copy(tmp_path, intact[:300]))
    assert "it is truncated (metadata key " in message and message.endswith("but the file has 300")


def test_a_file_cut_in_its_header(intact: bytes, tmp_path: Path) -> None:
    assert "it is truncated (metadata key count field)" in _message(_copy(tmp_path, intact[:20]))
    assert "it is truncated (header)" in _message(_copy(tmp_path, b""))


def test_a_tensor_count_larger_than_the_file_can_hold(intact: bytes, tmp_path: Path) -> None:
    tensors = HEADER.unpack_from(intact)[2]
    message = _message(_copy(tmp_path, _with_header(intact, tensors=0xD0_0000_0000)))
    assert "it is corrupt (tensor count field): 893353197568 tensors would take at least" in message
    assert message.endswith(f"tensors #{tensors} on read as garbage")


def test_a_tensor_count_one_too_many_names_the_count(intact: bytes, tmp_path: Path) -> None:
    tensors = HEADER.unpack_from(intact)[2]
    message = _message(_copy(tmp_path, _with_header(intact, tensors=tensors + 1)))
    assert f"it is corrupt (tensor info #{tensors} (the tensor count field says {tensors + 1}))" in message


def test_a_metadata_key_count_larger_than_the_file_can_hold(intact: bytes, tmp_path: Path) -> None:
    message = _message(_copy(tmp_path, _with_header(intact, keys=1 << 40)))
    assert "it is corrupt (metadata key count field): 1099511627776 metadata keys" in message


def test_a_bad_magic_or_version(intact: bytes, tmp_path: Path) -> None:
    assert _message(_copy(tmp_path, _with_header(intact, magic=b"GGUX"))).endswith(
        "it is corrupt (header: bad magic): it starts with b'GGUX', not b'GGUF': not a GGUF file")
    assert "it is corrupt (header: version): version 9 is not one GGUF reads" in \
        _message(_copy(tmp_path, _with_header(intact, version=9)))


def test_a_metadata_value_of_no_gguf_type(intact: bytes, tmp_path: Path) -> None:
    damaged = bytearray(intact)
    key_length = struct.unpack_from("<Q", intact, HEADER.size)[0]
    key = intact[HEADER.size + 8:HEADER.size + 8 + key_length].decode()
    struct.pack_into("<I", damaged, HEADER.size + 8 + key_length, 99)
    assert f"it is corrupt (metadata key {key!r}: value type): 99 is not a GGUF value type" in \
        _message(_copy(tmp_path, damaged))


def test_a_tensor_name_that_is_not_utf8(intact: bytes, tmp_path: Path) -> None:
    name = b"token_embd.weight"
    damaged = intact.replace(name, b"\xd0" + name[1:], 1)
    assert len(damaged) == len(intact)
    assert "it is corrupt (tensor info #0 (the tensor count field says" in _message(_copy(tmp_path, damaged))


def test_every_way_in_reports_the_same_message(intact: bytes, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = _copy(tmp_path, intact[: len(intact) // 2])
    message = _message(path)
    for load in (open_gguf, load_model, load_tokenizer):
        with pytest.raises(GGUFTruncatedError) as info:
            load(path)
        assert str(info.value) == message, load
    with pytest.raises(GGUFTruncatedError) as info:
        LLM(str(path), max_model_len=64)
    assert str(info.value) == message
    with pytest.raises(SystemExit) as done:
        main(["serve", str(path), "--port", "1"])
    assert done.value.code == 2
    assert capsys.readouterr().err == f"specdec serve: error: {message}\n"
