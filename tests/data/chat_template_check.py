#!/usr/bin/env python3
"""`data.chat_format: template` against transformers' apply_chat_template (the oracle).

  chat_template_check.py --lora-data BIN --model DIR|FILE.gguf --template FILE|model
                         [--kwargs JSON] [--conversations basic,reasoning,tools,bad] --work DIR

Writes conversations (multi-turn, with and without system prompts) to a JSONL file, runs
`lora-data preview --json` on a recipe with chat_format: template, and checks every example:
  - ids equal apply_chat_template(messages, tokenize=True) (transformers' tokenizer of MODEL);
  - where the template has {% generation %} tags, the trained tokens are exactly those of
    return_assistant_tokens_mask;
  - otherwise the trained tokens are lorarun's rule, recomputed here with Jinja2 and HF offsets:
    per assistant message i, from the end of the rendering of messages[:i] with
    add_generation_prompt (or, when that is not a prefix of the conversation, where the two
    part, or else where its content starts in the conversation rendered with the assistant
    contents marked) through the first end-of-turn token after it (which is trained);
  - a conversation the template raises on is rejected with the message and the template line.
Also checks that `lora-data preview` (text) marks the trained spans. Reports one line of JSON
(tests/support/oracle.py) and exits 1 naming every difference.
"""
import argparse
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import oracle  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--lora-data", required=True)
ap.add_argument("--model", required=True)
ap.add_argument("--template", required=True)
ap.add_argument("--kwargs", default="{}")
ap.add_argument("--conversations", default="basic")
ap.add_argument("--work", required=True)
a = ap.parse_args()
os.makedirs(a.work, exist_ok=True)
kwargs = json.loads(a.kwargs)

from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

if a.model.endswith(".gguf"):
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(a.model)), gguf_file=os.path.basename(a.model))
else:
    # tokenizer.json as it is, which lorarun's tokenizer follows (tests/tokenizer): the class a
    # tokenizer_config.json names may rebuild the pipeline (transformers 5's GPT2Tokenizer and
    # LlamaTokenizer do), which is not what the file says.
    tok = PreTrainedTokenizerFast.from_pretrained(a.model)
template = tok.chat_template if a.template == "model" else open(a.template, encoding="utf-8").read()
assert template, "no chat template"
generation = re.search(r"\{\%-?\s*generation\s*-?\%\}", template) is not None


def m(role, content, **extra):
    return dict(role=role, content=content, **extra)


# Keys in the order tool schemas are usually written (not sorted).
TOOLS = [{"type": "function",
          "function": {"name": "weather", "description": "The weather at a place, now.",
                       "parameters": {"type": "object",
                                      "properties": {"unit": {"type": "string", "enum": ["c", "f"]},
                                                     "city": {"type": "string", "description": "A city, e.g. Zürich"}},
                                      "required": ["city"]}}}]


def basic():
    """Multi-turn conversations, with and without a system prompt, with awkward text."""
    out = []
    texts = ["Hello!", "What is 2 + 2?", "  padded with spaces  ", "Line one\nLine two\n\nLine four",
             "Ünïcödé — “quotes”, 日本語, emoji 🙂", "tabs\tand\ttabs", "<b>html</b> & 'quotes'",
             "ends with newline\n", "numbers 12345 67890", "a"]
    for n in range(24):
        conv = []
        if n % 3 != 0:
            conv.append(m("system", ["You are terse.", "You are a helpful assistant.\nBe kind.",
                                     "  System with spaces  "][n % 3]))
        for t in range(1 + n % 4):
            conv.append(m("user", texts[(n + 2 * t) % len(texts)]))
            conv.append(m("assistant", texts[(n + 2 * t + 1) % len(texts)] + f" (turn {t})"))
        out.append({"messages": conv})
    return out


def reasoning():
    """Assistant turns with reasoning: in <think> in the content, and as reasoning_content."""
    out = []
    for n in range(8):
        conv = [m("system", "Think first.")] if n % 2 else []
        for t in range(1 + n % 3):
            conv.append(m("user", f"Question {t}: why is the sky blue?"))
            if (n + t) % 2:
                conv.append(m("assistant", f"<think>\nRayleigh scattering, step {t}.\n</think>\n\nShort waves scatter more."))
            else:
                conv.append(m("assistant", "Because of scattering.", reasoning_content=f"Consider light (turn {t})."))
        out.append({"messages": conv})
    return out


def tools():
    """Tool calls and tool results, with the tools passed to the template."""
    out = []
    for n in range(6):
        conv = [m("system", "Use tools when needed.")] if n % 2 else []
        conv.append(m("user", "Weather in Zürich and Paris?"))
        calls = [{"type": "function", "function": {"name": "weather", "arguments": {"unit": "c", "city": c}}}
                 for c in (["Zürich", "Paris"] if n % 3 else ["Zürich"])]
        conv.append(m("assistant", "" if n % 2 else "Let me check.", tool_calls=calls))
        for c in calls:
            conv.append(m("tool", json.dumps({"city": c["function"]["arguments"]["city"], "temp": 21})))
        conv.append(m("assistant", "21 °C in both."))
        if n >= 3:
            conv.append(m("user", "Thanks"))
            conv.append(m("assistant", "You're welcome."))
        out.append({"messages": conv, "tools": TOOLS})
    return out


def bad():
    """Conversations the templates that check role order raise on."""
    return [{"messages": [m("user", "one"), m("user", "two"), m("assistant", "three")]},
            {"messages": [m("system", "s"), m("assistant", "first"), m("user", "then")]}]


docs = []
for name in a.conversations.split(","):
    docs += {"basic": basic, "reasoning": reasoning, "tools": tools, "bad": bad}[name]()
# Keys in the order written here, not sorted (tools' "type" before "function", arguments as given):
# lorarun keeps a document's key order, as transformers does.
data = os.path.join(a.work, "data.jsonl")
with open(data, "w", encoding="utf-8") as f:
    for d in docs:
        f.write(json.dumps(d, ensure_ascii=False) + "\n")
with open(data, encoding="utf-8") as f:
    docs = [json.loads(line) for line in f]

recipe = os.path.join(a.work, "recipe.yaml")
chat_template = "" if a.template == "model" else f", chat_template: {json.dumps(os.path.abspath(a.template))}"
with open(recipe, "w") as f:
    f.write(f"model: {{path: {json.dumps(os.path.abspath(a.model))}}}\n"
            f"data: {{source: jsonl, path: {json.dumps(data)}, format: chat, chat_format: template{chat_template}, "
            f"chat_template_kwargs: {json.dumps(kwargs)}, max_length: 100000}}\n")
p = subprocess.run([a.lora_data, "preview", str(len(docs)), recipe, "--json"], capture_output=True, text=True)
if p.returncode != 0:
    sys.exit(f"lora-data preview failed ({p.returncode}): {p.stderr.strip()}")
ours = [json.loads(line) for line in p.stdout.splitlines()]
assert len(ours) == len(docs), (len(ours), len(docs))


def render(messages, tools, add_generation_prompt):
    return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=add_generation_prompt, **kwargs)


def eot_token():
    """lorarun's end-of-turn token, found the same way: the first added token after a probe reply."""
    reply = "lorarun probe reply"
    for conv in ([m("user", "lorarun probe question"), m("assistant", reply)],
                 [m("system", "lorarun probe system"), m("user", "lorarun probe question"), m("assistant", reply)]):
        try:
            text = render(conv, None, False)
        except Exception:
            continue
        at = text.rfind(reply) + len(reply)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        added = set(tok.added_tokens_decoder)
        for i, (s, _) in zip(enc["input_ids"], enc["offset_mapping"]):
            if s >= at and i in added:
                return tok.convert_ids_to_tokens(i)
    return None


def by_prefix(messages, tools, text, i):
    """Where assistant message i's turn starts by the rendering of the messages before it."""
    try:
        prefix = render(messages[:i], tools, True)
    except Exception:
        return None
    if text.startswith(prefix):
        return len(prefix)
    try:
        history = render(messages[:i], tools, False) if i else ""
    except Exception:
        return None
    if not text.startswith(history):
        return None
    part = next((k for k, (x, y) in enumerate(zip(prefix, text)) if x != y), min(len(prefix), len(text)))
    return max(part, len(history))


def by_marks(messages, tools, text, assistants):
    """(start, end) of each assistant content, rendered between two noncharacters, or None."""
    wrapped = [dict(msg) for msg in messages]
    for i in assistants:
        if not isinstance(wrapped[i].get("content"), str):
            return None
        wrapped[i]["content"] = "\ufdd2" + wrapped[i]["content"] + "\ufdd3"
    try:
        w = render(wrapped, tools, False)
    except Exception:
        return None
    plain, turns = "", []
    for ch in w:
        if ch == "\ufdd2":
            turns.append([len(plain), None])
        elif ch == "\ufdd3":
            turns[-1][1] = len(plain)
        else:
            plain += ch
    return [tuple(t) for t in turns] if plain == text and len(turns) == len(assistants) else None


def overlap(offsets, spans):
    """transformers' assistant mask rule: tokens overlapping a span."""
    mask, k = [0] * len(offsets), 0
    for t, (s, e) in enumerate(offsets):
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if e > spans[k][0]:
            mask[t] = 1
    return mask


eot = None if generation else eot_token()
failures, compared, trained_spans, rejected = [], 0, 0, 0
for n, (doc, got) in enumerate(zip(docs, ours)):
    messages, tools_ = doc["messages"], doc.get("tools")
    try:
        out = tok.apply_chat_template(messages, tools=tools_, chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=generation, **kwargs)
    except Exception as e:  # the template raised: lorarun rejects the document, naming the line
        msg = str(e)
        reason = got.get("rejected", "")
        if not (msg in reason and re.search(r"line \d+: ", reason)):
            failures.append(f"#{n}: transformers raised {msg!r}; lorarun: {reason or 'no rejection'!r}")
        rejected += 1
        continue
    if "rejected" in got:
        failures.append(f"#{n}: rejected by lorarun ({got['rejected']}) but not by transformers")
        continue
    compared += 1
    ids = list(out["input_ids"])
    if got["ids"] != ids:
        first = next((i for i, (x, y) in enumerate(zip(got["ids"], ids)) if x != y), min(len(ids), len(got["ids"])))
        failures.append(f"#{n}: ids differ from token {first}: ours {got['ids'][first:first + 8]}, "
                        f"transformers {ids[first:first + 8]} ({tok.decode(ids[max(0, first - 4):first + 4])!r})")
        continue
    trained = [int(label != -100) for label in got["labels"]]
    if generation:
        expected = list(out["assistant_masks"])
    else:
        text = render(messages, tools_, False)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert list(enc["input_ids"]) == ids
        spans, marks = [], None
        assistants = [i for i, msg in enumerate(messages) if msg["role"] == "assistant"]
        for k, i in enumerate(assistants):
            start = by_prefix(messages, tools_, text, i)
            frm = start
            if start is None:
                if marks is None:
                    marks = by_marks(messages, tools_, text, assistants) or []
                if marks:
                    start, frm = marks[k]
            assert start is not None, f"#{n}: assistant message {i} cannot be located"
            end = text.index(eot, frm) + len(eot)
            spans.append((start, end))
        expected = overlap(enc["offset_mapping"], spans)
        # Each span's end-of-turn token is trained.
        eot_id = tok.convert_tokens_to_ids(eot)
        for s, e in spans:
            last = max(t for t, (ts, te) in enumerate(enc["offset_mapping"]) if ts < e and te > s)
            if ids[last] != eot_id or not trained[last]:
                failures.append(f"#{n}: the span ending at {e} does not end in a trained {eot}")
    trained_spans += sum(1 for i in range(len(expected)) if expected[i] and (i == 0 or not expected[i - 1]))
    if trained != expected:
        diff = [i for i in range(len(ids)) if trained[i] != expected[i]]
        failures.append(f"#{n}: trained tokens differ at {diff[:10]}: ours {[trained[i] for i in diff[:10]]} "
                        f"({tok.decode([ids[i] for i in diff[:10]])!r})")
    assert got["labels"] == [i if t else -100 for i, t in zip(ids, trained)]

# The text preview marks the trained spans.
p = subprocess.run([a.lora_data, "preview", "1", recipe], capture_output=True, text=True, env=dict(os.environ, NO_COLOR="1"))
if p.returncode != 0 or "⟦" not in p.stdout or "trained" not in p.stdout:
    failures.append(f"lora-data preview (text) shows no trained span: {p.stdout[:300]!r} {p.stderr[:300]!r}")

for f in failures:
    print("FAIL", f)
summary = dict(conversations=len(docs), compared=compared, rejected=rejected, trained_spans=trained_spans,
               mismatches=len(failures), generation_tags=generation, eot=eot)
print(json.dumps(summary, ensure_ascii=False))
oracle.report(**summary)
sys.exit(1 if failures else 0)
