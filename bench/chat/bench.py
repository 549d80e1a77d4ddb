#!/usr/bin/env python3
"""Conversations/s rendered with a model's own chat template and tokenized: lorarun's
`lora-data stats` (chat_format: template: render, tokenize with offsets, locate the trained turns)
against transformers' apply_chat_template(messages, tools=…, tokenize=True) on the same documents,
in the same run, one thread each.

  .venv/bin/python bench/chat/bench.py --lora-data build/bin/lora-data --model .fixtures/tokenizers/qwen3

The documents: multi-turn conversations with a system prompt, tool calls and tool results, and
reasoning in some assistant turns (N of them, --docs). Ours is timed as the whole command (process
start and tokenizer load included); transformers' from after the tokenizer is loaded, so the
ratio is a lower bound. Prints one line per side and the ratio; the figures are reported on the
oracle line too.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "support"))
import oracle  # noqa: E402

TOOLS = [{"type": "function",
          "function": {"name": "weather", "description": "The weather at a place, now.",
                       "parameters": {"type": "object",
                                      "properties": {"city": {"type": "string", "description": "A city"}},
                                      "required": ["city"]}}}]


def conversation(n):
    msgs = [{"role": "system", "content": f"You are assistant number {n}. Be brief."}]
    for t in range(3):
        msgs.append({"role": "user", "content": f"Question {t} of conversation {n}: what is {t} + {n}?"})
        if t == 1:
            msgs.append({"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                                          "arguments": {"city": "Zürich"}}}]})
            msgs.append({"role": "tool", "content": json.dumps({"city": "Zürich", "temp": 21})})
        msgs.append({"role": "assistant", "content": f"It is {t + n}. " * (1 + n % 5),
                     "reasoning_content": "Adding the two numbers." if t == 2 else None})
    return {"messages": [{k: v for k, v in m.items() if v is not None} for m in msgs], "tools": TOOLS}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lora-data", required=True)
    p.add_argument("--model", required=True, help="a tokenizer directory whose tokenizer_config.json has a chat template")
    p.add_argument("--docs", type=int, default=2000)
    a = p.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"
    docs = [conversation(n) for n in range(a.docs)]
    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "data.jsonl")
        with open(data, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        recipe = os.path.join(work, "recipe.yaml")
        with open(recipe, "w") as f:
            f.write(f"model: {{path: {json.dumps(os.path.abspath(a.model))}}}\n"
                    f"data: {{source: jsonl, path: {json.dumps(data)}, format: chat, chat_format: template, "
                    f"max_length: 100000, prefetch: 1}}\n")
        start = time.perf_counter()
        r = subprocess.run([a.lora_data, "stats", recipe, "--json"], capture_output=True, encoding="utf-8")
        ours = time.perf_counter() - start
        if r.returncode != 0:
            sys.exit(f"lora-data stats failed: {r.stderr.strip()}")
        stats = json.loads(r.stdout)

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    start = time.perf_counter()
    tokens = 0
    for d in docs:
        tokens += len(tok.apply_chat_template(d["messages"], tools=d["tools"], tokenize=True, return_dict=True)["input_ids"])
    theirs = time.perf_counter() - start
    print(f"lorarun lora-data stats: {a.docs / ours:.0f} conversations/s ({ours:.2f} s, load included; "
          f"{json.dumps(stats)[:160]})")
    print(f"transformers apply_chat_template: {a.docs / theirs:.0f} conversations/s ({theirs:.2f} s, {tokens} tokens)")
    print(f"ratio lorarun / transformers: {theirs / ours:.2f}x")
    oracle.report(docs=a.docs, ours_seconds=ours, transformers_seconds=theirs, ratio=theirs / ours, tokens=tokens)


if __name__ == "__main__":
    main()
