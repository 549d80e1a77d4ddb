"""GGUF tokenizers for compare.py: files that carry a real vocabulary in llama.cpp's metadata keys.

  make(tokenizer_dir, out_path, kind, pre, add_bos, arch="llama")
      writes a small GGUF (architecture `arch`, one tiny tensor) whose tokenizer.ggml.* keys
      describe the tokenizer.json of tokenizer_dir as llama.cpp's converter writes them:
      kind "gpt2": byte-level BPE, tokens in id order, token_type normal / control (special
      added tokens) / user-defined (other added tokens), the merges as "a b";
      kind "llama": a SentencePiece vocabulary with scores and no merges, which transformers
      rebuilds from the scores (the case of llama 2 and mistral files); for gemma2/gemma3 a token
      of two or more "▁" is written as that many spaces, as Gemma's files hold them.
  reference(path)
      the tokenizers.Tokenizer that transformers' GGUF loading builds for the file
      (AutoTokenizer.from_pretrained(dir, gguf_file=name)): the oracle.
"""
import json
import os


def _merges(model):
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def _vocab_keys(tokenizer_dir):
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        j = json.load(f)
    tokens = {i: t for t, i in j["model"]["vocab"].items()}
    types = {i: 1 for i in tokens}
    for a in j.get("added_tokens") or []:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = 3 if a["special"] else 4
    n = max(tokens) + 1
    ordered = [tokens.get(i, f"[PAD{i}]") for i in range(n)]
    return j, ordered, [types.get(i, 5) for i in range(n)]


def _special(tokenizer_dir, ordered, name):
    path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        c = json.load(f)
    t = c.get(name)
    if isinstance(t, dict):
        t = t.get("content")
    return ordered.index(t) if t in ordered else None


def make(tokenizer_dir, out_path, kind, pre, add_bos, arch="llama"):
    import gguf
    import numpy as np

    j, tokens, types = _vocab_keys(tokenizer_dir)
    w = gguf.GGUFWriter(out_path, arch)
    for k, v in {"block_count": 1, "context_length": 64, "embedding_length": 8, "feed_forward_length": 16,
                 "attention.head_count": 2, "attention.head_count_kv": 2, "vocab_size": len(tokens)}.items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if arch.startswith("gemma"):
        tokens = [" " * len(t) if len(t) > 1 and set(t) == {"\u2581"} else t for t in tokens]
    w.add_tokenizer_model(kind)
    if pre:
        w.add_tokenizer_pre(pre)
    if kind == "llama":
        # SentencePiece: byte pieces typed 6, <unk> 2; a piece's score falls with its id, as
        # sentencepiece's BPE trainer assigns them.
        types = [6 if t.startswith("<0x") and t.endswith(">") and len(t) == 6 else ty
                 for t, ty in zip(tokens, types)]
        unk = j["model"].get("unk_token")
        types = [2 if t == unk else ty for t, ty in zip(tokens, types)]
        w.add_token_scores([0.0 if ty != 1 else -float(i) for i, ty in enumerate(types)])
    else:
        w.add_token_merges(_merges(j["model"]))
    w.add_token_list(tokens)
    w.add_token_types(types)
    for name, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                      ("pad_token", w.add_pad_token_id)):
        i = _special(tokenizer_dir, tokens, name)
        if i is not None:
            add(i)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference(path):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    return t.backend_tokenizer
