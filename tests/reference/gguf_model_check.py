"""GGUF models in transformers, the reference for tests/model/test_gguf_model.cpp.

  gguf_model_check.py logits FILE.gguf OUT.safetensors
      loads FILE with transformers' own GGUF loader (AutoModelForCausalLM.from_pretrained(dir,
      gguf_file=name), dequantised by the `gguf` package, float32), or FILE a model directory and writes to OUT a right-padded
      batch of fixed token ids (input_ids, attention_mask) and its logits; reports the seconds taken
      and `greedy`: 12 greedy ids continuing the batch's first 5 ids.
  gguf_model_check.py generate FILE PROMPT_FILE N [ADAPTER_DIR]
      transformers' greedy continuation of the text in PROMPT_FILE (its GGUF tokenizer, special
      tokens added as it adds them) by at most N tokens, with the PEFT adapter ADAPTER_DIR loaded
      onto the model when given; reports the new ids.
  gguf_model_check.py make FILE ARCH [DROP_KEY]
      writes a tiny random GGUF with gguf-py's GGUFWriter: architecture ARCH, the llama keys (less
      DROP_KEY, e.g. llama.block_count) and two blocks of F32 tensors in the llama layout (4 query
      heads, 2 KV heads); qwen2 adds the q/k/v biases and an untied output.weight; qwen3 q/k norms,
      head_dim 128 (attention.key_length) and an untied output.weight; gpt2 has
      llama.cpp's GPT-2 keys and tensors (fused QKV, LayerNorm biases, learned positions, the
      output projection written out as output.weight). The tensors are
      stored as llama.cpp's converter stores them: any row order is valid, since transformers and
      lorarun both read Q and K rows back the same way (`logits` on the file is the reference).

  gguf_model_check.py family NAME DIR [TYPE]
      a random transformers model of family NAME (llama3: Llama 3.1 rope scaling; gemma2; gemma3 (text,
      6 layers, the 6th global, linear rope scaling on it); phi3; phi3_longrope: longrope factors and partial rotary 0.75) saved
      to DIR/hf, and DIR/model.gguf converted from it as llama.cpp's convert_hf_to_gguf.py converts
      that family (Q/K rows permuted for llama, rope_freqs from the llama3 scaling, Gemma's norms
      stored plus one, phi3's fused qkv and gate_up, rope_factors_long/short); F32 tensors, or the
      linears quantised by gguf-py to ggml type TYPE (Q8_0, Q4_1, ...), and a vocabulary of 64
      one-character tokens (A-Z, a-z, 0-9, ! and #: text of capitals is a token a letter).

  gguf_model_check.py same FILE_A FILE_B
      compares two GGUF files with gguf-py's reader: reports `tensors` (names in either file whose
      type, shape or bytes differ, or that only one holds) and `keys` (the architecture's keys of
      FILE_A that FILE_B lacks or holds with another value).

  gguf_model_check.py poke FILE NAME VALUE
      edits FILE in place (gguf-py's reader in r+ mode): the scalar metadata key NAME, or every
      value of the F32 tensor NAME, becomes VALUE (a float); for hostile-file tests.

  gguf_model_check.py quantized FILE TYPE
      writes a tiny llama (hidden 256) whose linears are of ggml type TYPE (F16, BF16, Q4_0 … Q8_0,
      Q2_K … Q6_K): weights quantised by gguf-py, or random K-quant blocks with small scales;
      reports the largest |value| of those tensors.

Results are reported on marked lines (oracle.report); transformers' warnings and progress are not read.
"""
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from oracle import report  # noqa: E402

import numpy as np  # noqa: E402


def logits(path, out):
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    start = time.time()
    if os.path.isdir(path):  # a model directory lora-merge or export wrote from a GGUF
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                     gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    loaded = time.time() - start
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, vocab, (3, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # right padding, as the padded batches of the other reference tests
    mask[2, 5:] = 0
    ids[mask == 0] = 0
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        greedy = ids[0, :5].tolist()  # 12 greedy steps from row 0's first 5 ids, without a cache or an eos
        for _ in range(12):
            greedy.append(int(model(input_ids=torch.tensor([greedy])).logits[0, -1].argmax()))
    save_file({"input_ids": ids, "attention_mask": mask, "logits": got.contiguous()}, out)
    report(written=out, greedy=greedy[5:], load_seconds=loaded, seconds=time.time() - start, vocab_size=vocab,
           num_hidden_layers=model.config.num_hidden_layers, tie_word_embeddings=model.config.tie_word_embeddings)


def generate(path, prompt_file, n, adapter):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32).eval()
    if adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter).eval()
    tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
    with open(prompt_file, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    report(ids=out[0, ids.size(1):].tolist(), prompt_ids=ids[0].tolist())


def make(path, arch, drop, changes=()):
    import gguf

    w = gguf.GGUFWriter(path, arch)
    hidden, ffn, heads, kv, vocab, layers = 16, 32, 4, 2, 32, 2
    if arch == "gpt2":
        ffn, kv = 4 * hidden, heads  # transformers' GPT-2 from GGUF takes the 4x default
    # qwen3: an explicit head_dim (attention.key_length), and transformers' Qwen3 default (128): its GGUF
    # loading does not read key_length for qwen3
    head_dim = 128 if arch == "qwen3" else hidden // heads
    keys = {
        "block_count": layers, "context_length": 64, "embedding_length": hidden, "feed_forward_length": ffn,
        "attention.head_count": heads, "attention.head_count_kv": kv, "rope.dimension_count": head_dim,
        "vocab_size": vocab,
    }
    floats = {"attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 5000.0}
    if arch == "gpt2":
        # transformers' GPT-2 from GGUF sizes its positions by n_positions (1024, the default, not
        # context_length) and its vocabulary by the tokenizer's tokens.
        keys = {k: v for k, v in keys.items() if not k.startswith(("rope", "vocab", "attention.head_count_kv"))}
        keys["context_length"] = 1024
        floats = {"attention.layer_norm_epsilon": 1e-5}
        w.add_tokenizer_model("gpt2")
        w.add_token_list([chr(c) for c in range(ord("A"), ord("A") + vocab)])
        w.add_token_types([1] * vocab)
        w.add_token_merges([])
    if arch == "qwen3":
        keys.update({"attention.key_length": head_dim, "attention.value_length": head_dim})
        del keys["rope.dimension_count"]
    for change in changes:  # "attention.head_count=0": a key's value changed
        k, v = change.split("=", 1)
        keys[k] = int(v)
    for k, v in keys.items():
        if f"{arch}.{k}" != drop:
            w.add_uint32(f"{arch}.{k}", v)
    for k, v in floats.items():
        if f"{arch}.{k}" != drop:
            w.add_float32(f"{arch}.{k}", v)
    rng = np.random.default_rng(0)
    shapes = gpt2_shapes(hidden, ffn, vocab, layers) if arch == "gpt2" else llama_shapes(
        arch, hidden, ffn, heads, kv, head_dim, vocab, layers)
    tensors = {}
    for name, shape in shapes.items():
        scale = 1.0 if name.endswith("norm.weight") or name == "token_embd.weight" else 0.3
        tensors[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    if arch == "gpt2":  # llama.cpp's converter writes GPT-2's tied output projection out
        tensors["output.weight"] = tensors["token_embd.weight"].copy()
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    report(written=path)


# Tiny configs GGUF can say in full: what llama.cpp does not store (query_pre_attn_scalar, the
# local rope base, the window pattern) is what it assumes (head_dim, 10000, every 2nd / 6th global).
FAMILY_CONFIGS = {
    "llama3": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                                   rope_theta=500000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "gemma2": ("Gemma2Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                                    max_position_embeddings=64, sliding_window=6, attn_implementation="eager")),
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                        query_pre_attn_scalar=256, max_position_embeddings=64, sliding_window=5,
                                        rope_parameters={  # Gemma 3 4B's shape: linear scaling on global layers
                                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1000000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3": ("Phi3Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                                resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, rope_theta=10000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "phi3_longrope": ("Phi3Config", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, original_max_position_embeddings=8, tie_word_embeddings=False, resid_pdrop=0.0,
        embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.5], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
                         "original_max_position_embeddings": 8})),
    # a mixture of experts (llama.cpp's qwen3moe): 4 experts of 768 (transformers' GGUF loading reads no expert
    # size: its default), top 2 renormalised, q/k norms, untied
    "qwen3moe": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=768, num_experts=4,
                                        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=64, tie_word_embeddings=False)),
}
FAMILY_VOCAB = 64


def family(name, out, qtype=None):
    import torch
    import transformers

    config_class, kwargs = FAMILY_CONFIGS[name]
    config = getattr(transformers, config_class)(vocab_size=FAMILY_VOCAB, **kwargs)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms away from their init (Gemma's zeros, the others' ones): the +1 shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
            if n.endswith("mlp.gate.weight"):  # routers away from uniform: no near ties in a top k
                p.normal_(0.0, 1.0)
    model.save_pretrained(os.path.join(out, "hf"))
    convert(model, name, os.path.join(out, "model.gguf"), qtype)
    report(written=out, model_type=model.config.model_type)


def convert(model, name, path, qtype=None):
    """llama.cpp's converter for these families, written with gguf-py (F32)."""
    import gguf
    import torch

    c = model.config
    arch = {"llama3": "llama", "phi3_longrope": "phi3"}.get(name, name)
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":  # TextModel.set_gguf_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    extra = {}
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(c.vocab_size)
        # LlamaModel.generate_extra_tensors: the llama3 scaling as one divisor per frequency
        base, factor = rope["rope_theta"], rope["factor"]
        low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
        freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        factors = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                factors.append(1)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        extra["rope_freqs.weight"] = torch.tensor(factors, dtype=torch.float32)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch in ("gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(c.sliding_window)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        elif "sliding_attention" in c.rope_parameters:
            w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    if arch == "phi3":
        rot = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(int(rot * c.hidden_size) // c.num_attention_heads)
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", c.max_position_embeddings))
        w.add_sliding_window(c.sliding_window or 0)
        if rope.get("long_factor"):
            scale = c.max_position_embeddings / rope["original_max_position_embeddings"]
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])) if scale > 1 else 1.0)
            extra["rope_factors_long.weight"] = torch.tensor(rope["long_factor"], dtype=torch.float32)
            extra["rope_factors_short.weight"] = torch.tensor(rope["short_factor"], dtype=torch.float32)
    w.add_tokenizer_model("gpt2")
    letters = [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    w.add_token_list((letters + [str(d) for d in range(10)] + ["!", "#"])[:c.vocab_size])
    w.add_token_types([1] * c.vocab_size)
    w.add_token_merges([])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("pad_token_id", w.add_pad_token_id)):  # the converter's special vocabulary
        if isinstance(getattr(c, key, None), int) and getattr(c, key) < c.vocab_size:
            add(getattr(c, key))
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate": "ffn_gate_inp", "mlp.experts.down_proj": "ffn_down_exps"}
    if arch in ("gemma2", "gemma3"):
        layer.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    else:
        layer["post_attention_layernorm"] = "ffn_norm"

    def permute(t, heads):  # LlamaModel.permute
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    def rest_of(hf):  # "mlp.experts.gate_up_proj" of "model.layers.0.mlp.experts.gate_up_proj"
        return hf.split(".", 3)[3] if hf.startswith("model.layers.") else ""

    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        module, suffix = hf.rsplit(".", 1)
        if rest_of(hf) in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # parameters, not modules
            module, suffix = hf, "weight"
        if module in names:
            g = f"{names[module]}.{suffix}"
        elif rest_of(hf) == "mlp.experts.gate_up_proj":
            g = ""
        else:
            _, _, i, rest = module.split(".", 3)
            g = f"blk.{i}.{layer[rest]}.{suffix}"
        t = t.detach().to(torch.float32)
        if rest_of(hf) == "mlp.experts.gate_up_proj":  # transformers 5's fused stack: llama.cpp's two [E, I, H]
            gate, up = t.chunk(2, dim=1)
            w.add_tensor(f"blk.{hf.split('.')[2]}.ffn_gate_exps.weight", gate.contiguous().numpy())
            w.add_tensor(f"blk.{hf.split('.')[2]}.ffn_up_exps.weight", up.contiguous().numpy())
            continue
        if arch == "llama" and g.endswith(".attn_q.weight"):
            t = permute(t, c.num_attention_heads)
        if arch == "llama" and g.endswith(".attn_k.weight"):
            t = permute(t, c.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and g.endswith("norm.weight"):
            t = t + 1
        if qtype and t.dim() == 2 and g.startswith("blk."):
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(g, gguf.quants.quantize(t.contiguous().numpy(), qt), raw_dtype=qt)
        else:
            w.add_tensor(g, t.contiguous().numpy())
    for g, t in extra.items():
        w.add_tensor(g, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def same(path_a, path_b):
    import gguf

    a, b = gguf.GGUFReader(path_a), gguf.GGUFReader(path_b)
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    tensors = sorted(n for n in set(ta) | set(tb) if n not in ta or n not in tb or ta[n].tensor_type != tb[n].tensor_type
                     or list(ta[n].shape) != list(tb[n].shape) or ta[n].data.tobytes() != tb[n].data.tobytes())
    arch = a.fields["general.architecture"].contents()
    keys = sorted(k for k, f in a.fields.items() if k.startswith(arch + ".")
                  and (k not in b.fields or b.fields[k].contents() != f.contents()))
    report(tensors=tensors, keys=keys, compared=len(ta))


def poke(path, name, value):
    import gguf

    r = gguf.GGUFReader(path, "r+")
    if name in r.fields:
        field = r.fields[name]
        field.parts[field.data[0]][0] = value
    else:
        next(t for t in r.tensors if t.name == name).data[...] = value
    r.data.flush()
    report(written=path)


# K-quant blocks (256 elements): where their float16 scales d (and dmin) sit, in bytes
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def quantized(path, qtype):
    """A tiny llama (hidden 256, 2 blocks; norms F32, no output.weight: tied to the embedding) whose
    linears and embedding are of ggml type `qtype`: gguf.quants.quantize of random weights where gguf-py can,
    else (the K-quants) seeded random blocks with their float16 scales set in [1e-4, 1e-3]."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(path, "llama")
    hidden, ffn, heads, kv, vocab, layers = 256, 512, 4, 2, 64, 2
    for k, v in {"block_count": layers, "context_length": 64, "embedding_length": hidden,
                 "feed_forward_length": ffn, "attention.head_count": heads, "attention.head_count_kv": kv,
                 "rope.dimension_count": hidden // heads, "vocab_size": vocab}.items():
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_tokenizer_model("gpt2")  # one token a letter: text of capitals, no spaces
    w.add_token_list([chr(c) for c in range(ord("A"), ord("A") + vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    rng = np.random.default_rng(1)
    for name, shape in llama_shapes("llama", hidden, ffn, heads, kv, hidden // heads, vocab, layers).items():
        if len(shape) == 1:
            scale = 1.0 if name.endswith("norm.weight") else 0.5
            w.add_tensor(name, (scale * rng.standard_normal(shape)).astype(np.float32))
            continue
        if qtype in K_SCALES or qtype.startswith("IQ"):  # (an IQ type: random blocks, for refusals)
            size, nbytes = gguf.GGML_QUANT_SIZES[qt]
            raw = rng.integers(0, 256, size=(shape[0], shape[1] // size, nbytes), dtype=np.uint8)
            for at in K_SCALES.get(qtype, ()):
                d = rng.uniform(1e-4, 1e-3, size=raw.shape[:2]).astype(np.float16)
                raw[:, :, at:at + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
            w.add_tensor(name, raw.reshape(shape[0], -1), raw_dtype=qt)
        else:
            data = (0.05 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if qtype.startswith("IQ"):
        return report(written=path)
    worst = max(float(np.abs(gguf.quants.dequantize(t.data, t.tensor_type)).max())
                for t in gguf.GGUFReader(path).tensors if t.tensor_type == qt)
    report(written=path, largest=worst)


def llama_shapes(arch, hidden, ffn, heads, kv, head_dim, vocab, layers):
    """llama.cpp's llama / qwen2 / qwen3 tensors (qwen2: q/k/v biases; qwen3: q/k norms; both an
    untied output)."""
    q_out, kv_out = heads * head_dim, kv * head_dim
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if arch in ("qwen2", "qwen3"):
        shapes["output.weight"] = (vocab, hidden)
    for i in range(layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (q_out, hidden), f"blk.{i}.attn_k.weight": (kv_out, hidden),
            f"blk.{i}.attn_v.weight": (kv_out, hidden), f"blk.{i}.attn_output.weight": (hidden, q_out),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        })
        if arch == "qwen2":
            shapes.update({f"blk.{i}.attn_q.bias": (hidden,), f"blk.{i}.attn_k.bias": (kv_out,),
                           f"blk.{i}.attn_v.bias": (kv_out,)})
        if arch == "qwen3":
            shapes.update({f"blk.{i}.attn_q_norm.weight": (head_dim,), f"blk.{i}.attn_k_norm.weight": (head_dim,)})
    return shapes


def gpt2_shapes(hidden, ffn, vocab, layers):
    """llama.cpp's gpt2 tensors: learned positions, LayerNorm biases, fused QKV, stored [out, in]."""
    shapes = {"token_embd.weight": (vocab, hidden), "position_embd.weight": (1024, hidden),
              "output_norm.weight": (hidden,), "output_norm.bias": (hidden,)}
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            shapes.update({f"blk.{i}.{norm}.weight": (hidden,), f"blk.{i}.{norm}.bias": (hidden,)})
        for name, (out, inp) in {"attn_qkv": (3 * hidden, hidden), "attn_output": (hidden, hidden),
                                 "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}.items():
            shapes.update({f"blk.{i}.{name}.weight": (out, inp), f"blk.{i}.{name}.bias": (out,)})
    return shapes


def main():
    mode = sys.argv[1]
    if mode == "logits":
        return logits(sys.argv[2], sys.argv[3])
    if mode == "generate":
        return generate(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "")
    if mode == "make":
        return make(sys.argv[2], sys.argv[3].encode().decode("unicode_escape"), sys.argv[4] if len(sys.argv) > 4 else "",
                    sys.argv[5:])
    if mode == "family":
        return family(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
    if mode == "poke":
        return poke(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    if mode == "same":
        return same(sys.argv[2], sys.argv[3])
    if mode == "quantized":
        return quantized(sys.argv[2], sys.argv[3])
    sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
