"""An agent for the cheapest-item puzzles, written as any program on the OpenAI API is: a loop of
chat completions with one tool, which it runs itself. rlkit trains the model behind the endpoint;
nothing here knows about rlkit.

    harness = "examples/agents/cheapest_item.py:play"               # in a recipe's [environment]
    command = ["python", "examples/agents/cheapest_item.py"]        # or as a program of its own

Called as a function, it is given the puzzle (the prompt record: its `prompt` and `prices`) and a
client; run as a program, it reads the puzzle from RLKIT_RECORD and the endpoint from
OPENAI_BASE_URL and OPENAI_API_KEY, as the OpenAI client does, and prints its result. A puzzle the
server ends under it (410: the model's turn was cut off) is unsolved, as the in-process
environment counts it.
"""

import json
import os
import re

from openai import APIStatusError, OpenAI

PRICE_TOOL = {
    "type": "function",
    "function": {
        "name": "price",
        "description": "Look up the price of one item.",
        "parameters": {
            "type": "object",
            "properties": {"position": {"type": "integer", "description": "the item's position in the question, 1 for the first"}},
            "required": ["position"],
        },
    },
}
MAX_TURNS = 6
CALL_COST = 0.1  # reward lost for each lookup beyond one per item


def look_up(prices: list[int], call) -> tuple[str, bool]:
    """The tool's answer to one call, and whether it was a lookup (a call of `price` with a position)."""
    if call.function.name != "price":
        return f"Error: there is no tool named {call.function.name!r}; the tools are: price.", False
    try:
        position = json.loads(call.function.arguments)["position"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "Error: price takes one argument, position (a whole number).", False
    if not isinstance(position, int) or not 1 <= position <= len(prices):
        return f"Error: IndexError: no item at position {position}; the positions are 1 to {len(prices)}", True
    return str(prices[position - 1]), True


def play(record: dict, client: OpenAI) -> dict:
    try:
        return puzzle(record, client)
    except APIStatusError as error:
        if error.status_code != 410:  # 410: the server ended the puzzle (the model's turn was cut off)
            raise
        return {"reward": 0.0, "solved": 0.0, "optimal": 0.0}  # unsolved: the server counts its figures, not its reward


def puzzle(record: dict, client: OpenAI) -> dict:
    prices = record["prices"]
    messages = [{"role": "user", "content": record["prompt"]}]
    lookups = 0
    for _ in range(MAX_TURNS):
        response = client.chat.completions.create(model="policy", messages=messages, tools=[PRICE_TOOL])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            numbers = re.findall(r"\d+", message.content or "")
            solved = bool(numbers) and int(numbers[-1]) == prices.index(min(prices)) + 1
            extra = max(0, lookups - len(prices))
            reward = max(0.0, 1.0 - CALL_COST * extra) if solved else 0.0
            return {"reward": reward, "solved": float(solved), "optimal": float(solved and extra == 0)}
        for call in message.tool_calls:
            answer, counted = look_up(prices, call)
            lookups += counted
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    return {"reward": 0.0, "solved": 0.0, "optimal": 0.0}  # the turns ran out before an answer


if __name__ == "__main__":
    print(json.dumps(play(json.loads(os.environ["RLKIT_RECORD"]), OpenAI())))
