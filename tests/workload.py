"""Workload generator for the emulated engine's benchmarks (`otela_sim.py serve`) and any
OpenAI-compatible server on loopback.

Shapes:
  shared_prefix   sglang's "generated-shared-prefix" benchmark: `groups` system prompts of
                  `system_len` tokens, `prompts` questions of `question_len` tokens each,
                  `output_len` tokens asked for; requests shuffled across groups
  multi_turn      `conversations` chats of `turns` turns: turn k's prompt is the previous
                  turns (messages and answers of `output_len` tokens) plus a new message of
                  `message_len` tokens
  agent_loops     tool-calling loops (issue 44): an app's system prompt and a task, then turns
                  until the context reaches 16-32k tokens, each answer a tool call and the tool's
                  output (of varied length) appended, the next turn 0-2 s after the answer
                  (closed loops: run_loops); turn_loops the alternating case's chats
  PRESETS         reuse as the OpenTela trace reports it: "reasoning" (~90 % of prompt tokens
                  a reusable prefix) and "instruct" (~15 %); reusable_share() measures it
Arrivals: poisson (exponential gaps at `rate`) or bursty (gamma gaps, coefficient of
variation `cv`), bounded by a count and a duration.

Lengths are in the emulator's tokens (otela_sim.TOKEN_RULE): every generated word is a space
and four letters, one token, so the generator and the server agree on each prompt's length.
The runner (run()) speaks HTTP/1.1 to 127.0.0.1 only, one connection per request, streams, and
records per request TTFT, end-to-end time, prompt and cached tokens (usage, or llama.cpp's
timings.cache_n / prompt_n).

    python tests/workload.py --url http://127.0.0.1:8000 --model M --preset reasoning --rate 5 --count 50
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import otela_sim as sim  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Common English words of at most four letters: one token each under the emulator's rule and,
# with their leading space, one token each in GPT-2-style BPE vocabularies (SmolLM2's tokenizer
# counts 300 of them as 300 tokens): text of these has the same length for a real engine.
WORDS = tuple("the and of to in is it for on was with as at by be this from or but not are have they you his her "
              "she he we can all one out up so if my new time day year work life home back good make like just "
              "over know take come see long very well also down more then some them what when that into only "
              "most".split())

# name -> (shape, parameters). reasoning: a long shared system prompt / context and a short
# question (3840 of ~4100 prompt tokens shared, the first of each group missing: 90.6 %); instruct:
# a short shared system prompt and a long question (170 of ~1000: 14.9 %).
PRESETS = {
    "reasoning": ("shared_prefix", {"groups": 8, "prompts": 32, "system_len": 3840, "question_len": 256,
                                    "output_len": 256}),
    "instruct": ("shared_prefix", {"groups": 8, "prompts": 16, "system_len": 170, "question_len": 830,
                                   "output_len": 128}),
    "chat": ("multi_turn", {"conversations": 16, "turns": 6, "message_len": 120, "output_len": 120}),
}


def text(n, rng, words=None):
    """n tokens of text: " " + four random letters each, or " " + one of `words` each."""
    if words:
        return "".join(" " + w for w in rng.choices(words, k=n))
    letters = "".join(rng.choices(LETTERS, k=4 * n))
    return "".join(" " + letters[i:i + 4] for i in range(0, 4 * n, 4))


def shared_prefix(groups, prompts, system_len, question_len, output_len, seed=0, words=None):
    """Requests ({"messages", "max_tokens"}) of the generated-shared-prefix shape, shuffled."""
    rng = random.Random(seed)
    systems = [text(system_len, rng, words) for _ in range(groups)]
    out = [{"messages": [{"role": "system", "content": systems[g]},
                         {"role": "user", "content": text(question_len, rng, words)}],
            "max_tokens": output_len, "group": g} for g in range(groups) for _ in range(prompts)]
    rng.shuffle(out)
    return out


def multi_turn(conversations, turns, message_len, output_len, seed=0):
    """Requests of multi-turn chats, turn by turn interleaved across conversations: turn k of a
    chat carries its k - 1 earlier messages and answers (answers stand in at their length)."""
    rng = random.Random(seed)
    history = [[] for _ in range(conversations)]
    out = []
    for _turn in range(turns):
        for c in range(conversations):
            history[c].append({"role": "user", "content": text(message_len, rng)})
            out.append({"messages": list(history[c]), "max_tokens": output_len, "group": c})
            history[c].append({"role": "assistant", "content": text(output_len, rng)})
    return out


def agent_loops(loops, turns=None, system_len=1500, task_len=200, call_len=40, tool_lens=(50, 4000),
                context=(16000, 32000), gaps=(0.0, 2.0), apps=4, seed=0):
    """Tool-calling loops: each an app's system prompt (`apps` of them, shared by its loops) and
    a task, then turns until its prompt reaches a context drawn from `context` tokens (or
    exactly `turns` turns): turn k's prompt is the loop so far, its answer a tool call of
    `call_len` tokens, the tool's output (log-uniform in `tool_lens`) appended before turn k + 1,
    which is sent a gap (uniform in `gaps`, s) after turn k's answer ends. Each loop:
    {"turns": [request...], "gaps": [s before each turn; the first 0], "group": app, "loop": i}."""
    rng = random.Random(seed)
    systems = [text(system_len, rng) for _ in range(apps)]
    out = []
    for i in range(loops):
        app = i % apps
        target = rng.uniform(*context)
        messages = [{"role": "system", "content": systems[app]}, {"role": "user", "content": text(task_len, rng)}]
        size, reqs, waits = system_len + task_len, [], []
        while (len(reqs) < turns) if turns else (size < target or not reqs):
            reqs.append({"messages": list(messages), "max_tokens": call_len, "group": app})
            waits.append(rng.uniform(*gaps) if reqs[1:] else 0.0)
            tool = int(math.exp(rng.uniform(math.log(tool_lens[0]), math.log(tool_lens[1]))))
            call = f"call_{i}_{len(reqs)}"   # (a router's schema refuses a tool message without its call's id)
            messages += [{"role": "assistant", "content": text(call_len, rng),
                          "tool_calls": [{"id": call, "type": "function",
                                          "function": {"name": "run", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": call, "content": text(tool, rng)}]
            size += call_len + tool
        out.append({"turns": reqs, "gaps": waits, "group": app, "loop": i})
    return out


def turn_loops(conversations, turns, system_len=600, message_len=60, output_len=60, gap=0.3, seed=0):
    """Issue 44's alternating case: `conversations` chats of `turns` turns, each its own system
    prompt of `system_len` tokens, the next turn `gap` s after the last answer (agent_loops' shape)."""
    rng = random.Random(seed)
    out = []
    for i in range(conversations):
        messages = [{"role": "system", "content": text(system_len, rng)},
                    {"role": "user", "content": text(message_len, rng)}]
        reqs = []
        for _ in range(turns):
            reqs.append({"messages": list(messages), "max_tokens": output_len, "group": i})
            messages += [{"role": "assistant", "content": text(output_len, rng)},
                         {"role": "user", "content": text(message_len, rng)}]
        out.append({"turns": reqs, "gaps": [0.0] + [gap] * (turns - 1), "group": i, "loop": i})
    return out


def preset(name, seed=0, **override):
    shape, params = PRESETS[name]
    params = {**params, **override}
    return (shared_prefix if shape == "shared_prefix" else multi_turn)(seed=seed, **params)


def prompt_tokens(request):
    return sim.tokenize(sim.chat_prompt(request["messages"]))


def reusable_share(requests, block_size=sim.BLOCK_SIZE):
    """The share of prompt tokens an unbounded prefix cache of `block_size` blocks could serve
    (each request against the ones before it): the hit rate of a cache that never evicts."""
    seen, hit, total = set(), 0, 0
    for r in requests:
        tokens = prompt_tokens(r)
        total += len(tokens)
        h, found, blocks = None, True, (len(tokens) - 1) // block_size
        for i in range(blocks):
            h = hash((h, tuple(tokens[i * block_size:(i + 1) * block_size])))
            if found and h in seen:
                hit += block_size
            else:
                found = False
            seen.add(h)
    return hit / total if total else 0.0


def arrivals(n, rate, kind="poisson", cv=2.0, seed=0, duration=None):
    """Send times (s from the start) of at most n requests at `rate` per second."""
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        if kind == "poisson":
            t += rng.expovariate(rate)
        else:                                # gamma gaps: mean 1/rate, coefficient of variation cv
            shape = 1.0 / (cv * cv)
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
        if duration is not None and t > duration:
            break
        out.append(t)
    return out


# --- the runner -------------------------------------------------------------------------------------

def _account(rec, obj):
    """Usage (prompt and cached tokens), llama.cpp's timings and the response's id (its first
    chunk's) from a response or chunk."""
    if "id" not in rec and isinstance(obj.get("id"), str):
        rec["id"] = obj["id"]
    usage = obj.get("usage")
    if usage:
        rec["usage"] = usage
        rec["prompt_tokens"] = usage.get("prompt_tokens")
        rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    timings = obj.get("timings")
    if timings:                              # llama.cpp's server: its own cache accounting
        rec["cache_n"], rec["prompt_n"] = timings.get("cache_n"), timings.get("prompt_n")
        rec["timings"] = timings             # prompt_ms, predicted_ms...: the server's own clock
    if "choices" in obj:
        rec["_choices"] = obj["choices"]


async def one_request(host, port, path, body, timeout, headers=None, first=None):
    """Send one streamed request; {"ttft", "last" (s to the last token), "sent" (s to the last byte
    of the request written), "e2e", "tokens",
    "prompt_tokens", "cached_tokens", and llama.cpp's "cache_n", "prompt_n" when it sends them}.
    `first`: called with nothing at its first token (a harness that holds other sends till then)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    rec = {"ttft": None, "tokens": 0, "status": None, "prompt_tokens": None, "cached_tokens": None}
    try:
        data = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n{extra}"
                     f"content-length: {len(data)}\r\nconnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        rec["sent"] = time.monotonic() - t0  # the request's last byte handed to the kernel
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        rec["status"] = int(head.split(b" ", 2)[1])
        chunked = b"chunked" in head.lower()
        buf = b""

        def events(piece):
            nonlocal buf
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                        yield json.loads(line[6:])
        deadline = t0 + timeout
        while True:
            left = deadline - time.monotonic()
            if chunked:
                size = int((await asyncio.wait_for(reader.readline(), left)).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                piece = await asyncio.wait_for(reader.readexactly(size + 2), left)
                piece = piece[:-2]
            else:
                piece = await asyncio.wait_for(reader.read(65536), left)
                if not piece:
                    break
            now = time.monotonic()
            for ev in events(piece):
                for choice in ev.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or choice.get("text"):
                        rec["tokens"] += 1
                        rec["last"] = now - t0
                        if rec["ttft"] is None:
                            rec["ttft"] = now - t0
                            if first is not None:
                                first()
                _account(rec, ev)
        if rec["status"] != 200:              # what the server said, for the error's reason
            rec["body"] = buf[:300].decode(errors="replace")
        if buf.strip().startswith(b"{"):      # not streamed: one JSON body
            _account(rec, json.loads(buf))
            choice = (rec.pop("_choices", None) or [{}])[0]
            rec["tokens"] = (rec.get("usage") or {}).get("completion_tokens", 0) if "message" in choice or \
                "text" in choice else 0
        rec.pop("_choices", None)
        rec["e2e"] = time.monotonic() - t0
    finally:
        writer.close()
    return rec


def loopback(url):
    """(host, port, path prefix) of a loopback URL; anything else is refused."""
    u = urllib.parse.urlsplit(url)
    if u.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("workload.py sends to loopback only")
    return u.hostname, u.port, u.path.rstrip("/")


async def run_async(url, model, requests, times, timeout=120.0, extra=None, headers=None):
    """Each request sent at its time (s from the start), streamed; `url` one base URL or a list
    (request i to url[i % len], as a client alternating between ingresses); a request's
    "session" and "cache_key" as _body says. Each record holds "at", its send time, and
    "asked", its max_tokens."""
    targets = []
    for one in [url] if isinstance(url, str) else url:
        host, port, prefix = loopback(one)
        targets.append((host, port, prefix + "/v1/chat/completions"))
    start = time.monotonic()
    tasks = []
    for i, (req, at) in enumerate(zip(requests, times)):
        delay = start + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        body, more = _body(model, req, extra)
        sent_headers = {**(headers or {}), **more} if more else headers
        host, port, path = targets[i % len(targets)]
        tasks.append(asyncio.ensure_future(one_request(host, port, path, body, timeout, sent_headers)))
    out = await asyncio.gather(*tasks, return_exceptions=True)
    return [dict(r if isinstance(r, dict) else {"error": repr(r)}, at=at, asked=req["max_tokens"])
            for r, at, req in zip(out, times, requests)]


def _body(model, req, extra):
    """The JSON a request of this workload sends, and its headers beyond the base ones: a
    request's "session" goes in `user` and the X-Session-Id header (as routers read one), its
    "cache_key" in `prompt_cache_key` (OpenAI's)."""
    body = {"model": model, "messages": req["messages"], "max_tokens": req["max_tokens"], "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True, **(extra or {})}
    headers = {}
    if "session" in req:
        body["user"] = req["session"]
        headers["x-session-id"] = req["session"]
    if "cache_key" in req:
        body["prompt_cache_key"] = req["cache_key"]
    return body, headers


async def run_loops_async(url, model, loops, starts, timeout=120.0, extra=None, headers=None, requests=(),
                          times=()):
    """Closed loops (agent_loops' shape), loop i from starts[i] (s from the start): each turn
    sent its gap after the previous answer ended, to url[turn % len] (turns alternating between
    ingresses); alongside, open-loop `requests` at `times` (run_async's), request j to url[j % len].
    Records as run_async's, each with "loop" and "turn" (None for the open-loop ones)."""
    targets = []
    for one in [url] if isinstance(url, str) else url:
        host, port, prefix = loopback(one)
        targets.append((host, port, prefix + "/v1/chat/completions"))
    start = time.monotonic()

    async def send(req, i):
        body, more = _body(model, req, extra)
        host, port, path = targets[i % len(targets)]
        at = time.monotonic() - start
        try:
            rec = await one_request(host, port, path, body, timeout, {**(headers or {}), **more})
        except Exception as exc:             # a failed turn is a record; the loop goes on
            rec = {"error": repr(exc)}
        return dict(rec, at=at, asked=req["max_tokens"])

    async def loop(one, at):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        out = []
        for turn, (req, gap) in enumerate(zip(one["turns"], one["gaps"])):
            if gap:
                await asyncio.sleep(gap)
            out.append(dict(await send(req, turn), loop=one["loop"], turn=turn))
        return out

    async def single(req, i, at):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        return dict(await send(req, i), loop=None, turn=None)
    done = await asyncio.gather(*(loop(one, at) for one, at in zip(loops, starts)),
                                *(single(req, i, at) for i, (req, at) in enumerate(zip(requests, times))))
    return [r for d in done for r in (d if isinstance(d, list) else [d])]


def run(url, model, requests, times, timeout=120.0, extra=None, headers=None):
    return asyncio.run(run_async(url, model, requests, times, timeout, extra, headers))


def summary(records):
    """Median and p90 TTFT (ms), the hit rate seen by the server (cached / prompt tokens)."""
    ok = [r for r in records if r.get("status") == 200]
    ttft = sorted(r["ttft"] for r in ok if r.get("ttft") is not None)
    cached = sum((r.get("cache_n") if r.get("cache_n") is not None else r.get("cached_tokens")) or 0 for r in ok)
    prompt = sum(((r["cache_n"] + r["prompt_n"]) if r.get("cache_n") is not None else r.get("prompt_tokens")) or 0
                 for r in ok)

    def q(p):
        return ttft[min(len(ttft) - 1, int(p * len(ttft)))] * 1e3 if ttft else None
    return {"requests": len(records), "ok": len(ok), "ttft_p50_ms": q(0.5), "ttft_p90_ms": q(0.9),
            "hit_rate": cached / prompt if prompt else None,
            "e2e_p50_ms": sorted(r["e2e"] for r in ok)[len(ok) // 2] * 1e3 if ok else None}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--preset", default="reasoning", choices=tuple(PRESETS))
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--arrival", default="poisson", choices=("poisson", "bursty"))
    p.add_argument("--cv", type=float, default=2.0)
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--key", default=None, help="bearer key (an ingress)")
    a = p.parse_args()
    reqs = preset(a.preset, a.seed)[:a.count]
    times = arrivals(len(reqs), a.rate, a.arrival, a.cv, a.seed, a.duration)
    print(f"reusable prefix share {reusable_share(reqs) * 100:.1f}%")
    headers = {"authorization": f"Bearer {a.key}"} if a.key else None
    print(json.dumps(summary(run(a.url, a.model, reqs[:len(times)], times, headers=headers))))


if __name__ == "__main__":
    main()
