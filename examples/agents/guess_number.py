"""Guess-the-number as an agent: the game of the multi-turn default recipe (recipes/ppo_guess_number.toml,
its `guess-number` environment) written as any program on the OpenAI API is. It thinks of the
number, asks the model for a guess, and answers "higher: 9-16" or "lower: 1-7" (the range still
open) until the model says the number or its turns run out. rlkit trains the model behind the
endpoint; nothing here knows about rlkit.

    [environment]
    type = "agent"
    harness = "examples/agents/guess_number.py:play"                # in place of type = "guess-number"
    max_turns = 5
    max_episode_tokens = 128
    # or: command = ["python", "examples/agents/guess_number.py"]

Called as a function, it is given the game (the prompt record of `guess-number-games`: its
`prompt` and its `secret`) and a client; run as a program, it reads the game from RLKIT_RECORD and
the endpoint from OPENAI_BASE_URL and OPENAI_API_KEY, as the OpenAI client does, and prints its
result.

It says what the environment says, word for word, and pays what it pays: `TURN_COST` less for each
wrong guess and 1 for the right one, summed and returned when the game ends (an agent pays once,
at its end; the environment pays each turn as it goes). Its figures are the environment's: `won`,
`turns_to_win` (won games only) and `in_range` (whether the last guess was a number inside the
open range). A game the server ends under it (410: the model's turn was cut off) is lost, `won` 0,
as the environment counts it.
"""

import json
import os
import re

from openai import APIStatusError, OpenAI

LOW, HIGH = 1, 16  # the numbers it may think of: the recipe's environment.low and .high
MAX_TURNS = 5  # guesses before the game is lost: the recipe's environment.max_turns
TURN_COST = 0.1  # reward of each wrong guess (negated): the recipe's environment.turn_cost
NUMBER = re.compile(r"\s*(\d{1,3})\s*")  # a guess: a number of up to three digits, nothing else but spaces


def play(record: dict, client: OpenAI) -> dict:
    try:
        return game(record, client)
    except APIStatusError as error:
        if error.status_code != 410:  # 410: the server ended the game (the model's turn was cut off)
            raise
        return {"reward": 0.0, "won": 0.0}  # lost: the server counts its figures, not its reward


def game(record: dict, client: OpenAI) -> dict:
    secret, low, high = record["secret"], LOW, HIGH
    messages = [{"role": "user", "content": f"Guess my number, {low}-{high}."}]
    reward, in_range = 0.0, False
    for turn in range(1, MAX_TURNS + 1):
        message = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        match = NUMBER.fullmatch(message.content or "")
        guess = int(match.group(1)) if match else None
        if guess == secret:
            reward += 1.0
            return {"reward": reward, "won": 1.0, "turns_to_win": float(turn), "in_range": 1.0}
        reward -= TURN_COST
        in_range = guess is not None and low <= guess <= high
        if turn == MAX_TURNS:
            break  # no answer to the last wrong guess: the game is lost
        if guess is not None and in_range:
            if guess < secret:
                text, low = f"higher: {guess + 1}-{high}", guess + 1
            else:
                text, high = f"lower: {low}-{guess - 1}", guess - 1
        else:
            text = f"say a number: {low}-{high}"
        messages.append({"role": "user", "content": text})
    return {"reward": reward, "won": 0.0, "in_range": float(in_range)}


if __name__ == "__main__":
    print(json.dumps(play(json.loads(os.environ["RLKIT_RECORD"]), OpenAI())))
