#!/usr/bin/env python3
"""Checks `lora-data tokenize/detokenize` against Hugging Face tokenizers (the oracle).

  compare.py --tokenizer NAME --fixtures .fixtures/tokenizers --lora-data build/bin/lora-data

NAME is a fixture fetched by scripts/fetch-tokenizers (gpt2, llama3, llama2, qwen3, gpt4o, gemma, gemma3) or
a variant that this script derives from one of them to reach the components the real ones do
not use (added-token flags, Metaspace, Split behaviours, Digits, more normalizers, NFC/NFD),
or runs a real one on every Unicode code point.
A gguf-* NAME is a GGUF file (the real SmolLM2 one, or one gguf_vocab.py writes from a fixture):
lora-data reads its tokenizer from the metadata, and the oracle is the tokenizer transformers
builds from the same file (less any added token transformers invents past the file's vocabulary,
which the model has no embedding for).
For every corpus string it compares the ids with and without special tokens, and decode()
of those ids with and without skip_special_tokens; it also decodes random id sequences.
Prints the first mismatches (string, ours, theirs) and exits 1 if there is any.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import gguf_vocab  # noqa: E402

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def gpt2_added(j):
    n = max(t["id"] for t in j["added_tokens"]) + 1
    extra = [("<mask>", dict(lstrip=True, special=True, normalized=False)),
             ("[MASK]", dict(lstrip=True, rstrip=True, special=True, normalized=False)),
             ("ony", dict(single_word=True, normalized=False)),
             ("world", dict(single_word=True, normalized=True)),
             ("<|im_start|>", dict(normalized=False)),
             (" hello", dict(normalized=True, rstrip=True)),
             ("é", dict(special=True, normalized=False))]
    for i, (content, flags) in enumerate(extra):
        t = dict(id=n + i, content=content, single_word=False, lstrip=False, rstrip=False,
                 normalized=True, special=False)
        t.update(flags)
        j["added_tokens"].append(t)
    j["pre_tokenizer"]["add_prefix_space"] = True
    return j


def llama2_metaspace(scheme, split):
    def f(j):
        j["normalizer"] = None
        j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": split}
        j["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": split}
        j["post_processor"]["single"].append({"SpecialToken": {"id": "</s>", "type_id": 0}})
        j["post_processor"]["special_tokens"]["</s>"] = {"id": "</s>", "ids": [2], "tokens": ["</s>"]}
        return j
    return f


def phi3_added(j):
    """Phi-3's tokenizer: Llama 2's SentencePiece BPE plus its chat tokens from id 32000 (those after
    <|endoftext|> strip the whitespace on their right, as in Phi-3's tokenizer.json)."""
    names = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
             "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
    for i, content in enumerate(names):
        j["added_tokens"].append(dict(id=32000 + i, content=content, single_word=False, lstrip=False, rstrip=i > 0,
                                      normalized=False, special=True))
    return j


def llama2_norm(j):
    j["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Strip", "strip_left": True, "strip_right": True},
        {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
        {"type": "NFD"},
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    return j


def gpt2_split_a(j):
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": False},
        {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "MergedWithNext", "invert": False},
        {"type": "Split", "pattern": {"String": "e"}, "behavior": "MergedWithPrevious", "invert": False},
        BYTE_LEVEL]}
    return j


def gpt2_split_b(j):
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "Split", "pattern": {"Regex": "[aeiou]+"}, "behavior": "Contiguous", "invert": True},
        {"type": "Split", "pattern": {"Regex": "x+|\\p{P}"}, "behavior": "Removed", "invert": False},
        dict(BYTE_LEVEL, use_regex=True, add_prefix_space=True)]}
    return j


def truncate_pad(max_length, trunc_dir, fixed, multiple, pad_dir, pad_id, bos_eos=False):
    def f(j):
        j["truncation"] = {"direction": trunc_dir, "max_length": max_length, "strategy": "LongestFirst", "stride": 0}
        j["padding"] = {"strategy": {"Fixed": fixed}, "direction": pad_dir, "pad_to_multiple_of": multiple,
                        "pad_id": pad_id, "pad_type_id": 0, "pad_token": "<pad>"}
        if bos_eos:
            llama2_metaspace("first", True)(j)
        return j
    return f


def bytes_model(normalizer):
    def f(j):
        vocab = {c: i for i, c in enumerate(sorted(set(j["model"]["vocab"]) & _byte_chars()))}
        j["model"].update(vocab=vocab, merges=[])
        j.update(normalizer={"type": normalizer}, added_tokens=[], post_processor=None,
                 pre_tokenizer=BYTE_LEVEL)
        return j
    return f


def _byte_chars():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c) for c in cs}


# name: (fixture it is made from, how the tokenizer.json is changed, which corpus)
VARIANTS = {
    "gpt2-added": ("gpt2", gpt2_added, "main"),
    "llama2-metaspace-first": ("llama2", llama2_metaspace("first", True), "main"),
    "llama2-metaspace-always": ("llama2", llama2_metaspace("always", False), "main"),
    "llama2-norm": ("llama2", llama2_norm, "main"),
    "llama2-phi3": ("llama2", phi3_added, "main"),
    "gpt2-split-a": ("gpt2", gpt2_split_a, "main"),
    "gpt2-split-b": ("gpt2", gpt2_split_b, "main"),
    "gpt2-truncate-pad": ("gpt2", truncate_pad(16, "Left", 20, 8, "Right", 50256), "main"),
    "llama2-truncate-pad": ("llama2", truncate_pad(12, "Right", 9, None, "Left", 0, bos_eos=True), "main"),
    "nfc": ("gpt2", bytes_model("NFC"), "all"),
    "nfd": ("gpt2", bytes_model("NFD"), "main"),
    # Every code point through the real split patterns (\\p{L}, \\p{N}, \\p{Lu}...) and NFC.
    "qwen3-all-code-points": ("qwen3", None, "all"),
    "gpt4o-all-code-points": ("gpt4o", None, "all"),
}


# name: (fixture, tokenizer.ggml.model, tokenizer.ggml.pre, tokenizer.ggml.add_bos_token[,
# general.architecture]), or None for the real SmolLM2 file (gpt2 model, pre "smollm", 17 control
# tokens). SentencePiece files of architectures gemma2/gemma3 and phi3 get transformers' builders
# for those (Gemma's respelled spaces and merges by file order; Phi-3's prepending normalizer).
GGUF_VARIANTS = {
    "gguf-smollm2": None,
    "gguf-gpt2": ("gpt2", "gpt2", "gpt-2", None),
    "gguf-llama3": ("llama3", "gpt2", "llama-bpe", True),
    "gguf-qwen3": ("qwen3", "gpt2", "qwen2", None),
    "gguf-llama2": ("llama2", "llama", None, None),
    "gguf-gemma2": ("gemma", "llama", "default", True, "gemma2"),
    "gguf-gemma3": ("gemma3", "llama", "default", True, "gemma3"),
    "gguf-phi3": ("llama2", "llama", "default", True, "phi3"),
}
SMOLLM2 = os.path.join("models", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def prepare_gguf(name, fixtures, tmp):
    """(the .gguf file, transformers' tokenizer for it)"""
    spec = GGUF_VARIANTS[name]
    if spec is None:
        path = os.path.join(fixtures, "..", SMOLLM2)
        if not os.path.isfile(path):
            sys.exit(f"{path} is missing: run scripts/fetch-models (or scripts/setup)")
    else:
        path = os.path.join(tmp, name + ".gguf")
        gguf_vocab.make(os.path.join(fixtures, spec[0]), path, *spec[1:])
    import gguf
    n_tokens = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    j = json.loads(gguf_vocab.reference(path).to_str())
    j["added_tokens"] = [t for t in j["added_tokens"] if t["id"] < n_tokens]
    return path, Tokenizer.from_str(json.dumps(j))


def prepare(name, fixtures, tmp):
    """(what lora-data's --model gets, which corpus, the oracle tokenizer)"""
    if name in GGUF_VARIANTS:
        path, hf = prepare_gguf(name, fixtures, tmp)
        return path, "main", hf
    base, change, which = VARIANTS.get(name, (name, None, "main"))
    src = os.path.join(fixtures, base)
    if not os.path.isfile(os.path.join(src, "tokenizer.json")):
        sys.exit(f"{src}/tokenizer.json is missing: run scripts/fetch-tokenizers (or scripts/setup)")
    if change is not None:
        with open(os.path.join(src, "tokenizer.json"), encoding="utf-8") as f:
            j = change(json.load(f))
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(j, f)
        src = tmp
    return src, which, Tokenizer.from_file(os.path.join(src, "tokenizer.json"))


def run_tool(lora_data, args, lines):
    p = subprocess.run([lora_data, *args], input="".join(line + "\n" for line in lines),
                       capture_output=True, encoding="utf-8")
    if p.returncode != 0:
        sys.exit(f"lora-data {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    out = p.stdout.split("\n")  # not splitlines(): U+2028 and U+0085 may be in the text
    assert out[-1] == "", "output must end with a newline"
    assert len(out) - 1 == len(lines), f"{len(lines)} lines in, {len(out) - 1} out"
    return [json.loads(line) for line in out[:-1]]


def short(x, n=300):
    r = repr(x)
    return r if len(r) <= n else r[:n] + f"... ({len(x)} items)"


class Report:
    def __init__(self):
        self.failures = 0

    def check(self, what, text, ours, theirs):
        if ours == theirs:
            return
        self.failures += 1
        if self.failures <= 8:
            print(f"MISMATCH {what}\n  text:   {short(text)}\n  ours:   {short(ours)}\n  theirs: {short(theirs)}")


def random_id_sequences(hf, n, seed=7):
    rng = random.Random(seed)
    top = max(hf.get_vocab(with_added_tokens=True).values()) + 1
    seqs = [[rng.randrange(top) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    # Byte tokens alone decode to broken UTF-8: the replacement-character paths.
    byte_ids = [i for i in (hf.token_to_id(f"<0x{b:02X}>") for b in range(256)) if i is not None]
    if byte_ids:
        seqs += [[rng.choice(byte_ids) for _ in range(rng.randint(1, 6))] for _ in range(n // 2)]
    return seqs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--lora-data", required=True)
    a = ap.parse_args()
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, which, hf = prepare(a.tokenizer, a.fixtures, tmp)
        texts = corpus.corpus() if which == "main" else corpus.all_code_points()
        lines = [json.dumps(t) for t in texts]
        report = Report()
        ids = {}
        # The every-code-point corpora are large: one mode each (these have no special tokens to add).
        modes = (True, False) if which == "main" else (False,)
        for special in modes:
            theirs = [e.ids for e in hf.encode_batch(texts, add_special_tokens=special)]
            ours = run_tool(a.lora_data, ["tokenize", "--model", model_dir] + ([] if special else ["--no-special"]), lines)
            for t, o, h in zip(texts, ours, theirs):
                report.check(f"encode(add_special_tokens={special})", t, o, h)
            ids[special] = theirs
        # The first len(texts) sequences are encode(s, add_special_tokens=False): round trips.
        seqs = ids[False]
        if which == "main":
            seqs += ids[True] + random_id_sequences(hf, 400)
        for skip in (False, True) if which == "main" else (False,):
            theirs = hf.decode_batch(seqs, skip_special_tokens=skip)
            ours = run_tool(a.lora_data, ["detokenize", "--model", model_dir] + (["--skip-special"] if skip else []),
                            [json.dumps(s) for s in seqs])
            for s, o, h in zip(seqs, ours, theirs):
                report.check(f"decode(skip_special_tokens={skip})", s, o, h)
            if not skip:
                hf_trips = [h == t for h, t in zip(theirs, texts)]
                our_trips = [o == t for o, t in zip(ours, texts)]
                for t, o, h in zip(texts, our_trips, hf_trips):
                    report.check("decode(encode(s)) == s where HF round-trips", t, o or not h, True)
        print(f"{a.tokenizer}: {len(texts)} strings encoded (add_special_tokens={list(modes)}), "
              f"{len(seqs)} id sequences decoded: "
              f"{report.failures} mismatches with HF tokenizers; decode(encode(s)) == s for "
              f"{sum(our_trips)}/{len(texts)} strings (HF: {sum(hf_trips)}) ({time.time() - start:.1f}s)")
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
