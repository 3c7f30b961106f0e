"""Train an EAGLE-3 head (eagle3_head.py) for a target on the target's own answers.

Data: the target's greedy answers to the distill_data prompt set (or a --data file of
prompts), generated batched as distill_data does (`generate_batch`, whose LM-head hook
records the target's top-k logits at each generated position), with forward pre-hooks on
the target's three aux layers capturing the hidden states entering them at every
position, prompt included, during that same generation: no second pass. Shards are cached
under `$SPECDEC_HOME/distill/<model>/eagle3-<tag>-l<ids>/`.

Training is EAGLE-3's training-time test (`Eagle3Head.forward_train`): the layer is
unrolled --ttt-depth steps on its own outputs, step j at row t reading x_{t+j+1} at
position t+j and attending to step 0's keys at rows <= t plus its own earlier steps' keys,
exactly as drafting depth j does; step j's loss is the cross-entropy from the target's
top-k distribution (restricted to the draft vocabulary) for x_{t+j+2}, weighted 0.8^j, at
the answer positions whose target token the draft vocabulary holds. The draft vocabulary
is the --draft-vocab tokens the target generated most often (d2t / t2d); lm_head starts
from the target's LM-head rows for them and `norm` from its final norm.

    python -m specdec.drafters.train_eagle3 --out drafters/weights/smollm2-135m-eagle3
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specdec.drafters import distill_data as dd
from specdec.drafters.eagle3_head import Eagle3Config, Eagle3Head, config_dict, save_eagle3_head
from specdec.models.config import ModelConfig

STEP_WEIGHT = 0.8  # step j's loss weight is STEP_WEIGHT**j, as EAGLE-3 trains
Record = dict[str, Any]  # distill_data's record plus "aux" [L-1, 3H] fp16


# -- data --------------------------------------------------------------------------------------

class AuxCapture:
    """Forward pre-hooks on the target's aux layers: each call's input hidden states
    ([B, s, H], fp16), per layer in the order of `layer_ids`."""

    def __init__(self, model: Any, layer_ids: tuple[int, ...]) -> None:
        self.calls: list[list[torch.Tensor]] = [[] for _ in layer_ids]
        layers = model.model.layers
        self.handles = [layers[i].register_forward_pre_hook(self._hook(k), with_kwargs=True)
                        for k, i in enumerate(layer_ids)]

    def _hook(self, k: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            self.calls[k].append(hidden.detach().to(torch.float16))
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def sequences(self, records: list[Record]) -> list[torch.Tensor]:  # per record [L-1, 3H]
        """Per record, the aux states at positions 0..L-2: the prefill (left-padded to the
        batch's widest prompt) then one decode call per token fed back."""
        width = max(r["prompt_len"] for r in records)
        prefill = torch.cat([c[0] for c in self.calls], dim=-1)  # [B, W, 3H]
        decode = torch.cat([torch.cat(c[1:], dim=1) for c in self.calls], dim=-1) if len(self.calls[0]) > 1 \
            else prefill[:, :0]  # [B, steps-1, 3H]
        out = []
        for b, r in enumerate(records):
            generated = len(r["tokens"]) - r["prompt_len"]
            out.append(torch.cat((prefill[b, width - r["prompt_len"]:], decode[b, :generated - 1])))
        return out


def generate_with_aux(model: Any, tokenizer: Any, prompts: list[str], cfg: dd.DistillConfig,
                      layer_ids: tuple[int, ...]) -> list[Record]:
    capture = AuxCapture(model, layer_ids)
    try:
        records = dd.generate_batch(model, tokenizer, prompts, cfg)
    finally:
        capture.remove()
    for record, aux in zip(records, capture.sequences(records), strict=True):
        assert len(aux) == len(record["tokens"]) - 1
        record["aux"] = aux.clone()
    return records


def data_dir(cfg: dd.DistillConfig, layer_ids: tuple[int, ...], data_file: Path | None) -> Path:
    source = f"-{data_file.stem}" if data_file else ""
    return dd.distill_dir(cfg).parent / f"eagle3-{cfg.tag()}{source}-l{'.'.join(map(str, layer_ids))}"


def prompt_splits(cfg: dd.DistillConfig, data_file: Path | None, sample: int = 0) -> dict[str, list[str]]:
    """distill_data's split (with `sample`, a seeded random `sample` of its training
    prompts, spread over all its sections), or a JSON list of prompts whose first
    num_heldout are held out."""
    if data_file is None:
        splits = dd.split_prompts(cfg.num_train, cfg.num_heldout, cfg.seed)
        if sample:
            splits["train"] = random.Random(cfg.seed).sample(splits["train"], min(sample, len(splits["train"])))
        return splits
    prompts = json.loads(data_file.read_text())
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise SystemExit(f"--data {data_file}: expected a JSON list of prompt strings")
    held = prompts[:cfg.num_heldout]
    return {"heldout": held, "train": prompts[cfg.num_heldout:cfg.num_heldout + cfg.num_train]}


def ensure_data(cfg: dd.DistillConfig, layer_ids: tuple[int, ...], data_file: Path | None = None,
                sample: int = 0, progress: bool = True) -> tuple[list[Record], list[Record]]:
    """(train, heldout) records with aux states, generating the missing shards (the
    held-out ones in cfg.heldout_dtype, fp32: measured against the real target)."""
    from tqdm import tqdm

    out = data_dir(cfg, layer_ids, data_file)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg) | {"aux_layers": list(layer_ids)}, indent=2))
    names = {"heldout": "heldout", "train": f"train-r{sample}" if sample else "train"}
    for split, prompts in prompt_splits(cfg, data_file, sample).items():
        prompts = sorted(prompts, key=len)  # batches of similar length waste less on padding
        batches = [prompts[i:i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]
        todo = [i for i in range(len(batches)) if not (out / f"{names[split]}-{i:04d}.pt").exists()]
        if not todo:
            continue
        model, tokenizer = dd.load_target(cfg.model, cfg.heldout_dtype if split == "heldout" else cfg.train_dtype)
        torch.manual_seed(cfg.seed)
        for i in tqdm(todo, desc=f"generate {split}", disable=not progress):
            records = generate_with_aux(model, tokenizer, batches[i], cfg, layer_ids)
            if split == "train":  # the final hidden state only serves the held-out comparison
                for r in records:
                    del r["hidden"]
            shard = out / f"{names[split]}-{i:04d}.pt"
            torch.save(records, shard.with_suffix(".tmp"))
            shard.with_suffix(".tmp").rename(shard)
    return dd.load_split(out, names["train"]), dd.load_split(out, "heldout")


# -- batches -----------------------------------------------------------------------------------

def make_batch(records: list[Record], depth: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for forward_train: input_ids [B, S] (row t holds x_{t+1}),
    aux [B, S, 3H], mask [B, S]; and per step j the target's top-k at row t for x_{t+j+2}
    (top_idx / top_val [depth, B, S, k]) with `valid` [depth, B, S] where that exists."""
    s = max(len(r["tokens"]) - 1 for r in records)
    b, k = len(records), records[0]["top_idx"].shape[1]
    batch = {"input_ids": torch.zeros(b, s, dtype=torch.long), "mask": torch.zeros(b, s, dtype=torch.long),
             "aux": torch.zeros(b, s, records[0]["aux"].shape[1], dtype=torch.float16),
             "top_idx": torch.zeros(depth, b, s, k, dtype=torch.long), "top_val": torch.zeros(depth, b, s, k),
             "valid": torch.zeros(depth, b, s, dtype=torch.bool)}
    for i, r in enumerate(records):
        n = len(r["tokens"]) - 1
        batch["input_ids"][i, :n] = r["tokens"][1:].long()
        batch["aux"][i, :n] = r["aux"]
        batch["mask"][i, :n] = 1
        first = r["prompt_len"] - 1  # the position whose distribution is the record's row 0
        for j in range(depth):
            # row t's step j guesses the token after position t+j+1
            rows = torch.arange(max(0, first - j - 1), n - j - 1)
            src = rows + j + 1 - first
            batch["top_idx"][j, i, rows] = r["top_idx"][src].long()
            batch["top_val"][j, i, rows] = r["top_val"][src].float()
            batch["valid"][j, i, rows] = True
    return batch


def draft_vocab(records: list[Record], size: int, vocab_size: int) -> torch.Tensor:  # [size] int64, sorted
    """The `size` tokens the target generated most often (ties: lower id)."""
    tokens = torch.cat([r["tokens"][r["prompt_len"]:].long() for r in records])
    counts = torch.bincount(tokens, minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[:size].sort().values


def step_losses(head: Eagle3Head, outputs: list[torch.Tensor], batch: dict[str, torch.Tensor],
                draft_index: torch.Tensor) -> list[torch.Tensor]:
    """Per step, the mean cross-entropy from the target's top-k (in the draft vocabulary)
    at the rows whose target token has a draft id. draft_index [V]: draft id or -1."""
    losses = []
    for j, out in enumerate(outputs):
        idx = draft_index[batch["top_idx"][j]]  # [B, S, k]
        keep = batch["valid"][j] & (idx[..., 0] >= 0)
        if not keep.any():
            losses.append(out.sum() * 0)
            continue
        log_q = head.logits(out[keep]).float().log_softmax(-1)  # [n, Vd]
        col = idx[keep]
        p = batch["top_val"][j][keep].masked_fill(col < 0, float("-inf")).softmax(-1)
        losses.append(-(p * log_q.gather(1, col.clamp(min=0))).sum(-1).mean())
    return losses


# -- training ----------------------------------------------------------------------------------

def init_head(target: ModelConfig, vocab: torch.Tensor, layer_ids: tuple[int, ...], lm_head: torch.Tensor,
              final_norm: torch.Tensor, embed: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A fresh head: small random weights (HF's 0.02), norms at 1, lm_head and norm taken
    from the target (lm_head [V, H], final_norm [H], embed [V, H] the target's)."""
    config = Eagle3Config.from_dict(config_dict(target, len(vocab), layer_ids))
    torch.manual_seed(seed)
    head = Eagle3Head(config, embed)
    for name, param in head.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(param)
        else:
            torch.nn.init.normal_(param, std=0.02)
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_head[vocab])
        head.norm.weight.copy_(final_norm)
        head.d2t.copy_(vocab - torch.arange(len(vocab)))
        head.t2d.zero_()
        head.t2d[vocab] = True
    return head


def draft_index_of(head: Eagle3Head) -> torch.Tensor:  # [V] int64: draft id of each target id, -1 if none
    index = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    index[head.to_target_ids(torch.arange(head.config.draft_vocab_size))] = torch.arange(head.config.draft_vocab_size)
    return index


def batches_by_tokens(records: list[Record], max_tokens: int, rng: random.Random) -> list[list[Record]]:
    """Shuffled batches of at most max_tokens padded rows (length-sorted within pools)."""
    order = sorted(records, key=lambda r: len(r["tokens"]) + rng.random() * 40)
    out: list[list[Record]] = []
    for r in order:
        longest = max([len(r["tokens"])] + [len(x["tokens"]) for x in out[-1]]) if out else 0
        if out and longest * (len(out[-1]) + 1) <= max_tokens:
            out[-1].append(r)
        else:
            out.append([r])
    rng.shuffle(out)
    return out


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 10% of peak as `progress`
    (the fraction of the run done) goes to 1."""
    import math

    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(head: Eagle3Head, records: list[Record], steps: int, depth: int, lr: float, batch_tokens: int,
          warmup: int = 20, progress: bool = True, seed: int = 0, max_minutes: float = 0.0) -> list[float]:
    """Train in place (fp32 weights, bf16 autocast) for `steps` steps or `max_minutes`
    (if > 0), whichever ends first: the schedule follows whichever is further along.
    Returns each step's total loss."""
    from tqdm import tqdm

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng, draft_index, history = random.Random(seed), draft_index_of(head), []
    pool: list[list[Record]] = []
    start = time.time()
    bar = tqdm(range(steps), desc="train eagle3", mininterval=10, disable=not progress)
    for step in bar:
        done = max(step / steps, (time.time() - start) / 60 / max_minutes if max_minutes > 0 else 0.0)
        if done >= 1:
            break
        if not pool:
            pool = batches_by_tokens(records, batch_tokens, rng)
        batch = make_batch(pool.pop(), depth)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, done, lr, warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs = head.forward_train(batch["input_ids"], batch["aux"].float(), batch["mask"], depth)
            losses = step_losses(head, outputs, batch, draft_index)
        loss = sum(STEP_WEIGHT**j * x for j, x in enumerate(losses))
        assert isinstance(loss, torch.Tensor)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        history.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}", per_step=" ".join(f"{x.item():.2f}" for x in losses))
    return history


# -- evaluation --------------------------------------------------------------------------------

@torch.inference_mode()
def heldout_ranks(head: Eagle3Head, records: list[Record], depth: int, top_k: int,
                  batch_tokens: int = 4096) -> torch.Tensor:  # [N, depth] int64
    """In distill_data's row order (per record, each position p that predicted a generated
    token): the rank of x_{p+j+2} in step j's top_k over the draft vocabulary, teacher-forced
    along the answer; top_k when it is not there or lies past the answer's end."""
    ranks = []
    start = 0
    while start < len(records):
        group = [records[start]]
        while start + len(group) < len(records) and \
                max(len(r["tokens"]) for r in group + [records[start + len(group)]]) * (len(group) + 1) <= batch_tokens:
            group.append(records[start + len(group)])
        start += len(group)
        batch = make_batch(group, 1)
        outputs = head.forward_train(batch["input_ids"], batch["aux"].float(), batch["mask"], depth)
        for i, r in enumerate(group):
            tokens, first, n = r["tokens"].long(), r["prompt_len"] - 1, len(r["tokens"]) - 1
            rows = torch.arange(first, n)
            rank = torch.full((len(rows), depth), top_k, dtype=torch.long)
            for j, out in enumerate(outputs):
                top = head.to_target_ids(head.logits(out[i, first:n]).topk(top_k, dim=-1).indices)
                want = rows + j + 2
                inside = want <= n
                hit = top == tokens[want.clamp(max=n)][:, None]
                rank[:, j] = torch.where(inside & hit.any(-1), hit.int().argmax(-1), top_k)
            ranks.append(rank)
    return torch.cat(ranks)


def report_ranks(ranks: torch.Tensor, records: list[Record], choices: list[tuple[int, ...]]) -> dict[str, Any]:
    """train_medusa.evaluate's report (per-step top-1/top-5, chains, static-tree tau), the
    measure the recurrent heads' accuracy.json gives."""
    from specdec.drafters.train_medusa import FlatData, evaluate

    flat = FlatData([r if "hidden" in r else r | {"hidden": r["top_val"]} for r in records], ranks.shape[1])
    return evaluate(ranks, flat, choices)


def recurrent_report(path: Path, records: list[Record], embed: torch.Tensor) -> dict[str, Any]:
    """The recurrent heads at `path` on the same held-out records (their shipped tree)."""
    from specdec.drafters import recurrent_heads
    from specdec.drafters.train_medusa import FlatData, evaluate
    from specdec.drafters.train_recurrent_heads import step_ranks

    model, vocab = recurrent_heads.load(path)
    choices = [tuple(c) for c in json.loads((path / recurrent_heads.CONFIG).read_text())["tree_choices"]]
    flat = FlatData(records, model.num_steps)
    return evaluate(step_ranks(model, flat, embed, 10, vocab), flat, choices)


# -- command line ------------------------------------------------------------------------------

def main() -> None:
    from specdec.drafters.eagle3_head import load_eagle3_head
    from specdec.drafters.medusa_tree import best_choices
    from specdec.drafters.train_draft import setup_threads
    from specdec.drafters.train_medusa import target_tensor
    from specdec.model_registry import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dd.add_cli_args(parser)
    parser.add_argument("--data", type=Path, default=None,
                        help="JSON list of prompts (first --num-heldout held out); default: distill_data's set")
    parser.add_argument("--train-sample", type=int, default=0,
                        help="train on a seeded random sample of this many of the training prompts (0: all)")
    parser.add_argument("--out", type=Path, default=Path("drafters/weights/smollm2-135m-eagle3"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-minutes", type=float, default=0.0, help="stop training after this long (0: no limit)")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--ttt-depth", type=int, default=5, help="training-time-test steps unrolled")
    parser.add_argument("--eval-depth", type=int, default=6, help="steps measured on the held-out answers")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="padded rows per training step")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (most generated)")
    parser.add_argument("--aux-layers", type=int, nargs=3, default=None,
                        help="target layers whose input states feed fc (default: 2, L//2, L-3 as vLLM)")
    parser.add_argument("--init", type=Path, default=None, help="continue from this head")
    parser.add_argument("--compare", type=Path, default=Path("drafters/weights/smollm2-135m-medusa-recurrent"),
                        help="recurrent heads to measure on the same held-out answers (skipped if absent)")
    args = parser.parse_args()
    setup_threads(args.threads)
    cfg = dd.config_from_args(args)
    target = ModelConfig.from_dir(resolve_model(cfg.model))
    layer_ids = tuple(args.aux_layers) if args.aux_layers else \
        Eagle3Config.from_dict(config_dict(target, target.vocab_size)).aux_layers(target.num_layers)
    train_recs, heldout = ensure_data(cfg, layer_ids, args.data, args.train_sample)
    embed = target_tensor(cfg.model, "model.embed_tokens.weight")
    vocab = draft_vocab(train_recs, min(args.draft_vocab, target.vocab_size), target.vocab_size)
    if args.init:
        head = load_eagle3_head(args.init, target, embed).float().requires_grad_(True).train()
        vocab = head.to_target_ids(torch.arange(head.config.draft_vocab_size))
    else:
        lm_head = target_tensor(cfg.model, "lm_head.weight", "model.embed_tokens.weight")
        head = init_head(target, vocab, layer_ids, lm_head, target_tensor(cfg.model, "model.norm.weight"), embed)
    t0 = time.time()
    history = train(head, train_recs, args.steps, args.ttt_depth, args.lr, args.batch_tokens, args.warmup,
                    max_minutes=args.max_minutes)
    minutes = round((time.time() - t0) / 60, 1)
    save_eagle3_head(head, args.out)
    shipped = load_eagle3_head(args.out, target, embed)  # measured as shipped (fp16 weights)
    # The static tree (for tau, as the recurrent heads report it) is chosen on 128 training answers.
    sample = train_recs[:: max(1, len(train_recs) // 128)]
    choices = best_choices(heldout_ranks(shipped, sample, args.eval_depth, 10), 10, 64)
    generated = torch.cat([r["tokens"][r["prompt_len"]:].long() for r in heldout])
    report: dict[str, Any] = {
        "data": {"cache": data_dir(cfg, layer_ids, args.data).name,
                 "prompts": args.data.name if args.data else dd.PROMPTS_FILE.name, "train_prompts": len(train_recs),
                 "train_sample": args.train_sample, "heldout_prompts": len(heldout),
                 "train_positions": sum(len(r["tokens"]) - r["prompt_len"] for r in train_recs),
                 "train_dtype": cfg.train_dtype, "heldout_dtype": cfg.heldout_dtype},
        "aux_layers": list(layer_ids), "steps": len(history), "max_minutes": args.max_minutes, "lr": args.lr,
        "ttt_depth": args.ttt_depth,
        "batch_tokens": args.batch_tokens, "train_minutes": minutes, "init": str(args.init) if args.init else None,
        "loss": {"first_20": round(sum(history[:20]) / max(1, len(history[:20])), 3),
                 "last_50": round(sum(history[-50:]) / max(1, len(history[-50:])), 3)},
        "checkpoint_bytes": (args.out / "model.safetensors").stat().st_size,
        "draft_vocab": {"size": len(vocab),
                        "heldout_coverage": round(torch.isin(generated, vocab).float().mean().item(), 4)},
        "heldout": report_ranks(heldout_ranks(shipped, heldout, args.eval_depth, 10), heldout, choices),
        "tree_choices": [list(c) for c in choices],
    }
    if args.compare.is_dir():
        report["recurrent_heads_same_heldout"] = recurrent_report(args.compare, heldout, embed)
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "tree_choices"}, indent=2))


if __name__ == "__main__":
    main()
