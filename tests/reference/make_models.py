"""Reference fixtures for the model tests, made by transformers + PEFT themselves.

For each family: a tiny random model saved in real HF format, a right-padded batch, and what
the reference computes on it: logits of the base model, of base + a PEFT LoRA adapter, of the
merged model, and the loss and LoRA gradients after one backward pass; the same for a PEFT DoRA
adapter (random A and B, magnitudes away from the base's row norms), under "dora_" names. The
mixture-of-experts families' LoRA adapters adapt expert tensors too (PARAMETERS).

usage: make_models.py OUT_DIR
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import oracle  # noqa: E402,F401  (first: LORARUN_TEST_FORCE_BNB_AVX512BF16 applies before bitsandbytes loads)
import torch  # noqa: E402
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config,
                          GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          OPTConfig, OPTForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          MixtralConfig, MixtralForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

V = 384  # 256 byte-level symbols + merges + <|endoftext|>
FAMILIES = {
    # GQA, explicit head_dim != hidden/heads, llama3 rope scaling, tied embeddings
    "llama": (LlamaForCausalLM, LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=64, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}), "all-linear", False),
    "llama_linear_rope": (LlamaForCausalLM, LlamaConfig(
        vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=500.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0}), ["q_proj", "v_proj"], False),
    # sliding window shorter than the batch, rsLoRA
    "mistral": (MistralForCausalLM, MistralConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, sliding_window=6), ["q_proj", "k_proj", "down_proj"], True),
    # q/k/v bias
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True), "all-linear", False),
    # q/k RMSNorm per head, explicit head_dim != hidden/heads, layer 1 windowed shorter than the batch
    # and layer 0 not (max_window_layers 1: layer_types mixes them), untied
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=20, max_position_embeddings=64, tie_word_embeddings=False,
        use_sliding_window=True, sliding_window=6, max_window_layers=1), "all-linear", False),
    # word_embed_proj_dim != hidden_size (project_in/out), pre-LN
    "opt": (OPTForCausalLM, OPTConfig(
        vocab_size=V, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0), ["q_proj", "v_proj", "fc1"], False),
    # post-LN (like opt-350m)
    "opt_post_ln": (OPTForCausalLM, OPTConfig(
        vocab_size=V, hidden_size=48, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        do_layer_norm_before=False, max_position_embeddings=64, dropout=0.0), "all-linear", False),
    # fused c_attn, Conv1D weights
    "gpt2": (GPT2LMHeadModel, GPT2Config(
        vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0), ["c_attn", "c_proj"], False),
    # sandwich norms with 1+weight, GeGLU, embeddings scaled by sqrt(hidden), query_pre_attn_scalar, attention
    # and final-logit soft-capping low enough to bite, windowed layers 0 and 2 (window < batch), GQA 2
    "gemma2": (Gemma2ForCausalLM, Gemma2Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=18, query_pre_attn_scalar=24, max_position_embeddings=64, sliding_window=6,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, attn_implementation="eager"), "all-linear", False),
    # q/k norms with 1+weight, local (10k, default) and global (1e6, linear x2) rope bases, windowed layers
    # 0 and 2 (window < batch), GQA 4, untied
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=18, query_pre_attn_scalar=32, max_position_embeddings=64, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
     ["q_proj", "o_proj", "gate_proj", "down_proj"], False),
    # fused qkv_proj and gate_up_proj, longrope with the pretraining length (8) below the batch's (12), partial
    # rotary 0.75 (as Phi-4-mini), GQA 2, untied
    "phi3": (Phi3ForCausalLM, Phi3Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=8,
        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.5], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
                         "original_max_position_embeddings": 8}), "all-linear", False),
    # mixture of experts: 4 experts, top 2 renormalised, layer 1 a dense MLP (mlp_only_layers), q/k norms,
    # GQA 2; its LoRA adapter adapts both stacked expert tensors too (target_parameters: nested keys)
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False), "all-linear",
     False),
    # 4 experts, top 2 (always renormalised, float32 weights), GQA 4; its adapter adapts down_proj's experts alone
    "mixtral": (MixtralForCausalLM, MixtralConfig(
        vocab_size=V, hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64),
     ["q_proj", "v_proj"], False),
}
# PEFT's target_parameters of the families' LoRA adapter (DoRA does not take them)
PARAMETERS = {"qwen3_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], "mixtral": ["mlp.experts.down_proj"]}
LENGTHS = [12, 9, 5]



def batch(seed):
    g = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    ids = torch.randint(3, V, (len(LENGTHS), T), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    ids = ids * mask  # right padding with id 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Instruction: add two numbers. Response: 3 + 4 = 7",
    "LoRA adapts a frozen linear layer with a low-rank update.", "Tokenizers split text into ids; models predict them.",
    "Ünïcödé and emoji 🦊 appear too, with digits 0123456789.",
] * 20


def make_tokenizer(d):
    """A real byte-level BPE tokenizer.json of exactly V tokens, trained by HF tokenizers."""
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=V, min_frequency=1, special_tokens=["<|endoftext|>"])
    assert tok.get_vocab_size() <= V
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                   "eos_token": "<|endoftext|>", "model_max_length": 64}, f)
    return tok.token_to_id("<|endoftext|>")


def peft_key(name):
    """PEFT's parameter name as its saved key (DoRA's magnitude is saved without ".weight")."""
    return name.replace(".default", "").replace("lora_magnitude_vector.weight", "lora_magnitude_vector")


def adapter_reference(model, lcfg, seed, ids, mask, labels, adapter_dir, prefix, ref):
    """Random adapter weights on `model` (B != 0; a DoRA magnitude scaled by 1 +- 0.1 per row), saved
    to adapter_dir; its eval logits, train-mode loss and gradients, and the merged model's logits
    into ref under `prefix`."""
    peft = get_peft_model(model, lcfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_magnitude_vector" in n:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft.save_pretrained(adapter_dir)
    peft.eval()
    with torch.no_grad():
        ref[prefix + "peft_logits"] = peft(input_ids=ids, attention_mask=mask).logits
    peft.train()
    out_ = peft(input_ids=ids, attention_mask=mask, labels=labels)
    out_.loss.backward()
    ref[prefix + "loss"] = out_.loss.detach().reshape(1)
    for n, p in peft.named_parameters():
        if p.grad is not None:
            ref[prefix + "grad." + peft_key(n)] = p.grad
    peft.eval()
    with torch.no_grad():
        merged = peft.merge_and_unload()
        ref[prefix + "merged_logits"] = merged(input_ids=ids, attention_mask=mask).logits


def make(out, name, cls, config, targets, rslora, seed):
    torch.manual_seed(seed)
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    eos = make_tokenizer(d)
    config.bos_token_id = config.eos_token_id = eos
    config.pad_token_id = None
    model = cls(config).eval()
    if name.startswith("gemma"):
        with torch.no_grad():  # transformers starts Gemma's norms at 0 (a scale of 1): make them matter
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.5)
    with torch.no_grad():  # routers far from uniform, so that no token's top k is a near tie
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    model.generation_config.bos_token_id = model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    model.save_pretrained(d)
    ids, mask, labels = batch(seed)
    ref = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        ref["logits"] = model(input_ids=ids, attention_mask=mask).logits

    for prefix, dora in (("", False), ("dora_", True)):
        if dora and name in PARAMETERS:  # PEFT's DoRA takes no expert (nor router) adapters: the attention's
            targets = ["q_proj", "v_proj"]
        lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, use_rslora=rslora,
                          use_dora=dora, task_type="CAUSAL_LM",
                          target_parameters=None if dora else PARAMETERS.get(name))
        adapter_reference(cls.from_pretrained(d).eval(), lcfg, seed + 1, ids, mask, labels,
                          os.path.join(d, "peft_dora_adapter" if dora else "peft_adapter"), prefix, ref)
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(d, "reference.safetensors"))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    for i, (name, (cls, config, targets, rslora)) in enumerate(FAMILIES.items()):
        make(out, name, cls, config, targets, rslora, 1000 + i)
    with open(os.path.join(out, "families.json"), "w") as f:
        json.dump(sorted(FAMILIES), f)


if __name__ == "__main__":
    main()
