"""The rlkit command, telling what each process rolled out, for tests:
`torchrun ... tests/rollout_recorder.py OUT run RECIPE ...` runs `rlkit run RECIPE ...` and appends
every rollout batch this process made (its own share, before any gather) to `OUT/rollouts-<rank>.jsonl`,
one JSON line a row: its prompt ids, its response ids and the ids in it that were sampled (counted
in the loss, with the sampler's log-prob), its episode id and its score.
"""

import json
import os
import sys
from pathlib import Path

import torch


def rows(batch) -> list[dict]:
    told = []
    for i in range(len(batch)):
        response, counted = batch.response_ids[i], batch.loss_mask[i].bool()
        sampled = response[counted & ~torch.isnan(batch.sampled_logprobs[i])]
        told.append({"prompt_ids": batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist(),
                     "response_ids": response[batch.response_mask[i].bool()].tolist(), "sampled_ids": sampled.tolist(),
                     "episode_id": int(batch.episode_ids[i]) if batch.episode_ids is not None else None,
                     "score": float(batch.scores[i])})
    return told


def main(out: str, *args: str) -> int:
    from rlkit_core.runtime import rollout
    from rlkit_core.runtime.cli import main as rlkit

    made = rollout.rollout
    path = Path(out, f"rollouts-{os.environ.get('RANK', '0')}.jsonl")

    def recorded(*a, **k):
        batch, metrics = made(*a, **k)
        with path.open("a") as told:
            told.writelines(json.dumps(row) + "\n" for row in rows(batch))
        return batch, metrics

    rollout.rollout = recorded
    return rlkit(list(args))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
