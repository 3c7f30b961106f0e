"""Training an EAGLE-3 head on a tiny target: the captured features, the batch alignment,
the loss going down, and the command line writing a head that loads."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec.drafters import distill_data as dd
from specdec.drafters import train_eagle3 as te
from specdec.drafters.eagle3_head import load_eagle3_head
from specdec.models.config import ModelConfig

PROMPTS = ["Name a colour.", "Say hello.", "Count to three.", "What is Paris?", "Summarise this text.",
           "Add two numbers.", "Write a function.", "Translate hello.", "Tell a joke.", "Describe a fox."]
LAYERS = (0, 1, 1)


@pytest.fixture(scope="module")
def records(tiny_model_dir: Path) -> list[te.Record]:
    model, tokenizer = dd.load_target(str(tiny_model_dir))
    cfg = dd.DistillConfig(model=str(tiny_model_dir), max_new_tokens=12, topk=8)
    return te.generate_with_aux(model, tokenizer, PROMPTS[:6], cfg, LAYERS)


def test_aux_states_are_the_layers_inputs(records: list[te.Record], tiny_model_dir: Path) -> None:
    """What the hooks caught during generation = HF hidden_states[i] of a full forward,
    at every position but the last token's."""
    model, _ = dd.load_target(str(tiny_model_dir))
    for r in records:
        with torch.no_grad():
            states = model(r["tokens"][None].long(), output_hidden_states=True).hidden_states
        want = torch.cat([states[i][0, :-1] for i in LAYERS], dim=-1)
        torch.testing.assert_close(r["aux"].float(), want, atol=2e-2, rtol=1e-2)


def test_batch_targets_line_up(records: list[te.Record]) -> None:
    """Step j's target at row t is the target's distribution for x_{t+j+2} (its top-1 is
    the greedy token generated there); input row t holds x_{t+1}."""
    batch = te.make_batch(records, depth=3)
    for j in range(3):
        for i, r in enumerate(records):
            tokens = r["tokens"].long()
            rows = batch["valid"][j, i].nonzero().flatten()
            assert len(rows) == len(tokens) - r["prompt_len"]  # one per generated token, whatever j
            assert torch.equal(batch["top_idx"][j, i, rows, 0], tokens[rows + j + 2])
            assert torch.equal(batch["input_ids"][i, rows], tokens[rows + 1])


def test_loss_goes_down(records: list[te.Record], tiny_model_dir: Path) -> None:
    target = ModelConfig.from_dir(tiny_model_dir)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    vocab = te.draft_vocab(records, 128, target.vocab_size)
    head = te.init_head(target, vocab, LAYERS, embed, weights["model.norm.weight"], embed)
    history = te.train(head, records, steps=40, depth=3, lr=3e-3, batch_tokens=256, warmup=3, progress=False)
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    assert last < 0.7 * first, (first, last)


def test_command_line_writes_a_loadable_head(tmp_path: Path, tiny_model_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "head"
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "argv", [
        "train_eagle3", "--model", str(tiny_model_dir), "--data", str(prompts), "--num-train", "8",
        "--num-heldout", "2", "--max-new-tokens", "10", "--topk", "8", "--train-dtype", "float32",
        "--threads", "1", "--steps", "3", "--ttt-depth", "2", "--eval-depth", "3", "--draft-vocab", "100",
        "--aux-layers", *map(str, LAYERS), "--out", str(out), "--compare", str(tmp_path / "none")])
    te.main()
    target = ModelConfig.from_dir(tiny_model_dir)
    embed = load_file(str(tiny_model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    head = load_eagle3_head(out, target, embed)
    assert head.config.draft_vocab_size == 100 and head.config.aux_layers(target.num_layers) == LAYERS
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 3 and report["data"]["train_prompts"] == 8
    assert [h["predicts"] for h in report["heldout"]["heads"]] == ["t+2", "t+3", "t+4"]
