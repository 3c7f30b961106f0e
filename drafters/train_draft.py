"""Distil a small draft model (for `method: "draft_model"`) from the target.

The draft is a llama with the target's hidden size, a few layers initialised from some of
the target's layers, the target's final norm, and the target's embedding / tied LM head.
The embedding stays frozen and is not saved: the engine's loader fills
`model.embed_tokens.weight` / `lm_head.weight` from the target, so the checkpoint holds
only the layers and the final norm (a few MB in fp16).

Training minimises the cross-entropy from the target's top-k distribution (recorded
during the target's own generations by distill_data) to the draft's distribution, at the
positions the target actually generated. Held-out agreement is measured against the fp32
target over the full vocabulary.

    python -m specdec.drafters.train_draft --out drafters/weights/smollm2-135m-draft --steps 900
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from specdec.drafters import distill_data as dd
from specdec.model_registry import resolve_model

# ---------------------------------------------------------------------------------------
# Shared training utilities (train_medusa imports these too).
# ---------------------------------------------------------------------------------------


def sampled_log_probs(
    hidden: torch.Tensor, embed: torch.Tensor, wanted: torch.Tensor, num_negatives: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """log q(token) over a candidate set instead of the whole vocabulary.

    The LM head (576 x 49152) costs ~4x more than two decoder layers, so the softmax runs
    over the tokens the batch needs plus uniformly sampled negatives; the negatives'
    logits are shifted by log(rest / num_negatives) so their sum estimates the mass of all
    tokens left out. Returns (log_probs [N, |U|], column of each vocab id (-1 if absent)).
    """
    vocab = embed.shape[0]
    present = torch.zeros(vocab, dtype=torch.bool)
    present[wanted.reshape(-1).long()] = True
    rest = (~present).nonzero().squeeze(1)
    negatives = rest[torch.randperm(len(rest))[:num_negatives]]
    positives = present.nonzero().squeeze(1)
    cand = torch.cat([positives, negatives])
    logits = hidden @ embed[cand].T.to(hidden.dtype)
    logits = logits.float()
    if len(negatives):
        logits[:, len(positives):] += math.log(len(rest) / len(negatives))
    column = torch.full((vocab,), -1, dtype=torch.long)
    column[cand] = torch.arange(len(cand))
    return logits.log_softmax(dim=-1), column


def soft_cross_entropy(log_q: torch.Tensor, column: torch.Tensor,
                       top_val: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_k p_k log q_k, p = softmax of the target's top-k logits
    (KL to the target up to the target's own entropy)."""
    p = top_val.float().softmax(dim=-1)
    log_q_k = log_q.gather(1, column[top_idx.long()])
    return -(p * log_q_k).sum(dim=-1).mean()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def chain_stats(correct: list[torch.Tensor], ks: tuple[int, ...]) -> dict[str, float]:
    """Expected accepted tokens for greedy chains of length k.

    `correct[s][j]` says whether a chain started at position s gets its (j+1)-th draft
    token right assuming all earlier ones were right; the chain keeps going while the
    guesses match, so accepted = number of leading Trues, capped at k.
    """
    out: dict[str, float] = {}
    for k in ks:
        accepted = []
        for row in correct:
            run = 0
            for ok in row[:k].tolist():
                if not ok:
                    break
                run += 1
            accepted.append(run)
        mean = sum(accepted) / max(1, len(accepted))
        out[f"k{k}_mean_accepted"] = round(mean, 3)
        out[f"k{k}_acceptance_rate"] = round(mean / k, 3)
        out[f"k{k}_tokens_per_target_step"] = round(mean + 1, 3)  # + the target's own token
    return out


def optimize(opt: torch.optim.Optimizer, params: list[torch.Tensor], loss: torch.Tensor) -> None:
    """One optimizer step on `loss`, the gradient clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def setup_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    random.seed(0)


# ---------------------------------------------------------------------------------------
# Draft model.
# ---------------------------------------------------------------------------------------


def build_draft(target, layer_ids: list[int]):
    """A LlamaForCausalLM with len(layer_ids) layers copied from the target, the target's
    final norm, and the target's embedding / tied head (frozen, shared by reference)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg_dict = target.config.to_dict()
    cfg_dict["num_hidden_layers"] = len(layer_ids)
    cfg_dict.pop("layer_types", None)  # per-layer list sized for the target
    draft = LlamaForCausalLM(LlamaConfig(**cfg_dict)).float()
    for j, i in enumerate(layer_ids):
        draft.model.layers[j].load_state_dict(target.model.layers[i].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight
    draft.tie_weights()
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def draft_hidden(draft, records: list[dict]) -> torch.Tensor:
    """Final-norm hidden states of the draft at every position that predicts a generated
    token, concatenated over records in order ([sum C, H])."""
    width = max(len(r["tokens"]) for r in records)
    pad = draft.config.eos_token_id
    # Right padding: with causal attention the pads only affect positions we never read.
    ids = torch.full((len(records), width), pad, dtype=torch.long)
    for b, r in enumerate(records):
        ids[b, :len(r["tokens"])] = r["tokens"].long()
    hidden = draft.model(input_ids=ids, use_cache=False).last_hidden_state
    rows = []
    for b, r in enumerate(records):
        p, c = r["prompt_len"], len(r["top_idx"])
        rows.append(hidden[b, p - 1:p - 1 + c])
    return torch.cat(rows)


def record_batches(records: list[dict], max_tokens: int) -> list[list[dict]]:
    """Records grouped by length into batches of at most ~max_tokens padded tokens."""
    order = sorted(records, key=lambda r: len(r["tokens"]))
    batches: list[list[dict]] = []
    cur: list[dict] = []
    for r in order:
        if cur and len(r["tokens"]) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(r)
    if cur:
        batches.append(cur)
    return batches


@torch.inference_mode()
def evaluate_draft(draft, records: list[dict], max_tokens: int = 2048) -> dict:
    """Top-1 / top-5 agreement with the target's greedy token, chain acceptance for k=3,5,
    and the sampling acceptance sum_x min(p, q) at temperature 1 (p from the top-k)."""
    embed = draft.model.embed_tokens.weight
    top1 = top5 = soft = n = 0.0
    chains: list[torch.Tensor] = []
    for batch in record_batches(records, max_tokens):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = draft_hidden(draft, batch)
        logits = hidden.float() @ embed.T  # the full vocabulary: this is what decoding sees
        target = torch.cat([r["top_idx"] for r in batch]).long()
        pred5 = logits.topk(5, dim=-1).indices
        hit = pred5[:, 0] == target[:, 0]
        top1 += hit.sum().item()
        top5 += (pred5 == target[:, :1]).any(-1).sum().item()
        q = logits.softmax(-1).gather(1, target)
        p = torch.cat([r["top_val"] for r in batch]).float().softmax(-1)
        soft += torch.minimum(p, q).sum(-1).sum().item()
        n += len(target)
        start = 0
        for r in batch:
            c = len(r["top_idx"])
            seq_hit = hit[start:start + c]
            chains += [seq_hit[s:] for s in range(c)]
            start += c
    report = {"positions": int(n), "top1_agreement": round(top1 / n, 4),
              "top5_contains_target_top1": round(top5 / n, 4),
              "sampling_acceptance_T1": round(soft / n, 4)}
    report.update(chain_stats(chains, (3, 5)))
    return report


# ---------------------------------------------------------------------------------------
# Training and saving.
# ---------------------------------------------------------------------------------------


def train(draft, train_recs: list[dict], args: argparse.Namespace) -> None:
    from tqdm import tqdm

    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    embed = draft.model.embed_tokens.weight
    batches = record_batches(train_recs, args.batch_tokens)
    draft.train()
    bar = tqdm(range(args.steps), desc="train draft", mininterval=5)
    ema = None
    for step in bar:
        batch = random.choice(batches)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        top_idx = torch.cat([r["top_idx"][:, :args.loss_topk] for r in batch])
        top_val = torch.cat([r["top_val"][:, :args.loss_topk] for r in batch]).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = draft_hidden(draft, batch)
            log_q, column = sampled_log_probs(hidden, embed, top_idx, args.negatives)
        loss = soft_cross_entropy(log_q, column, top_val, top_idx)
        optimize(opt, params, loss)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    draft.eval()


def save_draft(draft, out: Path, model_name: str, layer_ids: list[int], report: dict) -> int:
    """config.json + fp16 model.safetensors (layers and final norm only); returns bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    target_cfg = json.loads((resolve_model(model_name) / "config.json").read_text())
    cfg = dict(target_cfg)
    cfg.pop("layer_types", None)
    cfg.update({
        "num_hidden_layers": len(layer_ids),
        "tie_word_embeddings": True,
        "torch_dtype": "float16",
        "specdec_shares_embeddings_with": Path(model_name).name,
        "specdec_init_layers": layer_ids,  # provenance only
    })
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in draft.state_dict().items()
             if k.startswith("model.layers.") or k == "model.norm.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "agreement.json").write_text(json.dumps(report, indent=2) + "\n")
    return (out / "model.safetensors").stat().st_size


def load_saved_draft(target, out: Path):
    """Rebuild the draft from its folder the way the engine does (embedding from target),
    so the reported numbers are those of the fp16 checkpoint actually shipped."""
    from safetensors.torch import load_file

    cfg = json.loads((out / "config.json").read_text())
    draft = build_draft(target, list(range(cfg["num_hidden_layers"])))
    missing, unexpected = draft.load_state_dict(
        {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"model.embed_tokens.weight", "lm_head.weight"}, missing
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight
    draft.tie_weights()
    return draft.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dd.add_cli_args(parser)
    parser.add_argument("--out", type=Path, default=Path("drafters/weights/smollm2-135m-draft"))
    parser.add_argument("--layers", default="0,1",
                        help="target layers that initialise the draft's layers, in order")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per step")
    parser.add_argument("--negatives", type=int, default=2048, help="sampled-softmax negatives")
    parser.add_argument("--loss-topk", type=int, default=8,
                        help="target top-k used as soft labels (fewer = smaller softmax set)")
    parser.add_argument("--eval-init", action="store_true", help="also evaluate before training")
    args = parser.parse_args()
    setup_threads(args.threads)
    cfg = dd.config_from_args(args)
    train_recs, heldout = dd.ensure_dataset(cfg)
    target, _ = dd.load_target(cfg.model)
    layer_ids = [int(x) for x in args.layers.split(",")]
    draft = build_draft(target, layer_ids)
    print(f"draft layers {layer_ids}; {len(train_recs)} train / {len(heldout)} held-out sequences")
    if args.eval_init:
        print("before training:", json.dumps(evaluate_draft(draft, heldout)))
    t0 = time.time()
    train(draft, train_recs, args)
    minutes = (time.time() - t0) / 60
    report = {"init_layers": layer_ids, "steps": args.steps, "train_minutes": round(minutes, 1),
              "train_sequences": len(train_recs), "heldout_sequences": len(heldout),
              "data": dd.distill_dir(cfg).name}
    size = save_draft(draft, args.out, cfg.model, layer_ids, report)
    # Measure the shipped fp16 checkpoint, not the fp32 weights still in memory.
    report["heldout"] = evaluate_draft(load_saved_draft(target, args.out), heldout)
    report["checkpoint_bytes"] = size
    (args.out / "agreement.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
