#!/usr/bin/env python3
"""A whitespace word-level tokenizer for a synthetic checkpoint that must serve chat prompts made of
`prism bench serve`'s synthetic words (multi-turn and prefix_repetition datasets on chat), so that
every word is its own token and two prompts share a token prefix exactly when they share a text
prefix. Token ids 0 .. VOCAB-1 are `t<id>` (as the stack trace's tokenizer names them, so token-id
prompts still decode), except FIRST .. FIRST+K-1, which become the chat markers `<|im_start|>`,
`<|im_end|>`, the roles `system`, `user`, `assistant` and the benchmark's words (read from the
`WORDS` list of cli/src/bench/dataset.rs, so the two never drift apart). The chat template puts
spaces around the markers so that a whitespace split finds them:
`<|im_start|> ROLE CONTENT <|im_end|> ` per message, then `<|im_start|> assistant `.

Written without the `tokenizers` Python package (plain tokenizer.json), so it also runs where only
the Rust side reads it.

Usage: python3 scripts/gpu/prefix_tokenizer.py DIR --vocab-size V [--first-word-id 1000]
       [--bos-id 128000] [--eos-id 128001] [--max-len 8192]
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKERS = ["<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|> ' + message['role'] + ' ' + message['content'] + "
            "' <|im_end|> ' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|> assistant ' }}{% endif %}")


def bench_words(source: Path) -> list:
    """The quoted strings of `const WORDS: &[&str] = &[ ... ];` in the dataset module."""
    m = re.search(r"const WORDS: &\[&str\] = &\[(.*?)\];", source.read_text(), re.S)
    if not m:
        raise SystemExit(f"no WORDS list in {source}")
    return re.findall(r'"([^"]+)"', m.group(1))


def build(vocab_size: int, first: int, bos: int, eos: int, words: list) -> dict:
    names = MARKERS + [w for w in words if w not in MARKERS]
    if len(set(names)) != len(names):
        raise SystemExit("duplicate words in the list")
    if first < 1 or first + len(names) > vocab_size or bos in range(first, first + len(names)) \
            or eos in range(first, first + len(names)) or max(bos, eos) >= vocab_size:
        raise SystemExit(f"ids {first}..{first + len(names) - 1} (and bos {bos}, eos {eos}) must fit in "
                         f"1..{vocab_size - 1} without overlapping")
    vocab = {f"t{i}": i for i in range(vocab_size)}
    for k, name in enumerate(names):
        del vocab[f"t{first + k}"]
        vocab[name] = first + k
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--first-word-id", type=int, default=1000)
    ap.add_argument("--bos-id", type=int, default=128000)
    ap.add_argument("--eos-id", type=int, default=128001)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--dataset-source", default=str(ROOT / "cli" / "src" / "bench" / "dataset.rs"))
    a = ap.parse_args()
    words = bench_words(Path(a.dataset_source))
    tok = build(a.vocab_size, a.first_word_id, a.bos_id, a.eos_id, words)
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": f"t{a.bos_id}", "eos_token": f"t{a.eos_id}", "model_max_length": a.max_len,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE}, indent=1))
    print(f"prefix tokenizer: {len(MARKERS)} markers + {len(words)} words at ids {a.first_word_id}.."
          f"{a.first_word_id + len(MARKERS) + len(words) - 1} of {a.vocab_size}, written to {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
