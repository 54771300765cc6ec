"""The DeepSeek-V4 chat protocol: conversations to prompt text.

DeepSeek-V4 ships no Jinja chat template; the release defines its prompts with a Python encoder
(`encoding/encoding_dsv4.py` in the release repositories). `chat_prompt` writes the same text for
every role and field that encoder accepts (checked against the encoder's own output,
`tests/data/release_chat/cases.json`, which names the revision). In short:

    <｜begin▁of▁sentence｜>{system}[tools][response format]
    <｜User｜>{user}<｜Assistant｜></think>{reply}<｜end▁of▁sentence｜>      chat mode
    <｜User｜>{user}<｜Assistant｜><think>{reasoning}</think>{reply}<｜end▁of▁sentence｜>   thinking

Tool calls are written in DSML after the reply, tool results go back as `<tool_result>` blocks of
a user turn (in the order of the calls), and in thinking mode the reasoning of turns before the
last user message is dropped unless the conversation has tools.
"""

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from .._typecheck import typechecked


BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
TASKS = {
    name: f"<｜{name}｜>"
    for name in ("action", "query", "authority", "domain", "title", "read_url")
}
# Tokens that structure a conversation rather than carry its text; `decode_text` hides them.
MARKERS = (USER, ASSISTANT, LATEST_REMINDER, THINK, END_THINK, *TASKS.values())
ROLES = ("system", "user", "developer", "assistant", "tool", "latest_reminder")
# The encoder's revisions: the original release's, and V4-Flash-0731's, which changed the
# reasoning-effort ladder (its `high` is the original `max`; its `max` is new).
REVISIONS = ("original", "0731")
REASONING_EFFORTS = ("max", "high")  # the original revision's
REASONING_EFFORTS_0731 = ("low", "high", "max")

# The release's prompt texts, byte for byte: the model was trained on exactly these.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
# 0731's `max` (U+2014 after "maximum").
REASONING_EFFORT_BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every "
    "causal chain to its root, and resolve the underlying cause rather than any surface "
    "symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple "
    "angles and are certain that no assumption remains unchecked and no error remains "
    "undiscovered.\n\n"
)
# Per revision, the text each effort puts at the start of a thinking-mode prompt (none: "").
EFFORT_TEXTS = {
    "original": {"max": REASONING_EFFORT_MAX},
    "0731": {"high": REASONING_EFFORT_MAX, "max": REASONING_EFFORT_BEYOND_MAX},
}
RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)
TOOLS = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning \
inside {THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value: Any, what: str) -> str:
    """JSON as the release writes it (non-ASCII kept, `", "` and `": "` separators)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serialisable: {e}") from None


def _text(message: Mapping[str, Any], where: str, key: str = "content") -> str:
    value = message.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} must be a string, not {type(value).__name__}")
    return value


def _tool_schemas(tools: Any, where: str) -> str:
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ValueError(f"{where}: 'tools' must be a list of OpenAI function tools")
    schemas = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            raise ValueError(
                f"{where}: tools[{j}] is not an OpenAI function tool "
                '({"type": "function", "function": {"name": ..., "parameters": ...}})'
            )
        schemas.append(to_json(tool["function"], f"{where}: tools[{j}]"))
    return TOOLS.format(schemas="\n".join(schemas))


def _call_arguments(arguments: Any, where: str) -> str:
    """A call's arguments as DSML parameters; text that is not JSON is one string argument."""
    if not isinstance(arguments, str):
        raise ValueError(f"{where}: 'arguments' must be a JSON string (OpenAI format)")
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = {"arguments": arguments}
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}: 'arguments' must be a JSON object, not {arguments!r}")
    lines = []
    for name, value in parsed.items():
        text = value if isinstance(value, str) else to_json(value, where)
        string = "true" if isinstance(value, str) else "false"
        lines.append(f'<{DSML}parameter name="{name}" string="{string}">{text}</{DSML}parameter>')
    return "\n".join(lines)


def _tool_calls(calls: Any, where: str) -> str:
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise ValueError(f"{where}: 'tool_calls' must be a list")
    invokes = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or "name" not in function:
            raise ValueError(
                f"{where}: tool_calls[{j}] needs 'function' with 'name' and 'arguments' "
                "(OpenAI format)"
            )
        arguments = _call_arguments(function.get("arguments"), f"{where}: tool_calls[{j}]")
        invokes.append(f'<{DSML}invoke name="{function["name"]}">\n{arguments}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _tool_result(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or not all(isinstance(b, Mapping) for b in content):
        raise ValueError(f"{where}: 'content' must be a string or a list of content blocks")
    parts = []
    for block in content:
        if block.get("type") == "text":
            text = block.get("text", "")
            if not isinstance(text, str):
                raise ValueError(f"{where}: a text block's 'text' must be a string")
            parts.append(text)
        else:
            parts.append(f"[Unsupported {block.get('type')}]")
    return "\n\n".join(parts)


def _check(message: Any, where: str) -> None:
    """Refuse what the release's encoder would fail on (here for every message, rendered or not)."""
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} is not a dict")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}: unknown role {role!r} (one of {', '.join(ROLES)})")
    task = message.get("task")
    if task is not None and task not in TASKS:
        raise ValueError(f"{where}: unknown task {task!r} (one of {', '.join(TASKS)})")
    if role == "tool":
        _tool_result(message.get("content", ""), where)
        return
    for key in ("content", "reasoning_content"):
        _text(message, where, key)
    if role == "user" and message.get("content", "") is None:
        raise ValueError(f"{where}: a user message needs 'content'")
    if role == "developer" and not message.get("content"):
        raise ValueError(f"{where}: a developer message needs non-empty 'content'")
    if role == "latest_reminder" and message.get("content") is None:
        raise ValueError(f"{where}: a latest_reminder message needs 'content'")
    if role in ("system", "developer"):
        if message.get("tools"):
            _tool_schemas(message["tools"], where)
        if message.get("response_format"):
            to_json(message["response_format"], f"{where}: 'response_format'")
    if role == "assistant" and message.get("tool_calls"):
        _tool_calls(message["tool_calls"], where)


def _merge(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tool results and runs of user messages become one user turn of blocks.

    A user message opens a new turn after a user turn with a task; a tool result joins any user
    turn before it.
    """
    merged: list[dict[str, Any]] = []
    for message in messages:
        message = copy.deepcopy(dict(message))
        role = message.get("role")
        last = merged[-1] if merged and merged[-1]["role"] == "user" else None
        if role == "tool":
            block = {
                "kind": "result",
                "id": message.get("tool_call_id", ""),
                "content": message.get("content", ""),
            }
            if last is not None:
                last["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = {"kind": "text", "content": message.get("content", "")}
            if last is not None and last.get("task") is None:
                last["blocks"].append(block)
            else:
                turn = {"role": "user", "blocks": [block]}
                if "task" in message:
                    turn["task"] = message["task"]
                merged.append(turn)
        else:
            merged.append(message)
    return merged


def _order_results(messages: list[dict[str, Any]]) -> None:
    """Put the tool results of each user turn in the order of the latest calls (by call id)."""
    order: dict[str, int] = {}
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            order = {}
            for j, call in enumerate(message["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    order[call_id] = j
        elif message["role"] == "user" and order:
            results = [b for b in message["blocks"] if b["kind"] == "result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))
                message["blocks"] = [
                    next(ranked) if b["kind"] == "result" else b for b in message["blocks"]
                ]


def _last_user(messages: Sequence[Mapping[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


def _drop_old_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before the last user message: assistants lose their reasoning, developer turns go."""
    last = _last_user(messages)
    kept = []
    for i, message in enumerate(messages):
        if i >= last or message["role"] in ("user", "system", "latest_reminder"):
            kept.append(message)
        elif message["role"] == "assistant":
            kept.append({k: v for k, v in message.items() if k != "reasoning_content"})
    return kept


def _render(
    i: int, messages: list[dict[str, Any]], last_user: int, thinking: bool, drop: bool, effort: str
) -> str:
    """Message `i`'s text (`last_user`: the index of the last user or developer message;
    `effort`: the reasoning-effort text that opens a thinking-mode prompt)."""
    message = messages[i]
    role, where = message["role"], f"message {i}"
    out = effort if i == 0 and thinking else ""
    if role in ("system", "developer"):
        out += USER + message["content"] if role == "developer" else _text(message, where)
        if message.get("tools"):
            out += "\n\n" + _tool_schemas(message["tools"], where)
        if message.get("response_format"):
            schema = to_json(message["response_format"], where)
            out += "\n\n" + RESPONSE_FORMAT.format(schema=schema)
    elif role == "user":
        parts = [
            b["content"]
            if b["kind"] == "text"
            else f"<tool_result>{_tool_result(b['content'], where)}</tool_result>"
            for b in message["blocks"]
        ]
        out += USER + "\n\n".join(parts)
    elif role == "latest_reminder":
        out += LATEST_REMINDER + message["content"]
    else:  # assistant
        after_task = i > 0 and messages[i - 1].get("task") is not None
        if thinking and not after_task and (not drop or i > last_user):
            out += _text(message, where, "reasoning_content") + END_THINK
        out += _text(message, where)
        if message.get("tool_calls"):
            out += _tool_calls(message["tool_calls"], where)
        if not message.get("wo_eos", False):
            out += EOS
    # What opens the next turn: nothing before a user-side message, else the assistant opener.
    if i + 1 < len(messages) and messages[i + 1]["role"] not in ("assistant", "latest_reminder"):
        return out
    task = message.get("task")
    if task is not None:
        if task == "action":
            out += ASSISTANT + (THINK if thinking else END_THINK) + TASKS[task]
        else:
            out += TASKS[task]
    elif role in ("user", "developer"):
        reason = thinking and (not drop or i >= last_user)
        out += ASSISTANT + (THINK if reason else END_THINK)
    return out


@typechecked
def chat_prompt(
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
    context: Sequence[Mapping[str, Any]] | None = None,
    add_bos: bool = True,
    revision: str = "original",
) -> str:
    """The prompt text of a conversation, as the release's `encode_messages` writes it.

    **Arguments:**

    - `messages`: OpenAI-style messages. Roles: `system` (`content`, `tools`,
      `response_format`), `user` (`content`, `task`), `developer` (`content`, `tools`,
      `response_format`), `assistant` (`content`, `reasoning_content`, `tool_calls` with
      JSON-string `arguments` and an `id`, `wo_eos`: leave the turn open for the model to
      continue, `task`), `tool` (`tool_call_id`, `content`: a string or text blocks),
      `latest_reminder` (`content`: date, place and the like). Tools are OpenAI function tools.
      A `task` (`action`, `query`, `authority`, `domain`, `title`, `read_url`) ends the turn with
      the task's token instead of the assistant opener.
    - `thinking`: thinking mode (the reply opens with `<think>`) instead of chat mode
      (`</think>`).
    - `reasoning_effort`: an instruction at the start of the prompt (thinking mode only). In the
      original revision `"max"` puts the release's maximum-effort text there, `"high"` and
      `None` add nothing; in `"0731"` `"high"` puts that same text, `"max"` 0731's
      beyond-maximum one, `"low"` and `None` nothing.
    - `drop_thinking`: in thinking mode, drop the reasoning of assistant turns before the last
      user message (and developer turns there). Ignored, as by the release, when a message has
      tools: tool use keeps all reasoning.
    - `context`: earlier messages already in the model's cache: the text of `messages` alone is
      returned, as it continues the context's (no BOS).
    - `add_bos`: start with `<｜begin▁of▁sentence｜>` (when there is no context).
    - `revision`: the encoder's revision, `"original"` (V4-Flash, V4-Pro) or `"0731"`
      (V4-Flash-0731): the model's release.

    **Returns:** the prompt text; `encode_text` gives its token ids.

    **Raises:** `ValueError` naming the message and field for input the release refuses (an
    unknown role or task, a developer message without content, tool calls that are not OpenAI
    function calls with JSON-object arguments, ...). Every message is checked, also those the
    release would skip.
    """
    if revision not in REVISIONS:
        raise ValueError(f"revision {revision!r}: one of {', '.join(REVISIONS)}")
    efforts = REASONING_EFFORTS_0731 if revision == "0731" else REASONING_EFFORTS
    if reasoning_effort is not None and reasoning_effort not in efforts:
        raise ValueError(
            f"reasoning_effort {reasoning_effort!r}: one of {', '.join(efforts)} or None "
            f"(revision {revision!r})"
        )
    effort = EFFORT_TEXTS[revision].get(reasoning_effort or "", "")
    context = list(context or [])
    for name, given in (("context", context), ("messages", messages)):
        for i, message in enumerate(given):
            _check(message, f"{name}[{i}]")
    old, new = _merge(context), _merge(messages)
    history = old + new
    _order_results(history)
    drop = drop_thinking and not any(m.get("tools") for m in history)
    if thinking and drop:
        history = _drop_old_reasoning(history)
        # As the release: where the new messages start is counted on the context dropped on its
        # own, which can differ from the context's share of the dropped whole.
        start = len(_drop_old_reasoning(old))
    else:
        start = len(old)
    prompt = BOS if add_bos and not context else ""
    last_user = _last_user(history)
    return prompt + "".join(
        _render(i, history, last_user, thinking, drop, effort) for i in range(start, len(history))
    )
