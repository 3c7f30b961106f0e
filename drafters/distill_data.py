"""Training data for the learned drafters: the target model's own continuations.

A drafter is only useful if it predicts what *this* target will say, so we distil from
the target's generations rather than from a text corpus. This module

1. builds a few hundred varied instructions combinatorially (templates x topics), with a
   fixed held-out split (the seed and the templates are private to this file, so they do
   not overlap with the evaluation prompts under evals/prompts/), optionally plus
   open-chat prompts the target writes itself (--num-self-instruct, self_instruct.py);
2. generates the target's continuations (chat template, batched HF generate with left
   padding, greedy by default);
3. records, for every generated token, the target's final-norm hidden state at the
   position that predicted it and the target's top-k logits there. Both fall out of the
   generation itself via a hook on the LM head, so no second forward pass is needed.

Everything is cached in shards under `$SPECDEC_HOME/distill/<model>/<tag>/`, so an
interrupted run resumes and both trainers reuse the same data.

    python -m specdec.drafters.distill_data --num-train 753 --num-heldout 64
"""
from __future__ import annotations

import argparse
import functools
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.model_registry import DEFAULT_MODEL, resolve_model, specdec_home

# The seed fixes both the prompt sampling and the held-out split.
PROMPT_SEED = 20240917
# One generated completion: prompt, token ids, and per generated token the target's hidden
# state and top-k logits (see generate_batch).
Record = dict[str, Any]

# ---------------------------------------------------------------------------------------
# Prompt set. Deliberately broad: chat, explanations, passage tasks, translation, math
# word problems and code, since the drafter must generalise to whatever users send. The
# text is in data/distill_prompts.json (data/README.md describes it); the order in which
# it is combined is fixed here, because cached shards depend on it.
# ---------------------------------------------------------------------------------------

PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "distill_prompts.json"


@functools.cache
def prompt_pools() -> dict[str, Any]:
    """Templates and what fills them, by section (chat, explain, passage, ...)."""
    pools: dict[str, Any] = json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))
    return pools


def _filled(templates: list[str], topics: list[str]) -> list[str]:
    return [t.format(x=x) for t in templates for x in topics]


def _writing_prompts() -> list[str]:
    """Open-ended writing (blog posts, emails, stories, role play): the kind of chat where the
    first heads trained without it guessed worst."""
    pool = prompt_pools()["writing"]
    prompts = _filled(pool["templates"], pool["topics"])
    roles = [t.format(role=role, audience=audience) for t in pool["role_plays"] for role, audience in pool["roles"]]
    return prompts + roles


def _open_chat_prompts() -> list[str]:
    """Open chat, added after the writing prompts (heads trained on both still guessed worst
    on open-ended chat): essays, opinions, plans, creative writing, role play, syllogisms."""
    pool = prompt_pools()["open_chat"]
    prompts = [p for group in pool["groups"] for p in _filled(group["templates"], group["topics"])]
    return prompts + [t.format(a=a, b=b, c=c) for t in pool["syllogism_templates"] for a, b, c in pool["syllogisms"]]


def _math_prompts(rng: random.Random, count: int) -> list[str]:
    """Word problems with random numbers, so each instance is distinct."""
    pool = prompt_pools()["math"]
    out = []
    for i in range(count):
        template = pool["templates"][i % len(pool["templates"])]
        n1, n2 = rng.sample(pool["names"], 2)
        a, b, c = rng.randint(2, 30), rng.randint(2, 12), rng.randint(2, 9)
        t = rng.randint(4, 20) * a  # keeps "weeks until" style answers whole
        prefix = rng.choice(pool["prefixes"])
        out.append(prefix + template.format(n1=n1, n2=n2, a=a, b=b, c=c, t=t))
    return out


def build_prompts(seed: int = PROMPT_SEED) -> list[str]:
    """All distinct instructions, in a fixed seeded order (several hundred)."""
    rng = random.Random(seed)
    pools = prompt_pools()
    chat, explain, passage = pools["chat"], pools["explain"], pools["passage"]
    translate, code = pools["translate"], pools["code"]
    prompts: list[str] = []
    prompts += _filled(chat["templates"], chat["topics"])
    prompts += _filled(explain["templates"], explain["topics"])
    prompts += [t.format(p=p) for t in passage["tasks"] for p in passage["passages"]]
    prompts += [t.format(lang=lang, s=s) for s in translate["sentences"] for lang in translate["languages"]
                for t in translate["templates"]]
    prompts += [t.format(lang=lang, task=task)
                for t in code["templates"] for lang in code["languages"] for task in code["tasks"]]
    prompts += _math_prompts(rng, 120)
    prompts = list(dict.fromkeys(prompts))  # dedupe, keep order
    rng.shuffle(prompts)
    # Added later, so appended (shuffled among themselves): the held-out split and the
    # first 633 training prompts, hence the cached shards of earlier data sets, stay as
    # they were.
    writing = _writing_prompts()
    rng.shuffle(writing)
    open_chat = _open_chat_prompts()
    rng.shuffle(open_chat)
    return prompts + writing + open_chat


def split_prompts(num_train: int, num_heldout: int, seed: int = PROMPT_SEED) -> dict[str, list[str]]:
    """Held-out prompts are taken first so they stay the same whatever num_train is."""
    prompts = build_prompts(seed)
    if num_train + num_heldout > len(prompts):
        raise ValueError(f"only {len(prompts)} prompts available")
    return {
        "heldout": prompts[:num_heldout],
        "train": prompts[num_heldout:num_heldout + num_train],
    }


# ---------------------------------------------------------------------------------------
# Generation with feature capture.
# ---------------------------------------------------------------------------------------


@dataclass
class DistillConfig:
    model: str = DEFAULT_MODEL
    num_train: int = 1021  # every prompt not held out
    num_heldout: int = 64
    max_new_tokens: int = 160
    batch_size: int = 32
    temperature: float = 0.0  # 0 = greedy, what the drafters are mostly used with
    topk: int = 32  # target logits kept per position (enough for KL; the tail is tiny)
    # Open-chat training prompts written by the target itself (self_instruct.py), and
    # num_heldout more of them for the held-out split.
    num_self_instruct: int = 0
    seed: int = PROMPT_SEED
    # bf16 matmuls are ~5x faster on CPU; the small drift only adds label noise to the
    # training split. The held-out split runs in fp32, exactly as the engine's target,
    # so the reported agreement is against the real target.
    train_dtype: str = "bfloat16"
    heldout_dtype: str = "float32"

    def tag(self) -> str:
        tag = (f"n{self.num_train}-h{self.num_heldout}-t{self.max_new_tokens}"
               f"-T{self.temperature:g}-k{self.topk}-{self.train_dtype}")
        return tag + (f"-s{self.num_self_instruct}" if self.num_self_instruct else "")


def distill_dir(cfg: DistillConfig) -> Path:
    return specdec_home() / "distill" / Path(cfg.model).name / cfg.tag()


class _LMHeadRecorder:
    """Forward hook on the LM head: its input is the final-norm hidden state, its output
    the raw logits. During generate each call's last position is the one predicting the
    token about to be chosen, so one record per step lines up with one generated token."""

    def __init__(self, topk: int) -> None:
        self.topk = topk
        self.hidden: list[torch.Tensor] = []
        self.top_val: list[torch.Tensor] = []
        self.top_idx: list[torch.Tensor] = []

    def __call__(self, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        self.hidden.append(inputs[0][:, -1].detach().to(torch.float16))
        val, idx = output[:, -1].detach().float().topk(self.topk, dim=-1)
        self.top_val.append(val.to(torch.float16))
        self.top_idx.append(idx.to(torch.int32))


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a single-turn chat prompt, ready for the assistant's reply."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


@torch.inference_mode()
def generate_batch(model: Any, tokenizer: Any, prompts: list[str], cfg: DistillConfig) -> list[Record]:
    """Generate one batch and return one record per prompt (trimmed at the first EOS)."""
    ids = [chat_prompt_ids(tokenizer, p) for p in prompts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model.config.eos_token_id
    width = max(len(x) for x in ids)
    # Left padding keeps every prompt's last token at the same column for batched decode.
    input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids])
    attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    recorder = _LMHeadRecorder(cfg.topk)
    handle = model.lm_head.register_forward_hook(recorder)
    try:
        sample = cfg.temperature > 0
        out = model.generate(
            input_ids=input_ids, attention_mask=attention, max_new_tokens=cfg.max_new_tokens,
            do_sample=sample, temperature=cfg.temperature if sample else None, top_p=None,
            top_k=None, pad_token_id=pad_id, eos_token_id=model.config.eos_token_id,
        )
    finally:
        handle.remove()
    completions = out[:, width:]
    hidden = torch.stack(recorder.hidden, dim=1)  # [B, steps, H]
    top_val = torch.stack(recorder.top_val, dim=1)
    top_idx = torch.stack(recorder.top_idx, dim=1)
    eos = model.config.eos_token_id
    records: list[Record] = []
    for b, prompt in enumerate(prompts):
        comp = completions[b].tolist()
        n = comp.index(eos) + 1 if eos in comp else len(comp)  # keep EOS: drafters predict it too
        records.append({
            "prompt": prompt,
            "prompt_len": len(ids[b]),
            "tokens": torch.tensor(ids[b] + comp[:n], dtype=torch.int32),
            # Row j belongs to the position predicting completion token j.
            "hidden": hidden[b, :n].clone(),
            "top_val": top_val[b, :n].clone(),
            "top_idx": top_idx[b, :n].clone(),
        })
    return records


def load_target(model_name: str, dtype: str = "float32") -> tuple[Any, Any]:
    """The target (fp32 is how the engine runs it); returns (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(model_name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    return model, tokenizer


def build_dataset(cfg: DistillConfig, progress: bool = True) -> Path:
    """Generate (or resume) all shards for cfg; returns the cache directory."""
    from tqdm import tqdm

    out_dir = distill_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    splits = split_prompts(cfg.num_train, cfg.num_heldout, cfg.seed)
    if cfg.num_self_instruct:
        add_self_instruct(splits, cfg, out_dir / "self_instruct.json")
    for split, prompts in splits.items():
        batches = _batches(prompts, cfg.batch_size)
        todo = [i for i in range(len(batches)) if not _shard_path(out_dir, split, i).exists()]
        if not todo:
            continue
        dtype = cfg.heldout_dtype if split == "heldout" else cfg.train_dtype
        model, tokenizer = load_target(cfg.model, dtype)
        torch.manual_seed(cfg.seed)
        for i in tqdm(todo, desc=f"generate {split}", disable=not progress):
            records = generate_batch(model, tokenizer, batches[i], cfg)
            tmp = _shard_path(out_dir, split, i).with_suffix(".tmp")
            torch.save(records, tmp)
            tmp.rename(_shard_path(out_dir, split, i))  # atomic: a shard is whole or absent
    return out_dir


def add_self_instruct(splits: dict[str, list[str]], cfg: DistillConfig, path: Path) -> None:
    """Append the target's own user prompts: num_heldout to held-out, the rest to train."""
    from specdec.drafters.self_instruct import cached_prompts

    count = cfg.num_self_instruct + cfg.num_heldout
    prompts = cached_prompts(path, lambda: load_target(cfg.model, cfg.train_dtype), count, cfg.seed)
    splits["heldout"] += prompts[:cfg.num_heldout]
    splits["train"] += prompts[cfg.num_heldout:]


# Prompts are length-sorted only within blocks of this many, so growing --num-train keeps
# the earlier shards' contents unchanged (only new shards are appended).
SORT_BLOCK = 384


def _batches(prompts: list[str], batch_size: int) -> list[list[str]]:
    """Batches of prompts of similar length (less compute wasted on padding)."""
    batches = []
    for start in range(0, len(prompts), SORT_BLOCK):
        block = sorted(prompts[start:start + SORT_BLOCK], key=len)
        batches += [block[i:i + batch_size] for i in range(0, len(block), batch_size)]
    return batches


def _shard_path(out_dir: Path, split: str, index: int) -> Path:
    return out_dir / f"{split}-{index:04d}.pt"


def load_split(out_dir: Path, split: str) -> list[Record]:
    """All records of one split ("train" or "heldout"), in shard order."""
    records: list[Record] = []
    for shard in sorted(out_dir.glob(f"{split}-*.pt")):
        records += torch.load(shard, weights_only=True)
    if not records:
        raise FileNotFoundError(f"no {split} shards in {out_dir}; run distill_data first")
    return records


def ensure_dataset(cfg: DistillConfig) -> tuple[list[Record], list[Record]]:
    """(train, heldout) records, generating whatever is missing."""
    out_dir = build_dataset(cfg)
    return load_split(out_dir, "train"), load_split(out_dir, "heldout")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Dataset flags shared by this script and the trainers (so they find the same cache)."""
    d = DistillConfig()
    parser.add_argument("--model", default=d.model, help="target name or HF directory")
    parser.add_argument("--num-train", type=int, default=d.num_train)
    parser.add_argument("--num-heldout", type=int, default=d.num_heldout)
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--gen-batch-size", type=int, default=d.batch_size)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--topk", type=int, default=d.topk)
    parser.add_argument("--num-self-instruct", type=int, default=d.num_self_instruct,
                        help="extra training prompts written by the target itself (Magpie)")
    parser.add_argument("--train-dtype", default=d.train_dtype, choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads; 1 is much faster when other jobs share the cores")


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    return DistillConfig(
        model=args.model, num_train=args.num_train, num_heldout=args.num_heldout,
        max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch_size,
        temperature=args.temperature, topk=args.topk, train_dtype=args.train_dtype,
        num_self_instruct=args.num_self_instruct,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    parser.add_argument("--list-prompts", action="store_true", help="print the prompt set and exit")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = config_from_args(args)
    if args.list_prompts:
        for split, prompts in split_prompts(cfg.num_train, cfg.num_heldout, cfg.seed).items():
            for p in prompts:
                print(f"[{split}] {p!r}")
        return
    train, heldout = ensure_dataset(cfg)
    n_tok = sum(len(r["hidden"]) for r in train)
    print(f"{distill_dir(cfg)}: {len(train)} train ({n_tok} generated tokens), {len(heldout)} held-out")


if __name__ == "__main__":
    main()
