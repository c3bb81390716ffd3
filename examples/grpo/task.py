"""Data and reward: the built-in verifiable task, JSONL prompt/answer files, named rewards.

The built-in tasks (``--task``): ``reverse``, string reversal -- the prompt ``"cabd="`` asks
for ``"dbac"``; ``count``, an arithmetic sequence written out -- ``"389+4:441="`` asks for
``"389 393 397 ... 441"``, a long answer from a short prompt (``make demo``). Each is seeded,
has a held-out split that no training prompt comes from, and its reward gives partial credit
(the share of positions right), so that GRPO groups rarely tie and every step has something to
learn from.

    task = ReverseTask()
    examples = task.sample(rng, 8, split="train")          # [Example(prompt, answer), ...]
    REWARDS["char_match"](completion_text, example.answer)  # float in [0, 1]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["CountTask", "Example", "JsonlTask", "REWARDS", "ReverseTask", "TASKS", "char_match",
           "exact_match", "in_held_out", "load_task"]

SPLITS = ("train", "held_out")


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


# ---------------------------------------------------------------------------------- rewards
# A reward maps (completion, answer) to [0, 1] and never raises: a completion is whatever the
# policy wrote up to its end-of-sequence token, and the rollout passes None when it never
# wrote one (ran out of --max_answer_seq_len): that is malformed and scores 0.
def char_match(completion: str | None, answer: str) -> float:
    """Share of positions where the completion has the answer's character (partial credit).

    Divided by the longer of the two, so extra or missing characters cost as wrong ones;
    a correct answer scores 1, malformed output (no end of sequence, empty) scores 0.
    """
    if not completion or not isinstance(completion, str):
        return 0.0
    right = sum(a == b for a, b in zip(completion, answer))
    return right / max(len(completion), len(answer))


def exact_match(completion: str | None, answer: str) -> float:
    """1 for the answer, 0 for anything else (surrounding whitespace ignored)."""
    if not isinstance(completion, str):
        return 0.0
    return float(completion.strip() == answer.strip())


REWARDS: dict[str, Callable[[str | None, str], float]] = {
    "char_match": char_match,
    "exact_match": exact_match,
}


# ---------------------------------------------------------------------------------- splits
def in_held_out(prompt: str, share: float) -> bool:
    """Whether ``prompt`` belongs to the held-out split: a hash, so the split is the same on
    every rank, every run and every machine, and no prompt is ever in both."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


# ---------------------------------------------------------------------------------- tasks
class _Drawn:
    """A task whose examples are drawn one at a time (``_draw``), train and held-out told apart by
    the prompt's hash (``in_held_out``)."""

    name = ""  # the task's name in its warm-start cache key

    @property
    def key(self) -> dict:
        """Everything that shapes the task (part of the warm-start cache key)."""
        return {"name": self.name, **dataclasses.asdict(self)}

    def _draw(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def sample(self, rng: random.Random, n: int, split: str = "train") -> list[Example]:
        """``n`` examples of ``split`` drawn with ``rng`` (rejection on the hash split)."""
        _check_split(split)
        out = []
        while len(out) < n:
            example = self._draw(rng)
            if in_held_out(example.prompt, self.held_out_share) == (split == "held_out"):
                out.append(example)
        return out

    def held_out(self, n: int) -> list[Example]:
        """The first ``n`` held-out examples: the same in every run, whatever its seed."""
        return self.sample(random.Random("held_out"), n, "held_out")


@dataclasses.dataclass(frozen=True)
class ReverseTask(_Drawn):
    """Reverse a random string: ``"cabd="`` -> ``"dbac"``. Lengths in [min_len, max_len]."""

    alphabet: str = "abcdefghij"
    min_len: int = 4
    max_len: int = 7
    held_out_share: float = 0.1
    reward: str = "char_match"

    name = "reverse"

    @property
    def characters(self) -> str:
        return self.alphabet + "="

    def make(self, text: str) -> Example:
        return Example(prompt=text + "=", answer=text[::-1])

    def _draw(self, rng: random.Random) -> Example:
        length = rng.randint(self.min_len, self.max_len)
        return self.make("".join(rng.choice(self.alphabet) for _ in range(length)))

    @property
    def longest(self) -> tuple[int, int]:
        """Characters of the longest prompt and of the longest answer."""
        return self.max_len + 1, self.max_len


@dataclasses.dataclass(frozen=True)
class CountTask(_Drawn):
    """Write out an arithmetic sequence: ``"389+4:441="`` (first term, step, last term) ->
    ``"389 393 397 ... 441"``. Every term has three digits, so a character's position says
    which digit of which term it is (partial credit lines up); ``min_terms``-``max_terms``
    terms, an answer of 4 x terms - 1 characters. Each next term follows from the one before,
    so a small model learns the rule from a short warm start, and the answer's length comes
    from the prompt."""

    min_terms: int = 38
    max_terms: int = 50
    max_step: int = 9
    held_out_share: float = 0.1
    reward: str = "char_match"

    name = "count"

    @property
    def characters(self) -> str:
        return "0123456789+: ="

    def make(self, first: int, step: int, terms: int) -> Example:
        last = first + step * (terms - 1)
        return Example(prompt=f"{first}+{step}:{last}=", answer=" ".join(str(first + step * i) for i in range(terms)))

    def _draw(self, rng: random.Random) -> Example:
        terms = rng.randint(self.min_terms, self.max_terms)
        step = rng.randint(1, self.max_step)
        return self.make(rng.randint(100, 999 - step * (terms - 1)), step, terms)

    @property
    def longest(self) -> tuple[int, int]:
        """Characters of the longest prompt and of the longest answer."""
        return len("999+9:999="), 4 * self.max_terms - 1


TASKS = {"reverse": ReverseTask, "count": CountTask}


@dataclasses.dataclass(frozen=True)
class JsonlTask:
    """Prompt/answer pairs from a JSONL file (one ``{"prompt": ..., "answer": ...}`` a line)."""

    path: str
    examples: tuple[Example, ...]
    held_out_share: float = 0.1
    reward: str = "exact_match"

    @property
    def key(self) -> dict:
        digest = hashlib.sha256("\n".join(f"{e.prompt}\t{e.answer}" for e in self.examples).encode())
        return {"name": "jsonl", "sha256": digest.hexdigest(), "held_out_share": self.held_out_share,
                "reward": self.reward}

    @property
    def characters(self) -> str:
        return "".join(sorted({c for e in self.examples for c in e.prompt + e.answer}))

    def split(self, split: str) -> list[Example]:
        _check_split(split)
        held = split == "held_out"
        return [e for e in self.examples if in_held_out(e.prompt, self.held_out_share) == held]

    def sample(self, rng: random.Random, n: int, split: str = "train") -> list[Example]:
        pool = self.split(split)
        return [rng.choice(pool) for _ in range(n)]

    def held_out(self, n: int) -> list[Example]:
        """The first ``n`` rows of the held-out split (fewer if it is smaller)."""
        return self.split("held_out")[:n]


Task = ReverseTask | CountTask | JsonlTask


def load_task(data_path: str | None, reward: str | None, task: str = "reverse") -> Task:
    """The built-in ``task`` (a key of TASKS; with ``data_path`` None) or a JSONL file;
    ``reward`` names a REWARDS entry.

    Raises:
        ValueError: a missing or malformed file, an unknown reward, an empty split.
    """
    if reward is not None and reward not in REWARDS:
        raise ValueError(f"--reward {reward!r} is not known; known: {', '.join(REWARDS)}.")
    if data_path is None:
        if task not in TASKS:
            raise ValueError(f"--task {task!r} is not known; known: {', '.join(TASKS)}.")
        return TASKS[task](**({} if reward is None else {"reward": reward}))
    path = Path(data_path)
    if not path.is_file():
        raise ValueError(f"--data_path {data_path}: no such file. Pass a JSONL file with one "
                         '{"prompt": ..., "answer": ...} a line, or leave it out for the built-in task.')
    examples = tuple(_read_jsonl(path))
    task = JsonlTask(str(path), examples, **({} if reward is None else {"reward": reward}))
    for split in SPLITS:
        if not task.split(split):
            raise ValueError(f"--data_path {data_path}: the {split} split is empty ({len(examples)} "
                             "rows, 10 % held out by prompt hash); add more rows.")
    return task


def _read_jsonl(path: Path) -> Sequence[Example]:
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(Example(prompt=str(row["prompt"]), answer=str(row["answer"])))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"--data_path {path}, line {number}: expected a JSON object with "
                             '"prompt" and "answer"; fix or remove that line.') from None
    return out


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not known; known: {', '.join(SPLITS)}.")
