"""Recurrent Medusa heads: Medusa heads that see the tokens drafted before them.

A Medusa-1 head guesses token t+i+2 from the hidden state h at t alone, blind to the
tokens in between; the tokens it must follow are what makes the guess hard. Here one
shared block is unrolled along the draft path (the Recurrent Drafter, Cheng et al. 2024;
Hydra's sequentially dependent heads are the same idea with one block per depth):

    s_0 = h,   s_{i+1} = s_i + W_out SiLU(W_in [s_i; e(x_{t+i+1})] + b_in) + b_out

where e is the target's (tied) input embedding and x_{t+1} the token the target's own LM
head chose (the tree's root). Step i's guess for token t+i+2 is the target's LM head on
s_{i+1}. W_out starts at zero, so every step starts as the target's next-token guess.

The heads draft from a fixed subset of the vocabulary, the tokens the target generated
most often in the training data (FR-Spec, Zhao et al. 2025): the LM head over them costs
a fraction of the full one, which at batch 1 would otherwise dominate drafting. Drafts
are verified against the full distribution, so the subset costs only the guesses it
cannot make.

The module is shared by training (train_recurrent_heads.py) and the drafter
(medusa.py), so both run the same arithmetic.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.kernels.linear import LinearBackend

CONFIG = "medusa_config.json"
WEIGHTS = "medusa_heads.safetensors"
HEAD_TYPE = "recurrent"
VOCAB = "draft_vocab"  # [Vd] int64 token ids the heads draft from, in the weights file


class RecurrentHeads(torch.nn.Module):
    def __init__(self, hidden: int, width: int, num_steps: int) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(2 * hidden, width)  # [state; token embedding] -> width
        self.out = torch.nn.Linear(width, hidden)
        torch.nn.init.zeros_(self.out.weight)
        torch.nn.init.zeros_(self.out.bias)
        self.num_steps = num_steps  # the depth it was trained to unroll
        self._packed: tuple[LinearBackend, Any, Any] | None = None  # see `use`

    def use(self, backend: LinearBackend | None) -> None:
        """Run the two projections on `backend` (the target's: a drafting step reads
        fp16 weights, not fp32), or on F.linear (None, as in training)."""
        if backend is None:
            self._packed = None
            return
        self._packed = (backend, backend.prepare(self.mix.weight, self.mix.bias),
                        backend.prepare(self.out.weight, self.out.bias))

    def step(self, state: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """One step: [B, H] state and [B, H] embeddings of the tokens just drafted -> [B, H]."""
        joined = torch.cat([state, embeds.to(state.dtype)], dim=-1)  # [B, 2H]
        if self._packed is None:
            return state + self.out(F.silu(self.mix(joined)))
        backend, mix, out = self._packed
        return state + backend.apply(F.silu(backend.apply(joined, mix)), out)

    def unroll(self, hidden: torch.Tensor,  # [B, H] the target's final hidden state at t
               embeds: list[torch.Tensor],  # n x [B, H] embeddings of x_{t+1}, ..., x_{t+n}
               ) -> list[torch.Tensor]:  # n x [B, H]: states guessing x_{t+2}, ..., x_{t+n+1}
        """Teacher-forced states along one given path (training and evaluation)."""
        states, state = [], hidden
        for e in embeds:
            state = self.step(state, e)
            states.append(state)
        return states


def save(model: RecurrentHeads, out: Path, config: dict, vocab: torch.Tensor | None = None) -> int:
    """Weights (fp16), the draft vocabulary (`vocab`, [Vd] token ids; None: all) and
    medusa_config.json (`config` plus the shape); returns the weight file's size in bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    if vocab is not None:
        tensors[VOCAB] = vocab.to(torch.int64).contiguous()
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    shape = {"head_type": HEAD_TYPE, "hidden_size": model.mix.in_features // 2,
             "width": model.mix.out_features, "num_heads": model.num_steps}
    (out / CONFIG).write_text(json.dumps(shape | config, indent=2) + "\n")
    return (out / WEIGHTS).stat().st_size


def load(path: Path, dtype: torch.dtype = torch.float32,
         device: torch.device | str = "cpu") -> tuple[RecurrentHeads, torch.Tensor | None]:
    """Heads saved by `save`, in `dtype` on `device`, and their draft vocabulary ([Vd]
    int64 on `device`, or None for the full one)."""
    from safetensors.torch import load_file

    config = json.loads((path / CONFIG).read_text())
    if config.get("head_type") != HEAD_TYPE:
        raise ValueError(f"{path / CONFIG} does not describe recurrent heads (head_type "
                         f"{config.get('head_type')!r})")
    model = RecurrentHeads(config["hidden_size"], config["width"], config["num_heads"])
    tensors = load_file(str(path / WEIGHTS))
    vocab = tensors.pop(VOCAB, None)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()})
    return model.to(device, dtype).eval(), None if vocab is None else vocab.to(device)
