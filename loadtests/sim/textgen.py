"""Deterministic answers: the same (adapter, prompt, seed) always gives the same words; adapters differ."""

from __future__ import annotations

import hashlib
import random

# Short words only (<= 4 characters), so each is exactly one token for the simulator's tokenizer.
_VOCABULARY = (  # noqa: SIM905
    "the a of to and in is it you that he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how if will up out many "
    "then them so some her make like him into time has look two more go see way who its now find long down day "
    "did get come made may part over new take only"
).split()


def answer_tokens(adapter: str, prompt: str, seed: int, natural_min: int, natural_max: int) -> list[str]:
    """The full answer this (adapter, prompt, seed) wants to give; callers cut it at ``max_tokens``."""
    digest = hashlib.sha256(f"{seed}\x00{adapter}\x00{prompt}".encode()).digest()
    rng = random.Random(digest)
    length = rng.randint(natural_min, natural_max)
    return [rng.choice(_VOCABULARY) for _ in range(length)]
