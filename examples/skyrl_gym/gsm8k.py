"""GSM8K as records for skyrl-gym's `gsm8k` environment, in the shape SkyRL's own GSM8K
preparation gives them: the question with SkyRL's instruction as `prompt`, and the number after
GSM8K's "####" as `reward_spec.ground_truth`, which the environment compares the model's answer
with. recipes/grpo_skyrl_gym.toml reads what it writes.

    python examples/skyrl_gym/gsm8k.py                       # GSM8K's train split from the Hugging Face hub
    python examples/skyrl_gym/gsm8k.py --source train.jsonl  # or a local copy of GSM8K's own files

The first needs the `datasets` package (pip install 'rlkit[datasets]') and network once (the hub
caches it); the second reads a file in GSM8K's own format, one {"question": ..., "answer": ...} a
line (github.com/openai/grade-school-math ships them), and needs neither.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable
from pathlib import Path

# SkyRL's instruction for GSM8K: the environment reads the number after the first "#### " of the answer
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
FINAL = re.compile(r"#### (-?[0-9.,]+)")


def record(question: str, answer: str, split: str, index: int) -> dict:
    """One skyrl-gym record of a GSM8K row; the ground truth as the environment compares it (a
    string, commas dropped)."""
    found = FINAL.search(answer)
    if found is None:
        raise ValueError(f"row {index}: the answer has no '#### <number>' line: {answer[-80:]!r}")
    return {"prompt": f"{question} {INSTRUCTION}", "reward_spec": {"method": "rule", "ground_truth": found.group(1).replace(",", "")},
            "extra_info": {"split": split, "index": index}}


def rows_from_hub(split: str) -> Iterable[dict]:
    import datasets

    return datasets.load_dataset("openai/gsm8k", "main", split=split)  # type: ignore[return-value]


def rows_from_file(path: Path) -> Iterable[dict]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="a local file in GSM8K's own format (default: the hub's openai/gsm8k)")
    parser.add_argument("--split", default="train", help="the hub's split (train or test)")
    parser.add_argument("--out", type=Path, default=Path("data/gsm8k_train.jsonl"), help="where the records go")
    args = parser.parse_args(argv)
    rows = rows_from_file(args.source) if args.source else rows_from_hub(args.split)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with args.out.open("w", encoding="utf-8") as out:
        for index, row in enumerate(rows):
            out.write(json.dumps(record(row["question"], row["answer"], args.split, index)) + "\n")
            count += 1
    print(f"wrote {count} records to {args.out}")


if __name__ == "__main__":
    main()
