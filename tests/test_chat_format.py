"""The chat format of multi-turn episodes (rlkit_core.chat_format): sampled ids are kept as they
are, and what is rendered between turns makes the stream the template's render of the whole
conversation, or a new sample where the template rewrites history. Offline tokenizers only."""

from __future__ import annotations

import pytest
from transformers import ByT5Tokenizer

from rlkit_core.chat_format import PlainFormat, TemplateFormat, audit, chat_format_for, parse_tool_calls
from rlkit_core.messages import Reply, ToolCall
from rlkit_core.testing.offline_models import build_bpe_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def chat_tokenizer():
    return build_bpe_tokenizer("chat")


@pytest.fixture(scope="module")
def chatml_tokenizer():
    return build_bpe_tokenizer("chatml")


def chat_ends(tokenizer):
    return (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot_id|>"))


def chatml_ends(tokenizer):
    return (tokenizer.eos_token_id, tokenizer.pad_token_id)


def play(chat, opening, turns, tools, end_id):
    """An episode as the runner plays it: each turn's text (what the model writes) tokenised once as
    the sampled ids, then the bridge. Returns the samples (ids), the history and the bridges."""
    history = list(opening)
    samples, bridges = [chat.opening(history, tools)], []
    for turn, (written, answer) in enumerate(turns, 1):
        sampled = chat.encode(written) + [end_id]
        samples[-1] += sampled
        history.append(chat.assistant_message(chat.read(sampled, turn)))
        if answer is None:
            break
        bridge = chat.bridge(history, answer, tools)
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
    # a tool result is no new user message: nothing is stripped, the stream goes on
    assert chat.bridge(history, [{"role": "tool", "name": "add", "content": "3"}], TOOLS) is not None
    # a user message makes the template drop the earlier turn's reasoning: no bridge extends that
    assert chat.bridge(history, [{"role": "user", "content": "more"}], TOOLS) is None
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
    bridge = chat.bridge(history, [{"role": "tool", "name": "add", "content": "3"}, {"role": "user", "content": "next"}], TOOLS)
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
    assert (found.format, found.mode, found.boundary_ids, found.split_turns) == ("template", "merge", (), ())
    assert found.matches and found.tool_content_rendered and not found.tool_calls_rendered
    lines = found.lines()
    assert any(line.startswith("mode: merge") for line in lines)
    assert "tool calls: not rendered by the template: the history shows the model's turns without its calls" in lines


def test_audit_splits_the_think_stripping_template(chatml_tokenizer):
    found = audit(chatml_tokenizer, chatml_ends(chatml_tokenizer))
    assert (found.mode, found.split_turns, found.boundary_ids) == ("split", (2,), (chatml_tokenizer.convert_tokens_to_ids("Ċ"),))
    assert found.matches and found.tool_calls_rendered and found.tool_calls_read and found.tool_content_rendered
    split = [line for line in found.lines() if line.startswith("mode: ")]
    assert split[0].startswith("mode: split: the template rewrites the history after turn 2") and "<think>" in split[0]


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
    assert found.mode == "merge" and not found.matches
    position, stream_id, render_id = found.differences[0]
    assert tokenizer.convert_ids_to_tokens(stream_id) == "Ġ" and tokenizer.convert_ids_to_tokens(render_id).startswith("Ġ")
    assert any("ids differ, at " in line for line in found.lines())


def test_audit_reports_an_end_of_turn_the_generation_does_not_stop_on(chat_tokenizer):
    found = audit(chat_tokenizer, (chat_tokenizer.eos_token_id,))  # <|eot_id|> left out of the end ids
    assert found.mode == "split" and not found.end_found
    assert any("ends an assistant turn on none of the end ids" in line for line in found.lines())
