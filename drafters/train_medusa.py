"""Train Medusa-1 heads (for `method: "medusa"`) on the target's own hidden states.

Each head is one residual block `h + SiLU(W h + b)` followed by the target's frozen,
shared LM head. Convention (as in the Medusa paper): the target's own LM head predicts
token t+1 from the final-norm hidden state at position t; `heads.{i}` (0-based) predicts
token t+i+2, i.e. the (i+1)-th token *beyond* the target's next one. W and b start at 0,
so every head starts as a copy of the target's next-token prediction.

The hidden states come from the distill_data cache (recorded during the target's own
generations, stored under $SPECDEC_HOME/distill/), so nothing is recomputed here. The
loss is the cross-entropy to the target's distribution at the predicted position (its
top-k; for greedy data its argmax is the generated token), which carries more signal
than the one-hot token.

    python -m specdec.drafters.train_medusa --out drafters/weights/smollm2-135m-medusa --steps 600
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.drafters import distill_data as dd
from specdec.drafters.medusa_tree import best_choices, expected_accepted
from specdec.drafters.train_draft import (
    chain_stats,
    lr_at,
    optimize,
    sampled_log_probs,
    setup_threads,
    soft_cross_entropy,
)
from specdec.drafters.tree_choices import Choice
from specdec.model_registry import resolve_model

TREE_SIZES = (4, 8, 16, 24, 32, 48, 64)


class MedusaHeads(torch.nn.Module):
    """K residual blocks; the LM head is applied outside (it belongs to the target)."""

    def __init__(self, num_heads: int, hidden: int) -> None:
        super().__init__()
        linears = [torch.nn.Linear(hidden, hidden) for _ in range(num_heads)]
        for head in linears:  # zero init: each head starts as the identity
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
        self.heads = torch.nn.ModuleList(linears)

    def forward(self, h: torch.Tensor) -> list[torch.Tensor]:
        return [h + F.silu(head(h)) for head in self.heads]


class FlatData:
    """All generated positions of a split as flat tensors.

    Row r is the position predicting some generated token; `future[i][r]` is the row
    whose target distribution describes the token head i must predict (i+1 rows later in
    the same sequence), or -1 past the sequence's end.
    """

    def __init__(self, records: list[dict], num_heads: int) -> None:
        self.hidden = torch.cat([r["hidden"] for r in records])  # fp16 [N, H]
        self.top_val = torch.cat([r["top_val"] for r in records])
        self.top_idx = torch.cat([r["top_idx"] for r in records])
        # The token actually generated at each row (for accuracy).
        self.token = torch.cat([r["tokens"][r["prompt_len"]:] for r in records]).long()
        futures: list[list[torch.Tensor]] = [[] for _ in range(num_heads)]
        start = 0
        for r in records:
            c = len(r["top_idx"])
            rows = torch.arange(start, start + c)
            for i in range(num_heads):
                shifted = rows + i + 1
                futures[i].append(torch.where(shifted < start + c, shifted, -1))
            start += c
        self.future = [torch.cat(f) for f in futures]
        self.seq_end = start

    def __len__(self) -> int:
        return len(self.hidden)


def train(model: MedusaHeads, data: FlatData, embed: torch.Tensor,
          args: argparse.Namespace) -> None:
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    valid = [(f >= 0).nonzero().squeeze(1) for f in data.future]
    bar = tqdm(range(args.steps), desc="train medusa", mininterval=5)
    ema = None
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        # Rows valid for the last head are valid for all, so one sample serves every head.
        rows = valid[-1][torch.randint(len(valid[-1]), (args.batch_positions,))]
        h = data.hidden[rows].float()
        kk = args.loss_topk
        wanted = torch.cat([data.top_idx[data.future[i][rows], :kk] for i in range(len(model.heads))])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = model(h)
            log_q, column = sampled_log_probs(torch.cat(outs), embed, wanted, args.negatives)
        losses = []
        n = len(rows)
        for i in range(len(outs)):
            fut = data.future[i][rows]
            losses.append(soft_cross_entropy(log_q[i * n:(i + 1) * n], column,
                                             data.top_val[fut, :kk], data.top_idx[fut, :kk]))
        loss = torch.stack(losses).sum()
        optimize(opt, list(model.parameters()), loss)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", per_head=" ".join(f"{x.item():.2f}" for x in losses))


@torch.inference_mode()
def head_ranks(model: MedusaHeads, data: FlatData, embed: torch.Tensor, top_k: int,
               chunk: int = 1024) -> torch.Tensor:  # [N, heads] int64
    """Where the token each head must guess ranks in its top_k over the full vocabulary;
    top_k when it is not there or lies past the sequence's end."""
    ranks = torch.full((len(data), len(model.heads)), top_k, dtype=torch.long)
    for start in range(0, len(data), chunk):
        rows = torch.arange(start, min(start + chunk, len(data)))
        for i, out in enumerate(model(data.hidden[rows].float())):
            top = (out @ embed.T).topk(top_k, dim=-1).indices  # [n, top_k]
            future = data.future[i][rows]
            hit = top == data.token[future.clamp(min=0)][:, None]
            rank = torch.where(hit.any(-1), hit.int().argmax(-1), top_k)
            ranks[rows, i] = torch.where(future >= 0, rank, top_k)
    return ranks


def evaluate(ranks: torch.Tensor, data: FlatData, choices: list[Choice]) -> dict:
    """Per-head top-1 / top-5 accuracy against the generated tokens, expected accepted
    tokens for a chain of k heads, and tau of the best trees of several sizes."""
    valid = torch.stack([f >= 0 for f in data.future], dim=1)
    report: dict = {"positions": len(data), "heads": []}
    for i in range(ranks.shape[1]):
        m = valid[:, i]
        report["heads"].append({
            "head": i, "predicts": f"t+{i + 2}",
            "top1": round((ranks[m, i] == 0).float().mean().item(), 4),
            "top5": round((ranks[m, i] < 5).float().mean().item(), 4),
        })
    # A Medusa chain: the target supplies t+1; head i's guess survives only if heads
    # 0..i-1 were right too. Rows near a sequence end count as misses there.
    report["chain"] = chain_stats(list(ranks == 0), tuple(range(1, ranks.shape[1] + 1)))
    report["tree_tau"] = {str(n): round(1 + expected_accepted(choices[:n], ranks), 3)
                          for n in TREE_SIZES if n <= len(choices)}
    return report


def save_heads(model: MedusaHeads, out: Path) -> int:
    """medusa_heads.safetensors in fp16; returns its size in bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, head in enumerate(model.heads):
        assert isinstance(head, torch.nn.Linear)
        tensors[f"heads.{i}.weight"] = head.weight.detach().to(torch.float16).contiguous()
        tensors[f"heads.{i}.bias"] = head.bias.detach().to(torch.float16).contiguous()
    save_file(tensors, str(out / "medusa_heads.safetensors"), metadata={"format": "pt"})
    return (out / "medusa_heads.safetensors").stat().st_size


def write_config(out: Path, num_heads: int, hidden: int, model_name: str,
                 heldout: dict | None, choices: list[Choice] | None = None) -> None:
    heads = heldout["heads"] if heldout else []
    cfg = {
        "num_heads": num_heads,
        "hidden_size": hidden,
        "base_model": Path(model_name).name,
        "block": "h + silu(W h + b), then the base model's (tied) LM head",
        "head_offsets": [i + 2 for i in range(num_heads)],  # heads.{i} -> token t+i+2
        "dtype": "float16",
        "heldout_top1": [h["top1"] for h in heads],
        "heldout_top5": [h["top5"] for h in heads],
        # The best static tree on the training positions, most valuable node first
        # (medusa_tree.py): the drafter's tree unless speculative_config gives one.
        "tree_choices": [list(c) for c in choices or []],
    }
    (out / "medusa_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_saved(out: Path) -> MedusaHeads:
    """The shipped fp16 heads, so the report describes what the engine will load."""
    from safetensors.torch import load_file

    cfg = json.loads((out / "medusa_config.json").read_text())
    model = MedusaHeads(cfg["num_heads"], cfg["hidden_size"])
    model.load_state_dict({k: v.float() for k, v in
                           load_file(str(out / "medusa_heads.safetensors")).items()})
    return model.eval()


def target_tensor(model_name: str, *keys: str) -> torch.Tensor:
    """The first of `keys` in the target's model.safetensors, as float32."""
    from safetensors import safe_open

    with safe_open(str(resolve_model(model_name) / "model.safetensors"), framework="pt") as f:
        present = set(f.keys())
        return f.get_tensor(next(k for k in keys if k in present)).float()


def target_embedding(model_name: str) -> torch.Tensor:
    """The target's (tied) LM head matrix, read straight from its safetensors."""
    return target_tensor(model_name, "lm_head.weight", "model.embed_tokens.weight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dd.add_cli_args(parser)
    parser.add_argument("--out", type=Path, default=Path("drafters/weights/smollm2-135m-medusa"))
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-positions", type=int, default=512)
    parser.add_argument("--negatives", type=int, default=2048, help="sampled-softmax negatives")
    parser.add_argument("--loss-topk", type=int, default=8,
                        help="target top-k used as soft labels (fewer = smaller softmax set)")
    parser.add_argument("--tree-nodes", type=int, default=64, help="draft nodes of the stored tree")
    parser.add_argument("--tree-top-k", type=int, default=10, help="ranks per head the tree may use")
    parser.add_argument("--eval-only", action="store_true", help="no training: evaluate the heads in --out")
    args = parser.parse_args()
    setup_threads(args.threads)
    cfg = dd.config_from_args(args)
    train_recs, heldout_recs = dd.ensure_dataset(cfg)
    embed = target_embedding(cfg.model)
    train_data = FlatData(train_recs, args.num_heads)
    heldout = FlatData(heldout_recs, args.num_heads)
    print(f"{len(train_data)} train / {len(heldout)} held-out positions")
    if args.eval_only:  # re-measure the heads in --out and choose their tree
        report = json.loads((args.out / "accuracy.json").read_text())
        size = (args.out / "medusa_heads.safetensors").stat().st_size
    else:
        model = MedusaHeads(args.num_heads, embed.shape[1])
        t0 = time.time()
        train(model, train_data, embed, args)
        report = {"steps": args.steps, "train_minutes": round((time.time() - t0) / 60, 1),
                  "train_positions": len(train_data), "data": dd.distill_dir(cfg).name}
        size = save_heads(model, args.out)
        write_config(args.out, args.num_heads, embed.shape[1], cfg.model, None)
    # Measure the shipped fp16 heads, not the fp32 weights still in memory; choose the
    # tree on the training positions, report it on the held-out ones.
    shipped = load_saved(args.out)
    choices = best_choices(head_ranks(shipped, train_data, embed, args.tree_top_k), args.tree_top_k,
                           args.tree_nodes)
    report["heldout"] = evaluate(head_ranks(shipped, heldout, embed, args.tree_top_k), heldout, choices)
    report["checkpoint_bytes"] = size
    write_config(args.out, args.num_heads, embed.shape[1], cfg.model, report["heldout"], choices)
    (args.out / "accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
