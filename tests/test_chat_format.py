"""The chat format of multi-turn episodes (rlkit_core.chat_format): sampled ids are kept as they
are, and what is rendered between turns makes the stream the template's render of the whole
conversation, or a new sample where the stream is not a token prefix of that render (a template that
rewrites history). Offline tokenizers only; Qwen3's real template is read from the installed `trl`."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import ByT5Tokenizer

from rlkit_core.chat_format import PROBE_OPENING, PROBE_THINK, PROBE_TOOLS, PROBE_TURNS, PlainFormat, TemplateFormat, audit, chat_format_for
from rlkit_core.messages import Reply, ToolCall
from rlkit_core.testing.offline_models import build_bpe_tokenizer
from rlkit_core.tool_call_formats import parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def chat_tokenizer():
    return build_bpe_tokenizer("chat")


@pytest.fixture(scope="module")
def chatml_tokenizer():
    return build_bpe_tokenizer("chatml")


def qwen3_template() -> str:
    """Qwen3's chat template as trl ships it (trl in the `test` extra), read from the installed package."""
    trl = pytest.importorskip("trl", reason="Qwen3's real chat template comes with trl (pip install -e .[test])")
    return (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    """The offline Qwen-style BPE (`<|im_end|>`, tool and think tags as added tokens) with Qwen3's real template."""
    tokenizer = build_bpe_tokenizer("chatml")
    tokenizer.chat_template = qwen3_template()
    return tokenizer


def chat_ends(tokenizer):
    return (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot_id|>"))


def chatml_ends(tokenizer):
    return (tokenizer.eos_token_id, tokenizer.pad_token_id)


def play(chat, opening, turns, tools, end_id):
    """An episode as the runner plays it: each turn's text (what the model writes) tokenised once as
    the sampled ids, then the bridge from the stream so far. Returns the samples (prompt and stream
    ids), the history and the bridges."""
    history = list(opening)
    samples, bridges = [chat.opening(history, tools)], []
    for turn, (written, answer) in enumerate(turns, 1):
        sampled = chat.encode(written) + [end_id]
        samples[-1] += sampled
        history.append(chat.assistant_message(chat.read(sampled, turn)))
        if answer is None:
            break
        bridge = chat.bridge(list(samples[-1]), history, answer, tools)
        bridges.append(bridge)
        history += answer
        if bridge is None:
            samples.append(chat.opening(history, tools))
        else:
            samples[-1] += bridge
    return samples, history, bridges


def whole_render(tokenizer, history, tools):
    return list(tokenizer.apply_chat_template(history, tools=tools, tokenize=True, return_dict=True)["input_ids"])


def test_append_only_template_stream_is_the_whole_render(chat_tokenizer):
    chat = chat_format_for("auto", chat_tokenizer, chat_ends(chat_tokenizer))
    assert isinstance(chat, TemplateFormat)
    eot = chat_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    opening = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    turns = [("fine, thanks", [{"role": "user", "content": "and you?"}]),
             ("the quick brown fox", [{"role": "tool", "name": "add", "content": "3"}]),
             ("a lovely day", None)]
    samples, history, bridges = play(chat, opening, turns, None, eot)
    assert len(samples) == 1 and None not in bridges
    # the Llama-3-style template puts nothing after <|eot_id|>: a bridge starts with the next header
    assert all(bridge[0] == chat_tokenizer.convert_tokens_to_ids("<|start_header_id|>") for bridge in bridges)
    assert samples[0] == whole_render(chat_tokenizer, history, None)
    assert samples[0][0] == chat_tokenizer.bos_token_id and samples[0].count(chat_tokenizer.bos_token_id) == 1


def test_chatml_bridge_carries_the_newline_after_the_end_token(chatml_tokenizer):
    """The template writes `<|im_end|>\\n`; the generation stops at `<|im_end|>`. The bridge starts
    with that newline, so the stream equals the whole render but for the newline after the final
    turn, which no turn samples."""
    chat = chat_format_for("template", chatml_tokenizer, chatml_ends(chatml_tokenizer))
    im_end, newline = chatml_tokenizer.eos_token_id, chat.encode("\n")
    assert len(newline) == 1
    opening = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 1 + 2?"}]
    turns = [(CALL_TEXT, [{"role": "tool", "name": "add", "content": "3"}]),
             ("it is 3", [{"role": "user", "content": "thanks"}]),
             ("you are welcome", None)]
    samples, history, bridges = play(chat, opening, turns, TOOLS, im_end)
    assert len(samples) == 1 and None not in bridges
    assert all(bridge[:1] == newline for bridge in bridges)
    whole = whole_render(chatml_tokenizer, history, TOOLS)
    assert whole[-2:] == [im_end] + newline
    assert samples[0] == whole[:-1]
    assert history[2]["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert history[2]["content"] == ""


def test_think_stripping_template_splits_never_merges(chatml_tokenizer):
    chat = chat_format_for("template", chatml_tokenizer, chatml_ends(chatml_tokenizer))
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"}]
    stream = chat.opening(history[:1], TOOLS) + chat.encode(history[1]["content"]) + [chatml_tokenizer.eos_token_id]
    # a tool result is no new user message: nothing is stripped, the stream goes on
    assert chat.bridge(stream, history, [{"role": "tool", "name": "add", "content": "3"}], TOOLS) is not None
    # a user message makes the template drop the earlier turn's reasoning: no bridge extends that
    assert chat.bridge(stream, history, [{"role": "user", "content": "more"}], TOOLS) is None
    reopened = chat.decode(chat.opening(history + [{"role": "user", "content": "more"}], TOOLS))
    assert "<think>" not in reopened and "hello<|im_end|>" in reopened

    think = "<think>\nthe user greets\n</think>\n\nhello"
    turns = [(think, [{"role": "user", "content": "more"}]), ("fine", None)]
    samples, history, bridges = play(chat, [{"role": "user", "content": "hi"}], turns, [], chatml_tokenizer.eos_token_id)
    assert bridges == [None] and len(samples) == 2
    assert samples[1] == whole_render(chatml_tokenizer, history, None)[:-1]


def test_parse_tool_calls_reads_well_formed_blocks():
    text = f'let me add\n{CALL_TEXT}\n<tool_call>{{"name": "neg", "arguments": {{"x": -1}}}}</tool_call>'
    calls, error = parse_tool_calls(text)
    assert error is None
    assert calls == (ToolCall("add", {"a": 1, "b": 2}), ToolCall("neg", {"x": -1}))
    assert parse_tool_calls("no calls here") == ((), None)


@pytest.mark.parametrize(("text", "words"), [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "invalid JSON"),
    ('<tool_call>{"name": "add", "arguments": {}}', "not closed"),
    ('{"name": "add"}</tool_call>', "no <tool_call>"),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', '"name" is missing'),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', '"name" is missing or not a string'),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', '"arguments" is not a JSON object'),
    ('<tool_call>["add"]</tool_call>', "JSON object"),
])
def test_parse_tool_calls_names_what_is_malformed(text, words):
    calls, error = parse_tool_calls(f'{CALL_TEXT}\n{text}')
    assert calls == ()  # all or none: the good first call is not made either
    assert error is not None and words in error
    assert ("tool call 2: " in error) == text.startswith("<tool_call>")  # the malformed one is named


def test_read_drops_only_the_end_token_and_keeps_tool_markup(chatml_tokenizer):
    chat = chat_format_for("auto", chatml_tokenizer, chatml_ends(chatml_tokenizer))
    ids = chat.encode(f"sure\n{CALL_TEXT}") + [chatml_tokenizer.eos_token_id]
    reply = chat.read(ids, 3)
    assert reply == Reply(text=f"sure\n{CALL_TEXT}", turn=3, tool_calls=(ToolCall("add", {"a": 1, "b": 2}),))
    assert chat.assistant_message(reply)["content"] == "sure"
    broken = chat.read(chat.encode("<tool_call>{oops</tool_call>") + [chatml_tokenizer.pad_token_id], 1)
    assert broken.parse_error and broken.tool_calls == ()
    assert chat.assistant_message(broken) == {"role": "assistant", "content": "<tool_call>{oops</tool_call>"}
    cut_off = chat.read(chat.encode("unfinished"), 1)  # no end token: nothing is dropped
    assert cut_off.text == "unfinished"


def test_plain_format_round_trip_with_byt5():
    tokenizer = ByT5Tokenizer()
    chat = chat_format_for("auto", tokenizer, (tokenizer.eos_token_id,))
    assert isinstance(chat, PlainFormat)
    opening = chat.opening([{"role": "system", "content": "be kind"}, {"role": "user", "content": "abc"}], TOOLS)
    assert chat.decode(opening) == "tools: add(a, b)\nbe kind\nabc\n"
    sampled = chat.encode(f"ok {CALL_TEXT}") + [tokenizer.eos_token_id]
    reply = chat.read(sampled, 1)
    assert reply.text == f"ok {CALL_TEXT}" and reply.tool_calls == (ToolCall("add", {"a": 1, "b": 2}),)
    history = [{"role": "user", "content": "abc"}, chat.assistant_message(reply)]
    bridge = chat.bridge(opening + sampled, history, [{"role": "tool", "name": "add", "content": "3"}, {"role": "user", "content": "next"}],
                         TOOLS)
    assert bridge is not None and tokenizer.eos_token_id not in opening + bridge
    assert chat.decode(opening + sampled + bridge) == f"tools: add(a, b)\nbe kind\nabc\nok {CALL_TEXT}</s>3\nnext\n"
    # an assistant message in an opening renders as it was sampled, end token included
    assert chat.opening(history, []) == chat.encode("abc\n") + chat.encode('ok<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
                                                                          "</tool_call>") + [tokenizer.eos_token_id]


def test_chat_format_for_names_the_fix(chat_tokenizer):
    with pytest.raises(ValueError, match="no chat template") as raised:
        chat_format_for("template", ByT5Tokenizer(), (1,))
    assert "chat_template" in str(raised.value) and 'chat_format = "plain"' in str(raised.value)
    with pytest.raises(ValueError, match="unknown chat format 'jinja'"):
        chat_format_for("jinja", chat_tokenizer, chat_ends(chat_tokenizer))
    assert chat_format_for("plain", chat_tokenizer, chat_ends(chat_tokenizer)).name == "plain"
    assert chat_format_for("auto", chat_tokenizer, chat_ends(chat_tokenizer)).name == "template"


def test_audit_merges_the_append_only_template(chat_tokenizer):
    found = audit(chat_tokenizer, chat_ends(chat_tokenizer))
    assert (found.format, found.mode, found.boundary_ids, found.split_turns, found.think_split_turns) == ("template", "merge", (), (), ())
    assert found.matches and found.tool_content_rendered and not found.tool_calls_rendered
    lines = found.lines()
    assert any(line.startswith("mode: merge") for line in lines)
    assert "tool calls: not rendered by the template: the history shows the model's turns without its calls" in lines


def test_audit_of_the_think_stripping_template_splits_only_turns_with_a_think_block(chatml_tokenizer):
    """Without a think block nothing is stripped (merge); with one, the user message after turn 2
    strips it (turn 1's too: a turn of calls alone, recorded with its content stripped of the blank
    line before the calls, renders otherwise than the model wrote it)."""
    found = audit(chatml_tokenizer, chatml_ends(chatml_tokenizer))
    assert (found.mode, found.split_turns, found.boundary_ids) == ("merge", (), (chatml_tokenizer.convert_tokens_to_ids("Ċ"),))
    assert 2 in found.think_split_turns and found.think_parting
    assert found.matches and found.tool_calls_rendered and found.tool_calls_read and found.tool_content_rendered
    lines = found.lines()
    assert any(line.startswith("mode: merge: when the model writes no think block") for line in lines)
    assert any(line.startswith("think blocks: stripped from the history") and "the stream has" in line for line in lines)


def test_audit_of_plain_byt5():
    found = audit(ByT5Tokenizer(), (1,))
    assert (found.format, found.mode) == ("plain", "merge") and found.matches and found.tool_calls_read


def test_audit_finds_a_stream_the_whole_render_segments_otherwise():
    """A generation prompt ending in a space: the whole render merges it with the answer's first
    word (" a"), the stream cannot, since the prompt was tokenised before the answer existed."""
    tokenizer = build_bpe_tokenizer("gpt2")
    tokenizer.chat_template = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
                               "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    found = audit(tokenizer, (tokenizer.eos_token_id,))
    # the stream is not a token prefix of the render (ids, not text): the turn splits, truthfully (it used to merge)
    assert found.mode == "split" and found.split_turns == (2,) and not found.matches
    position, stream_id, render_id = found.differences[0]
    assert tokenizer.convert_ids_to_tokens(stream_id) == "Ġ" and tokenizer.convert_ids_to_tokens(render_id).startswith("Ġ")
    assert any("ids differ, at " in line for line in found.lines())
    assert any(line.startswith("mode: split: after turn 2") and "' ' + 'a'" in line for line in found.lines())


def test_audit_reports_an_end_of_turn_the_generation_does_not_stop_on(chat_tokenizer):
    found = audit(chat_tokenizer, (chat_tokenizer.eos_token_id,))  # <|eot_id|> left out of the end ids
    assert found.mode == "split" and not found.end_found
    assert any("ends an assistant turn on none of the end ids" in line for line in found.lines())


QWEN3_OPENING = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 1 + 2?"}]


def qwen3_turns(think: str) -> list:
    """A tool call, its result, an answer, another user message, an answer: each turn written as Qwen3
    writes it (calls after the content and a newline), opening with `think`."""
    return [(think + "let me add\n" + CALL_TEXT, [{"role": "tool", "name": "add", "content": "3"}]),
            (think + "it is 3", [{"role": "user", "content": "thanks"}]),
            (think + "you are welcome", None)]


def test_qwen3_turns_without_a_think_block_extend_the_sample(qwen3_tokenizer):
    """Qwen3's template gives the last assistant turn an empty think block and drops it once a message
    follows, so the render of the history ending on a turn is never a prefix of the longer render;
    the stream, what the model saw and wrote, is: no turn splits."""
    chat = chat_format_for("template", qwen3_tokenizer, chatml_ends(qwen3_tokenizer))
    im_end = qwen3_tokenizer.eos_token_id
    history, stream = list(QWEN3_OPENING), chat.opening(QWEN3_OPENING, TOOLS)
    for turn, (written, answer) in enumerate(qwen3_turns(""), 1):
        sampled = chat.encode(written) + [im_end]
        stream += sampled
        history.append(chat.assistant_message(chat.read(sampled, turn)))
        if answer is None:
            break
        assert "<think>\n\n</think>" in chat.render(history, TOOLS, False)  # what the former test compared, and failed on
        bridge = chat.bridge(list(stream), history, answer, TOOLS)
        history += answer
        assert bridge is not None and stream + bridge == chat.opening(history, TOOLS)  # the whole conversation rendered
        stream += bridge
    assert history[2]["tool_calls"] and history[2]["content"] == "let me add"
    samples, _, bridges = play(chat, QWEN3_OPENING, qwen3_turns(""), TOOLS, im_end)
    assert len(samples) == 1 and None not in bridges and samples[0] == stream


def test_qwen3_a_think_block_splits_once_the_template_strips_it(qwen3_tokenizer):
    """Qwen3 keeps the reasoning of the turns after the last user message (a tool result goes on)
    and strips it once a user message follows: that turn splits, and the next sample is the
    re-rendered conversation."""
    chat = chat_format_for("template", qwen3_tokenizer, chatml_ends(qwen3_tokenizer))
    im_end = qwen3_tokenizer.eos_token_id
    samples, history, bridges = play(chat, QWEN3_OPENING, qwen3_turns(PROBE_THINK), TOOLS, im_end)
    assert bridges[0] is not None and bridges[1] is None and len(samples) == 2
    reopened, last = chat.opening(history[:-1], TOOLS), chat.encode(PROBE_THINK + "you are welcome") + [im_end]
    assert samples[1] == reopened + last and "some reasoning" not in chat.decode(reopened)
    # the think block the model wrote is what the stream holds; the render of the longer history has none
    assert "<think>\nsome reasoning\n</think>\n\nit is 3<|im_end|>" in chat.decode(samples[0])


def test_audit_of_qwen3_agrees_with_the_runner(qwen3_tokenizer):
    """The audit's verdicts are those of the runner's bridge on the audit's own probe, its turns
    written without and with a think block."""
    ends = chatml_ends(qwen3_tokenizer)
    found = audit(qwen3_tokenizer, ends)
    assert (found.format, found.mode, found.split_turns, found.think_split_turns) == ("template", "merge", (), (2,))
    assert found.matches and found.end_found and found.tool_calls_rendered and found.tool_calls_read and found.tool_content_rendered
    lines = found.lines()
    assert any(line.startswith("mode: merge: when the model writes no think block") for line in lines)
    think = [line for line in lines if line.startswith("think blocks: ")]
    assert think and think[0].startswith("think blocks: stripped from the history") and "turn 2 of the probe split" in think[0]
    chat = chat_format_for("auto", qwen3_tokenizer, ends)
    call = PROBE_TURNS[0][0]["tool_calls"][0]["function"]
    written = ['<tool_call>\n{"name": "' + call["name"] + '", "arguments": {"word": "fox"}}\n</tool_call>',
               *(message["content"] for message, _ in PROBE_TURNS[1:])]
    for prefix, splits in (("", found.split_turns), (PROBE_THINK, found.think_split_turns)):
        turns = [(prefix + text, answer) for text, (_, answer) in zip(written, PROBE_TURNS)]
        _, _, bridges = play(chat, PROBE_OPENING, turns, PROBE_TOOLS, qwen3_tokenizer.eos_token_id)
        assert tuple(turn for turn, bridge in enumerate(bridges, 1) if bridge is None) == splits


def test_a_qwen3_episode_through_the_runner_does_not_split(recipe_document, builtin_registry, tmp_path):
    """The whole runner on Qwen3's real template, with a model that writes no think block: one sample
    an episode (it used to split at every turn), its stream the template's render of the
    conversation up to the last turn's generation prompt, then that turn."""
    import attrs
    import torch
    from transformers import AutoTokenizer

    from rlkit_core.testing.offline_models import write_tiny_model
    from tests.test_episodes import Scripted, episode_document
    from tests.test_trainer import make_trainer, rollout_with

    template = qwen3_template()
    path = write_tiny_model(tmp_path / "qwen3", "chatml")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn = tokenizer("7", add_special_tokens=False)["input_ids"] + [end]
    trainer = make_trainer(episode_document(recipe_document, path, max_turns=3), builtin_registry)
    trainer.components = attrs.evolve(trainer.components, generator=Scripted([turn], tokenizer.pad_token_id))
    batch, metrics = rollout_with(trainer, [{"prompt": "Guess my number, 1-16.", "secret": 16}] * 2)
    assert metrics["env/splits"] == 0 and len(batch) == 2 and metrics["env/turns"] == 3
    conversation = [{"role": "user", "content": "Guess my number, 1-16."}]
    for answer in ("higher: 8-16", "say a number: 8-16"):
        conversation += [{"role": "assistant", "content": "7"}, {"role": "user", "content": answer}]
    render = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    row = torch.cat([batch.prompt_ids[0][batch.prompt_mask[0].bool()], batch.response_ids[0][batch.response_mask[0].bool()]]).tolist()
    assert row == tokenizer(render, add_special_tokens=False)["input_ids"] + turn


def test_qwen3_thinking_kept_as_sampled_goes_on_with_what_the_template_renders_after_the_turn(qwen3_tokenizer):
    """`thinking_in_history = "kept"`: where Qwen3's template strips the think blocks (a user message
    follows turn 2), the stream goes on as the model wrote it, and the bridge is what the template
    puts after that turn's end token: its newline, the user message and the generation prompt."""
    chat = chat_format_for("template", qwen3_tokenizer, chatml_ends(qwen3_tokenizer))
    chat.keep_sampled = True
    im_end = qwen3_tokenizer.eos_token_id
    samples, history, bridges = play(chat, QWEN3_OPENING, qwen3_turns(PROBE_THINK), TOOLS, im_end)
    assert len(samples) == 1 and None not in bridges
    assert chat.decode(bridges[1]) == "\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n"
    # the first bridge is the same either way: Qwen3 keeps the reasoning while a tool result goes on
    chat.keep_sampled = False
    assert play(chat, QWEN3_OPENING, qwen3_turns(PROBE_THINK), TOOLS, im_end)[2][0] == bridges[0]
    # the one sample is the opening, then each turn exactly as written and each bridge, in order
    turns = [chat.encode(written) + [im_end] for written, _ in qwen3_turns(PROBE_THINK)]
    assert samples[0] == chat.opening(QWEN3_OPENING, TOOLS) + turns[0] + bridges[0] + turns[1] + bridges[1] + turns[2]
    assert chat.decode(samples[0]).count("some reasoning") == 3


def test_audit_costs_both_treatments_of_thinking_and_agrees_with_the_runner(qwen3_tokenizer):
    """The audit plays the probe with think blocks both ways and prints the setting's verdict with
    the other's cost; kept, no turn of the probe splits, as in the runner."""
    ends = chatml_ends(qwen3_tokenizer)
    rendered, kept = audit(qwen3_tokenizer, ends), audit(qwen3_tokenizer, ends, thinking_in_history="kept")
    assert rendered.think_costs == kept.think_costs
    costs = {setting: (samples, ids) for setting, samples, ids in kept.think_costs}
    assert costs["rendered"][0] == 2 and costs["kept"][0] == 1 and costs["rendered"][1] > costs["kept"][1]
    assert (kept.mode, kept.split_turns, kept.think_split_turns, kept.think_rewritten_turns) == ("merge", (), (), (2,))
    think = next(line for line in kept.lines() if line.startswith("think blocks: "))
    assert think.startswith('think blocks: kept as sampled (thinking_in_history = "kept")') and "after turn 2 of the probe" in think
    assert f"the probe makes 1 training sample of {costs['kept'][1]} ids, against 2 training samples of {costs['rendered'][1]}" in think
    think = next(line for line in rendered.lines() if line.startswith("think blocks: "))
    assert f"against 1 training sample of {costs['kept'][1]} ids with thinking_in_history" in think
    chat = chat_format_for("auto", qwen3_tokenizer, ends)
    chat.keep_sampled = True
    written = ['<tool_call>\n{"name": "probe_lookup", "arguments": {"word": "fox"}}\n</tool_call>',
               *(message["content"] for message, _ in PROBE_TURNS[1:])]
    samples, _, bridges = play(chat, PROBE_OPENING, [(PROBE_THINK + text, answer) for text, (_, answer) in zip(written, PROBE_TURNS)],
                               PROBE_TOOLS, qwen3_tokenizer.eos_token_id)
    assert None not in bridges and [len(sample) for sample in samples] == [costs["kept"][1]]


@pytest.mark.parametrize(("thinking", "rows"), [("rendered", [0, 0, 0, 1]), ("kept", [0, 1])])
def test_a_thinking_qwen3_episode_through_the_runner_splits_or_not_as_the_recipe_says(recipe_document, builtin_registry, tmp_path,
                                                                                        thinking, rows):
    """The whole runner on Qwen3's real template with a model that thinks in every turn of the first
    game: rendered, each user message after a turn splits the episode (three rows); kept, it stays one
    row whose stream holds every think block."""
    from tests.test_episode_credit import thinking_qwen3_trainer
    from tests.test_trainer import rollout_with

    trainer = thinking_qwen3_trainer(recipe_document, builtin_registry, tmp_path, thinking_in_history=thinking)
    tokenizer = trainer.components.policy.tokenizer
    games = [{"prompt": "Guess my number, 1-16.", "secret": 16}, {"prompt": "Guess my number, 1-16.", "secret": 7}]
    batch, metrics = rollout_with(trainer, games, samples_per_prompt=1)
    assert batch.episode_ids.tolist() == rows and metrics["env/splits"] == (1.0 if thinking == "rendered" else 0.0)
    first = tokenizer.decode(batch.response_ids[0][batch.response_mask[0].bool()])
    assert first.count("<think>\nhmm\n</think>") == (1 if thinking == "rendered" else 3)
