"""The chat protocol against the release's own encoder and parser.

`data/release_chat/cases.json` holds what the release's `encoding/encoding_dsv4.py` wrote for
each conversation and reply (made by `data/release_chat/make_cases.py`; the file records the
encoder's source and revision). The encoder is not part of this repository.
"""

import copy
import json
import pathlib

import pytest

import equinox_dsv4 as ed


CASES = json.loads(
    (pathlib.Path(__file__).parent / "data" / "release_chat" / "cases.json").read_text("utf-8")
)


def _names(entries):
    return [entry["name"] for entry in entries]


def test_stored_data_covers_the_protocol():
    conversations = CASES["conversations"]
    assert len(conversations) >= 30
    assert "2ecc534c2423f589fd2c3f04b76b46dc41f6f162" in CASES["encoder"]["source"]
    roles = {
        m["role"]
        for c in conversations
        for m in c["messages"] + (c["options"].get("context") or [])
    }
    assert roles == {"system", "user", "developer", "assistant", "tool", "latest_reminder"}
    options = [c["options"] for c in conversations]
    assert {o.get("thinking", False) for o in options} == {False, True}
    assert {o.get("reasoning_effort") for o in options} == {None, "max", "high"}
    assert any(o.get("context") for o in options) and any(
        o.get("drop_thinking") is False for o in options
    )
    fields = {k for c in conversations for m in c["messages"] for k in m}
    assert {
        "tools",
        "response_format",
        "tool_calls",
        "reasoning_content",
        "wo_eos",
        "task",
    } <= fields
    assert {"string", "integer", "number", "boolean", "array", "object"} <= {
        p["type"]
        for c in conversations
        for m in c["messages"]
        for t in m.get("tools", [])
        for p in t["function"].get("parameters", {}).get("properties", {}).values()
        if isinstance(p.get("type"), str)
    }
    assert any(r.get("parsed", {}).get("tool_calls") for r in CASES["replies"])
    assert any("release_error" in r for r in CASES["replies"])


@pytest.mark.parametrize("case", CASES["conversations"], ids=_names(CASES["conversations"]))
def test_prompt_is_the_release_encoders(case):
    messages = copy.deepcopy(case["messages"])
    assert ed.chat_prompt(messages, **case["options"]) == case["prompt"]
    assert messages == case["messages"]  # the caller's messages are left as they were


@pytest.mark.parametrize("case", CASES["rejected"], ids=_names(CASES["rejected"]))
def test_input_the_release_refuses_is_a_value_error(case):
    with pytest.raises(ValueError):
        ed.chat_prompt(case["messages"], **case["options"])


@pytest.mark.parametrize("case", CASES["replies"], ids=_names(CASES["replies"]))
def test_reply_parses_as_the_release_parses(case):
    if "parsed" in case:
        assert ed.parse_reply(case["text"], thinking=case["thinking"]) == case["parsed"]
    else:
        with pytest.raises(ValueError):
            ed.parse_reply(case["text"], thinking=case["thinking"])


def test_parsed_reply_goes_back_into_the_conversation():
    """A reply with tool calls, parsed, then the results: the prompt holds the calls as written."""
    weather = next(c for c in CASES["conversations"] if c["name"] == "tools_thinking")
    system, user = weather["messages"][:2]
    prompt = ed.chat_prompt([system, user], thinking=True)
    written = next(r for r in CASES["replies"] if r["name"] == "thinking_one_call")["text"]
    reply = ed.parse_reply(written, thinking=True)
    reply["tool_calls"][0]["id"] = "a"
    turn = [system, user, reply, {"role": "tool", "tool_call_id": "a", "content": "cold"}]
    after = ed.chat_prompt(turn, thinking=True)
    assert after.startswith(prompt + written)
    assert after.endswith("<｜User｜><tool_result>cold</tool_result><｜Assistant｜><think>")


@pytest.mark.parametrize(
    "messages,options,message",
    [
        # Stricter than the release, which skips these when it does not render the message.
        (
            [{"role": "user", "content": "a", "task": "bogus"}, {"role": "user", "content": "b"}],
            {},
            "task",
        ),
        (
            [{"role": "narrator", "content": "x"}, {"role": "user", "content": "b"}],
            {"thinking": True},
            "narrator",
        ),
        ([{"role": "user", "content": ["x"]}], {}, "'content' must be a string"),
        ([{"role": "latest_reminder"}], {}, "latest_reminder"),
        ([{"role": "tool", "tool_call_id": "a", "content": None}], {}, "content"),
        (
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
                }
            ],
            {},
            "JSON string",
        ),
        ([{"role": "user", "content": "x"}], {"reasoning_effort": "low"}, "reasoning_effort 'low'"),
    ],
)
def test_errors_name_the_problem(messages, options, message):
    with pytest.raises(ValueError, match=message):
        ed.chat_prompt(messages, **options)


def test_tokens_and_decoding():
    prompt = next(c for c in CASES["conversations"] if c["name"] == "tools_thinking")["prompt"]
    ids = ed.encode_text(prompt)
    tokenizer = ed.load_tokenizer()
    for marker in (
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "｜DSML｜",
        "<｜end▁of▁sentence｜>",
    ):
        assert tokenizer.token_to_id(marker) in ids, marker  # each marker is one token
    assert ed.decode_text(ids, skip_special_tokens=False) == prompt
    shown = ed.decode_text(ids)
    for hidden in (
        "<｜begin▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "<｜end▁of▁sentence｜>",
    ):
        assert hidden not in shown
    assert "｜DSML｜invoke" in shown and "What's the weather in Beijing?" in shown
    reminder = ed.encode_text("<｜latest_reminder｜>today<｜action｜><｜read_url｜>")
    assert ed.decode_text(reminder) == "today"
    assert ed.decode_text(reminder, skip_special_tokens=False).endswith(
        "y<｜action｜><｜read_url｜>"
    )
