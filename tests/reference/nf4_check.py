"""QLoRA references from bitsandbytes (CPU) + transformers + PEFT, for lorarun's NF4 tests.

usage: nf4_check.py quant OUT.safetensors
           weights of several shapes and dtypes (CASE.w) with what bnb makes of them:
           quantize_4bit(w, blocksize=64, quant_type="nf4") packed codes and absmax, and with
           compress_statistics=True the 8-bit absmax, offset, state2 absmax and map; both
           dequantised; and quantize_blockwise(x, blocksize=256) of probe vectors (b8.CASE.*)
       nf4_check.py logits FIXTURES OUT_ROOT CASE...
           CASE is FAMILY-dq0 or FAMILY-dq1; OUT_ROOT/CASE holds our adapter and expected.safetensors
           (input_ids, attention_mask, logits of our QLoRA model); PEFT on the NF4 round-tripped base
           must give the same logits within 1e-4
       nf4_check.py merge MODEL_DIR ADAPTER MERGED_DIR QUANT_DTYPE DQ
           lora-merge --qlora's output against PEFT's merge_and_unload on the NF4 round-tripped base
       nf4_check.py train DQ <train_reference.py check arguments and options>
           train_reference.py's step-by-step check on the NF4 round-tripped base (reports match; with
           --init=olora,… each adapted weight's residual is round-tripped through NF4 again, as
           bitsandbytes re-quantises what PEFT's OLoRA leaves of a 4-bit weight), then
           PEFT loads the final adapter onto transformers' own 4-bit model and runs it; where
           bitsandbytes' CPU path is the reference's, its logits must equal the reference's within 1e-4
           (reports peft_4bit: compared, loaded or skipped; a warning says why it was not compared)
       nf4_check.py eval DQ <check.py eval arguments>
           check.py's per-document loss check on the NF4 round-tripped base
The NF4 round-tripped base is the float32 model whose linears transformers quantises
(BitsAndBytesConfig(load_in_4bit=True, nf4)) hold dequantize_4bit(quantize_4bit(W)): a plain model,
so no Linear4bit forward runs in the numbers compared. transformers + bitsandbytes quantise W as they
load the 4-bit model; dequantize_4bit is bitsandbytes' own PyTorch implementation, since its native
CPU kernel and Linear4bit's CPU forward change with the CPU's AVX-512 features
(tests/support/bnb_cpu.py; LORARUN_TEST_FORCE_BNB_AVX512BF16=1 makes any CPU take those paths).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import oracle  # noqa: E402  (first: before anything imports bitsandbytes)

# bnb torch.compiles its generic dequantisation (used for odd widths) once per shape: seconds each.
# Eager runs the same operations.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as F  # noqa: E402
import bnb_cpu  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# {module name: max |native - portable|} where bitsandbytes' native CPU dequantize_4bit gave another
# weight than bnb_cpu.dequantize_nf4 (its AVX-512 branch): told, never used.
NATIVE_DIFFERS = {}


def load_4bit(model_dir, dq, dtype):
    """transformers' own 4-bit model: nf4, blocks of 64, double quantisation `dq`, W quantised from `dtype`."""
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=dq,
                           bnb_4bit_compute_dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=q, dtype=dtype, device_map="cpu")


def nf4_weights(model_dir, dq, dtype):
    """{module name: dequantize_4bit(quantize_4bit(W))} for every linear transformers quantises, W [out, in]
    in `dtype`, dequantised the same way on every CPU."""
    NATIVE_DIFFERS.clear()
    out = {}
    for n, mod in load_4bit(model_dir, dq, dtype).named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            packed, state = mod.weight.data, mod.weight.quant_state
            out[n] = bnb_cpu.dequantize_nf4(packed, state)
            native = F.dequantize_4bit(packed, state)
            if not torch.equal(native, out[n]):
                NATIVE_DIFFERS[n] = (native.float() - out[n].float()).abs().max().item()
    if NATIVE_DIFFERS:
        print(f"note: bitsandbytes' native dequantize_4bit differs on this CPU for {len(NATIVE_DIFFERS)} of "
              f"{len(out)} linears (max {max(NATIVE_DIFFERS.values()):.3g}: {', '.join(sorted(NATIVE_DIFFERS))}); "
              "its AVX-512 branch, see tests/support/bnb_cpu.py. The reference uses the portable one.")
    return out


def qlora_base(model_dir, dq, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, w in nf4_weights(model_dir, dq, dtype).items():
            m = modules[name]
            m.weight.copy_(w.float().t() if type(m).__name__ == "Conv1D" else w.float())
    return model


def requantize_residuals(model):
    """PEFT's olora_init on a Linear4bit: the residual W - s·BA (float32) quantised again by Params4bit."""
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
                w = mod.base_layer.weight
                packed, state = F.quantize_4bit(w.data.float(), blocksize=64, quant_type="nf4",
                                                compress_statistics=QloraAuto.dq)
                w.copy_(bnb_cpu.dequantize_nf4(packed, state).float())


class QloraAuto:
    """Stands in for AutoModelForCausalLM in the other reference scripts."""
    dq = True

    @classmethod
    def from_pretrained(cls, model_dir, **_):
        return qlora_base(model_dir, cls.dq)


def weights():
    g = torch.Generator().manual_seed(1234)
    cases = {}
    for dt in ("fp32", "bf16", "fp16"):
        # the last: more than lorarun's chunk of 2^20 values, odd, its last block short
        for rows, cols in ((96, 64), (48, 33), (7, 13), (300, 200), (1024, 1024), (1500, 1001)):
            if dt == "fp16" and rows != 48:
                continue
            w = torch.randn(rows, cols, generator=g) * 0.02
            if rows == 1024:  # heavier tails and a spread of block scales
                w = w * torch.rand(rows, 1, generator=g) * 10 + torch.randn(rows, cols, generator=g).pow(3) * 1e-3
            cases[f"{dt}_{rows}x{cols}"] = w.to(DTYPES[dt])
        # Ties, zeros and extremes: a block with absmax 1 holding every midpoint between NF4 levels
        # (a tie takes the lower level), a zero block, tiny values, an outlier, a scaled block.
        code = F.get_4bit_type("nf4", device="cpu")
        mids = (code[:-1] + code[1:]) / 2
        row0 = torch.cat([torch.ones(1), mids, -mids, code, torch.zeros(64 - 1 - 30 - 16)])
        rows = [row0, torch.zeros(64), torch.randn(64, generator=g) * 1e-30,
                torch.cat([torch.randn(63, generator=g), torch.tensor([100.0])]), row0 * 3.7]
        cases[f"{dt}_edge"] = torch.stack(rows).to(DTYPES[dt])
    return cases


def blockwise_probes():
    """Values on and around the rounding points where bnb's 65536-entry CPU lookup table changes."""
    code = F.create_dynamic_map()
    mid = 0.5 * (code[:-1] + code[1:])
    i = torch.arange(65536, dtype=torch.float32)
    lut = torch.searchsorted(mid, -1.0 + (2.0 * i) / 65535.0, right=False)
    xs = []
    for k in torch.nonzero(lut[1:] != lut[:-1]).flatten().tolist():
        v = torch.tensor(-1 + 2 * (k + 0.5) / 65535, dtype=torch.float32)
        up, down = v.clone(), v.clone()
        for _ in range(8):
            xs += [up.clone(), down.clone()]
            up = torch.nextafter(up, torch.tensor(2.0))
            down = torch.nextafter(down, torch.tensor(-2.0))
    x = torch.stack(xs)
    x = torch.cat([x, torch.zeros((-x.numel()) % 255)]).view(-1, 255)
    probes = torch.cat([torch.ones(x.size(0), 1), x], 1).flatten()  # absmax 1: the values are the normed ones
    g = torch.Generator().manual_seed(99)
    return {"probes": probes, "random": torch.randn(5000, generator=g) * torch.rand(5000, generator=g),
            "zero_block": torch.cat([torch.zeros(256), torch.randn(300, generator=g)])}


def quant(out):
    t = {"nf4_levels": F.get_4bit_type("nf4", device="cpu"), "dynamic_map": F.create_dynamic_map()}
    for name, w in weights().items():
        t[f"{name}.w"] = w
        q, s = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
        t[f"{name}.packed"], t[f"{name}.absmax"] = q.flatten(), s.absmax
        t[f"{name}.dequant"] = bnb_cpu.dequantize_nf4(q, s)
        q, s = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        assert torch.equal(q.flatten(), t[f"{name}.packed"])
        t[f"{name}.dq.absmax8"], t[f"{name}.dq.offset"] = s.absmax, s.offset.reshape(1)
        t[f"{name}.dq.absmax2"], t[f"{name}.dq.code"] = s.state2.absmax, s.state2.code
        t[f"{name}.dq.dequant"] = bnb_cpu.dequantize_nf4(q, s)
    for name, x in blockwise_probes().items():
        q, s = F.quantize_blockwise(x, blocksize=256)
        t[f"b8.{name}.x"], t[f"b8.{name}.codes"], t[f"b8.{name}.absmax"] = x, q, s.absmax
    save_file({k: v.contiguous() for k, v in t.items()}, out)
    print(f"{len(t)} tensors")


def logits(fixtures, out_root, cases):
    from peft import PeftModel
    worst = 0.0
    for case in cases:
        family, dq = case.rsplit("-dq", 1)
        model = PeftModel.from_pretrained(qlora_base(f"{fixtures}/{family}", dq == "1"), f"{out_root}/{case}").eval()
        expected = load_file(f"{out_root}/{case}/expected.safetensors")
        with torch.no_grad():
            got = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).logits
        real = expected["attention_mask"].bool()
        diff = (got[real] - expected["logits"][real]).abs().max().item()
        print(f"{case}: max abs logit difference {diff:.3g}")
        worst = max(worst, diff)
    return 0 if worst <= 1e-4 else 1


def merge(model_dir, adapter, merged_dir, quant_dtype, dq):
    from peft import PeftModel
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(qlora_base(model_dir, dq, DTYPES[quant_dtype]), adapter)
    want = model.merge_and_unload().state_dict()
    got = load_file(merged_dir + "/model.safetensors")
    changed = {n + ".weight" for n in nf4_weights(model_dir, dq, DTYPES[quant_dtype])}
    worst, untouched_equal, linears = 0.0, True, 0
    for k, v in got.items():
        if k in changed:
            worst = max(worst, (v - want[k]).abs().max().item())
            linears += 1
        else:  # embeddings, norms, biases, lm_head: the base's own
            untouched_equal &= torch.equal(v, base.state_dict()[k])
    missing = set(base.state_dict()) - set(got) - {"lm_head.weight"}
    print(f"{linears} linear weights, max abs difference {worst:.3g}; others equal: {untouched_equal}; "
          f"missing {sorted(missing)}")
    return 0 if linears == len(changed) and worst <= 1e-6 and untouched_equal and not missing else 1


def peft_on_4bit(model_dir, adapter, dq):
    """PEFT loads `adapter` onto transformers' own 4-bit model (Linear4bit, float32 compute) and runs it.
    Where bitsandbytes' CPU path computes what the reference claims (dequantize_4bit(W) in float32), its
    logits must equal those of PEFT on the NF4 round-tripped base within 1e-4; elsewhere a warning says
    why not. Returns the exit status."""
    from peft import PeftModel
    reason = bnb_cpu.linear4bit_cpu_path()
    if reason:  # its forward would repack the weights in place, and assert out_features % 32 == 0
        oracle.warn(f"PEFT on transformers' 4-bit model not run: {reason}")
        oracle.report(peft_4bit="skipped")
        return 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    model = PeftModel.from_pretrained(load_4bit(model_dir, dq, torch.float32), adapter).eval()
    with torch.no_grad():
        got = model(input_ids=ids).logits
    print("PEFT loaded the adapter onto the 4-bit model")
    reference = PeftModel.from_pretrained(qlora_base(model_dir, dq), adapter).eval()
    if NATIVE_DIFFERS:  # its forward dequantises with the native kernel
        oracle.warn("logits of PEFT on transformers' 4-bit model not compared: bitsandbytes' native CPU "
                    f"dequantize_4bit differs here for {len(NATIVE_DIFFERS)} linears (its AVX-512 branch)")
        oracle.report(peft_4bit="loaded")
        return 0
    with torch.no_grad():
        diff = (got - reference(input_ids=ids).logits).abs().max().item()
    print(f"PEFT on the 4-bit model: max abs logit difference from the reference {diff:.3g}")
    oracle.report(peft_4bit="compared", peft_4bit_logit_diff=diff)
    return 0 if diff <= 1e-4 else 1


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    if mode == "quant":
        return quant(args[0])
    if mode == "logits":
        return logits(args[0], args[1], args[2:])
    if mode == "merge":
        return merge(args[0], args[1], args[2], args[3], args[4] == "1")
    QloraAuto.dq = args[0] == "1"
    if mode == "train":
        import train_reference
        train_reference.AutoModelForCausalLM = QloraAuto
        options = dict(a[2:].split("=", 1) for a in args if a.startswith("--"))
        args = [a for a in args if not a.startswith("--")]
        if options.get("init", "").startswith("olora"):
            train_reference.after_init = requantize_residuals
        status = train_reference.check(args[1], args[2], args[3], args[4], int(args[5]), int(args[6]), int(args[7]),
                                       int(args[8]), float(args[9]), int(args[10]), init_spec=options.get("init"))
        return status | peft_on_4bit(args[1], f"{args[4]}/epoch_{int(args[8]) - 1}", QloraAuto.dq)
    if mode == "eval":
        import check
        check.AutoModelForCausalLM = QloraAuto
        return check.check_eval(args[1], args[2], args[3], int(args[4]), args[5])
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main())
