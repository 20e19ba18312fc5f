#!/usr/bin/env python3
"""Reference outputs for Gemma 3 270M (models/gemma-3-270m-q4_k_m.gguf, scripts/fetch-gemma.sh)
from llama.cpp (llama-cpp-python) and jinja2:
  - tokenizer ids of varied strings (Unicode, spaces, newlines, tabs, digits, emoji, HTML tags
    and control tokens), with special-token parsing on and off, no BOS, and one with BOS;
  - chat prompts rendered by jinja2 the way transformers' apply_chat_template does
    (trim_blocks, lstrip_blocks, loop controls, raise_exception) from the GGUF's
    `tokenizer.chat_template`, or, as for this file, which was converted without one, from
    the template Prism falls back to for `gemma3` (worker/engine/templates/gemma3.jinja,
    Gemma 3's published template), including messages the template rejects;
  - llama.cpp's greedy (argmax) continuation of completion and chat prompts: ids until an
    end-of-generation token (`<eos>`, `<end_of_turn>`) or NEW_TOKENS, and their text.

Writes tests/fixtures/gemma3_reference.json (ids and texts only).

Environment (pinned):
    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install numpy==2.2.6 llama-cpp-python==0.3.16 jinja2==3.1.6  # builds llama.cpp (minutes)
    /tmp/refvenv/bin/python tests/reference/gemma_reference.py [models/gemma-3-270m-q4_k_m.gguf]
"""

import hashlib
import json
import platform
import sys
from pathlib import Path

import jinja2
import llama_cpp
import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
BUILTIN_TEMPLATE = ROOT / "worker" / "engine" / "templates" / "gemma3.jinja"
OUT = ROOT / "tests" / "fixtures" / "gemma3_reference.json"
NEW_TOKENS = 24

TOKENIZER_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces and trailing   ",
    "two  spaces and                                        forty",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "tabs\tand\t\ttabs\nnewlines\n\n\nand\r\nCRLF",
    "Numbers: 1234567890 and 3.14159 and 1e-9 and 00042",
    "emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧",
    "中文测试：你好，世界！",
    "日本語のテキストとカタカナ",
    "한국어 문장입니다.",
    "Ünïcödé àccents — “quotes” … ellipsis",
    "Привет, мир! Ελληνικά. עברית. العربية.",
    "rare: \u0fff\U0001d49c\U000e0041 private \ue000",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk><mask>",
    "<table><tr><td>cell</td></tr></table> and <b>bold</b>",
    "URL: https://example.com/path?q=1&r=two#frag",
    "I'm can't won't they'll we've",
    "CamelCaseIdentifiers and snake_case_names",
    "▁already▁escaped▁",
    "",
]

TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Q: What is 12 plus 7?\nA:",
]

# Conversations for the template check: (messages, add_generation_prompt).
TEMPLATE_CASES = [
    ([{"role": "user", "content": "Hi"}], True),
    ([{"role": "user", "content": "  Hi, with spaces to trim \n"}], True),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}], True),
    (
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "Quatre."},
            {"role": "user", "content": "And 3+3?"},
        ],
        True,
    ),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], False),
    ([{"role": "user", "content": "Ünïcödé 😀\nsecond line"}], False),
    # Rejected by the template: roles must alternate, a conversation must start with the user.
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], True),
    ([{"role": "assistant", "content": "I start."}], True),
]

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Name a colour."}],
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def greedy(llm: Llama, ids: list[int]) -> list[int]:
    """Argmax continuation of `ids` until an end-of-generation token (not included)."""
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(NEW_TOKENS):
        tok = int(np.argmax(np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)))
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
            break
        out.append(tok)
        llm.eval([tok])
    return out


def main() -> None:
    llm = Llama(model_path=str(MODEL), n_ctx=1024, n_threads=2, n_batch=512, seed=0, logits_all=True, verbose=False)
    tok = lambda s, special=True, bos=False: llm.tokenize(s.encode("utf-8"), add_bos=bos, special=special)  # noqa: E731

    template = llm.metadata.get("tokenizer.chat_template")
    template_from = "gguf tokenizer.chat_template"
    if template is None:
        template = BUILTIN_TEMPLATE.read_text()
        template_from = str(BUILTIN_TEMPLATE.relative_to(ROOT))
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    bos = llm.detokenize([llm.token_bos()], special=True).decode()
    eos = llm.detokenize([llm.token_eos()], special=True).decode()

    def render(messages, add_generation_prompt):
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )

    templates = []
    for messages, agp in TEMPLATE_CASES:
        case = {"messages": messages, "add_generation_prompt": agp}
        try:
            case["text"] = render(messages, agp)
        except jinja2.exceptions.TemplateError as e:
            case["error"] = str(e)
        templates.append(case)

    prompts = [{"kind": "text", "text": p, "prompt_ids": tok(p, bos=True)} for p in TEXT_PROMPTS]
    for messages in CHAT_PROMPTS:
        text = render(messages, True)
        # The template prints <bos>: no BOS added on top (apply_chat_template's tokenization).
        prompts.append({"kind": "chat", "messages": messages, "text": text, "prompt_ids": tok(text)})
    for p in prompts:
        p["greedy_ids"] = greedy(llm, p["prompt_ids"])
        p["greedy_text"] = llm.detokenize(p["greedy_ids"]).decode("utf-8", errors="replace")
        print(f"{p['text'][:40]!r} -> {p['greedy_text']!r}", file=sys.stderr)

    fixture = {
        "generator": "tests/reference/gemma_reference.py",
        "implementation": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp CPU, 2 threads); jinja2 {jinja2.__version__}",
        "versions": {
            "python": platform.python_version(),
            "llama_cpp_python": llama_cpp.__version__,
            "numpy": np.__version__,
            "jinja2": jinja2.__version__,
        },
        "model": {"file": MODEL.name, "sha256": sha256(MODEL)},
        "bos_id": llm.token_bos(),
        "new_tokens": NEW_TOKENS,
        "decoding": "greedy argmax of the last-token logits; stops before an end-of-generation token",
        "tokenizer": [
            {"text": s, "ids": tok(s), "ids_plain": tok(s, special=False), "ids_bos": tok(s, bos=True)}
            for s in TOKENIZER_STRINGS
        ],
        "chat_template": {"from": template_from, "bos_token": bos, "eos_token": eos, "cases": templates},
        "prompts": prompts,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
