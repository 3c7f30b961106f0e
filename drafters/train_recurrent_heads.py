"""Train recurrent Medusa heads (recurrent_heads.py) on the target's own generations.

The same distill_data cache as train_medusa.py: the target's final hidden state h at
each generated position t, the tokens it generated, and its top-k distribution at each
position. The block is unrolled teacher-forced along the generated tokens (the path a
greedy verify accepts): step i reads x_{t+i+1} and is trained toward the target's
distribution for x_{t+i+2}, and, as EAGLE does, its state toward the target's own hidden
state there (a smooth-L1 term), so later steps see states like the ones the target makes.

    python -m specdec.drafters.train_recurrent_heads --out drafters/weights/smollm2-135m-medusa-recurrent
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.drafters import distill_data as dd
from specdec.drafters import recurrent_heads
from specdec.drafters.medusa_tree import best_choices
from specdec.drafters.recurrent_heads import RecurrentHeads
from specdec.drafters.train_draft import (
    lr_at,
    optimize,
    sampled_log_probs,
    setup_threads,
    soft_cross_entropy,
)
from specdec.drafters.train_medusa import (
    FlatData,
    evaluate,
    target_embedding,
    target_tensor,
)


def path_embeds(data: FlatData, embed: torch.Tensor, rows: torch.Tensor,
                steps: int) -> list[torch.Tensor]:  # steps x [n, H]
    """Embeddings of x_{t+1}, ..., x_{t+steps} for the positions `rows` (a clamped,
    harmless token past a sequence's end; those steps count as misses)."""
    tokens = [data.token[rows]] + [data.token[data.future[i][rows].clamp(min=0)] for i in range(steps - 1)]
    return [embed[t] for t in tokens]


def train(model: RecurrentHeads, data: FlatData, embed: torch.Tensor, args: argparse.Namespace) -> None:
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    steps = model.num_steps
    valid = (data.future[steps - 1] >= 0).nonzero().squeeze(1)  # rows with every step in range
    bar = tqdm(range(args.steps), desc="train recurrent heads", mininterval=5)
    ema = None
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        rows = valid[torch.randint(len(valid), (args.batch_positions,))]
        future = [data.future[i][rows] for i in range(steps)]
        kk = args.loss_topk
        wanted = torch.cat([data.top_idx[f, :kk] for f in future])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            states = model.unroll(data.hidden[rows].float(), path_embeds(data, embed, rows, steps))
            log_q, column = sampled_log_probs(torch.cat(states), embed, wanted, args.negatives)
        n = len(rows)
        token_losses = [soft_cross_entropy(log_q[i * n:(i + 1) * n], column, data.top_val[f, :kk],
                                           data.top_idx[f, :kk]) for i, f in enumerate(future)]
        feature_losses = [F.smooth_l1_loss(s.float(), data.hidden[f].float()) for s, f in zip(states, future)]
        loss = torch.stack(token_losses).sum() + args.feature_weight * torch.stack(feature_losses).sum()
        optimize(opt, list(model.parameters()), loss)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", per_step=" ".join(f"{x.item():.2f}" for x in token_losses))


def draft_vocab(data: FlatData, size: int, vocab_size: int) -> torch.Tensor:  # [size] int64
    """The `size` tokens the target generated most often (ties: lower id), sorted."""
    counts = torch.bincount(data.token, minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[:size].sort().values


@torch.inference_mode()
def step_ranks(model: RecurrentHeads, data: FlatData, embed: torch.Tensor, top_k: int,
               vocab: torch.Tensor | None = None, chunk: int = 1024) -> torch.Tensor:  # [N, steps] int64
    """Where the generated token ranks in each step's top_k over the draft vocabulary
    (teacher-forced along the generated path); top_k when it is not there or lies past
    the sequence's end."""
    steps = model.num_steps
    lm_head = embed if vocab is None else embed[vocab]
    ranks = torch.full((len(data), steps), top_k, dtype=torch.long)
    for start in range(0, len(data), chunk):
        rows = torch.arange(start, min(start + chunk, len(data)))
        states = model.unroll(data.hidden[rows].float(), path_embeds(data, embed, rows, steps))
        for i, state in enumerate(states):
            top = (state @ lm_head.T).topk(top_k, dim=-1).indices  # [n, top_k] columns
            top = top if vocab is None else vocab[top]
            future = data.future[i][rows]
            hit = top == data.token[future.clamp(min=0)][:, None]
            rank = torch.where(hit.any(-1), hit.int().argmax(-1), top_k)
            ranks[rows, i] = torch.where(future >= 0, rank, top_k)
    return ranks


def initial_heads(args: argparse.Namespace, hidden: int) -> RecurrentHeads:
    """Fresh heads, or the --init ones in fp32 (their one block serves any depth)."""
    if args.init is None:
        return RecurrentHeads(hidden, args.width, args.num_heads)
    model, _ = recurrent_heads.load(args.init)
    if model.mix.out_features != args.width:
        raise SystemExit(f"--init heads have width {model.mix.out_features}, not --width {args.width}")
    model.num_steps = args.num_heads
    return model.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dd.add_cli_args(parser)
    parser.add_argument("--out", type=Path, default=Path("drafters/weights/smollm2-135m-medusa-recurrent"))
    parser.add_argument("--num-heads", type=int, default=4, help="steps unrolled (draft depth)")
    parser.add_argument("--width", type=int, default=1152, help="the block's inner width")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--batch-positions", type=int, default=512)
    parser.add_argument("--negatives", type=int, default=2048, help="sampled-softmax negatives")
    parser.add_argument("--loss-topk", type=int, default=8, help="target top-k used as soft labels")
    parser.add_argument("--feature-weight", type=float, default=0.1, help="weight of the hidden-state term")
    parser.add_argument("--tree-nodes", type=int, default=64, help="draft nodes of the stored tree")
    parser.add_argument("--tree-top-k", type=int, default=10, help="ranks per step the tree may use")
    parser.add_argument("--init", type=Path, default=None,
                        help="continue from these recurrent heads (same width; any depth)")
    parser.add_argument("--vocab", type=int, default=8192,
                        help="draft vocabulary: the most generated tokens (0: the whole vocabulary)")
    args = parser.parse_args()
    setup_threads(args.threads)
    cfg = dd.config_from_args(args)
    train_recs, heldout_recs = dd.ensure_dataset(cfg)
    lm_head, embed = target_embedding(cfg.model), target_tensor(cfg.model, "model.embed_tokens.weight")
    train_data, heldout = FlatData(train_recs, args.num_heads), FlatData(heldout_recs, args.num_heads)
    print(f"{len(train_data)} train / {len(heldout)} held-out positions")
    if not torch.equal(lm_head, embed):
        raise SystemExit("recurrent heads need a target whose LM head is tied to its input embedding")
    model = initial_heads(args, embed.shape[1])
    t0 = time.time()
    train(model, train_data, embed, args)
    report = {"steps": args.steps, "train_minutes": round((time.time() - t0) / 60, 1),
              "train_positions": len(train_data), "data": dd.distill_dir(cfg).name,
              "init": str(args.init) if args.init else None}
    meta = {"base_model": Path(cfg.model).name,
            "block": "s + W_out silu(W_in [s; embed(token)] + b_in) + b_out, from s = h; "
                     "the base model's (tied) LM head on each state"}
    vocab = draft_vocab(train_data, args.vocab, embed.shape[0]) if args.vocab else None
    report["checkpoint_bytes"] = recurrent_heads.save(model, args.out, meta, vocab)
    if vocab is not None:
        report["draft_vocab"] = {"size": len(vocab), "heldout_coverage": round(
            torch.isin(heldout.token, vocab).float().mean().item(), 4)}
    # Measure the shipped fp16 heads; choose the tree on the training positions, report
    # it on the held-out ones.
    shipped, vocab = recurrent_heads.load(args.out)
    choices = best_choices(step_ranks(shipped, train_data, embed, args.tree_top_k, vocab), args.tree_top_k,
                           args.tree_nodes)
    report["heldout"] = evaluate(step_ranks(shipped, heldout, embed, args.tree_top_k, vocab), heldout, choices)
    recurrent_heads.save(shipped, args.out, meta | {
        "heldout_top1": [h["top1"] for h in report["heldout"]["heads"]],
        "heldout_top5": [h["top5"] for h in report["heldout"]["heads"]],
        "tree_choices": [list(c) for c in choices]}, vocab)
    (args.out / "accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
