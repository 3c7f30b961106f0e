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
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.model_registry import DEFAULT_MODEL, resolve_model, specdec_home

# The seed fixes both the prompt sampling and the held-out split.
PROMPT_SEED = 20240917

# ---------------------------------------------------------------------------------------
# Prompt set. Deliberately broad: chat, explanations, passage tasks, translation, math
# word problems and code, since the drafter must generalise to whatever users send.
# ---------------------------------------------------------------------------------------

CHAT_TEMPLATES = [
    "What are some practical tips for {x}?",
    "I'm new to {x}. Where should I start?",
    "Can you give me a short checklist for {x}?",
    "What mistakes do beginners usually make with {x}?",
    "How do I stay motivated when {x} gets hard?",
    "Give me three fun facts related to {x}.",
]
CHAT_TOPICS = [
    "learning to play the guitar", "growing tomatoes on a balcony", "running a first 5k",
    "saving money on groceries", "studying for an exam", "baking sourdough bread",
    "keeping a journal", "learning a second language", "planning a camping trip",
    "organising a small office", "training a puppy", "public speaking",
    "starting a podcast", "drawing portraits", "managing remote meetings",
    "cooking healthy weeknight dinners", "writing a cover letter", "birdwatching",
]

EXPLAIN_TEMPLATES = [
    "Explain {x} in simple terms.",
    "Explain {x} to a ten-year-old.",
    "What is {x}, and why does it matter?",
    "Describe how {x} works, step by step.",
    "Write a short paragraph about {x}.",
]
EXPLAIN_TOPICS = [
    "photosynthesis", "the water cycle", "compound interest", "how vaccines work",
    "the greenhouse effect", "black holes", "supply and demand", "plate tectonics",
    "how a bicycle stays upright", "machine learning", "the immune system",
    "how bridges carry weight", "inflation", "the phases of the moon", "DNA replication",
    "how the internet routes data", "ocean tides", "electric circuits", "erosion",
    "how batteries store energy", "the scientific method", "recycling plastics",
]

PASSAGES = [
    ("The town library reopened on Monday after a six-month renovation. The new building "
    "has a children's reading room, twelve public computers and a small cafe. Director "
    "Maria Lopez said visitor numbers doubled in the first week."),
    ("Honeybees communicate the location of flowers through a 'waggle dance'. The angle of "
    "the dance relative to the sun shows the direction, and its length signals the "
    "distance. A single hive can visit millions of flowers in a season."),
    ("Our quarterly sales rose 8 percent to 4.2 million dollars, driven by strong demand in "
    "Europe. However, shipping costs increased and margins fell slightly. The company plans "
    "to open two new warehouses next year."),
    ("The marathon began at 7 a.m. under clear skies. More than 3,000 runners took part, and "
    "Kenji Tanaka won in 2 hours 14 minutes. Volunteers handed out 20,000 cups of water "
    "along the route."),
    ("Regular exercise improves sleep, mood and heart health. Experts recommend at least "
    "150 minutes of moderate activity per week, such as brisk walking or cycling, plus "
    "two days of strength training."),
    ("The old lighthouse on Gull Island was built in 1872 and guided ships for over a "
    "century. It was automated in 1965, and today it is a museum run by volunteers who "
    "offer tours every weekend in summer."),
    ("Please remember that the team meeting has moved from Tuesday to Thursday at 3 p.m. "
    "Bring your project updates and the draft budget. Contact Sam Rivera if you cannot "
    "attend."),
    ("Rainforests cover about six percent of the Earth's land but hold more than half of its "
    "plant and animal species. Logging and farming remove large areas each year, which "
    "threatens many species and affects the global climate."),
    ("The new phone has a larger battery, a brighter screen and two rear cameras. Reviewers "
    "praised the battery life but complained that the price, 899 dollars, is high for a "
    "mid-range device."),
    ("In 1969, Apollo 11 landed on the Moon. Neil Armstrong and Buzz Aldrin spent about two "
    "and a half hours outside the lander, collecting samples, while Michael Collins orbited "
    "above in the command module."),
    ("Volunteers planted 500 trees along the river last Saturday. The project, organised by "
    "the Green Valley school, aims to reduce flooding and give shade to walkers. Another "
    "planting day is planned for April."),
    ("Coffee plants grow best in tropical highlands with steady rain and mild temperatures. "
    "The beans are the seeds of a red fruit called a cherry, and they are dried, roasted "
    "and ground before brewing."),
]
PASSAGE_TASKS = [
    "Summarise the following text in one sentence.\n\n{p}",
    "Rewrite this passage in a more formal tone:\n\n{p}",
    "List every name and number mentioned in this text:\n\n{p}",
    "Give three key points from the passage below as bullet points.\n\n{p}",
    "Suggest a short title for this text.\n\n{p}",
    "Read the passage and write two questions a student could answer from it.\n\n{p}",
    "Rewrite the following for a young child:\n\n{p}",
]

TRANSLATE_TEMPLATES = [
    "Translate into {lang}: \"{s}\"",
    "How would you say \"{s}\" in {lang}?",
    "Please translate this sentence to {lang}: {s}",
]
TRANSLATE_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese"]
TRANSLATE_SENTENCES = [
    "Where is the nearest train station?", "I would like a cup of tea, please.",
    "The weather is beautiful today.", "My brother works in a hospital.",
    "Can you help me find my keys?", "We are going to the beach tomorrow.",
    "This book is very interesting.", "What time does the museum open?",
    "I have been learning to cook.", "The children are playing in the garden.",
]

CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Show me {lang} code that {task}, with a short explanation.",
    "How can I write a program in {lang} that {task}?",
]
CODE_LANGS = ["Python", "JavaScript", "C", "Python"]  # Python twice: the common case
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "counts the vowels in a sentence", "returns the largest element of a list",
    "removes duplicates from a list", "converts Celsius to Fahrenheit",
    "checks whether a word is a palindrome", "sums the even numbers in an array",
    "merges two sorted lists", "reads a text file and counts its lines",
    "computes the n-th Fibonacci number", "sorts a list of names alphabetically",
    "finds the average of a list of numbers",
]

MATH_TEMPLATES = [
    ("{n1} has {a} apples and buys {b} more bags with {c} apples each. How many apples "
    "does {n1} have now?"),
    "A train travels at {a} km per hour for {b} hours. How far does it go?",
    "{n1} saves {a} dollars a week. How many weeks until {n1} has {t} dollars?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    ("{n1} and {n2} share {t} stickers so that {n1} gets {a} more than {n2}. How many does "
    "each get?"),
    "A shop sells pens at {a} for {b} dollars. How much do {c} pens cost?",
    "There are {t} students and each bus holds {a}. How many buses are needed?",
    ("{n1} read {a} pages on Monday and {b} pages on each of the next {c} days. How many "
    "pages did {n1} read in total?"),
]
# Open-ended writing (blog posts, emails, stories, role play): the kind of chat where the
# first heads trained without it guessed worst. Topics are our own; none is an evaluation
# prompt's.
WRITING_TEMPLATES = [
    "Write a short blog post about {x}.",
    "Draft a friendly email to a colleague telling them about {x}.",
    "Write a short story about {x}.",
    "Write a persuasive paragraph about {x}.",
    "Write a letter to a friend describing {x}.",
    "Give a short motivational speech inspired by {x}.",
]
WRITING_TOPICS = [
    "a rainy afternoon in a small cafe", "the first day at a new job", "a family picnic by the river",
    "a lost cat finding its way home", "a bicycle tour along the coast", "learning to cook from a grandparent",
    "a power outage in the city", "volunteering at an animal shelter", "moving to a new country",
    "a surprise birthday party", "a night at the observatory", "a street market on a Sunday morning",
    "a friendship that began on a train", "finishing a marathon", "planting a community garden",
    "a snowy weekend in a cabin", "the last day of school", "a visit to a science museum",
]
ROLE_PLAYS = [
    "Pretend you are a {role}. Introduce yourself to {audience} and describe a typical day.",
    "You are a {role}. Give {audience} three pieces of advice from your work.",
]
ROLES = [("lighthouse keeper", "a class of schoolchildren"), ("museum curator", "new volunteers"),
         ("ship's captain", "first-time passengers"), ("park ranger", "a group of hikers"),
         ("baker", "a cooking club"), ("zookeeper", "visiting students")]
# Open chat, added after the writing prompts (heads trained on both still guessed worst on
# open-ended chat): essays, comparisons, opinions, plans, creative writing, product copy,
# role play, syllogisms and science questions. Topics are our own; none is an evaluation
# prompt's, and no template copies one.
OPEN_CHAT: list[tuple[list[str], list[str]]] = [
    (["What were the main causes and consequences of {x}?", "How did {x} change everyday life?",
      "Write a short essay about the importance of {x}."],
     ["the printing press", "the industrial revolution", "the fall of the Roman Empire", "the telephone",
      "the first moon landing", "the transcontinental railroad", "coffee houses in Europe", "the Silk Road",
      "the steam engine", "the discovery of penicillin", "the rise of the internet", "the Renaissance"]),
    (["What are the pros and cons of {x}?", "Should a town adopt {x}? Give arguments for and against.",
      "Write a balanced opinion piece on {x}."],
     ["a four-day work week", "school uniforms", "social media for teenagers", "self-driving cars",
      "online classes", "a vegetarian diet", "open-plan offices", "smart home devices", "space tourism",
      "coding lessons in primary school", "car-free city centres", "later school start times"]),
    (["Give me a step-by-step plan to {x}.", "I want to {x}. What should I do in the first month?",
      "What usually gets in the way when people try to {x}, and how can I get past it?"],
     ["learn to swim as an adult", "prepare for a job interview", "organise a neighbourhood clean-up",
      "start running regularly", "write a first novel", "reduce my screen time", "plan a wedding on a budget",
      "build a simple personal website", "sleep better", "learn basic photography", "keep bees",
      "prepare for a week-long hike"]),
    (["Write a short poem about {x}.", "Describe {x} in vivid detail, using all five senses.",
      "Write a haiku and a limerick about {x}.", "Write a children's story about {x}."],
     ["the ocean at night", "an old library", "a city waking up", "autumn leaves", "a robot learning to paint",
      "a forgotten toy", "a thunderstorm", "the smell of fresh bread", "a long train journey", "the first snowfall",
      "a garden in spring", "a busy airport", "a quiet mountain village", "a kite on a windy day"]),
    (["Write a product description for {x}.",
      "Write a customer review of {x}, mentioning one thing you liked and one you did not.",
      "Write a short advertisement for {x} aimed at students."],
     ["a reusable water bottle", "a solar-powered phone charger", "a smart alarm clock", "a folding bicycle",
      "noise-cancelling headphones", "a board game for families", "an electric kettle", "a hiking backpack",
      "a standing desk", "a language-learning app"]),
    (["You are {x}. A visitor asks about the hardest part of your job. Answer in character.",
      "Stay in character as {x} and tell a story from your career.",
      "As {x}, explain what someone should know before their first visit to your workplace."],
     ["an astronaut", "a detective", "a beekeeper", "a deep-sea diver", "a librarian", "a train driver",
      "a florist", "a mountain guide", "a radio host", "a veterinarian"]),
    (["Can you explain {x}? Keep it under 150 words.", "A curious friend asks you {x}. What do you tell them?"],
     ["how airplanes fly", "why we have seasons", "how a refrigerator keeps food cold", "what causes earthquakes",
      "how the heart pumps blood", "why metals conduct electricity", "how GPS finds a location",
      "what makes a rainbow", "how muscles get stronger", "why the moon has craters", "how sound travels",
      "how a microwave oven heats food"]),
]
SYLLOGISMS = [("roses", "flowers", "red things"), ("whales", "mammals", "ocean animals"),
              ("squares", "rectangles", "blue shapes"), ("sparrows", "birds", "pets"),
              ("violins", "instruments", "old objects"), ("oaks", "trees", "tall plants"),
              ("trout", "fish", "river animals"), ("novels", "books", "best sellers"),
              ("tulips", "plants", "gifts"), ("lorries", "vehicles", "electric machines")]
SYLLOGISM_TEMPLATES = [
    "All {a} are {b}. Some {b} are {c}. Does it follow that some {a} are {c}? Explain your reasoning.",
    "If every one of the {a} is one of the {b}, and none of the {b} are {c}, can any {a} be {c}? Explain.",
]


def _open_chat_prompts() -> list[str]:
    prompts = [t.format(x=x) for templates, topics in OPEN_CHAT for t in templates for x in topics]
    return prompts + [t.format(a=a, b=b, c=c) for t in SYLLOGISM_TEMPLATES for a, b, c in SYLLOGISMS]


NAMES = ["Ava", "Liam", "Noah", "Mia", "Omar", "Priya", "Lucas", "Zoe", "Ethan", "Sofia"]


def _math_prompts(rng: random.Random, count: int) -> list[str]:
    """Word problems with random numbers, so each instance is distinct."""
    out = []
    for i in range(count):
        template = MATH_TEMPLATES[i % len(MATH_TEMPLATES)]
        n1, n2 = rng.sample(NAMES, 2)
        a, b, c = rng.randint(2, 30), rng.randint(2, 12), rng.randint(2, 9)
        t = rng.randint(4, 20) * a  # keeps "weeks until" style answers whole
        prefix = rng.choice(["", "Solve step by step: ", "Word problem: "])
        out.append(prefix + template.format(n1=n1, n2=n2, a=a, b=b, c=c, t=t))
    return out


def build_prompts(seed: int = PROMPT_SEED) -> list[str]:
    """All distinct instructions, in a fixed seeded order (several hundred)."""
    rng = random.Random(seed)
    prompts: list[str] = []
    prompts += [t.format(x=x) for t in CHAT_TEMPLATES for x in CHAT_TOPICS]
    prompts += [t.format(x=x) for t in EXPLAIN_TEMPLATES for x in EXPLAIN_TOPICS]
    prompts += [t.format(p=p) for t in PASSAGE_TASKS for p in PASSAGES]
    prompts += [
        t.format(lang=lang, s=s)
        for s in TRANSLATE_SENTENCES for lang in TRANSLATE_LANGS for t in TRANSLATE_TEMPLATES
    ]
    prompts += [t.format(lang=lang, task=task)
                for t in CODE_TEMPLATES for lang in CODE_LANGS[:3] for task in CODE_TASKS]
    prompts += _math_prompts(rng, 120)
    prompts = list(dict.fromkeys(prompts))  # dedupe, keep order
    rng.shuffle(prompts)
    # Added later, so appended (shuffled among themselves): the held-out split and the
    # first 633 training prompts, hence the cached shards of earlier data sets, stay as
    # they were.
    writing = [t.format(x=x) for t in WRITING_TEMPLATES for x in WRITING_TOPICS]
    writing += [t.format(role=role, audience=audience) for t in ROLE_PLAYS for role, audience in ROLES]
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

    def __call__(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.hidden.append(inputs[0][:, -1].detach().to(torch.float16))
        val, idx = output[:, -1].detach().float().topk(self.topk, dim=-1)
        self.top_val.append(val.to(torch.float16))
        self.top_idx.append(idx.to(torch.int32))


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a single-turn chat prompt, ready for the assistant's reply."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def generate_batch(model, tokenizer, prompts: list[str], cfg: DistillConfig) -> list[dict]:
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
    records = []
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


def load_target(model_name: str, dtype: str = "float32"):
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


def load_split(out_dir: Path, split: str) -> list[dict]:
    """All records of one split ("train" or "heldout"), in shard order."""
    records: list[dict] = []
    for shard in sorted(out_dir.glob(f"{split}-*.pt")):
        records += torch.load(shard, weights_only=True)
    if not records:
        raise FileNotFoundError(f"no {split} shards in {out_dir}; run distill_data first")
    return records


def ensure_dataset(cfg: DistillConfig) -> tuple[list[dict], list[dict]]:
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
