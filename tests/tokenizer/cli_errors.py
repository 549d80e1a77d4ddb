#!/usr/bin/env python3
"""lora-data on bad input: exit 1 (78 for what running it again cannot change: a model that is not
there) and one line `lora-data: error: ...` naming the problem."""
import argparse
import os
import subprocess
import sys
import tempfile

ap = argparse.ArgumentParser()
ap.add_argument("--fixtures", required=True)
ap.add_argument("--lora-data", required=True)
a = ap.parse_args()
failures = 0


def expect(args, stdin, needle, files=None, status=1):
    global failures
    with tempfile.TemporaryDirectory() as d:
        for name, text in (files or {}).items():
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
        args = [x.replace("{tmp}", d) for x in args]
        p = subprocess.run([a.lora_data, *args], input=stdin, capture_output=True, text=True)
    lines = p.stderr.strip().split("\n")
    ok = p.returncode == status and len(lines) == 1 and lines[0].startswith("lora-data: error: ") and needle in lines[0]
    print(("ok    " if ok else "FAIL  ") + " ".join(args) + f" -> {p.returncode}: {p.stderr.strip()!r}")
    failures += not ok


expect(["tokenize", "--model", "/nonexistent/model"], "", "does not exist", status=78)
expect(["tokenize", "--model", "{tmp}"], "", "tokenizer.json: not found")
expect(["tokenize", "--model", "{tmp}"], "", "not valid JSON", {"tokenizer.json": '{"model": {"type": "BPE", "vo'})
expect(["tokenize", "--model", "{tmp}"], "", "pre_tokenizer type 'Whitespace' is not supported",
       {"tokenizer.json": '{"model": {"type": "BPE", "vocab": {}, "merges": []}, "pre_tokenizer": {"type": "Whitespace"}}'})
expect(["tokenize", "--model", "{tmp}"], "", "model type 'WordPiece' is not supported",
       {"tokenizer.json": '{"model": {"type": "WordPiece", "vocab": {}}}'})
expect(["tokenize", "--model", "{tmp}"], "", "model.vocab must be an object", {"tokenizer.json": '{"model": {"type": "BPE", "vocab": []}}'})
expect(["tokenize", "--model", "{tmp}"], "", "must be an integer", {"tokenizer.json": '{"model": {"type": "BPE", "vocab": {"a": "x"}}}'})
gpt2 = os.path.join(a.fixtures, "gpt2")
if os.path.isdir(gpt2):
    expect(["tokenize", "--model", gpt2], "hello\n", "stdin line 1: not a JSON string literal")
    expect(["detokenize", "--model", gpt2], "[1, 2, \"x\"]\n", "stdin line 1: not a JSON array of integer ids")
    p = subprocess.run([a.lora_data, "tokenize", "--raw", "--model", gpt2], input="Hello world\n",
                       capture_output=True, text=True)
    ok = p.returncode == 0 and p.stdout == "[15496,995]\n"
    print(("ok    " if ok else "FAIL  ") + f"tokenize --raw -> {p.stdout!r}")
    failures += not ok
print(f"lora-data errors: {failures} failed")
sys.exit(1 if failures else 0)
