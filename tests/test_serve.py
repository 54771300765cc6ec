"""The OpenAI-compatible server, driven over loopback with the official `openai` client: the
real engine on a one-layer tiny model (many concurrent clients each get what `ed.generate`
gives their prompt alone; no compilation per request), a scripted engine that replies with
DSML tool calls (parsed, never leaking into the content, in both modes), the bad-input table,
a client that goes away, and examples/serve.py stopped by SIGTERM."""

import contextlib
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
import urllib.error
import urllib.request

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import uvicorn
from helpers import PYTHONPATH, ROOT, lowered
from test_readme import README, python_blocks

import equinox_dsv4 as ed
from equinox_dsv4 import serve


# examples/serve.py --layers 1 --slots 4 --max-len 128 --chunk 16 --prefill-rows 2: the same
# programs (the subprocess test reads them from the session's compilation cache). Two prefill
# rows of four: a prefill step runs on some rows and leaves the others as they are.
SLOTS, MAX_LEN, CHUNK, LANES = 4, 128, 16, 2
CONFIG = ed.Config.tiny().first_layers(1)
EOS = CONFIG.eos_token_id
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}
CALL_TEXT = (
    "The user wants the weather.</think>Let me look.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Oslo</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(engine, **kwargs):
    """`engine` behind the application on a free loopback port, uvicorn in a thread; yields the
    base URL."""
    app = serve.make_app(
        engine,
        model_name="tiny",
        encode=ed.encode_text,
        decode=lambda ids: ed.decode_text(ids, skip_special_tokens=False),
        stop_tokens=frozenset([EOS]),
        **kwargs,
    )
    port = _port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model():
    return ed.DeepseekV4(CONFIG, key=jax.random.key(0))


@pytest.fixture(scope="module")
def real(model):
    engine = serve.Engine(
        model, slots=SLOTS, max_len=MAX_LEN, chunk=CHUNK, prefill_rows=LANES, max_waiting=32
    )
    with serving(engine) as url:
        yield url, engine


class Scripted:
    """An engine whose every reply is `text`'s tokens then the end of sentence, one token per
    `pace` seconds; it keeps the prompts it was given."""

    def __init__(self, text: str, pace: float = 0.0, slots: int = 4):
        self.tokens = ed.encode_text(text)
        self.pace, self.max_len, self.slots = pace, 1024, slots
        self.prompts, self.busy, self.lock = [], set(), threading.Lock()

    def start(self):
        pass

    def stop(self):
        pass

    def health(self):
        with self.lock:
            return {
                "slots": self.slots,
                "busy": len(self.busy),
                "free": self.slots - len(self.busy),
            }

    def cancel(self, request):
        request.cancelled = True

    def submit(self, request):
        with self.lock:
            if len(self.busy) >= self.slots:
                raise serve.QueueFull("scripted: every slot busy")
            self.busy.add(id(request))
        self.prompts.append(list(request.ids))

        def run():
            reason = "stop"
            for i, t in enumerate(self.tokens):
                time.sleep(self.pace)
                if request.cancelled:
                    reason = "cancelled"
                    break
                if i == request.max_new_tokens:
                    reason = "length"
                    break
                request.on_token(t)
            with self.lock:
                self.busy.discard(id(request))
            request.finish(reason)

        threading.Thread(target=run, daemon=True).start()


def test_chat_whole_and_streamed(real):
    url, _ = real
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client(url).chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0
    )
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens <= 6
    prompt = ed.encode_text(ed.chat_prompt(messages))
    assert whole.usage.prompt_tokens == len(prompt)
    chunks = list(
        client(url).chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_concurrent_clients_get_what_generate_gives_alone(real, model):
    # 16 clients at once, 4 slots: rows are freed and reused while others run, prompts are
    # prefilled in chunks between decode steps. Each answer is exactly `ed.generate`'s
    # tokens for its prompt alone (greedy), and no step compiles again.
    url, engine = real
    rng = np.random.default_rng(0)
    # Up to 29 tokens (two chunks) and 12 new ones: `generate` compiles one shape for all.
    prompts = [rng.integers(1, 1000, n).tolist() for n in rng.integers(3, 30, 16)]
    limits = rng.integers(1, 13, 16).tolist()
    programs = len(lowered())
    answers = [None] * 16

    def ask(i):
        answers[i] = client(url).completions.create(
            model="tiny", prompt=prompts[i], max_tokens=limits[i], temperature=0
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(lowered()) == programs
    assert engine.health()["busy"] == 0
    for i, answer in enumerate(answers):
        expected = ed.generate(model, [prompts[i]], max_new_tokens=limits[i])[0]
        assert answer.choices[0].text == ed.decode_text(expected, skip_special_tokens=False), i
        assert answer.usage.completion_tokens == len(expected)


def test_seeded_sampling_is_reproducible(real):
    url, _ = real
    ask = dict(model="tiny", prompt=[5, 6, 7], max_tokens=5, temperature=1.0, seed=3)
    first = client(url).completions.create(**ask, extra_body={"top_k": 50})
    again = client(url).completions.create(**ask, extra_body={"top_k": 50})
    assert first.choices[0].text == again.choices[0].text


def _few_tokens(model, keep: int = 4):
    # The head shrunk but for `keep` rows (the end of sentence among them): the main model's
    # and the MTP block's greedy choices (they share the head) fall among them, so drafts are
    # often accepted, and rows stop in the middle of a step's accepted tokens.
    scale = jnp.where(jnp.arange(model.config.vocab_size) < keep, 1.0, 0.05)[:, None]
    return eqx.tree_at(lambda m: m.head.weight, model, model.head.weight * scale)


def test_speculative_rows_give_what_generate_gives(model):
    # MTP drafting per row: 12 requests at once on 4 slots, longest prompt first (rows reused
    # for shorter prompts; prompts of one and two chunks), greedy. Each gets exactly
    # speculative `ed.generate`'s tokens (plain greedy's, test_speculative), stops and length
    # limits falling inside accepted drafts, with as many drafts accepted: a row reused or
    # beside others drafts what it drafts in `generate`'s batch. A seeded sampling request gets
    # the same tokens beside others as alone; nothing compiles once the engine is warm.
    model = _few_tokens(model)
    engine = serve.Engine(
        model, slots=SLOTS, max_len=MAX_LEN, chunk=CHUNK, prefill_rows=LANES, speculative="mtp"
    ).start()
    rng = np.random.default_rng(1)
    prompts = sorted((rng.integers(1, 1000, n).tolist() for n in rng.integers(1, 30, 12)), key=len)
    prompts = prompts[::-1]

    def run(asks):
        out = [([], []) for _ in asks]
        for (ids, sampling), (tokens, reasons) in zip(asks, out, strict=True):
            engine.submit(
                serve.Request(
                    ids,
                    12,
                    on_token=tokens.append,
                    on_finish=reasons.append,
                    stop_tokens=frozenset([EOS]),
                    **sampling,
                )
            )
        end = time.monotonic() + 300
        while not all(reasons for _, reasons in out):
            assert time.monotonic() < end, "the engine did not finish"
            time.sleep(0.05)
        return out

    programs = len(lowered())
    try:
        seeded = dict(temperature=1.0, top_k=3, seed=11)
        alone = run([(prompts[0], seeded)])[0][0]
        before = engine.health()
        answers = run([(p, {}) for p in prompts])
        counts = {k: engine.health()[k] - before[k] for k in ("drafted", "accepted")}
        beside = run([(prompts[1], {}), (prompts[0], seeded)])[1][0]
        assert len(lowered()) == programs
    finally:
        engine.stop()
    stats = {}
    expected = ed.generate(
        model, prompts, max_new_tokens=12, max_len=MAX_LEN, speculative="mtp", stats=stats
    )
    assert [tokens for tokens, _ in answers] == expected
    assert [reasons for _, reasons in answers] == [
        ["length" if len(e) == 12 else "stop"] for e in expected
    ]
    assert {len(e) for e in expected} > {12}  # some stop early, some at the limit
    assert (
        counts == {"drafted": stats["drafted"], "accepted": stats["accepted"]}
        and counts["accepted"]
    )
    assert beside == alone


def _scripted_chat(url, stream, **kwargs):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    ask = dict(model="tiny", messages=messages, tools=[WEATHER], reasoning_effort="high")
    return client(url).chat.completions.create(**ask, stream=stream, **kwargs)


def test_tool_calls_parse_whole_and_streamed():
    engine = Scripted(CALL_TEXT)
    with serving(engine) as url:
        whole = _scripted_chat(url, False).choices[0]
        chunks = list(_scripted_chat(url, True))
        # The call's result sent back continues the conversation.
        call = whole.message.tool_calls[0]
        messages = [
            {"role": "user", "content": "Weather in Oslo?"},
            whole.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "-3°C"},
        ]
        client(url).chat.completions.create(
            model="tiny", messages=messages, tools=[WEATHER], reasoning_effort="high"
        )
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Let me look."
    assert whole.message.reasoning_content == "The user wants the weather."
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"location": "Oslo"}
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert content == "Let me look." and reasoning == "The user wants the weather."
    assert "DSML" not in content + reasoning
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"location": "Oslo"}')
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The third prompt holds the call and its result, in thinking mode.
    third = ed.decode_text(engine.prompts[2], skip_special_tokens=False)
    assert third.endswith("<tool_result>-3°C</tool_result><｜Assistant｜><think>")
    assert '<｜DSML｜invoke name="get_weather">' in third


def test_the_readme_client_block_runs_as_written():
    # The README's `openai` block, against a server on the address it names (its port
    # changed to the test server's), the scripted engine replying with a tool call.
    (block,) = python_blocks(README.read_text(), server=True)
    printed = []
    namespace = {"weather": WEATHER, "print": lambda *a: printed.append(" ".join(map(str, a)))}
    with serving(Scripted(CALL_TEXT)) as url:
        exec(block.replace("http://127.0.0.1:8000", url), namespace)
    printed = "\n".join(printed)
    assert "The user wants the weather." in printed and "get_weather" in printed


def test_a_reply_cut_inside_a_tool_call_keeps_its_text():
    # The length limit falls inside the DSML block: the content before it, no call, `length`.
    cut = len(ed.encode_text(CALL_TEXT[: CALL_TEXT.index("Oslo<")]))
    with serving(Scripted(CALL_TEXT)) as url:
        whole = _scripted_chat(url, False, max_tokens=cut).choices[0]
        chunks = list(_scripted_chat(url, True, max_tokens=cut))
    assert whole.finish_reason == "length" and not whole.message.tool_calls
    assert whole.message.content == "Let me look."
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me look."
    assert not any(d.tool_calls for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "length"


class Response(typing.NamedTuple):
    status_code: int
    text: str

    def json(self):
        return json.loads(self.text)


def _get(url: str) -> Response:
    with urllib.request.urlopen(url, timeout=60) as r:
        return Response(r.status, r.read().decode())


def _health(url: str) -> dict:
    return _get(url + "/health").json()


def _post(url: str, body, path: str = "/v1/chat/completions") -> Response:
    content = body if isinstance(body, str) else json.dumps(body)
    request = urllib.request.Request(url + path, data=content.encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return Response(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Response(e.code, e.read().decode())


USER = [{"role": "user", "content": "Hi"}]
BAD = [
    ("{not json", "not JSON", None),
    ([1, 2], "JSON object", None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "wizard", "messages"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0]", "tools[0]"),
    ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools[0]", "tools[0]"),
    (
        {
            "messages": USER
            + [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },  # fmt: skip
                {"role": "tool", "tool_call_id": "c2", "content": "r"},
            ]
        },
        "'c2' answers no tool call",
        "messages[2].tool_call_id",
    ),
    (
        {"messages": USER + [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
        "needs a string 'id'",
        "messages[1]",
    ),
    ({"messages": [{"role": "user", "content": "word " * 200}]}, "limit is 128 tokens", "messages"),
    ({"messages": USER, "n": 2}, "'n' must be 1", "n"),
    ({"messages": USER, "temperature": "hot"}, "'temperature' must be", "temperature"),
    ({"messages": USER, "temperature": 3}, "'temperature' must be in", "temperature"),
    ({"messages": USER, "max_tokens": 0}, "'max_tokens' must be >= 1", "max_tokens"),
    ({"messages": USER, "reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort"),
    ({"messages": USER, "tool_choice": "required"}, "'tool_choice'", "tool_choice"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "'stop'", "stop"),
    ({"messages": []}, "non-empty", "messages"),
    ({"messages": USER, "top_p": float("nan")}, "'top_p' must be in", "top_p"),
    ({"messages": USER, "temperature": 10**400}, "'temperature' is out of range", "temperature"),
    (
        {"messages": USER + [{"role": "tool", "tool_call_id": ["c1"], "content": "r"}]},
        "answers no tool call",
        "messages[1].tool_call_id",
    ),
    ({"prompt": [5, 10**9]}, "token id 1000000000 is not in the model's vocabulary", "prompt"),
    ({"prompt": {"text": "x"}}, "'prompt' must be", "prompt"),
]


@pytest.mark.parametrize("body,message,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_an_openai_error_and_the_server_goes_on(real, body, message, param):
    url, _ = real
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else None
    response = _post(url, body, *([path] if path else []))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert message in error["message"], error
    assert error["param"] == param
    assert _health(url)["status"] == "ok"


def test_unknown_paths_and_busy_servers():
    with serving(Scripted("a b c d e f", pace=0.2, slots=1)) as url:
        try:
            _get(url + "/v1/nothing")
        except urllib.error.HTTPError as e:
            assert e.code == 404 and json.loads(e.read())["error"]["type"] == "not_found_error"
        else:
            raise AssertionError("no 404")
        first = threading.Thread(target=_post, args=(url, {"messages": USER}))
        first.start()
        while _health(url)["busy"] == 0:
            time.sleep(0.01)
        busy = _post(url, {"messages": USER})
        first.join()
    assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"


def test_the_engine_bounds_its_queue(model):
    # Not started: requests wait; beyond the free rows plus `max_waiting`, QueueFull.
    engine = serve.Engine(model, slots=2, max_len=MAX_LEN, chunk=CHUNK, max_waiting=1)

    def request():
        return serve.Request([1, 2], 4, on_token=lambda t: None, on_finish=lambda r: None)

    for _ in range(3):
        engine.submit(request())
    with pytest.raises(serve.QueueFull):
        engine.submit(request())
    with pytest.raises(ValueError, match="rows hold 128"):
        engine.submit(serve.Request([1] * 128, 4, on_token=print, on_finish=print))


def test_a_client_gone_mid_stream_frees_its_slot(real):
    url, engine = real
    body = {"prompt": [1, 2, 3], "max_tokens": 100, "stream": True, "temperature": 0}
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body))
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    assert engine.health()["busy"] == 1
    connection.close()
    # Gone after its first chunk: its row is free within a step (polled through /health).
    end = time.monotonic() + 10
    while _health(url)["busy"] and time.monotonic() < end:
        time.sleep(0.02)
    assert _health(url)["busy"] == 0


def test_a_client_gone_before_its_whole_answer_frees_its_slot():
    # Not streamed: the client leaves while its answer is being generated (slowly, by the
    # scripted engine); its request is cancelled.
    with serving(Scripted(CALL_TEXT, pace=0.1)) as url:
        connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
        connection.request("POST", "/v1/chat/completions", json.dumps({"messages": USER}))
        while _health(url)["busy"] == 0:
            time.sleep(0.01)
        connection.close()
        end = time.monotonic() + 5
        while _health(url)["busy"] and time.monotonic() < end:
            time.sleep(0.02)
        assert _health(url)["busy"] == 0


def test_stop_strings_end_the_content(real):
    url, _ = real
    whole = client(url).completions.create(model="tiny", prompt=[1, 2], max_tokens=8, temperature=0)
    text = whole.choices[0].text
    stop = text[2:4]
    assert stop, text
    cut = client(url).completions.create(
        model="tiny", prompt=[1, 2], max_tokens=8, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_the_script_serves_and_stops_on_sigterm():
    port = _port()
    cmd = [sys.executable, "examples/serve.py", "--layers", "1", "--port", str(port)]
    cmd += ["--slots", str(SLOTS), "--max-len", str(MAX_LEN), "--chunk", str(CHUNK)]
    cmd += ["--prefill-rows", str(LANES)]
    env = dict(__import__("os").environ, JAX_PLATFORMS="cpu", PYTHONPATH=PYTHONPATH)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if _get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < end, "the server did not come up"
            time.sleep(0.2)
        answer = client(f"http://127.0.0.1:{port}").chat.completions.create(
            model="equinox-dsv4-tiny", messages=USER, max_tokens=3, temperature=0
        )
        assert answer.choices[0].finish_reason in ("length", "stop")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "RANDOM weights" in stderr and re.search(r"serving equinox-dsv4-tiny on", stderr)
    assert "stopped" in stderr


REPLY = (
    "Let me think.</think>Sure.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Oslo</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="f">\n'
    '<｜DSML｜parameter name="n" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def _read(text: str, size: int, **kwargs) -> tuple[dict, serve.ReplyStream]:
    # `text` pushed `size` characters at a time: the joined events, and the stream.
    stream, parts = serve.ReplyStream(**kwargs), {}
    events = [e for i in range(0, len(text), size) for e in stream.push(text[i : i + size])]
    for e in events + stream.finish():
        if e.kind == "tool_call":
            parts.setdefault("tool_calls", []).append(e.value)
        else:
            parts[e.kind] = parts.get(e.kind, "") + e.value
    return parts, stream


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 1000])
def test_the_reply_stream_reads_what_the_release_parser_reads(size):
    parts, stream = _read(REPLY, size, thinking=True)
    expected = ed.parse_reply(REPLY + ed.text.EOS, thinking=True)
    assert sorted(parts) == ["content", "reasoning", "tool_calls"]
    assert parts["reasoning"] == expected["reasoning_content"]
    assert parts["content"] == expected["content"]
    assert parts["tool_calls"] == expected["tool_calls"]
    assert stream.calls == 2 and stream.ended


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_the_reply_stream_keeps_dsml_out_of_the_text(size):
    call = REPLY[REPLY.index("<｜DSML｜tool_calls>") :]
    # A block opened inside the reasoning (no </think>), or without its blank line.
    parts, _ = _read("Thinking" + "\n\n" + call, size, thinking=True)
    assert parts == {"reasoning": "Thinking", "tool_calls": parts["tool_calls"]}
    parts, _ = _read("Done." + call, size, thinking=False)
    assert parts["content"] == "Done." and len(parts["tool_calls"]) == 2
    # Malformed DSML: nothing of it, and the reply is over.
    bad = "Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke nam>\n</｜DSML｜invoke>\nxx"
    parts, stream = _read(bad, size, thinking=False)
    assert parts == {"content": "Hi"} and stream.ended and stream.malformed
    # A stop string's start at the end of a finished reply is text; a whole one ends it.
    parts, _ = _read("abc EN", size, thinking=False, stop=("END",))
    assert parts == {"content": "abc EN"}
    parts, stream = _read("abc END more", size, thinking=False, stop=("END",))
    assert parts == {"content": "abc "} and stream.ended
    # A completion's text is all content.
    parts, _ = _read("x</think>y" + call, size, thinking=True, plain=True)
    assert parts == {"content": "x</think>y" + call}


def test_sample_rows_draws_each_rows_own_filtered_distribution(getkey):
    logits = jax.random.normal(getkey(), (4, 50)) * 3
    settings = [ed.Sampling(0.7, 5, 1.0), ed.Sampling(1.0, 0, 0.8), ed.Sampling(1.3, 9, 0.5)]
    settings.append(ed.Sampling(2.0, 0, 1.0))
    rows = ed.inference.SamplingRows(
        jnp.asarray([s.temperature for s in settings], jnp.float32),
        jnp.asarray([s.top_k for s in settings], jnp.int32),
        jnp.asarray([s.top_p for s in settings], jnp.float32),
    )
    filtered = ed.inference.filtered_rows(logits, rows)
    for b, s in enumerate(settings):
        expected = ed.inference.filtered_logits(logits[b], s)
        np.testing.assert_array_equal(np.isinf(filtered[b]), np.isinf(expected))
        np.testing.assert_allclose(filtered[b], expected, rtol=1e-6)
    greedy = ed.inference.SamplingRows(jnp.zeros(4), jnp.zeros(4, jnp.int32), jnp.ones(4))
    drawn = ed.inference.sample_rows(logits, jax.random.split(getkey(), 4), greedy)
    np.testing.assert_array_equal(drawn, jnp.argmax(logits, -1))
