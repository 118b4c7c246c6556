"""The benchmark's chat prompts: one deterministic, varied set shared by every contender.

Every tool in `bench/` (HTTP load generator, transformers' `generate_batch`, our engine offline) draws
its requests from `chat_prompts()`, so "the same prompts" means the same list of chat messages; the
offline tools apply the model's chat template to it, the servers apply their own (the same template,
read from the same model).

Prompts are unique (task x topic pairs, no two alike) so that no contender gains from prefix caching
beyond the shared system prompt that the chat template adds anyway.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TASKS: tuple[str, ...] = (
    "Explain {t} to a ten-year-old in a few sentences.",
    "Write a short poem about {t}.",
    "List three surprising facts about {t}.",
    "What are the main arguments for and against {t}? Be brief.",
    "Summarize the history of {t} in one paragraph.",
    "Give me a step-by-step plan to learn about {t} in a weekend.",
    "Write a haiku about {t}.",
    "Describe {t} as if you were a tour guide.",
    "What questions would a curious student ask about {t}? List five.",
    "Compose a friendly email inviting a colleague to a talk on {t}.",
    "Tell a very short story in which {t} plays a key role.",
    "What is the most common misconception about {t}, and what is the truth?",
    "Compare {t} with something from everyday life.",
    "Write a tweet announcing a new book on {t}.",
    "Give two pros and two cons of {t}.",
    "How would you explain {t} to someone from the year 1800?",
)

TOPICS: tuple[str, ...] = (
    "photosynthesis",
    "the Roman Empire",
    "black holes",
    "sourdough bread",
    "the stock market",
    "honeybees",
    "volcanoes",
    "the internet",
    "jazz music",
    "climate change",
    "chess openings",
    "the human heart",
    "electric cars",
    "origami",
    "the Moon landing",
    "coral reefs",
    "machine learning",
    "the printing press",
    "coffee",
    "Antarctica",
    "vaccines",
    "rainbows",
    "the Silk Road",
    "recycling",
    "dinosaurs",
    "the Olympic Games",
    "quantum computers",
    "public libraries",
    "tea ceremonies",
    "bicycles",
    "lighthouses",
    "the water cycle",
    "octopuses",
    "the Great Wall of China",
    "solar panels",
    "marathon running",
    "glaciers",
    "the violin",
    "spices",
    "bridges",
    "sleep",
    "the periodic table",
)

# Neutral filler for stretching prompts to a target length (see `PromptLengths`).
_FILLER = (
    "Here is some background that may or may not be relevant. The committee met on a Tuesday to "
    "review the quarterly figures, the weather was mild, and the agenda ran longer than planned. "
    "Several members asked for more detail on the budget, the schedule and the staffing plan, and "
    "the chair promised a written summary before the next meeting. "
)


@dataclass(frozen=True)
class PromptLengths:
    """Target prompt lengths, in words (roughly 1.3 tokens per word for English BPE vocabularies).

    `spec` is "natural" (the prompts as written, 8-20 words), "fixed:N", "uniform:LO:HI" or
    "lognormal:MEDIAN:SIGMA". A prompt shorter than its target is prefixed with neutral filler text.
    """

    spec: str = "natural"

    def targets(self, n: int, rng: random.Random) -> list[int | None]:
        kind, _, rest = self.spec.partition(":")
        args = [float(a) for a in rest.split(":")] if rest else []
        if kind == "natural" and not args:
            return [None] * n
        if kind == "fixed" and len(args) == 1:
            return [int(args[0])] * n
        if kind == "uniform" and len(args) == 2:
            lo, hi = int(args[0]), int(args[1])
            if lo > hi:
                raise ValueError(f"prompt length uniform:{lo}:{hi} has lo > hi")
            return [rng.randint(lo, hi) for _ in range(n)]
        if kind == "lognormal" and len(args) == 2:
            import math

            median, sigma = args
            return [max(1, int(rng.lognormvariate(math.log(median), sigma))) for _ in range(n)]
        raise ValueError(
            f"bad prompt length spec {self.spec!r}: "
            "use natural, fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA"
        )


def _stretch(text: str, target_words: int | None) -> str:
    if target_words is None:
        return text
    missing = target_words - len(text.split())
    if missing <= 0:
        return text
    filler_words = (_FILLER * (missing // len(_FILLER.split()) + 1)).split()[:missing]
    return " ".join(filler_words) + "\n\n" + text


def chat_prompts(
    n: int, seed: int = 0, lengths: PromptLengths | str = "natural"
) -> list[list[dict[str, str]]]:
    """`n` chat conversations (each one user message), deterministic for a given `seed`.

    Unique for n <= len(TASKS) * len(TOPICS) (672); beyond that the set repeats.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if isinstance(lengths, str):
        lengths = PromptLengths(lengths)
    rng = random.Random(seed)
    pairs = [(task, topic) for task in TASKS for topic in TOPICS]
    rng.shuffle(pairs)
    targets = lengths.targets(n, rng)
    out = []
    for i in range(n):
        task, topic = pairs[i % len(pairs)]
        out.append([{"role": "user", "content": _stretch(task.format(t=topic), targets[i])}])
    return out
