"""Checks that no module of lib/ includes a header of a module above it (the layering that
lib/CMakeLists.txt links): exit 0 when none does, else one line per offending include."""
import pathlib
import re
import sys

# Each module and the modules it may include (itself included).
ALLOWED = {
    "util": {"util"},
    "io": {"io", "util"},
    "tokenizer": {"tokenizer", "util"},
    "recipe": {"recipe", "util"},
    "chat": {"chat", "util"},
    "data": {"data", "chat", "io", "tokenizer", "recipe", "util"},
    "track": {"track", "data", "chat", "io", "tokenizer", "recipe", "util"},
    "model": {"model", "data", "chat", "io", "tokenizer", "recipe", "util"},
    "dist": {"dist", "recipe", "util"},
    "train": {"train", "model", "dist", "track", "data", "chat", "io", "tokenizer", "recipe", "util"},
}

lib = pathlib.Path(sys.argv[1])
bad = []
for path in sorted(lib.rglob("*.[ch]pp")):
    module = path.relative_to(lib).parts[0]
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r'#include "(\w+)/', line)
        if m and m.group(1) in ALLOWED and m.group(1) not in ALLOWED[module]:
            bad.append(f"{path.relative_to(lib)}:{n}: module {module} includes {m.group(1)}/, a module above it")
if set(p.name for p in lib.iterdir() if p.is_dir()) - set(ALLOWED):
    bad.append(f"lib/ has modules this check does not know: {set(p.name for p in lib.iterdir() if p.is_dir()) - set(ALLOWED)}")
print("\n".join(bad) or f"{len(ALLOWED)} modules, no include of a module above")
sys.exit(1 if bad else 0)
