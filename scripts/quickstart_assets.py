"""Makes the quickstart's dataset (run with .venv's python; data preparation, not product).

The task is one no pretrained model can know: order codes of a made-up shop, "Lumen & Quill".
An order such as "3 red chairs and 2 blue lamps" has the code LQ-3RED-CHR+2BLU-LMP: the shop's
prefix, then per item the quantity, a 3-letter colour code and a 3-letter item code. The
combinations of the held-out set never occur in training, so the held-out loss shows whether the
rule was learnt, not the examples.

usage: quickstart_assets.py OUT_DIR
  OUT_DIR/train.jsonl    {"messages": [user, assistant]}: what lora-data imports into FerretDB
  OUT_DIR/heldout.jsonl  {"prompt": ChatML up to the answer, "answer": code + "<|im_end|>\n"}, as trained: lora-eval
  OUT_DIR/heldout_chat.jsonl the same 48 questions as chat documents: the recipe's eval split
  OUT_DIR/prompt_N.txt   three held-out prompts (ChatML) for lora-generate, N = 0, 1, 2, and
  OUT_DIR/prompt_N.expected their right answers
  OUT_DIR/pairs.jsonl    {"prompt": [user], "chosen": [assistant: the code], "rejected": [assistant: a near
                         miss]}: configs/smollm2-dpo.yaml's preference pairs (scripts/preference-example)
  OUT_DIR/heldout_pairs.jsonl the held-out questions as pairs, their near misses drawn alike
  OUT_DIR/answers.jsonl  {"prompt": [user], "completion": [assistant], "label": true|false}: each pair's two
                         answers marked right or wrong (configs/smollm2-kto.yaml's data, TRL's unpaired form)
  OUT_DIR/heldout_answers.jsonl the held-out pairs' answers alike
"""
import itertools
import json
import os
import random
import sys

COLOURS = {"red": "RED", "blue": "BLU", "green": "GRN", "black": "BLK", "white": "WHT", "yellow": "YEL"}
ITEMS = {"chair": "CHR", "lamp": "LMP", "table": "TBL", "desk": "DSK", "shelf": "SHF", "sofa": "SFA",
         "rug": "RUG", "clock": "CLK"}
PLURAL = {"shelf": "shelves", "sofa": "sofas"}
ASKS = ["Write the order code for: {}", "Order code for {}?", "What is the Lumen & Quill order code for {}?"]


def phrase(n, colour, item):
    return f"{n} {colour} {item if n == 1 else PLURAL.get(item, item + 's')}"


def order(rng, pairs):
    """One or two items, each a (colour, item) of `pairs`: (the order in words, its code)."""
    lines = rng.sample(pairs, rng.choice((1, 2)))
    words, codes = [], []
    for colour, item in lines:
        n = rng.randint(1, 9)
        words.append(phrase(n, colour, item))
        codes.append(f"{n}{COLOURS[colour]}-{ITEMS[item]}")
    return " and ".join(words), "LQ-" + "+".join(codes)


def near_miss(rng, code):
    """The code with one thing wrong: an item's colour or item code swapped for another, or its quantity."""
    items = code[3:].split("+")
    k = rng.randrange(len(items))
    n, colour_item = items[k][0], items[k][1:]
    colour, item = colour_item.split("-")
    what = rng.choice(("colour", "item", "quantity"))
    if what == "colour":
        colour = rng.choice([c for c in COLOURS.values() if c != colour])
    elif what == "item":
        item = rng.choice([i for i in ITEMS.values() if i != item])
    else:
        n = str(rng.choice([q for q in range(1, 10) if str(q) != n]))
    items[k] = f"{n}{colour}-{item}"
    return "LQ-" + "+".join(items)


def write_pairs(path, rng, questions):
    with open(path, "w") as f:
        for question, code in questions:
            f.write(json.dumps({"prompt": [{"role": "user", "content": question}],
                                "chosen": [{"role": "assistant", "content": code}],
                                "rejected": [{"role": "assistant", "content": near_miss(rng, code)}]}) + "\n")


def write_answers(pairs_path, path):
    """Each pair of `pairs_path` as two labelled answers: the code right (true), the near miss wrong."""
    with open(pairs_path) as f, open(path, "w") as out:
        for line in f:
            pair = json.loads(line)
            for key, right in (("chosen", True), ("rejected", False)):
                out.write(json.dumps({"prompt": pair["prompt"], "completion": pair[key], "label": right}) + "\n")


def chatml_prompt(question):
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = random.Random(7)
    pairs = list(itertools.product(COLOURS, ITEMS))
    rng.shuffle(pairs)
    held_pairs, train_pairs = pairs[:8], pairs[8:]  # 8 colour/item pairs never seen in training
    trained = []
    with open(os.path.join(out, "train.jsonl"), "w") as f:
        for _ in range(480):
            words, code = order(rng, train_pairs)
            question = rng.choice(ASKS).format(words)
            trained.append((question, code))
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": code}]}) + "\n")
    held = []
    for _ in range(48):
        words, code = order(rng, held_pairs)
        held.append((rng.choice(ASKS).format(words), code))
    with open(os.path.join(out, "heldout.jsonl"), "w") as f:
        for question, code in held:
            f.write(json.dumps({"prompt": chatml_prompt(question), "answer": code + "<|im_end|>\n"}) + "\n")
    with open(os.path.join(out, "heldout_chat.jsonl"), "w") as f:
        for question, code in held:
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": code}]}) + "\n")
    # (their own generator: the files above stay as they were)
    write_pairs(os.path.join(out, "pairs.jsonl"), random.Random(11), trained)
    write_pairs(os.path.join(out, "heldout_pairs.jsonl"), random.Random(12), held)
    for name in ("", "heldout_"):
        write_answers(os.path.join(out, f"{name}pairs.jsonl"), os.path.join(out, f"{name}answers.jsonl"))
    for i, (question, code) in enumerate(held[:3]):
        with open(os.path.join(out, f"prompt_{i}.txt"), "w") as f:
            f.write(chatml_prompt(question))
        with open(os.path.join(out, f"prompt_{i}.expected"), "w") as f:
            f.write(code + "\n")


if __name__ == "__main__":
    main()
