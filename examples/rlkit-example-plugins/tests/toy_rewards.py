"""Rule rewards for the tests, named as 'path/to/toy_rewards.py:function' in reward tables."""


def length(prompts, responses):
    return [float(len(r)) for r in responses]


def exclamations(prompts, responses, **columns):
    return [float(r.count("!")) for r in responses]
