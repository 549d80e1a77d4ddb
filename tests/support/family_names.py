"""Checks that the model families' names - each model_type and GGUF architecture of the table in
lib/model/families.cpp - are spelled, as string literals, in that file alone: a family is one
table entry, and the rest of lib/ asks the table for its traits. Exit 0, else one line per literal
found elsewhere. The few literals that name something else (a tokenizer model, a chat template)
are listed below with why."""
import pathlib
import re
import sys

# (file under lib/, literal): what it names instead of a family.
NOT_FAMILIES = {
    ("recipe/recipe.hpp", "mistral"): "data.chat_format: mistral, a chat template (the recipe's contract)",
    ("tokenizer/gguf_vocab.cpp", "qwen2"): "tokenizer.ggml.pre's name of a pre-tokenizer",
    ("tokenizer/gguf_vocab.cpp", "gpt2"): "tokenizer.ggml.model's name of byte-level BPE",
    ("tokenizer/gguf_vocab.cpp", "llama"): "tokenizer.ggml.model's name of SentencePiece",
    ("model/gguf_export.cpp", "gpt2"): "tokenizer.ggml.model's name of byte-level BPE",
}

lib = pathlib.Path(sys.argv[1])
table = (lib / "model" / "families.cpp").read_text()
names = set(re.findall(r'\.(?:model_type|gguf) = "([^"]+)"', table))
if len(names) < 9:
    sys.exit(f"found only {sorted(names)} in lib/model/families.cpp: this check no longer reads its table")
bad = []
for path in sorted(lib.rglob("*.[ch]pp")):
    rel = path.relative_to(lib).as_posix()
    if rel == "model/families.cpp":
        continue
    for n, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("//", 1)[0]  # (comments may name a family)
        for literal in re.findall(r'"([^"\\]*)"', code):
            if literal in names and (rel, literal) not in NOT_FAMILIES:
                bad.append(f'lib/{rel}:{n}: "{literal}" spells a family: ask lib/model/families.hpp for its traits')
for line in bad:
    print(line)
sys.exit(1 if bad else 0)
