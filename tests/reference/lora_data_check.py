#!/usr/bin/env python3
"""Checks `lora-data stats --json` / `preview --json` against HF tokenizers (the oracle).

  lora_data_check.py stats|preview MODEL_DIR DATA.jsonl TEMPLATE MAX_LENGTH truncate|skip OURS

For `format: instruction` with `response_field: output`: the prompt is TEMPLATE with its {field}
placeholders filled ({{ and }} are literal braces), encoded with the tokenizer's special tokens;
the response is encoded without them and followed by EOS. Labels are -100 on the prompt and the
ids on the response + EOS. Percentiles are nearest-rank. Exits 1 naming every difference.
"""
import json
import os
import re
import sys

from tokenizers import Tokenizer


def load_docs(path):
    """The non-blank lines of a JSONL file, parsed (None where not a JSON object)."""
    docs = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            if not line.strip(" \t\r\n"):
                continue
            try:
                doc = json.loads(line)
            except ValueError:
                doc = None
            docs.append(doc if isinstance(doc, dict) else None)
    return docs


def render(template, doc):
    """The prompt text, or None when a placeholder's field is missing or not a string."""
    out = ""
    for literal, field in re.findall(r"(\{\{|\}\}|[^{}]+)|\{([^{}]+)\}", template):
        if field:
            if not isinstance(doc.get(field), str):
                return None
            out += doc[field]
        else:
            out += {"{{": "{", "}}": "}"}.get(literal, literal)
    return out


class Oracle:
    def __init__(self, model_dir):
        self.tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            eos = json.load(f)["eos_token"]
        self.eos = self.tok.token_to_id(eos if isinstance(eos, str) else eos["content"])

    def untruncated(self, template, doc):
        """(ids, labels) of one document, or None when it is a bad document."""
        if doc is None:
            return None
        prompt = render(template, doc)
        response = doc.get("output")
        if prompt is None or not isinstance(response, str) or not response:
            return None
        p = self.tok.encode(prompt).ids
        r = self.tok.encode(response, add_special_tokens=False).ids + [self.eos]
        return p + r, [-100] * len(p) + r


def build(example, max_length, overlong):
    """What training gets: (ids, labels), "overlong", or None (bad document)."""
    if example is None:
        return None
    ids, labels = example
    if len(ids) > max_length:
        if overlong == "skip":
            return "overlong"
        ids, labels = ids[:max_length], labels[:max_length]
    return None if all(l == -100 for l in labels) else (ids, labels)


def percentile(sorted_values, p):
    return sorted_values[max(-(-p * len(sorted_values) // 100) - 1, 0)]


def expected_stats(oracle, docs, template, max_length, overlong):
    wide = [oracle.untruncated(template, d) for d in docs]
    built = [build(w, max_length, overlong) for w in wide]
    lengths = sorted(len(w[0]) for w in wide if w is not None)
    examples = [b for b in built if isinstance(b, tuple)]
    return {
        "documents": len(docs),
        "examples": len(examples),
        "bad_documents": sum(b is None for b in built),
        "overlong": sum(n > max_length for n in lengths),
        "token_length": {"p50": percentile(lengths, 50), "p90": percentile(lengths, 90),
                         "p99": percentile(lengths, 99), "max": lengths[-1]} if lengths else None,
        "trained_tokens": sum(sum(l != -100 for l in labels) for _, labels in examples),
    }


def check_stats(oracle, docs, template, max_length, overlong, ours_path):
    with open(ours_path) as f:
        ours = json.load(f)
    want = expected_stats(oracle, docs, template, max_length, overlong)
    problems = [f"{k}: ours {ours.get(k)!r}, HF tokenizers {v!r}" for k, v in want.items() if ours.get(k) != v]
    print("expected", json.dumps(want))
    return problems


def check_preview(oracle, docs, template, max_length, overlong, ours_path):
    problems = []
    with open(ours_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    for n, line in enumerate(lines):
        pos = line["position"]
        if pos != n:
            problems.append(f"line {n}: position {pos}, expected {n} (file order)")
            continue
        want = build(oracle.untruncated(template, docs[pos]), max_length, overlong)
        if not isinstance(want, tuple):
            if "rejected" not in line:
                problems.append(f"#{pos}: ours built an example, HF tokenizers' rules reject it ({want or 'bad'})")
            continue
        if "rejected" in line:
            problems.append(f"#{pos}: ours rejected it ({line['rejected']}), expected an example")
        elif (line["ids"], line["labels"]) != want:
            problems.append(f"#{pos}: ids/labels differ:\n  ours {line['ids']}\n       {line['labels']}\n"
                            f"  want {want[0]}\n       {want[1]}")
    return problems


def main():
    mode, model_dir, data, template, max_length, overlong, ours = sys.argv[1:8]
    oracle, docs = Oracle(model_dir), load_docs(data)
    check = check_stats if mode == "stats" else check_preview
    problems = check(oracle, docs, template, int(max_length), overlong, ours)
    for p in problems:
        print("MISMATCH", p)
    print(f"lora-data {mode}: {len(problems)} mismatches")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
