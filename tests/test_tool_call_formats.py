"""Tool-call formats (rlkit_core.tool_call_formats and the built-ins): each reads the markup its
family writes, all or none, and leaves the turn so that the family's real chat template (read
from the installed `trl`) renders it back as it was; "auto" picks the format from the template; a
turn a format cannot read is answered and counted, never dropped."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlkit_core.chat_format import audit, chat_format_for, episode_format
from rlkit_core.messages import Reply, ToolCall
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.testing.contracts import ToolCallFormatContract
from rlkit_core.testing.offline_models import build_bpe_tokenizer
from rlkit_core.tool_call_formats import chosen_format, typed_arguments

TOOLS = [{"type": "function", "function": {"name": "search", "description": "searches the shelves", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}, "weight": {"type": "number"},
                                     "exact": {"type": "boolean"}, "filters": {"type": "object"}, "shelves": {"type": "array"}},
    "required": ["query"]}}}]
# values of every schema type, a string of two lines among them
CALLS = [ToolCall("search", {"query": "red fox\nor wolf", "limit": 3, "weight": 0.5, "exact": True, "filters": {"lang": "en"},
                             "shelves": [1, 2]}),
         ToolCall("search", {"query": "badger"})]
# template file -> (the format "auto" picks, whether the template renders more than one call a turn)
FAMILIES = {"qwen3_5_think.jinja": ("qwen3-coder", True), "qwen3_6.jinja": ("qwen3-coder", True), "llama3_1.jinja": ("llama3-json", False),
            "llama3_2.jinja": ("llama3-json", False), "glm4moe.jinja": ("glm45", True), "qwen3.jinja": ("hermes", True)}
OPENING = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "find me a book on foxes"}]


def real_template(name: str) -> str:
    trl = pytest.importorskip("trl", reason="the families' real chat templates come with trl (pip install -e .[test])")
    return (Path(trl.__file__).parent / "chat_templates" / name).read_text()


def entry(call: ToolCall) -> dict:
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def written_turn(tokenizer, message: dict) -> str:
    """The assistant turn as the model writes it: the template's render of it after the generation
    prompt, up to its end token (GLM-4.5 renders none after a last turn: it ends on the next role's)."""
    prompt = tokenizer.apply_chat_template(OPENING, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(OPENING + [message], tools=TOOLS, tokenize=False)
    assert whole.startswith(prompt)
    text = whole[len(prompt):]
    ends = [text.index(end) for end in ("<|im_end|>", "<|eot_id|>") if end in text]
    return text[:min(ends)] if ends else text


@pytest.mark.parametrize("template_file", sorted(FAMILIES))
def test_a_call_round_trips_through_the_familys_real_template(template_file, builtin_registry):
    """Render an assistant message with calls through the real template, cut the turn out as the
    model writes it, read it with the format "auto" picks: the same calls, values of every schema
    type included. The message the format leaves renders to the same text again."""
    expected, several = FAMILIES[template_file]
    tokenizer = build_bpe_tokenizer("chatml")
    tokenizer.chat_template = real_template(template_file)
    calls = CALLS if several else CALLS[:1]
    message = {"role": "assistant", "content": "Let me look that up." if several else "", "tool_calls": [entry(c) for c in calls]}
    fmt, how = chosen_format(None, tokenizer.chat_template, builtin_registry)
    assert how == f"{expected} (auto: recognised in the chat template)"
    text = written_turn(tokenizer, message)
    assert fmt is not None and fmt.read(text, TOOLS) == (tuple(calls), None), text
    recorded = fmt.assistant_message(Reply(text=text, turn=1, tool_calls=tuple(calls)))
    assert recorded["tool_calls"] == message["tool_calls"]
    again = tokenizer.apply_chat_template(OPENING + [recorded], tools=TOOLS, tokenize=False)
    assert again == tokenizer.apply_chat_template(OPENING + [message], tools=TOOLS, tokenize=False)


@pytest.mark.parametrize("template_file", ["qwen3_6.jinja", "glm4moe.jinja"])
def test_xml_values_stay_strings_without_a_schema_type(template_file, builtin_registry):
    """The XML formats carry text: without the tool's schema (or with typed_arguments off) every
    value is the string the template wrote, a non-string value as JSON."""
    tokenizer = build_bpe_tokenizer("chatml")
    tokenizer.chat_template = real_template(template_file)
    text = written_turn(tokenizer, {"role": "assistant", "content": "", "tool_calls": [entry(CALLS[0])]})
    fmt, _ = chosen_format(None, tokenizer.chat_template, builtin_registry)
    assert fmt is not None
    strings = {"query": "red fox\nor wolf", "limit": "3", "weight": "0.5", "exact": "true", "filters": '{"lang": "en"}', "shelves": "[1, 2]"}
    assert fmt.read(text, []) == ((ToolCall("search", strings),), None)
    untyped = builtin_registry.find("tool_call_format", FAMILIES[template_file][0])
    assert untyped.factory(untyped.config_class(typed_arguments=False)).read(text, TOOLS) == ((ToolCall("search", strings),), None)


def test_typed_arguments_convert_only_what_fits_the_declared_type():
    # Qwen3.5's template writes a boolean with Jinja's `string` filter: "True"
    values = {"query": "42", "limit": "3", "weight": "2", "exact": "True", "filters": "[1]", "shelves": "not json", "extra": "7"}
    assert typed_arguments("search", values, TOOLS) == {
        "query": "42",  # declared a string: kept, though it reads as a number
        "limit": 3, "weight": 2, "exact": True,
        "filters": "[1]",  # an array where an object is declared: kept as written, the tool's check answers it
        "shelves": "not json", "extra": "7"}  # not JSON; no declared type
    assert typed_arguments("other", {"limit": "3"}, TOOLS) == {"limit": "3"}  # an unknown tool: no schema
    either = [{"function": {"name": "f", "parameters": {"properties": {"n": {"type": ["integer", "null"]}, "s": {"type": ["string", "integer"]}}}}}]
    assert typed_arguments("f", {"n": "null", "s": "5"}, either) == {"n": None, "s": "5"}


def test_auto_recognises_one_format_for_every_template_trl_ships(builtin_registry):
    """No template of trl's reads as two formats (auto refuses those), and the families above are
    recognised; a template that names none falls back to hermes, as does a tokenizer without one."""
    trl = pytest.importorskip("trl")
    for path in sorted((Path(trl.__file__).parent / "chat_templates").glob("*.jinja")):
        chosen_format(None, path.read_text(), builtin_registry)  # raises on two
    assert chosen_format(None, real_template("gemma.jinja"), builtin_registry)[1] == "hermes (auto: the chat template names no other format)"
    assert chosen_format(None, None, builtin_registry)[1] == "hermes (auto: no chat template)"
    assert chosen_format(None, None, None) == (None, "hermes (auto: no chat template)")  # no registry: the core's reading, the same markup


def test_a_template_two_formats_claim_is_refused_with_the_fix(builtin_registry):
    both = real_template("qwen3_6.jinja") + real_template("glm4moe.jinja")
    with pytest.raises(ValueError, match=r"reads as 2 tool-call formats \(glm45, qwen3-coder\); set tool_call_format"):
        chosen_format(None, both, builtin_registry)


@pytest.mark.parametrize(("name", "text", "reason"), [
    ("qwen3-coder", "<tool_call>\n<function=search>\n<parameter=query>\nfox\n</function>\n</tool_call>", "is not a <parameter=NAME>"),
    ("qwen3-coder", "<tool_call>\n{\"name\": \"search\"}\n</tool_call>", "one <function=NAME>...</function> expected"),
    ("qwen3-coder", "<function=search>\n</function>", "is not inside <tool_call>"),
    ("qwen3-coder", "<tool_call>\n<function=search>\n<parameter=q>\n1\n</parameter>\n<parameter=q>\n2\n</parameter>\n</function>\n</tool_call>",
     "parameter 'q' is given twice"),
    ("glm45", "<tool_call>search\n<arg_key>query</arg_key>\n</tool_call>", "is not an <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> pair"),
    ("glm45", "<tool_call>{\"name\": \"search\"}</tool_call>", "a function name expected"),
    ("glm45", "<tool_call>search\n<arg_key>query</arg_key><arg_value>fox</arg_value>", "is not closed"),
    ("llama3-json", '{"name": "search", "parameters": {"query": "fox"', "invalid JSON"),
    ("llama3-json", '[{"name": "search", "parameters": {}}, {"name": "search", "parameters": {}}]', "one call a turn expected"),
    ("llama3-json", '<|python_tag|>brave_search.call(query="fox")', "invalid JSON"),
    ("llama3-json", '{"name": "search", "parameters": "fox"}', "\"parameters\" is not a JSON object"),
])
def test_a_malformed_turn_gives_no_call_and_says_why(builtin_registry, name, text, reason):
    component = builtin_registry.find("tool_call_format", name)
    if name == "qwen3-coder":  # all or none: a well-formed call beside the malformed one is not read either
        text += "\n<tool_call>\n<function=search>\n</function>\n</tool_call>"
    calls, error = component.factory(component.config_class()).read(text, TOOLS)
    assert calls == () and error is not None and reason in error, error


def test_llama3_reads_prose_and_json_answers_without_a_name_as_prose(builtin_registry):
    component = builtin_registry.find("tool_call_format", "llama3-json")
    fmt = component.factory(component.config_class())
    assert fmt.read("The answer is {x}.", TOOLS) == ((), None)
    assert fmt.read('{"answer": 4}', TOOLS) == ((), None)
    assert fmt.read('<|python_tag|>{"name": "search", "arguments": {"query": "fox"}}', TOOLS) == ((ToolCall("search", {"query": "fox"}),), None)


class TestHermes(ToolCallFormatContract):
    component = "hermes"
    malformed = ['<tool_call>{"name": "lookup", "arguments": {</tool_call>', "<tool_call>{}", '<tool_call>{"arguments": {}}</tool_call>']

    @property
    def template(self):
        return real_template("qwen3.jinja")


class TestQwen3Coder(ToolCallFormatContract):
    component = "qwen3-coder"
    malformed = ["<tool_call>\n<function=lookup>\n<parameter=word>\nfox\n</function>\n</tool_call>", "<tool_call>\n<function=lookup>\n",
                 "<function=lookup>\n</function>"]

    @property
    def template(self):
        return real_template("qwen3_6.jinja")


class TestLlama3Json(ToolCallFormatContract):
    component = "llama3-json"
    calls = [ToolCall("lookup", {"word": "fox", "count": 2, "exact": True})]
    malformed = ['{"name": "lookup", "parameters": {', '{"name": 3, "parameters": {}}']

    @property
    def template(self):
        return real_template("llama3_1.jinja")


class TestGLM45(ToolCallFormatContract):
    component = "glm45"
    malformed = ["<tool_call>lookup\n<arg_key>word</arg_key>\n</tool_call>", "<tool_call>lookup\n<arg_value>fox</arg_value></tool_call>"]

    @property
    def template(self):
        return real_template("glm4moe.jinja")


def test_the_audit_reads_the_probe_in_the_format_auto_picks(builtin_registry):
    """`rlkit check` and `rlkit run` print the format and how it was picked; the probe's call,
    rendered by Qwen3.6's template, reads back in it (hermes would not read it)."""
    from rlkit_core.episode_limits import StandardEpisode

    tokenizer = build_bpe_tokenizer("chatml")
    tokenizer.chat_template = real_template("qwen3_6.jinja")
    ends = (tokenizer.eos_token_id, tokenizer.pad_token_id)
    chat, how = episode_format(StandardEpisode(), tokenizer, ends, builtin_registry)
    found = audit(tokenizer, ends, "auto", chat.tool_calls, how)
    assert found.tool_calls_rendered and found.tool_calls_read
    assert "tool-call format: qwen3-coder (auto: recognised in the chat template)" in found.lines()
    assert "tool calls: rendered and read back" in found.lines()
    hermes = audit(tokenizer, ends, "auto")
    assert hermes.tool_calls_rendered and not hermes.tool_calls_read


def test_the_recipe_picks_a_format_by_name_or_table_and_names_an_unknown_one(recipe_document, builtin_registry):
    recipe_document.pop("reward")
    recipe_document["environment"] = {"type": "counter"}
    recipe_document["data"] = {"type": "counter-tasks", "size": 8}
    default = parse_recipe(recipe_document, builtin_registry)["environment"].config.tool_call_format
    assert (default.component.name, default.table) == ("auto", "environment.tool_call_format")
    recipe_document["environment"]["tool_call_format"] = "glm45"
    assert parse_recipe(recipe_document, builtin_registry)["environment"].config.tool_call_format.config.typed_arguments is True
    recipe_document["environment"]["tool_call_format"] = {"type": "qwen3-coder", "typed_arguments": False}
    chosen = parse_recipe(recipe_document, builtin_registry)["environment"].config.tool_call_format
    assert chosen_format(chosen, None, builtin_registry)[1] == "qwen3-coder (the recipe's)"
    assert chosen.config.typed_arguments is False
    recipe_document["environment"]["tool_call_format"] = "qwen3"
    with pytest.raises(Exception, match=r"\$\.environment\.tool_call_format: unknown tool_call_format 'qwen3'.*did you mean 'qwen3-coder'"):
        parse_recipe(recipe_document, builtin_registry)


def test_the_plain_format_writes_a_historys_calls_in_the_tool_call_format(builtin_registry):
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    component = builtin_registry.find("tool_call_format", "glm45")
    chat = chat_format_for("plain", tokenizer, (tokenizer.eos_token_id,), component.factory(component.config_class()))
    message = {"role": "assistant", "content": "", "tool_calls": [entry(ToolCall("search", {"query": "fox"}))]}
    assert chat.render([message], [], False) == "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>fox</arg_value>\n</tool_call></s>"


def test_unreadable_markup_is_answered_and_counted_through_the_runner(recipe_document, builtin_registry, tmp_path):
    """A counter episode whose model writes Qwen3-Coder calls: the readable one reaches the tool
    (its amount typed as the tool's integer), the malformed one is told to the model in a tool
    message and counted in env/unreadable_tool_calls, never dropped."""
    import attrs
    from transformers import AutoTokenizer

    from rlkit_core.runtime.episodes import EpisodeRunner, episode_metrics
    from rlkit_core.testing.offline_models import write_tiny_model
    from tests.test_episodes import Scripted
    from tests.test_trainer import make_trainer

    model = write_tiny_model(tmp_path / "chatml", "chatml")  # tool tags one token each, 256 positions
    tokenizer = AutoTokenizer.from_pretrained(model)
    good = "<tool_call>\n<function=add>\n<parameter=amount>\n3\n</parameter>\n</function>\n</tool_call>"
    bad = "<tool_call>\n<function=add>\n<parameter=amount>\n4\n</function>\n</tool_call>"
    turns = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in (good, bad)]
    recipe_document.pop("reward")
    recipe_document["policy"]["model"] = str(model)
    recipe_document["generator"]["max_new_tokens"] = max(map(len, turns))
    recipe_document["environment"] = {"type": "counter", "max_turns": 3, "max_episode_tokens": 2000, "chat_format": "plain",
                                       "tool_call_format": "qwen3-coder"}
    recipe_document["data"] = {"type": "counter-tasks", "size": 8}
    trainer = make_trainer(recipe_document, builtin_registry)
    components = attrs.evolve(trainer.components, generator=Scripted(turns, tokenizer.pad_token_id))
    played = EpisodeRunner(trainer.engine, components, trainer.recipe)(trainer.stream.batch(0)[:2], [0, 1], [0, 1])
    assert episode_metrics(played)["env/unreadable_tool_calls"] == 1.0  # one unreadable turn an episode
    episode = played[0]
    assert episode.unreadable == 1  # turns: good, bad, then good again (or the context's end)
    first, answer, second, told = episode.messages[1:5]
    assert first["tool_calls"] == [entry(ToolCall("add", {"amount": 3}))] and answer["content"] == "3"
    assert second == {"role": "assistant", "content": bad}
    assert told["role"] == "tool" and "could not be read" in told["content"] and "is not a <parameter=NAME>" in told["content"]
