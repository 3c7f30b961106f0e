"""Medusa-1 heads: from the target's last hidden state, guess the next few tokens at once.

Head i maps the hidden state h that produced the last committed token to
h + SiLU(W_i h + b_i), read through the target's own LM head: a guess for the token
i + 1 places after the last committed one. Top-1 per head gives a chain; top-k per head
arranged by tree choices gives a static tree.

Heads whose medusa_config.json says `"head_type": "recurrent"` are recurrent Medusa heads
instead (recurrent_heads.py, drafted by recurrent_drafter.py): each guess also reads the
tokens guessed before it.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdec.drafters import recurrent_heads
from specdec.drafters.base import Drafter, DrafterContext, DraftRequest, HiddenReader
from specdec.drafters.recurrent_drafter import DYNAMIC_WIDTH, RecurrentDrafter
from specdec.drafters.tree_choices import DEFAULT_CHOICES, Choice, tree_from_choices
from specdec.head_graphs import HeadGraphs
from specdec.sampler import SamplingTensors, argmax, logits_to_probs, sample_probs
from specdec.spec.tree import DraftTree

if TYPE_CHECKING:
    from specdec.models import LlamaForCausalLM

SHIPPED = Path(__file__).parent / "weights"


class MedusaHeads(torch.nn.Module):
    def __init__(self, weights: torch.Tensor, biases: torch.Tensor,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.weights = weights  # [heads, H, H]
        self.biases = biases  # [heads, H]
        self.compute_logits = compute_logits  # the target's LM head: [N, H] -> [N, V] float32

    @property
    def num_heads(self) -> int:
        return int(self.weights.shape[0])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [heads, B, V] float32
        residual = torch.einsum("bh,koh->kbo", hidden, self.weights) + self.biases[:, None, :]
        states = hidden[None] + F.silu(residual)  # [heads, B, H]
        # One LM-head matmul for every head (through the target's linear backend): the
        # weight is read from memory once.
        return self.compute_logits(states.reshape(-1, states.shape[-1])).view(self.num_heads, hidden.shape[0], -1)


def load_heads(path: Path, lm_head: torch.Tensor,
               compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> MedusaHeads:
    config = json.loads((path / "medusa_config.json").read_text())
    tensors = load_file(str(path / "medusa_heads.safetensors"))
    n = config["num_heads"]
    if config["hidden_size"] != lm_head.shape[1]:
        raise ValueError(f"Medusa heads in {path} have hidden size {config['hidden_size']}, "
                         f"the target has {lm_head.shape[1]}")
    weights = torch.stack([tensors[f"heads.{i}.weight"] for i in range(n)]).to(lm_head.device, lm_head.dtype)
    biases = torch.stack([tensors[f"heads.{i}.bias"] for i in range(n)]).to(lm_head.device, lm_head.dtype)
    return MedusaHeads(weights, biases, compute_logits)


def _recurrent(context: DrafterContext, path: Path, choices: list[Choice], dynamic: bool,
               branching: bool) -> RecurrentDrafter:
    model = context.target
    heads, vocab = recurrent_heads.load(path, model.embed_tokens.dtype, model.embed_tokens.device)
    if heads.mix.in_features != 2 * model.embed_tokens.shape[1]:
        raise ValueError(f"recurrent Medusa heads in {path} have hidden size {heads.mix.in_features // 2}, "
                         f"the target has {model.embed_tokens.shape[1]}")
    heads.use(model.linear_backend)
    if vocab is not None and (int(vocab.max()) >= model.embed_tokens.shape[0] or int(vocab.min()) < 0):
        raise ValueError(f"the draft vocabulary in {path} has token ids outside the target's "
                         f"[0, {model.embed_tokens.shape[0]})")
    lm_head = model.compute_logits if vocab is None else _lm_head_over(model, vocab)
    drafter = RecurrentDrafter(heads, model.embed_tokens, lm_head, choices, vocab, dynamic, branching)
    if context.cuda_graphs:  # a step's rows: each request's frontier, at most DYNAMIC_WIDTH nodes
        drafter.use_graphs(context.max_num_seqs * DYNAMIC_WIDTH)
    return drafter


def _lm_head_over(model: LlamaForCausalLM, vocab: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's LM head over the rows `vocab` only ([N, H] -> [N, Vd] float32), on the
    target's linear backend."""
    weight = model.lm_head_weight[vocab]  # [Vd, H]
    backend = model.linear_backend
    packed = backend.prepare(weight)
    return lambda hidden: backend.apply(hidden, packed).float()


def resolve_heads_dir(name: str | None) -> Path:
    path = Path(name) if name else SHIPPED / "smollm2-135m-medusa"
    if not (path / "medusa_config.json").is_file() and (SHIPPED / str(name) / "medusa_config.json").is_file():
        path = SHIPPED / str(name)
    if not (path / "medusa_config.json").is_file():
        raise ValueError(f"no Medusa heads at {path} (expected medusa_config.json and medusa_heads.safetensors)")
    return path


def _measured_choices(path: Path) -> list[list[int]]:
    """The tree train_medusa chose for these heads on its data (best first), if any."""
    choices: list[list[int]] = json.loads((path / "medusa_config.json").read_text()).get("tree_choices", [])
    return choices


def build_medusa(context: DrafterContext) -> Drafter:
    """The drafter of `method: "medusa"`: Medusa-1 heads, or recurrent ones when the
    heads' medusa_config.json says `"head_type": "recurrent"` (recurrent_heads.py).

    Medusa-1 trees are static (`tree_choices`). Recurrent heads draft EAGLE-2 dynamic
    trees unless the speculative config gives `tree_choices`: their guesses follow
    their own path, so the best nodes differ from step to step."""
    spec = context.spec
    path = resolve_heads_dir(spec.model)
    choices = [tuple(c) for c in spec.tree_choices or _measured_choices(path)] or DEFAULT_CHOICES
    if json.loads((path / "medusa_config.json").read_text()).get("head_type") == recurrent_heads.HEAD_TYPE:
        return _recurrent(context, path, choices, dynamic=spec.tree_choices is None,
                          branching=spec.num_tree_nodes > 0)
    heads = load_heads(path, context.target.lm_head_weight, context.target.compute_logits)
    drafter = MedusaDrafter(heads, choices, branching=spec.num_tree_nodes > 0)
    if context.cuda_graphs:
        drafter.use_graphs(context.max_num_seqs)
    return drafter


def build_recurrent_heads(context: DrafterContext) -> RecurrentDrafter:
    """The recurrent heads of `model` (a directory or shipped name) drafting EAGLE-2 dynamic
    trees, for hybrid drafting."""
    path = resolve_heads_dir(context.spec.model)
    if json.loads((path / "medusa_config.json").read_text()).get("head_type") != recurrent_heads.HEAD_TYPE:
        raise ValueError(f"hybrid drafting needs recurrent Medusa heads (medusa_config.json \"head_type\": "
                         f"\"{recurrent_heads.HEAD_TYPE}\"), and {path} holds other heads")
    return _recurrent(context, path, list(DEFAULT_CHOICES), dynamic=True, branching=True)


class MedusaDrafter(HiddenReader):
    def __init__(self, heads: MedusaHeads, choices: list[Choice], branching: bool) -> None:
        super().__init__()
        self.heads = heads
        self.choices = choices
        self.branching = branching  # static trees from `choices` instead of chains
        self.top_k = 1 + max((max(c) for c in choices if c), default=0)
        self.run_heads: Callable[[torch.Tensor], torch.Tensor] = heads  # eager, or replayed graphs (`use_graphs`)
        self.graphs: HeadGraphs | None = None

    def use_graphs(self, max_rows: int) -> None:
        """Run the heads from CUDA graphs captured per batch size, up to max_rows requests
        (specdec/head_graphs.py); their outputs are row-major there: [B, heads, V]."""
        weights = self.heads.weights  # [heads, H, H]
        graphs = self.graphs = HeadGraphs(lambda hidden: (self.heads(hidden).transpose(0, 1),),
                                          [weights.new_zeros(1, weights.shape[1])], max_rows)
        self.run_heads = lambda hidden: graphs(hidden)[0].transpose(0, 1)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        ready = [i for i, r in enumerate(requests) if self.has_hidden(r.request_id)]
        drafts = [DraftTree.chain([r.token_ids[-1]]) for r in requests]
        if not ready:
            return drafts
        logits = self.run_heads(torch.stack([self.target_hidden(requests[i].request_id)
                                             for i in ready]))  # [heads, R, V]
        # Every ready request's ranked guesses in one copy to the host (one wait for the GPU).
        top = logits.topk(self.top_k, dim=-1).indices if self.branching else argmax(logits).unsqueeze(-1)
        ranked = top.tolist()  # [heads][R][top_k]
        for row, i in enumerate(ready):
            drafts[i] = self._draft(requests[i], logits[:, row], [head[row] for head in ranked])
        return drafts

    def _draft(self, request: DraftRequest, logits: torch.Tensor,  # [heads, V]
               ranked: list[list[int]]) -> DraftTree:  # ranked: [heads][top_k] each head's best tokens
        depth = min(request.max_depth, self.heads.num_heads)
        logits = logits[:depth]
        root = request.token_ids[-1]
        if self.branching:
            return tree_from_choices(root, ranked[:depth], self.choices).prune(request.num_draft_tokens, depth)
        if request.sampling_params.greedy:
            return DraftTree.chain([root, *(head[0] for head in ranked[:depth])])
        st = SamplingTensors.from_params([request.sampling_params] * depth, [None] * depth)
        probs = logits_to_probs(logits, st)  # [depth, V]
        return DraftTree.chain([root, *sample_probs(probs, st.generators).tolist()], probs)
