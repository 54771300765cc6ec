"""Write cases.json: conversations and replies run through the release's own encoder and parser.

The release's `encoding/encoding_dsv4.py` is not part of this repository: get a copy of the
DeepSeek-V4 release's `encoding/` directory (the revision used is recorded in cases.json) and run

    python tests/data/release_chat/make_cases.py --encoder PATH/TO/encoding/encoding_dsv4.py \
        --source "REPOSITORY @ COMMIT, PATH"

The encoder of V4-Flash-0731 (its reasoning efforts low / high / max) writes
`cases_0731.json` instead, its cases carrying `revision="0731"` among their options.

It needs the `regex` package only if that revision of the encoder imports it. The release's own
examples (`encoding/tests/test_input_*.json`) are added as cases when they sit beside the encoder.
"""

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import sys


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather and a forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["location"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "max_results": {"type": "integer", "default": 5},
                "safe": {"type": "boolean"},
                "filters": {
                    "type": "object",
                    "properties": {"site": {"type": "string"}, "after": {"type": "string"}},
                },
                "languages": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["query"],
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string"},
                "precision": {"type": "number"},
                "exact": {"type": ["boolean", "null"]},
            },
            "required": ["expression"],
        },
    },
}
BOOK = {
    "type": "function",
    "function": {
        "name": "book_flight",
        "description": "Book a flight for several passengers.",
        "parameters": {
            "type": "object",
            "properties": {
                "origin": {"type": "string"},
                "destination": {"type": "string"},
                "passengers": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                    },
                },
                "price_limit": {"type": "number"},
                "refundable": {"type": "boolean"},
            },
        },
    },
}
NO_ARGS = {
    "type": "function",
    "function": {"name": "get_time", "description": "The current time.", "parameters": {}},
}


def call(id_, name, arguments):
    return {
        "id": id_,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def raw_call(id_, name, arguments_text):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments_text}}


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def weather_turns():
    """A user question, a tool call, its result, the final answer."""
    return [
        {"role": "user", "content": "What's the weather in Beijing?"},
        {
            "role": "assistant",
            "reasoning_content": "The user wants the weather. I should call get_weather.",
            "content": "",
            "tool_calls": [call("c1", "get_weather", {"location": "Beijing", "unit": "celsius"})],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 22, "sky": "clear"}'},
        {
            "role": "assistant",
            "reasoning_content": "Got it. Format the answer.",
            "content": "It is 22°C and clear in Beijing.",
        },
    ]


def parallel_turns():
    """Three calls in one reply; their results come back in another order."""
    return [
        {"role": "user", "content": "Weather in Paris and Tokyo, and 17*23?"},
        {
            "role": "assistant",
            "reasoning_content": "Three independent calls.",
            "content": "Let me look these up.",
            "tool_calls": [
                call("w1", "get_weather", {"location": "Paris", "days": 3}),
                call("w2", "get_weather", {"location": "Tokyo", "unit": "fahrenheit"}),
                call("k1", "calculate", {"expression": "17*23", "precision": 0.5, "exact": None}),
            ],
        },
        {"role": "tool", "tool_call_id": "k1", "content": "391"},
        {"role": "tool", "tool_call_id": "w2", "content": "75°F, humid"},
        {"role": "tool", "tool_call_id": "w1", "content": "14°C, rain"},
    ]


def conversations(revision="original"):
    """(name, messages, options) for the encoder; options are chat_prompt's keyword arguments."""
    out = []

    def add(name, messages, **options):
        if revision != "original":
            options["revision"] = revision
        out.append((name, messages, options))

    add("user_only_chat", [{"role": "user", "content": "Hello!"}])
    add("user_only_thinking", [{"role": "user", "content": "Hello!"}], thinking=True)
    add("system_user_chat", [SYSTEM, {"role": "user", "content": "What is 2+2?"}])
    basic = [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "reasoning_content": "Greet back.",
            "content": "Hello! How can I help?",
        },
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "reasoning_content": "2 is prime.", "content": "2."},
        {"role": "user", "content": "Another?"},
    ]
    add("multi_turn_chat", basic)
    add("multi_turn_thinking_drops_reasoning", basic, thinking=True)
    add("multi_turn_thinking_keep_reasoning", basic, thinking=True, drop_thinking=False)
    add("multi_turn_thinking_effort_max", basic, thinking=True, reasoning_effort="max")
    add("multi_turn_thinking_effort_high", basic, thinking=True, reasoning_effort="high")
    add("effort_max_in_chat_mode_ignored", basic, reasoning_effort="max")
    add("effort_max_no_system", basic[1:], thinking=True, reasoning_effort="max")
    if revision == "0731":
        add("multi_turn_thinking_effort_low", basic, thinking=True, reasoning_effort="low")
        add("effort_low_no_system", basic[1:], thinking=True, reasoning_effort="low")
        add("effort_high_no_system", basic[1:], thinking=True, reasoning_effort="high")
        add("effort_high_in_chat_mode_ignored", basic, reasoning_effort="high")
    add("no_bos", basic[:2], add_bos=False)
    add("empty_system_content", [{"role": "system", "content": ""}, basic[1]], thinking=True)
    add(
        "consecutive_user_messages_merged",
        [
            {"role": "user", "content": "First part."},
            {"role": "user", "content": "Second part."},
            {"role": "user", "content": "Third part."},
        ],
        thinking=True,
    )
    add(
        "non_ascii_and_newlines",
        [
            {"role": "system", "content": "你是一个有用的助手。\n回答要简短。"},
            {"role": "user", "content": "北京的天气怎么样？🌤\n\n谢谢"},
            {"role": "assistant", "reasoning_content": "用户问天气。", "content": "晴，22°C。"},
            {"role": "user", "content": 'Ünïcödé and "quotes" and {braces}'},
        ],
        thinking=True,
    )
    tools_system = {**SYSTEM, "tools": [WEATHER, CALC]}
    add("tools_thinking", [tools_system, *weather_turns()], thinking=True)
    add("tools_chat", [tools_system, *weather_turns()])
    add(
        "tools_thinking_next_question",
        [tools_system, *weather_turns(), {"role": "user", "content": "And tomorrow?"}],
        thinking=True,
    )
    add(
        "tools_pending_result_thinking",
        [tools_system, *weather_turns()[:3]],
        thinking=True,
        reasoning_effort="max",
    )
    add(
        "parallel_calls_results_out_of_order",
        [{**SYSTEM, "tools": [WEATHER, CALC]}, *parallel_turns()],
        thinking=True,
    )
    add("parallel_calls_chat", [{**SYSTEM, "tools": [WEATHER, CALC]}, *parallel_turns()])
    add(
        "tool_results_then_user_text_merged",
        [
            {**SYSTEM, "tools": [WEATHER, CALC]},
            *parallel_turns(),
            {"role": "user", "content": "Also convert Paris to Fahrenheit."},
        ],
        thinking=True,
    )
    add(
        "tool_result_content_blocks",
        [
            {"role": "system", "content": "", "tools": [SEARCH]},
            {"role": "user", "content": "Find recent JAX releases."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    call(
                        "s1",
                        "search",
                        {
                            "query": "JAX release notes",
                            "max_results": 3,
                            "safe": True,
                            "filters": {"site": "github.com", "after": "2026-01-01"},
                            "languages": ["en", "zh"],
                        },
                    )
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "s1",
                "content": [
                    {"type": "text", "text": "jax 0.10.2 released"},
                    {"type": "image", "url": "x.png"},
                    {"type": "text", "text": "jax 0.10.1 released"},
                ],
            },
        ],
        thinking=True,
    )
    add(
        "tool_calls_every_parameter_type",
        [
            {"role": "system", "content": "Travel agent.", "tools": [BOOK, NO_ARGS]},
            {"role": "user", "content": "Book Lisbon to Oslo for Ana (34) and Bo (6)."},
            {
                "role": "assistant",
                "reasoning_content": "Two passengers.",
                "content": "",
                "tool_calls": [
                    call(
                        "b1",
                        "book_flight",
                        {
                            "origin": "Lisbon",
                            "destination": "Oslo",
                            "passengers": [{"name": "Ana", "age": 34}, {"name": "Bo", "age": 6}],
                            "price_limit": 412.5,
                            "refundable": False,
                        },
                    ),
                    call("t1", "get_time", {}),
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "09:30"},
            {"role": "tool", "tool_call_id": "b1", "content": "Booked: ref XK12"},
            {"role": "assistant", "reasoning_content": "Done.", "content": "Booked (ref XK12)."},
        ],
        thinking=True,
    )
    add(
        "tool_call_arguments_not_json",
        [
            {"role": "system", "content": "", "tools": [CALC]},
            {"role": "user", "content": "2+2"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [raw_call("x", "calculate", "2+2 (not JSON)")],
            },
            {"role": "tool", "tool_call_id": "x", "content": "4"},
        ],
    )
    add(
        "response_format",
        [
            {
                "role": "system",
                "content": "Extract fields.",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "person",
                        "schema": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                        },
                    },
                },
            },
            {"role": "user", "content": "Ana is 34."},
        ],
    )
    add(
        "tools_and_response_format",
        [
            {**SYSTEM, "tools": [WEATHER], "response_format": {"type": "json_object"}},
            {"role": "user", "content": "Weather in Rome as JSON."},
        ],
        thinking=True,
    )
    add(
        "developer_with_tools_and_reminder",
        [
            {"role": "system", "content": "You are DeepSeek."},
            {"role": "latest_reminder", "content": "2026-12-02, Wednesday, Lisbon, App, English"},
            {"role": "developer", "content": "Search for the ECB rate.", "tools": [SEARCH]},
            {
                "role": "assistant",
                "reasoning_content": "Search it.",
                "content": "",
                "tool_calls": [call("s", "search", {"query": "ECB deposit rate"})],
            },
            {"role": "tool", "tool_call_id": "s", "content": "2.00%"},
            {"role": "assistant", "reasoning_content": "Answer.", "content": "It is 2.00%."},
        ],
        thinking=True,
    )
    add(
        "developer_dropped_before_last_user",
        [
            {"role": "developer", "content": "Internal instruction."},
            {"role": "assistant", "reasoning_content": "r", "content": "ok"},
            {"role": "user", "content": "Next?"},
        ],
        thinking=True,
    )
    add(
        "developer_last_response_format",
        [
            {
                "role": "developer",
                "content": "Answer in JSON.",
                "response_format": {"type": "json_object"},
            },
        ],
    )
    add(
        "latest_reminder_after_user",
        [
            {"role": "user", "content": "What day is it?"},
            {"role": "latest_reminder", "content": "2026-12-02"},
        ],
        thinking=True,
    )
    add(
        "assistant_prefill_wo_eos",
        [
            {"role": "user", "content": "Write a haiku."},
            {
                "role": "assistant",
                "reasoning_content": "Five, seven, five.",
                "content": "Autumn",
                "wo_eos": True,
            },
        ],
        thinking=True,
    )
    add(
        "assistant_prefill_wo_eos_chat",
        [
            {"role": "user", "content": "Write a haiku."},
            {"role": "assistant", "content": "Autumn", "wo_eos": True},
        ],
    )
    for task in ("action", "query", "authority", "domain", "title", "read_url"):
        add(
            f"task_{task}_chat",
            [
                SYSTEM,
                {"role": "user", "content": "Plan a trip to Oslo.", "task": task},
                {"role": "assistant", "content": f"{task} output"},
            ],
        )
    add(
        "task_action_thinking",
        [
            {"role": "user", "content": "Plan a trip.", "task": "action"},
            {"role": "assistant", "content": "search"},
            {"role": "user", "content": "Go on."},
        ],
        thinking=True,
    )
    add(
        "task_query_last_message",
        [{"role": "user", "content": "Best pizza in Naples", "task": "query"}],
        thinking=True,
    )
    context = [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "Greet.", "content": "Hello!"},
    ]
    add(
        "context_continuation_chat",
        [{"role": "user", "content": "How are you?"}],
        context=context,
    )
    add(
        "context_continuation_thinking",
        [{"role": "user", "content": "How are you?"}],
        thinking=True,
        context=context,
    )
    add(
        "context_continuation_thinking_keep",
        [{"role": "user", "content": "How are you?"}],
        thinking=True,
        drop_thinking=False,
        context=context,
    )
    tool_context = [tools_system, *parallel_turns()[:2]]
    add(
        "context_continuation_tool_results",
        parallel_turns()[2:],
        thinking=True,
        context=tool_context,
    )
    add(
        "context_continuation_assistant_turn",
        [
            {"role": "assistant", "reasoning_content": "Think.", "content": "Fine."},
            {"role": "user", "content": "Good."},
        ],
        thinking=True,
        context=[SYSTEM, {"role": "user", "content": "How are you?"}],
    )
    add(
        "context_split_tool_results",
        parallel_turns()[3:],
        thinking=True,
        context=[tools_system, *parallel_turns()[:3]],
    )
    add(
        "context_ends_with_developer",
        [
            {"role": "assistant", "reasoning_content": "r", "content": "Done."},
            {"role": "user", "content": "Thanks. Anything else?"},
        ],
        thinking=True,
        context=[
            {"role": "user", "content": "Look this up."},
            {"role": "developer", "content": "Search."},
        ],
    )
    add(
        "context_continuation_effort_max",
        [{"role": "user", "content": "How are you?"}],
        thinking=True,
        reasoning_effort="max",
        context=context,
    )
    return out


def rejected(revision="original"):
    """(name, messages, options) the release's encoder refuses."""
    user = {"role": "user", "content": "Hi"}
    cases = [
        ("reasoning_effort_low", [user], {"thinking": True, "reasoning_effort": "low"}),
        ("reasoning_effort_unknown_chat", [user], {"reasoning_effort": "extreme"}),
        ("developer_without_content", [{"role": "developer", "content": ""}, user], {}),
        ("unknown_role", [{"role": "narrator", "content": "x"}, user], {}),
        ("unknown_role_last", [user, {"role": "function", "content": "x"}], {"thinking": True}),
        ("invalid_task", [{"role": "user", "content": "x", "task": "summarise"}], {}),
        (
            "tool_call_arguments_json_list",
            [
                user,
                {"role": "assistant", "content": "", "tool_calls": [raw_call("a", "f", "[1, 2]")]},
            ],
            {},
        ),
        (
            "tool_call_without_function",
            [user, {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "name": "f"}]}],
            {},
        ),
        (
            "tool_without_function",
            [{"role": "system", "content": "", "tools": [{"name": "f"}]}, user],
            {},
        ),
        ("user_content_none", [{"role": "user", "content": None}], {}),
    ]
    if revision == "original":
        return cases
    # 0731 accepts "low"; "medium" is not one of its efforts.
    cases[0] = ("reasoning_effort_medium", [user], {"thinking": True, "reasoning_effort": "medium"})
    return [
        (name, messages, {**options, "revision": revision}) for name, messages, options in cases
    ]


def reply_texts(enc):
    """(name, text, thinking) replies, well-formed ones written by the encoder itself."""
    eos, dsml = enc.eos_token, enc.dsml_token
    out = []

    def completion(message, thinking):
        """The reply the model would write for `message`: the text after the assistant opener."""
        user = {"role": "user", "content": "q"}
        mode = "thinking" if thinking else "chat"
        system = {"role": "system", "content": "", "tools": [WEATHER]}
        before = enc.encode_messages([system, user], thinking_mode=mode)
        full = enc.encode_messages([system, user, message], thinking_mode=mode)
        assert full.startswith(before)
        return full[len(before) :]

    for thinking in (False, True):
        mode = "thinking" if thinking else "chat"
        samples = {
            "plain": {
                "role": "assistant",
                "reasoning_content": "Think first.",
                "content": "Answer.",
            },
            "empty": {"role": "assistant", "content": ""},
            "multiline_unicode": {
                "role": "assistant",
                "reasoning_content": "步骤 1\n步骤 2",
                "content": "结果：42 🎉\n\nDone.",
            },
            "one_call": {
                "role": "assistant",
                "reasoning_content": "Call it.",
                "content": "",
                "tool_calls": [call("a", "get_weather", {"location": "Oslo", "unit": "celsius"})],
            },
            "parallel_calls_with_content": {
                "role": "assistant",
                "reasoning_content": "Two calls.",
                "content": "Checking both.",
                "tool_calls": [
                    call("a", "get_weather", {"location": "Oslo", "days": 2}),
                    call(
                        "b",
                        "book_flight",
                        {
                            "passengers": [{"name": "Ana", "age": 34}],
                            "price_limit": 99.5,
                            "refundable": True,
                            "origin": 'Oslo "Gardermoen"',
                            "note": None,
                        },
                    ),
                ],
            },
            "call_without_arguments": {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("t", "get_time", {})],
            },
            "call_multiline_string_argument": {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("c", "calculate", {"expression": "1 +\n2 <= 3 </b>"})],
            },
        }
        for name, message in samples.items():
            out.append((f"{mode}_{name}", completion(message, thinking), thinking))

    think = "Reasoning.</think>"
    calls = (
        f'\n\n<{dsml}tool_calls>\n<{dsml}invoke name="f">\n'
        f'<{dsml}parameter name="x" string="false">1</{dsml}parameter>\n'
        f"</{dsml}invoke>\n</{dsml}tool_calls>"
    )
    out += [
        ("thinking_missing_end_think", "Still thinking, no end." + eos, True),
        ("chat_missing_eos", "Answer without an end", False),
        ("thinking_missing_eos", think + "Answer without an end", True),
        ("chat_text_after_eos", "Answer." + eos + "more", False),
        ("chat_two_eos", "A." + eos + eos, False),
        ("chat_end_think_in_content", "A</think>B" + eos, False),
        ("chat_think_in_content", "<think>A" + eos, False),
        ("thinking_think_in_reasoning", "<think>R" + think + "A" + eos, True),
        ("chat_bos_in_content", enc.bos_token + "A" + eos, False),
        ("chat_dsml_in_content", f"A {dsml} B" + eos, False),
        ("thinking_empty_reasoning", "</think>A" + eos, True),
        ("chat_tool_calls_without_eos", calls, False),
        ("chat_tool_calls_text_after", calls + "extra" + eos, False),
        ("thinking_tool_calls_inside_reasoning", "R" + calls + "</think>A" + eos, True),
        ("chat_tool_calls_truncated_after_open", f"\n\n<{dsml}tool_calls", False),
        (
            "chat_tool_calls_truncated_after_invoke",
            f'\n\n<{dsml}tool_calls>\n<{dsml}invoke name="f">\n',
            False,
        ),
        (
            "chat_tool_call_bad_separator",
            f'\n\n<{dsml}tool_calls> <{dsml}invoke name="f">\n</{dsml}invoke>\n</{dsml}tool_calls>'
            + eos,
            False,
        ),
        (
            "chat_tool_call_bad_name",
            f'\n\n<{dsml}tool_calls>\n<{dsml}invoke nom="f">\n</{dsml}invoke>\n</{dsml}tool_calls>'
            + eos,
            False,
        ),
        (
            "chat_tool_call_bad_parameter",
            f'\n\n<{dsml}tool_calls>\n<{dsml}invoke name="f">\n'
            f'<{dsml}parameter name="x" string="maybe">1</{dsml}parameter>\n'
            f"</{dsml}invoke>\n</{dsml}tool_calls>" + eos,
            False,
        ),
        (
            "chat_tool_call_duplicate_parameter",
            f'\n\n<{dsml}tool_calls>\n<{dsml}invoke name="f">\n'
            f'<{dsml}parameter name="x" string="true">1</{dsml}parameter>\n'
            f'<{dsml}parameter name="x" string="true">2</{dsml}parameter>\n'
            f"</{dsml}invoke>\n</{dsml}tool_calls>" + eos,
            False,
        ),
        (
            "chat_tool_call_parameter_bad_separator",
            f'\n\n<{dsml}tool_calls>\n<{dsml}invoke name="f">\n'
            f'<{dsml}parameter name="x" string="true">1</{dsml}parameter> '
            f"</{dsml}invoke>\n</{dsml}tool_calls>" + eos,
            False,
        ),
        (
            "chat_tool_call_raw_value_not_json",
            f'\n\n<{dsml}tool_calls>\n<{dsml}invoke name="f">\n'
            f'<{dsml}parameter name="x" string="false">not json</{dsml}parameter>\n'
            f"</{dsml}invoke>\n</{dsml}tool_calls>" + eos,
            False,
        ),
        ("chat_only_eos", eos, False),
        ("chat_empty", "", False),
    ]
    return out


def load_encoder(path):
    spec = importlib.util.spec_from_file_location("release_encoding_dsv4", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def release_kwargs(options):
    return {
        "thinking_mode": "thinking" if options.get("thinking") else "chat",
        "reasoning_effort": options.get("reasoning_effort"),
        "drop_thinking": options.get("drop_thinking", True),
        "context": copy.deepcopy(options.get("context")),
        "add_default_bos_token": options.get("add_bos", True),
    }


def error_text(err):
    return f"{type(err).__name__}: {err}"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--encoder", required=True, help="the release's encoding/encoding_dsv4.py")
    parser.add_argument(
        "--source", required=True, help="where the encoder came from (repository @ commit, path)"
    )
    parser.add_argument(
        "--out", help="default: cases.json (original) or cases_0731.json beside this script"
    )
    args = parser.parse_args()
    enc = load_encoder(args.encoder)
    with open(args.encoder, "rb") as f:
        sha256 = hashlib.sha256(f.read()).hexdigest()
    revision = "0731" if hasattr(enc, "REASONING_EFFORT_PROMPTS") else "original"
    out = args.out or os.path.join(
        os.path.dirname(__file__), "cases.json" if revision == "original" else "cases_0731.json"
    )

    cases = conversations(revision)
    release_dir = os.path.join(os.path.dirname(args.encoder), "tests")
    for i, mode in ((1, "thinking"), (2, "thinking"), (3, "thinking"), (4, "chat")):
        path = os.path.join(release_dir, f"test_input_{i}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if isinstance(data, dict):  # the first example keeps its tools beside the messages
                messages = data["messages"]
                messages[0]["tools"] = data["tools"]
            else:
                messages = data
            cases.append((f"release_example_{i}", messages, {"thinking": mode == "thinking"}))

    encoded = []
    for name, messages, options in cases:
        before = copy.deepcopy(messages)
        prompt = enc.encode_messages(copy.deepcopy(messages), **release_kwargs(options))
        assert messages == before
        encoded.append({"name": name, "messages": messages, "options": options, "prompt": prompt})
    refused = []
    for name, messages, options in rejected(revision):
        try:
            enc.encode_messages(copy.deepcopy(messages), **release_kwargs(options))
        except Exception as err:  # the release refuses with asserts and whatever else breaks
            refused.append(
                {
                    "name": name,
                    "messages": messages,
                    "options": options,
                    "release_error": error_text(err),
                }
            )
        else:
            raise SystemExit(f"the release's encoder accepts the 'rejected' case {name}")
    replies = []
    for name, text, thinking in reply_texts(enc):
        entry = {"name": name, "text": text, "thinking": thinking}
        try:
            entry["parsed"] = enc.parse_message_from_completion_text(
                text, thinking_mode="thinking" if thinking else "chat"
            )
        except Exception as err:
            entry["release_error"] = error_text(err)
        replies.append(entry)

    data = {
        "encoder": {
            "source": args.source,
            "sha256": sha256,
            "revision": {
                "original": "reasoning efforts 'max' (adds REASONING_EFFORT_MAX) and 'high' "
                "(adds nothing)",
                "0731": "reasoning efforts 'low' (the default, adds nothing), 'high' and 'max' "
                "(REASONING_EFFORT_PROMPTS)",
            }[revision],
            "made_by": "tests/data/release_chat/make_cases.py",
        },
        "conversations": encoded,
        "rejected": refused,
        "replies": replies,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(
        f"{len(encoded)} conversations, {len(refused)} rejected inputs, {len(replies)} replies "
        f"({sum('release_error' in r for r in replies)} refused) -> {out}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
