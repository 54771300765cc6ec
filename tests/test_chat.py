"""The chat protocol against the release's own encoder and parser.

`data/release_chat/cases.json` holds what the release's `encoding/encoding_dsv4.py` wrote for
each conversation and reply (made by `data/release_chat/make_cases.py`; the file records the
encoder's source and revision). The encoder is not part of this repository.
"""

import copy
import io
import json
import types

import pytest
from helpers import ROOT, run_main, script_module

import equinox_dsv4 as ed


CASES = json.loads((ROOT / "tests" / "data" / "release_chat" / "cases.json").read_text("utf-8"))
# Written by V4-Flash-0731's encoder (its cases' options say revision="0731").
CASES_0731 = json.loads(
    (ROOT / "tests" / "data" / "release_chat" / "cases_0731.json").read_text("utf-8")
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


def test_stored_0731_data():
    assert "bf85304efacced9af1f88aeb6f4ef3acb4fcef5c" in CASES_0731["encoder"]["source"]
    options = [c["options"] for c in CASES_0731["conversations"]]
    assert all(o["revision"] == "0731" for o in options)
    thinking = {o.get("reasoning_effort") for o in options if o.get("thinking")}
    assert thinking == {None, "low", "high", "max"}
    # 0731's `high` is the original `max`; its `max` is new.
    by_name = {c["name"]: c["prompt"] for c in CASES_0731["conversations"]}
    original = {c["name"]: c["prompt"] for c in CASES["conversations"]}
    assert by_name["effort_high_no_system"] == original["effort_max_no_system"]
    assert by_name["effort_max_no_system"] != original["effort_max_no_system"]
    # Its reply parser did not change: the same replies, parsed the same.
    assert CASES_0731["replies"] == CASES["replies"]


BOTH = CASES["conversations"] + CASES_0731["conversations"]


@pytest.mark.parametrize(
    "case",
    BOTH,
    ids=_names(CASES["conversations"]) + [f"0731-{n}" for n in _names(CASES_0731["conversations"])],
)
def test_prompt_is_the_release_encoders(case):
    messages = copy.deepcopy(case["messages"])
    assert ed.chat_prompt(messages, **case["options"]) == case["prompt"]
    assert messages == case["messages"]  # the caller's messages are left as they were


@pytest.mark.parametrize(
    "case",
    CASES["rejected"] + CASES_0731["rejected"],
    ids=_names(CASES["rejected"]) + [f"0731-{n}" for n in _names(CASES_0731["rejected"])],
)
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
    tokenizer = ed.text.load_tokenizer()
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


# --- examples/chat.py


def _chat_module():
    return script_module("examples/chat.py")


class _Scripted:
    """A stand-in for the model: gives the listed replies in turn and keeps the prompts."""

    def __init__(self, *replies):
        self.replies, self.prompts = list(replies), []

    def __call__(self, prompt, thinking):
        self.prompts.append((prompt, thinking))
        return self.replies.pop(0)


def _reply(name):
    return next(r for r in CASES["replies"] if r["name"] == name)["text"]


def test_chat_session_keeps_history_calls_tools_and_drops_old_reasoning():
    chat = _chat_module()
    tools = json.loads((ROOT / "examples" / "tools.json").read_text())
    conversation = chat.Conversation(system="Be brief.", tools=tools, thinking=True)
    model = _Scripted(
        'Call it.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Oslo</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>",
        "Got it.</think>Cold.<｜end▁of▁sentence｜>",
        "No tools now.</think>Bye.<｜end▁of▁sentence｜>",
        "cut off by the token limit",
    )
    lines = iter(
        ["Weather in Oslo?", "-3°C", "/think", "/think", "/effort max", "Thanks", "/prompt"]
    )
    log = io.StringIO()

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    chat.interact(conversation, model, read, log)
    assert "[tool call] get_weather" in log.getvalue()
    assert "Oslo" in log.getvalue()
    first, after_result, third = (p for p, _ in model.prompts)
    assert first == ed.chat_prompt(
        [
            {"role": "system", "content": "Be brief.", "tools": tools},
            {"role": "user", "content": "Weather in Oslo?"},
        ],
        thinking=True,
    )
    # The call and its result went back into the conversation; with tools nothing is dropped.
    assert after_result.endswith("<｜User｜><tool_result>-3°C</tool_result><｜Assistant｜><think>")
    assert "Call it.</think>" in after_result
    assert third.startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum")
    assert "unchecked.\n\nBe brief.\n\n## Tools" in third  # /effort max, before the system
    assert "Got it.</think>Cold." in third and third.endswith(
        "<｜User｜>Thanks<｜Assistant｜><think>"
    )
    assert conversation.messages[-1] == {
        "role": "assistant",
        "content": "Bye.",
        "reasoning_content": "No tools now.",
    }
    assert log.getvalue().rstrip().endswith(conversation.prompt())  # /prompt

    # Without tools the release drops the reasoning of earlier turns.
    plain = chat.Conversation(thinking=True)
    model = _Scripted(
        "R1.</think>A1.<｜end▁of▁sentence｜>", "R2.</think>A2.<｜end▁of▁sentence｜>", "cut"
    )
    lines = iter(["Q1", "Q2", "Q3", "/reset", "/prompt"])
    chat.interact(plain, model, read, log)
    assert model.prompts[2][0] == ed.chat_prompt(
        [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1."},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2."},
            {"role": "user", "content": "Q3"},
        ],
        thinking=True,
    )
    assert "R1." not in model.prompts[2][0] and "A1.<｜end▁of▁sentence｜>" in model.prompts[2][0]
    assert "not in the chat format" in log.getvalue()  # the cut-off reply, kept as text
    assert plain.messages == []  # /reset

    def too_long(prompt, thinking):
        raise ValueError("the conversation has 9 tokens, more than --max-len 8 allows")

    lines = iter(["Q4", "/prompt"])
    chat.interact(plain, too_long, read, log)
    assert "[error: the conversation has 9 tokens" in log.getvalue() and plain.messages == []


# What the chat example reads of a model besides what the tests replace.
_STAND_IN = types.SimpleNamespace(config=ed.Config.tiny())

# V4-Flash-0731's effort texts (from the description of its encoder: `high` carries the original
# release's `max` text, `max` a new one).
_ABSOLUTE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough "
    "in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\nExplicitly write out your entire deliberation process, documenting "
    "every intermediate step, considered alternative, and rejected hypothesis to ensure "
    "absolutely no assumption is left unchecked.\n\n"
)
_BEYOND = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\nYou MUST "
    "reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its "
    "root, and resolve the underlying cause rather than any surface symptom.\nDo not stop "
    "reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)


def test_0731_reasoning_efforts():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = ed.chat_prompt(messages, thinking=True)
    bos = ed.text.BOS
    for effort, text in ((None, ""), ("low", ""), ("high", _ABSOLUTE), ("max", _BEYOND)):
        got = ed.chat_prompt(messages, thinking=True, reasoning_effort=effort, revision="0731")
        assert got == bos + text + plain[len(bos) :], effort
        # Chat mode: no effort text, as in the original protocol.
        chat = ed.chat_prompt(messages, reasoning_effort=effort, revision="0731")
        assert chat == ed.chat_prompt(messages)
    # The original protocol is the default, its `max` 0731's `high`.
    assert (
        ed.chat_prompt(messages, thinking=True, reasoning_effort="max")
        == bos + _ABSOLUTE + (plain[len(bos) :])
    )
    for effort, revision, match in (
        ("low", "original", "'low': one of max, high or None"),
        ("extreme", "0731", "'extreme': one of low, high, max or None"),
        (None, "0732", "revision '0732'"),
    ):
        with pytest.raises(ValueError, match=match):
            ed.chat_prompt(messages, reasoning_effort=effort, revision=revision)


def test_chat_one_shot_messages_file(tmp_path, monkeypatch, capsys):
    chat = _chat_module()
    case = next(
        c for c in CASES["conversations"] if c["name"] == "parallel_calls_results_out_of_order"
    )
    (tmp_path / "conversation.json").write_text(json.dumps({"messages": case["messages"]}))
    model = _Scripted(_reply("thinking_one_call"))
    monkeypatch.setattr(chat, "load_model", lambda args, mtp: (_STAND_IN, "scripted"))
    monkeypatch.setattr(chat, "check_vocabulary", lambda _: None)
    monkeypatch.setattr(chat, "Replier", lambda *_: model)
    code = chat.main(["--messages", str(tmp_path / "conversation.json"), "--thinking", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert model.prompts == [(case["prompt"], True)]
    parsed = json.loads(out.strip().splitlines()[-1])
    assert parsed == next(r for r in CASES["replies"] if r["name"] == "thinking_one_call")["parsed"]
    assert "[tool call] get_weather" in err

    # Tools from a file, on a conversation without a system message.
    (tmp_path / "question.json").write_text('[{"role": "user", "content": "Weather in Oslo?"}]')
    model = _Scripted(_reply("chat_plain"))
    args = ["--messages", str(tmp_path / "question.json"), "--tools", "examples/tools.json"]
    assert chat.main([*args, "--system", "Be brief."]) == 0
    tools = json.loads((ROOT / "examples" / "tools.json").read_text())
    system = {"role": "system", "content": "Be brief.", "tools": tools}
    assert model.prompts[0][0] == ed.chat_prompt(
        [system, {"role": "user", "content": "Weather in Oslo?"}]
    )

    (tmp_path / "bad.json").write_text('[{"role": "narrator", "content": "x"}]')
    assert chat.main(["--messages", str(tmp_path / "bad.json")]) == 1
    assert "unknown role 'narrator'" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("[{")
    assert chat.main(["--messages", str(tmp_path / "broken.json")]) == 1
    assert "not JSON" in capsys.readouterr().err


def test_chat_example_picks_the_checkpoints_revision(tmp_path, monkeypatch, capsys):
    # A checkpoint with a DSpark drafter is a 0731 release: its protocol, and its efforts.
    chat = _chat_module()
    (tmp_path / "q.json").write_text('[{"role": "user", "content": "Hi"}]')
    q = [{"role": "user", "content": "Hi"}]
    dspark = ed.Config.tiny(
        dspark_block_size=5,
        dspark_markov_rank=8,
        dspark_target_layer_ids=(6, 7, 8),
        dspark_noise_token_id=3,
    )
    monkeypatch.setattr(chat, "check_vocabulary", lambda _: None)
    for config, effort, revision in (
        (dspark, "max", "0731"),
        (dspark, "low", "0731"),
        (ed.Config.tiny(), "max", "original"),
    ):
        model = _Scripted(_reply("thinking_plain"))
        stand_in = types.SimpleNamespace(config=config)
        monkeypatch.setattr(chat, "load_model", lambda args, mtp, m=stand_in: (m, "scripted"))
        monkeypatch.setattr(chat, "Replier", lambda *_, m=model: m)
        args = ["--messages", str(tmp_path / "q.json"), "--thinking", "--reasoning-effort", effort]
        assert chat.main(args) == 0
        assert f"chat protocol: {revision} revision (the checkpoint's release)" in (
            capsys.readouterr().err
        )
        expected = ed.chat_prompt(q, thinking=True, reasoning_effort=effort, revision=revision)
        assert model.prompts == [(expected, True)]
    # "low" is not an effort of the original protocol: refused once the model says which.
    stand_in = types.SimpleNamespace(config=ed.Config.tiny())
    monkeypatch.setattr(chat, "load_model", lambda args, mtp: (stand_in, "scripted"))
    args = ["--messages", str(tmp_path / "q.json"), "--thinking", "--reasoning-effort", "low"]
    assert chat.main(args) == 1
    assert "'low': one of max, high or None (revision 'original')" in capsys.readouterr().err


def test_chat_example_through_stdin():
    """Two turns on the embedded default through stdin, with the thinking toggle and /prompt:
    the printed prompt holds both turns in the release's format. The first prompt, the sampling
    and the cache length are test_generate's example run's, whose compiled programs this run
    then finds in the session's compilation cache."""
    result = run_main(
        "examples/chat.py",
        *("--max-new-tokens", "5", "--temperature", "0.7", "--max-len", "64"),
        input="What is the capital of France?\n/think\nAnd of Spain?\n/prompt\n",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "RANDOM weights" in result.stderr and "Traceback" not in result.stderr
    transcript = result.stderr
    assert "you> What is the capital of France?" in transcript
    assert "[thinking mode on]" in transcript
    prompt = transcript[transcript.index("<｜begin▁of▁sentence｜>") :]
    first = "<｜User｜>What is the capital of France?<｜Assistant｜></think>"
    assert prompt.startswith("<｜begin▁of▁sentence｜>" + first)  # chat mode, not dropped
    assert (
        prompt.count("<｜User｜>") == 2
        and "<｜User｜>And of Spain?<｜Assistant｜><think>" in prompt
    )
    assert prompt.rstrip().endswith("<｜end▁of▁sentence｜>")  # the second reply is in the history
    assert "(thinking) " in result.stdout  # the second reply streamed as reasoning
