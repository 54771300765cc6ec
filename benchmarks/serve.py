"""Serving: requests per second and time to the first token with 1, 8 and 32 clients at once, the
server's continuous batching against `ed.generate` on the same prompts in batches.

The small config (random weights, float32). `--requests-per-client` (4) requests per client,
each a prompt of 16 to 240 random tokens and a reply of 8 to `--new-tokens` (64) greedy tokens,
drawn at random (the same for both sides): replies differ in length, as a server's do. Server:
`equinox_dsv4.serve` in this process on loopback, as many slots as clients, prompts prefilled
in chunks of 256 on up to 4 rows between decode steps (the defaults of examples/serve.py); each
client (a thread) streams its answers one after the other over HTTP; the first token's time is
when its first chunk arrives. `ed.generate`: the prompts in batches of as many as there are
clients, one batch after the other, each generating its longest reply's count for every row (a
batch waits for its slowest row: `generate` takes one `max_new_tokens`; the first token's time
is when `generate`'s callback first gives a row a token, from the start of its batch: when its
client would have sent it). Both compile before the clock starts; each side's requests per
second is requests over its wall time. The end of sentence is not a stop token here: every
reply has its drawn length.

    python benchmarks/serve.py [--clients 1 8 32] [--requests-per-client 4] [--new-tokens 64]

Writes benchmarks/results/serve.{json,md}.
"""

import argparse
import contextlib
import http.client
import json
import socket
import threading
import time

import jax
import numpy as np
import uvicorn
from common import markdown, small_config, write

import equinox_dsv4 as ed
from equinox_dsv4 import serve


MAX_LEN, CHUNK = 320, 256


@contextlib.contextmanager
def server(model, slots: int):
    engine = serve.Engine(model, slots=slots, max_len=MAX_LEN, chunk=CHUNK, max_waiting=4096)
    app = serve.make_app(
        engine,
        model_name="small",
        encode=ed.encode_text,
        decode=lambda ids: ed.decode_text(ids, skip_special_tokens=False),
        stop_tokens=frozenset(),
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    try:
        yield port
    finally:
        uv.should_exit = True
        thread.join()


def stream(port: int, prompt: list[int], new_tokens: int) -> tuple[float, int]:
    """One streamed completion: seconds to its first token, and the tokens it got."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/completions", json.dumps(body))
    response = connection.getresponse()
    first, tokens = None, 0
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
            first = time.perf_counter() - start
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    connection.close()
    return first if first is not None else float("nan"), tokens


def served(model, prompts: list[list[int]], clients: int, new_tokens: list[int]) -> dict:
    with server(model, clients) as port:
        stream(port, prompts[0], 2)  # the first HTTP round trip, outside the clock
        firsts, counts = [], []
        lock = threading.Lock()

        def client(i):
            for prompt, new in zip(prompts[i::clients], new_tokens[i::clients], strict=True):
                first, tokens = stream(port, prompt, new)
                with lock:
                    firsts.append(first)
                    counts.append(tokens)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
    assert sorted(counts) == sorted(new_tokens), counts
    return {"seconds": seconds, "first_token_s": firsts}


def batched(model, prompts: list[list[int]], clients: int, new_tokens: list[int]) -> dict:
    firsts = []
    start = time.perf_counter()
    for b in range(0, len(prompts), clients):
        batch = prompts[b : b + clients]
        began, seen = time.perf_counter(), np.zeros(len(batch), bool)

        def first(tokens, running, began=began, seen=seen):
            for row in np.flatnonzero(running & ~seen):
                firsts.append(time.perf_counter() - began)
                seen[row] = True

        longest = max(new_tokens[b : b + clients])
        out = ed.generate(
            model, batch, max_new_tokens=longest, max_len=MAX_LEN, callback=first,
            stop_tokens=(),
        )  # fmt: skip
        assert all(len(o) == longest for o in out)
    return {"seconds": time.perf_counter() - start, "first_token_s": firsts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    config = small_config(args.layers)
    model = ed.DeepseekV4(config, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    rows, table = [], []
    for clients in args.clients:
        n = clients * args.requests_per_client
        prompts = [rng.integers(1, 100_000, int(k)).tolist() for k in rng.integers(16, 241, n)]
        new_tokens = rng.integers(8, args.new_tokens + 1, n).tolist()
        # Compiled before the clock: every shape of `generate`'s (its prompts padded to a
        # multiple of 32 tokens); the server's two steps compile when it starts.
        batched(model, prompts, clients, [2] * n)
        results = {
            "served": served(model, prompts, clients, new_tokens),
            "generate": batched(model, prompts, clients, new_tokens),
        }
        line = [str(clients), str(n)]
        row = {"clients": clients, "requests": n, "new_tokens": [8, args.new_tokens]}
        for side, r in results.items():
            rps = n / r["seconds"]
            ttft = float(np.median(r["first_token_s"]))
            row[side] = {"requests_per_s": rps, "median_first_token_s": ttft,
                         "seconds": r["seconds"]}  # fmt: skip
            line += [f"{rps:.2f}", f"{1e3 * ttft:.0f}"]
        row["requests_per_s_ratio"] = (
            row["served"]["requests_per_s"] / row["generate"]["requests_per_s"]
        )
        row["first_token_ratio"] = (
            row["generate"]["median_first_token_s"] / row["served"]["median_first_token_s"]
        )
        line += [f"{row['requests_per_s_ratio']:.2f}x", f"{row['first_token_ratio']:.2f}x"]
        rows.append(row)
        table.append(line)
        print(line, flush=True)
    header = ["clients", "requests", "server req/s", "server first token ms (median)",
              "generate req/s", "generate first token ms (median)", "req/s: server / generate",
              "first token: generate / server"]  # fmt: skip
    extra = {"config": "small", "layers": args.layers, "max_len": MAX_LEN, "chunk": CHUNK}
    write("serve", rows, markdown(header, table), extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
