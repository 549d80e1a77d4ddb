#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses (scripts/fuzz runs it; nothing is committed).

  make_seeds.py OUT_DIR [FIXTURES_DIR]

OUT_DIR/safetensors: small valid files (every dtype, scalars, empty tensors, metadata, padded
  headers) and a few broken ones.
OUT_DIR/tokenizer_json: small tokenizer.json files cut from the real fixtures (the first merges
  and the tokens they need, the byte alphabet, a few added tokens), variants that reach the
  components the fixtures do not use, and a few inputs with a tokenizer_config.json part.
OUT_DIR/tokenizer_encode: texts and id sequences for the fixed real tokenizers.
"""
import json
import os
import struct
import sys

SEP = "\n---\n"


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8"))


# ---- safetensors --------------------------------------------------------------------------

SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def safetensors(tensors, metadata=None, pad=True, header_extra=""):
    """tensors: [(name, dtype, shape)]; data is a byte counter so that every tensor differs."""
    header, offset = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = SIZES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")) + header_extra
    if pad:
        text += " " * ((8 - len(text) % 8) % 8)
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(i % 251 for i in range(offset))


def raw_safetensors(header, data_bytes):
    """A file with exactly this header (consistent or not) and data_bytes zero bytes."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data_bytes)


def safetensors_seeds(out):
    d = os.path.join(out, "safetensors")
    seeds = {
        "empty": safetensors([]),
        "metadata": safetensors([], {"format": "pt", "note": "é"}),
        "one_f32": safetensors([("w", "F32", [2, 3])]),
        "all_dtypes": safetensors([(f"t_{k.lower()}", k, [3]) for k in SIZES]),
        "scalar_and_empty": safetensors([("s", "F64", []), ("e", "F16", [0, 4]), ("z", "I8", [5, 0])]),
        "lora": safetensors([("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "BF16", [4, 8]),
                             ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", "BF16", [8, 4])],
                            {"format": "pt"}),
        "unpadded": safetensors([("a", "U8", [7]), ("b", "I32", [1, 1, 2])], pad=False),
        "overlap": raw_safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12),
        "truncated": safetensors([("w", "F32", [4, 4])])[:-9],
    }
    for name, data in seeds.items():
        write(os.path.join(d, name), data)


# ---- tokenizer.json -----------------------------------------------------------------------

def byte_chars():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def shrink(j, merges=150, low_ids=120, added=8):
    """The first `merges` merges of j, the tokens they need, ids < low_ids, the byte alphabet."""
    m = j["model"]
    vocab = m["vocab"]
    keep = {t for t, i in vocab.items() if i < low_ids}
    keep |= {c for c in byte_chars() if c in vocab}
    keep |= {f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" in vocab}
    kept_merges = []
    for e in m["merges"][:merges]:
        a, b = e if isinstance(e, list) else e.split(" ", 1)
        if a + b in vocab:
            keep |= {a, b, a + b}
            kept_merges.append(e)
    m = dict(m, vocab={t: vocab[t] for t in keep}, merges=kept_merges)
    out = dict(j, model=m, added_tokens=j["added_tokens"][:added])
    if isinstance(out.get("post_processor"), dict) and out["post_processor"].get("type") == "TemplateProcessing":
        out["post_processor"] = dict(out["post_processor"], pair=[])
    return out


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}

# Changes of a shrunk fixture that reach the components and options the fixtures leave out.
VARIANTS = {
    "gpt2": {
        "added_flags": lambda j: j["added_tokens"].extend([
            dict(id=900, content="<mask>", single_word=False, lstrip=True, rstrip=False, normalized=False, special=True),
            dict(id=901, content="[MASK]", single_word=False, lstrip=True, rstrip=True, normalized=False, special=True),
            dict(id=902, content="ony", single_word=True, lstrip=False, rstrip=False, normalized=False, special=False),
            dict(id=903, content=" hello", single_word=False, lstrip=False, rstrip=True, normalized=True, special=False)]),
        "split_a": lambda j: j.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": False},
            {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "MergedWithNext", "invert": False},
            {"type": "Split", "pattern": {"String": "e"}, "behavior": "MergedWithPrevious", "invert": False},
            BYTE_LEVEL]}),
        "split_b": lambda j: j.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "Split", "pattern": {"Regex": "[aeiou]+"}, "behavior": "Contiguous", "invert": True},
            {"type": "Split", "pattern": {"Regex": "x+|\\p{P}"}, "behavior": "Removed", "invert": False},
            dict(BYTE_LEVEL, use_regex=True, add_prefix_space=True)]}),
        "truncate_pad": lambda j: j.update(
            truncation={"direction": "Left", "max_length": 16, "strategy": "LongestFirst", "stride": 0},
            padding={"strategy": {"Fixed": 20}, "direction": "Right", "pad_to_multiple_of": 8,
                     "pad_id": 50256, "pad_type_id": 0, "pad_token": "<pad>"}),
        "nfc_bert": lambda j: j.update(
            normalizer={"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Strip", "strip_left": True, "strip_right": False}]},
            post_processor={"type": "Sequence", "processors": [
                {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
                {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0], "trim_offsets": True, "add_prefix_space": False}]}),
    },
    "llama2": {
        "metaspace_first": lambda j: j.update(
            normalizer=None,
            pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True},
            decoder={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}),
        "metaspace_legacy": lambda j: j.update(
            normalizer={"type": "NFD"},
            pre_tokenizer={"type": "Metaspace", "replacement": "▁", "add_prefix_space": True},
            decoder={"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"Regex": "▁+"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 1}]}),
        "norm": lambda j: j.update(normalizer={"type": "Sequence", "normalizers": [
            {"type": "Strip", "strip_left": True, "strip_right": True},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
            {"type": "NFD"}, {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            truncation={"direction": "Right", "max_length": 12, "strategy": "LongestFirst", "stride": 0},
            padding={"strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": None,
                     "pad_id": 0, "pad_type_id": 0, "pad_token": "<unk>"}),
        "bert": lambda j: j.update(post_processor={"type": "BertProcessing", "sep": ["</s>", 2], "cls": ["<s>", 1]}),
    },
}


def subword_model():
    """A WordPiece-like BPE: continuing_subword_prefix, end_of_word_suffix, unfused unk."""
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "c": 3, "##a": 4, "##b": 5, "##c": 6, "##b</w>": 7, "##c</w>": 8,
             "a##b": 9, "ab": 10, "##bc</w>": 11, "a</w>": 12}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "Split", "pattern": {"String": " "},
                                                             "behavior": "Removed", "invert": False},
            "post_processor": None, "decoder": {"type": "Fuse"},
            "model": {"type": "BPE", "dropout": None, "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                      "end_of_word_suffix": "</w>", "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": True, "vocab": vocab, "merges": [["a", "##b"], "##b ##c</w>"]}}


def tokenizer_seeds(out, fixtures):
    d = os.path.join(out, "tokenizer_json")
    dump = lambda j: json.dumps(j, ensure_ascii=False, separators=(",", ":"))
    write(os.path.join(d, "subword"), dump(subword_model()))
    write(os.path.join(d, "minimal"), '{"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]}}')
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}, "pad_token": None,
              "add_bos_token": True, "add_eos_token": False}
    for name in ["gpt2", "llama2", "llama3", "qwen3", "gpt4o"]:
        path = os.path.join(fixtures, name, "tokenizer.json")
        if not os.path.isfile(path):
            print(f"make_seeds: {path} missing (scripts/fetch-tokenizers); its seeds are skipped", file=sys.stderr)
            continue
        with open(path, encoding="utf-8") as f:
            full = json.load(f)
        write(os.path.join(d, f"{name}_tiny"), dump(shrink(full, merges=20, low_ids=40, added=3)))
        small = shrink(full)
        write(os.path.join(d, f"{name}_small"), dump(small))
        write(os.path.join(d, f"{name}_small_config"), dump(small) + SEP + dump(config) + SEP + "Hello <s>world</s>")
        for variant, change in VARIANTS.get(name, {}).items():
            j = json.loads(dump(shrink(full, merges=60, low_ids=60, added=4)))
            change(j)
            write(os.path.join(d, f"{name}_{variant}"), dump(j))


# ---- texts and ids for the real tokenizers ------------------------------------------------

TEXTS = ["Hello world", " Hello  world \n", "It's 12345 o'clock, isn't it?", "<s>Hi</s><unk>",
         "<|endoftext|>text<|begin_of_text|>", "naïve cafe\u0301 東京 😀👍🏽", "\u0000\t\r\n\u2028\u180e",
         "def f(x):\n    return x**2\n", "ꙮ\U0010fffd\ue000", "▁▁hello Ġ Ċ <0x0A>"]


def encode_seeds(out):
    d = os.path.join(out, "tokenizer_encode")
    n = 0
    for selector in range(3):
        for text in TEXTS:
            write(os.path.join(d, f"text_{n}"), bytes([selector]) + text.encode("utf-8"))
            n += 1
        ids = [0, 1, 2, 3, 13, 29871, 50256, 128000, 128009, 300, 259, -1, 2**31 - 1]
        write(os.path.join(d, f"ids_{selector}"), bytes([selector | 4]) + struct.pack(f"<{len(ids)}i", *ids))
    write(os.path.join(d, "invalid_utf8"), b"\x01abc\xff\xfe\xed\xa0\x80")


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    out = sys.argv[1]
    fixtures = sys.argv[2] if len(sys.argv) == 3 else ".fixtures/tokenizers"
    safetensors_seeds(out)
    tokenizer_seeds(out, fixtures)
    encode_seeds(out)


if __name__ == "__main__":
    main()
