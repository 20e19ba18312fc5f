#!/usr/bin/env python3
"""Structured outputs and tool calling through the official `openai` Python client.

What it checks against a Prism router serving the bundled model (greedy decoding):

- `client.beta.chat.completions.parse(response_format=PydanticModel)` returns a parsed object;
- `response_format` json_schema: the output of 50 varied prompts validates against the schema
  (pydantic, the model the schema came from), streamed and not, every one;
- `response_format` json_object gives a JSON object; vLLM's `guided_choice` / `guided_regex`
  (extra_body) give one of the choices / a match;
- `tool_choice: "required"` with two tools returns valid calls (arguments valid for the
  called tool's schema, finish_reason `tool_calls`); a named tool_choice calls that tool once;
- a streamed tool call arrives as `delta.tool_calls` chunks (head chunk with id and name, then
  arguments) that accumulate into a valid call, with no call text in the content;
- a conversation with an assistant tool call (null content) and a `tool` result is answered;
- an invalid schema and an unknown tool name are 400s naming the field.

Usage:
    test_structured.py --base-url http://127.0.0.1:8000/v1 --model smollm2

Exit status 0 when every check passes, 1 otherwise. Run by `tests/tests/structured_up.rs`.
"""

from __future__ import annotations

import os
import argparse
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import openai
from pydantic import BaseModel, Field, StringConstraints

from checks import Check, eq

SUBJECTS = [
    "a retired sailor", "a young chess prodigy", "a baker from Lyon", "an astronaut", "a jazz pianist",
    "a beekeeper", "a marathon runner", "a librarian", "a volcano scientist", "a street artist",
    "a lighthouse keeper", "a robotics student", "a cheese maker", "a mountain guide", "a florist",
    "a deep-sea diver", "a violin teacher", "a train driver", "a tea farmer", "a museum curator",
    "a surfer", "a glassblower", "a park ranger", "a translator", "a kite designer",
    "a tailor", "a wildlife photographer", "a goat herder", "a comic writer", "a pilot",
    "a potter", "a software tester", "a fisherman", "a judo coach", "a radio host",
    "a carpenter", "a bird watcher", "a chemist", "a dancer", "a map maker",
    "a sommelier", "a puppeteer", "a nurse", "a stonemason", "a game designer",
    "a falconer", "a clockmaker", "a chef", "a poet", "a farmer",
]


class Person(BaseModel):
    """What the json_schema checks ask for: bounded so every output fits in max_tokens."""

    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    job: str = Field(max_length=24)
    hobbies: list[Annotated[str, StringConstraints(max_length=16)]] = Field(max_length=3)


class Weather(BaseModel):
    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


class Add(BaseModel):
    a: int = Field(ge=-1000, le=1000)
    b: int = Field(ge=-1000, le=1000)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": Add.model_json_schema()}},
]
ARGS = {"get_weather": Weather, "add": Add}


def person_format() -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True}}


def ask(subject: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe {subject} as a JSON object with name, age, job and hobbies."}]


def parse_pydantic(c: openai.OpenAI, model: str) -> None:
    done = c.beta.chat.completions.parse(model=model, messages=ask("a famous painter"), response_format=Person,
                                         max_tokens=MAX_PERSON_TOKENS, temperature=0)
    parsed = done.choices[0].message.parsed
    if not isinstance(parsed, Person):
        raise AssertionError(f"parsed is {parsed!r} ({done.choices[0].message.content!r})")
    eq(done.choices[0].finish_reason, "stop", "finish_reason")


# Every string of Person is bounded, the grammar allows no free whitespace and no keys the
# schema does not name (objects are closed, as in OpenAI's strict mode), so a complete
# object fits in 1024 tokens even when every character is a six-character \u escape: the
# output always ends with `stop`, however the model fills the fields.
MAX_PERSON_TOKENS = 1024


def one_schema_output(c: openai.OpenAI, model: str, subject: str, stream: bool) -> str:
    kw = dict(model=model, messages=ask(subject), response_format=person_format(), max_tokens=MAX_PERSON_TOKENS,
              temperature=0)
    if not stream:
        r = c.chat.completions.create(**kw)
        eq(r.choices[0].finish_reason, "stop", f"finish_reason for {subject}")
        return r.choices[0].message.content
    text, finish = "", None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    eq(finish, "stop", f"streamed finish_reason for {subject}")
    return text


def json_schema_50(c: openai.OpenAI, model: str, stream: bool) -> None:
    with ThreadPoolExecutor(max_workers=10) as pool:
        outs = list(pool.map(lambda s: one_schema_output(c, model, s, stream), SUBJECTS))
    bad = []
    for subject, text in zip(SUBJECTS, outs):
        try:
            Person.model_validate_json(text)
        except Exception as e:  # noqa: BLE001 - collected and reported together
            bad.append(f"{subject}: {text!r}: {e}")
    eq(len(outs), 50, "outputs")
    if bad:
        raise AssertionError(f"{len(bad)}/50 outputs do not validate:\n" + "\n".join(bad))


def json_object_choice_regex(c: openai.OpenAI, model: str) -> None:
    r = c.chat.completions.create(model=model, messages=ask("a cat"), response_format={"type": "json_object"},
                                  max_tokens=80, temperature=0)
    if r.choices[0].finish_reason == "stop" and not isinstance(json.loads(r.choices[0].message.content), dict):
        raise AssertionError(r.choices[0].message.content)
    choices = ["positive", "negative", "neutral"]
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "I love this! Sentiment?"}],
                                  max_tokens=10, temperature=0, extra_body={"guided_choice": choices})
    if r.choices[0].message.content not in choices:
        raise AssertionError(r.choices[0].message.content)
    r = c.completions.create(model=model, prompt="A phone number: ", max_tokens=20, temperature=0,
                             extra_body={"guided_regex": r"\d{3}-\d{4}"})
    if not re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text):
        raise AssertionError(r.choices[0].text)


WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def check_call(name: str, arguments: str) -> None:
    if name not in ARGS:
        raise AssertionError(f"unknown tool {name!r}")
    ARGS[name].model_validate_json(arguments)


def tool_required(c: openai.OpenAI, model: str) -> None:
    r = c.chat.completions.create(model=model, messages=WEATHER_Q, tools=TOOLS, tool_choice="required",
                                  max_tokens=120, temperature=0)
    ch = r.choices[0]
    eq(ch.finish_reason, "tool_calls", "finish_reason")
    calls = ch.message.tool_calls or []
    if not calls:
        raise AssertionError(f"no tool calls: {ch.message!r}")
    for call in calls:
        eq(call.type, "function", "type")
        if not call.id.startswith("call_"):
            raise AssertionError(call.id)
        check_call(call.function.name, call.function.arguments)
    if ch.message.content:
        raise AssertionError(f"call text leaked into content: {ch.message.content!r}")
    # Named: exactly that function, once.
    r = c.chat.completions.create(model=model, messages=WEATHER_Q, tools=TOOLS, max_tokens=120, temperature=0,
                                  tool_choice={"type": "function", "function": {"name": "add"}})
    calls = r.choices[0].message.tool_calls or []
    eq([t.function.name for t in calls], ["add"], "named tool_choice")
    Add.model_validate_json(calls[0].function.arguments)


def tool_stream(c: openai.OpenAI, model: str) -> None:
    stream = c.chat.completions.create(model=model, messages=WEATHER_Q, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=120, temperature=0, stream=True)
    acc: dict[int, dict] = {}
    content, finish, heads = "", None, 0
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                if d.index not in acc:
                    if not (d.id and d.function and d.function.name):
                        raise AssertionError(f"first chunk of call {d.index} has no id/name: {d!r}")
                    heads += 1
                    acc[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                acc[d.index]["arguments"] += (d.function.arguments or "") if d.function else ""
    eq(finish, "tool_calls", "finish_reason")
    eq(len(acc), 1, "one call without parallel calls")
    eq(heads, 1, "head chunks")
    if "tool_call" in content:
        raise AssertionError(f"call text in content: {content!r}")
    for call in acc.values():
        check_call(call["name"], call["arguments"])


def tool_history(c: openai.OpenAI, model: str) -> None:
    msgs = WEATHER_Q + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=30, temperature=0)
    ch = r.choices[0]
    if ch.finish_reason not in ("stop", "length", "tool_calls"):
        raise AssertionError(ch.finish_reason)
    for call in ch.message.tool_calls or []:
        if call.function.name not in ARGS:
            raise AssertionError(call)
    # tool_choice none: no calls parsed.
    r = c.chat.completions.create(model=model, messages=WEATHER_Q, tools=TOOLS, tool_choice="none",
                                  max_tokens=20, temperature=0)
    eq(r.choices[0].message.tool_calls, None, "tool_choice none")


def error_param(fn) -> str | None:
    try:
        fn()
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        body = body.get("error", body)
        return body.get("param")
    raise AssertionError("not a 400")


def errors_name_the_field(c: openai.OpenAI, model: str) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}}
    eq(error_param(lambda: c.chat.completions.create(model=model, messages=ask("x"), response_format=bad_schema,
                                                     max_tokens=5)),
       "response_format.json_schema.schema", "invalid schema")
    eq(error_param(lambda: c.chat.completions.create(model=model, messages=ask("x"), tools=TOOLS, max_tokens=5,
                                                     tool_choice={"type": "function", "function": {"name": "nope"}})),
       "tool_choice", "unknown tool")
    # A schema llguidance rejects (the engine's INVALID_ARGUMENT) still names the client's field.
    unsat = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                           "maximum": 1}}}
    eq(error_param(lambda: c.chat.completions.create(model=model, messages=ask("x"), response_format=unsat,
                                                     max_tokens=5)),
       "response_format.json_schema.schema", "schema the engine rejects")
    # Its message names the client's field too, not the engine's.
    try:
        c.chat.completions.create(model=model, messages=ask("x"), response_format=unsat, max_tokens=5)
    except openai.BadRequestError as e:
        message = (e.body.get("error", e.body) if isinstance(e.body, dict) else {}).get("message", "")
        if not message.startswith("response_format.json_schema.schema: ") or "structured_output" in message:
            raise AssertionError(f"message of the rejected schema: {message!r}") from None
    eq(error_param(lambda: c.chat.completions.create(model=model, messages=ask("x"), max_tokens=5,
                                                     extra_body={"guided_regex": "a", "guided_choice": ["b"]})),
       "guided_choice", "two constraints")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default="unused")
    a = ap.parse_args()
    c = openai.OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=300)
    check = Check()
    check.run("errors_name_the_field", errors_name_the_field, c, a.model)
    check.run("parse_pydantic", parse_pydantic, c, a.model)
    # PRISM_STRUCTURED_50=0 leaves out the 50-subject sweep (the slowest checks).
    if os.environ.get("PRISM_STRUCTURED_50") != "0":
        check.run("json_schema_50_whole", json_schema_50, c, a.model, False)
        check.run("json_schema_50_streamed", json_schema_50, c, a.model, True)
    check.run("json_object_choice_regex", json_object_choice_regex, c, a.model)
    check.run("tool_required", tool_required, c, a.model)
    check.run("tool_stream", tool_stream, c, a.model)
    check.run("tool_history", tool_history, c, a.model)
    print(f"{check.passed} passed, {len(check.failures)} failed", flush=True)
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
