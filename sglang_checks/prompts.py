"""The prompt set: built in and deterministic, or `--prompts` as a JSONL file of token ids or texts.

Each JSONL line is an object with either "input_ids" (a list of token ids) or "text" (a string). Texts, and the
built-in prompts (short English sentences), are turned into ids with the checkpoint's own tokenizer when it has one;
generated models have none, so they use a byte-level stand-in: the UTF-8 bytes of the text as ids 0..255 (inside every
vocabulary here), which is deterministic and needs no download.
"""

from __future__ import annotations

import json
from typing import List, Optional

from sglang_checks.errors import CheckError

BUILT_IN = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, a robot",
    "The derivative of x^2 is",
    "Water boils at a temperature of",
    "import torch\nx = torch.",
    "My favourite colour is",
    "Translate to German: good morning",
)


def byte_ids(text: str) -> List[int]:
    return list(text.encode("utf-8"))


class Tokenize:
    """Text -> ids with the checkpoint's tokenizer (loaded lazily), or bytes when the model has none."""

    def __init__(self, model_path: Optional[str]):
        self._path = model_path
        self._tokenizer = None

    def __call__(self, text: str) -> List[int]:
        if self._path is None:
            return byte_ids(text)
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._path)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


def built_in_prompts(num_prompts: int, tokenize: Tokenize) -> List[List[int]]:
    if not 1 <= num_prompts <= len(BUILT_IN):
        raise CheckError(f"--num_prompts: expected 1 to {len(BUILT_IN)} built-in prompts, got {num_prompts}")
    return [tokenize(text) for text in BUILT_IN[:num_prompts]]


def load_prompts(path: str, *, vocab_size: int, tokenize: Tokenize, limit: int = 0) -> List[List[int]]:
    """Reads the JSONL file; every error names the line and what was expected. `limit` > 0 keeps the first ones."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckError(f"--prompts={path}: cannot read the file ({exc})") from exc
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"--prompts={path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CheckError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(record, dict) or ("input_ids" in record) == ("text" in record):
            raise CheckError(f"{where}: expected an object with exactly one of \"input_ids\" or \"text\"")
        if "text" in record:
            if not isinstance(record["text"], str) or not record["text"]:
                raise CheckError(f"{where}: \"text\" must be a non-empty string")
            ids = tokenize(record["text"])
        else:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
                raise CheckError(f"{where}: \"input_ids\" must be a non-empty list of integers")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise CheckError(f"{where}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})")
        prompts.append(ids)
    if not prompts:
        raise CheckError(f"--prompts={path}: no prompts in the file")
    return prompts[:limit] if limit > 0 else prompts
