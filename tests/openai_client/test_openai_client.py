#!/usr/bin/env python3
"""The official `openai` Python client (pinned in requirements.txt) against a Prism router.

What it checks: completions and chat completions, streamed and not, `n: 2`, stop strings
and logprobs all come back as well-formed objects that the client parses, with real values:

- choices count and indexes, finish_reason in {stop, length} (length exactly at max_tokens);
- a stop string never appears in the text, and the text is the greedy text cut before it;
- logprobs: one entry per generated token, top_logprobs of the requested length, sorted,
  the greedy token's logprob equal to the best alternative's;
- at temperature 0 the streamed deltas join to the non-streamed text;
- usage: total = prompt + completion, completion = tokens generated (counted from logprobs).

Usage:
    test_openai_client.py --base-url http://127.0.0.1:8000/v1 --model smollm2 [--api-key KEY]

Exit status 0 when every check passes, 1 otherwise (each failure is printed).
Run by `tests/tests/router_cluster.rs` (which creates the venv) against a real cluster.
"""

from __future__ import annotations

import argparse
import math
import sys

import openai

from checks import Check, eq

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 12


def check_usage(usage, what: str, max_tokens: int | None = None, completion: int | None = None) -> None:
    if usage is None:
        raise AssertionError(f"{what}: no usage")
    if usage.prompt_tokens <= 0:
        raise AssertionError(f"{what}: prompt_tokens {usage.prompt_tokens}")
    if usage.completion_tokens <= 0:
        raise AssertionError(f"{what}: completion_tokens {usage.completion_tokens}")
    eq(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens, f"{what}: total_tokens")
    if max_tokens is not None and usage.completion_tokens > max_tokens:
        raise AssertionError(f"{what}: completion_tokens {usage.completion_tokens} > max_tokens {max_tokens}")
    if completion is not None:
        eq(usage.completion_tokens, completion, f"{what}: completion_tokens")


def check_finish(reason, what: str) -> None:
    if reason not in ("stop", "length"):
        raise AssertionError(f"{what}: finish_reason {reason!r}")


class Suite:
    """The checks, sharing one client and a few greedy reference answers."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        self.c = client
        self.model = model

    # ---- completions -------------------------------------------------------------------

    def completion(self, **kw):
        return self.c.completions.create(model=self.model, prompt=PROMPT, temperature=0, **kw)

    def completions_plain_and_streamed(self) -> None:
        r = self.completion(max_tokens=MAX_TOKENS, logprobs=1)
        eq(r.object, "text_completion", "object")
        eq(r.model, self.model, "model")
        eq(len(r.choices), 1, "choices")
        ch = r.choices[0]
        eq(ch.index, 0, "index")
        check_finish(ch.finish_reason, "completion")
        n_tokens = len(ch.logprobs.tokens)
        check_usage(r.usage, "completion", MAX_TOKENS, completion=n_tokens)
        if ch.finish_reason == "length":
            eq(r.usage.completion_tokens, MAX_TOKENS, "length finish at max_tokens")
        if not ch.text:
            raise AssertionError("empty completion text")

        chunks = list(self.completion(max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        eq(text, ch.text, "streamed text joined vs non-streamed")
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        eq(finishes, [ch.finish_reason], "streamed finish_reason (once, at the end)")
        usage_chunks = [c for c in chunks if c.usage is not None]
        eq(len(usage_chunks), 1, "chunks carrying usage")
        eq(usage_chunks[0].choices, [], "usage chunk choices")
        eq(usage_chunks[0].usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}),
           r.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}), "streamed usage")
        ids = {c.id for c in chunks}
        eq(len(ids), 1, "one id across chunks")

    def completions_n2(self) -> None:
        r = self.c.completions.create(
            model=self.model, prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=7, logprobs=0
        )
        eq(len(r.choices), 2, "choices")
        eq(sorted(ch.index for ch in r.choices), [0, 1], "indexes")
        total = 0
        for ch in r.choices:
            check_finish(ch.finish_reason, f"choice {ch.index}")
            total += len(ch.logprobs.tokens)
            if ch.finish_reason == "length":
                eq(len(ch.logprobs.tokens), 8, f"choice {ch.index} tokens at length")
        check_usage(r.usage, "n=2", 16, completion=total)

        texts = {0: "", 1: ""}
        finishes: dict[int, list] = {0: [], 1: []}
        for c in self.c.completions.create(model=self.model, prompt=PROMPT, n=2, max_tokens=8, temperature=1.0,
                                           seed=7, stream=True):
            for ch in c.choices:
                texts[ch.index] += ch.text
                if ch.finish_reason:
                    finishes[ch.index].append(ch.finish_reason)
        for i in (0, 1):
            eq(len(finishes[i]), 1, f"streamed choice {i} finish count")
            check_finish(finishes[i][0], f"streamed choice {i}")

    def completions_stop(self) -> None:
        # The greedy text without a stop string, then stop on a word inside it.
        full = self.completion(max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
        words = full.split()
        if len(words) < 3:
            raise AssertionError(f"greedy text too short to pick a stop word: {full!r}")
        stop = words[2]
        cut = full.index(stop)
        want = full[:cut]
        r = self.completion(max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
        ch = r.choices[0]
        eq(ch.finish_reason, "stop", "finish_reason with a stop string")
        if stop in ch.text:
            raise AssertionError(f"stop string {stop!r} in text {ch.text!r}")
        eq(ch.text, want, "text cut before the stop string")
        check_usage(r.usage, "stop", 24)

        chunks = list(self.completion(max_tokens=24, stop=stop, extra_body={"ignore_eos": True}, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        eq(text, want, "streamed text with a stop string")
        for c in chunks:
            if c.choices and stop in c.choices[0].text:
                raise AssertionError(f"a chunk leaked the stop string: {c.choices[0].text!r}")
        eq([c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason], ["stop"],
           "streamed finish_reason")

    def completions_logprobs(self) -> None:
        r = self.completion(max_tokens=MAX_TOKENS, logprobs=3)
        lp = r.choices[0].logprobs
        n = r.usage.completion_tokens
        eq(len(lp.tokens), n, "logprobs.tokens per token")
        eq(len(lp.token_logprobs), n, "token_logprobs per token")
        eq(len(lp.top_logprobs), n, "top_logprobs per token")
        eq(len(lp.text_offset), n, "text_offset per token")
        for i, (tok, lpv, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
            if not (lpv <= 0.0 and math.isfinite(lpv)):
                raise AssertionError(f"token {i} logprob {lpv}")
            # Keyed by token text: two ids that decode alike collapse into one key.
            if not 1 <= len(top) <= 3:
                raise AssertionError(f"token {i} top_logprobs {top}")
            if tok not in top:
                raise AssertionError(f"greedy token {i} {tok!r} missing from its top_logprobs {top}")
            best = max(top.values())
            if lpv < best - 1e-3:
                raise AssertionError(f"greedy token {i} {tok!r} logprob {lpv} below an alternative's {best}")
        offsets = lp.text_offset
        if offsets != sorted(offsets) or offsets[0] != 0:
            raise AssertionError(f"text_offset not increasing from 0: {offsets}")

    # ---- chat completions --------------------------------------------------------------

    def chat(self, **kw):
        return self.c.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": QUESTION}], temperature=0, **kw
        )

    def chat_plain_and_streamed(self) -> None:
        r = self.chat(max_tokens=MAX_TOKENS, logprobs=True)
        eq(r.object, "chat.completion", "object")
        eq(len(r.choices), 1, "choices")
        ch = r.choices[0]
        eq(ch.message.role, "assistant", "role")
        check_finish(ch.finish_reason, "chat")
        if not ch.message.content:
            raise AssertionError("empty chat content")
        check_usage(r.usage, "chat", MAX_TOKENS, completion=len(ch.logprobs.content))

        chunks = list(self.chat(max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True}))
        eq(chunks[0].object, "chat.completion.chunk", "chunk object")
        roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
        eq(roles, ["assistant"], "role sent once")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        eq(text, ch.message.content, "streamed deltas joined vs non-streamed")
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        eq(finishes, [ch.finish_reason], "streamed finish_reason")
        usage = [c.usage for c in chunks if c.usage is not None]
        eq(len(usage), 1, "chunks carrying usage")
        eq((usage[0].prompt_tokens, usage[0].completion_tokens), (r.usage.prompt_tokens, r.usage.completion_tokens),
           "streamed usage")

    def chat_n2(self) -> None:
        r = self.c.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": QUESTION}], n=2, max_tokens=8,
            temperature=1.0, seed=11, logprobs=True,
        )
        eq(len(r.choices), 2, "choices")
        eq(sorted(ch.index for ch in r.choices), [0, 1], "indexes")
        total = 0
        for ch in r.choices:
            check_finish(ch.finish_reason, f"choice {ch.index}")
            eq(ch.message.role, "assistant", "role")
            total += len(ch.logprobs.content)
        check_usage(r.usage, "chat n=2", 16, completion=total)

        texts = {0: "", 1: ""}
        finishes: dict[int, list] = {0: [], 1: []}
        for c in self.c.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": QUESTION}], n=2, max_tokens=8,
            temperature=1.0, seed=11, stream=True,
        ):
            for ch in c.choices:
                texts[ch.index] += ch.delta.content or ""
                if ch.finish_reason:
                    finishes[ch.index].append(ch.finish_reason)
        for i in (0, 1):
            eq(len(finishes[i]), 1, f"streamed choice {i} finish count")
            check_finish(finishes[i][0], f"streamed choice {i}")

    def chat_stop(self) -> None:
        full = self.chat(max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
        words = full.split()
        if len(words) < 3:
            raise AssertionError(f"greedy chat text too short to pick a stop word: {full!r}")
        stop = words[2]
        want = full[: full.index(stop)]
        r = self.chat(max_tokens=24, stop=[stop, "\u00a7never\u00a7"], extra_body={"ignore_eos": True})
        eq(r.choices[0].finish_reason, "stop", "finish_reason")
        eq(r.choices[0].message.content, want, "content cut before the stop string")
        chunks = list(self.chat(max_tokens=24, stop=stop, extra_body={"ignore_eos": True}, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        eq(text, want, "streamed content with a stop string")

    def chat_logprobs(self) -> None:
        r = self.chat(max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        eq(len(content), r.usage.completion_tokens, "logprobs.content entries per token")
        for i, e in enumerate(content):
            if not (e.logprob <= 0.0 and math.isfinite(e.logprob)):
                raise AssertionError(f"entry {i} logprob {e.logprob}")
            eq(len(e.top_logprobs), 3, f"entry {i} top_logprobs")
            tops = [t.logprob for t in e.top_logprobs]
            eq(tops, sorted(tops, reverse=True), f"entry {i} top_logprobs sorted")
            if abs(tops[0] - e.logprob) > 1e-3:
                raise AssertionError(f"greedy entry {i} logprob {e.logprob} != best {tops[0]}")
            if not e.bytes:
                raise AssertionError(f"entry {i} has no bytes")
            spelled = bytes(e.bytes).decode("utf-8", errors="replace")
            if "\ufffd" not in spelled:  # a token holding part of a character has no text of its own
                eq(spelled, e.token, f"entry {i} bytes")

        # Streamed: each chunk carries exactly its own tokens' entries; together the same list.
        streamed = []
        for c in self.chat(max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3, stream=True):
            if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content:
                streamed.extend(c.choices[0].logprobs.content)
        eq([e.token for e in streamed], [e.token for e in content], "streamed logprob tokens")
        for a, b in zip(streamed, content):
            if abs(a.logprob - b.logprob) > 1e-3:
                raise AssertionError(f"streamed logprob {a.logprob} != {b.logprob} for {a.token!r}")

    # ---- models and errors -------------------------------------------------------------

    def models_and_errors(self) -> None:
        ids = [m.id for m in self.c.models.list()]
        if self.model not in ids:
            raise AssertionError(f"{self.model} not in /v1/models: {ids}")
        try:
            self.c.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
            raise AssertionError("unknown model accepted")
        except openai.NotFoundError as e:
            eq(e.status_code, 404, "unknown model status")
        try:
            self.completion(max_tokens=-1)
            raise AssertionError("max_tokens -1 accepted")
        except openai.BadRequestError as e:
            eq(e.status_code, 400, "max_tokens -1 status")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="router OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--api-key", default="not-needed", help="API key (when the router requires one)")
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=120.0, max_retries=0)
    s = Suite(client, args.model)
    check = Check()
    print(f"openai {openai.__version__} against {args.base_url} model {args.model}", flush=True)
    for name in (
        "completions_plain_and_streamed",
        "completions_n2",
        "completions_stop",
        "completions_logprobs",
        "chat_plain_and_streamed",
        "chat_n2",
        "chat_stop",
        "chat_logprobs",
        "models_and_errors",
    ):
        check.run(name, getattr(s, name))
    print(f"{check.passed} passed, {len(check.failures)} failed {check.failures}", flush=True)
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
