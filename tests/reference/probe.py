"""One question to a reference library, for tests that compare a single fact with it.

usage: probe.py lr-schedule NAME WARMUP TOTAL STEPS
           transformers' get_scheduler(NAME, or constant_with_warmup for constant): the lr factor
           of steps 0 .. STEPS-1 (reported: factors)
       probe.py mongodb-version URI
           the server version pymongo reads from buildInfo (reported: version)
       probe.py peft-load MODEL_DIR ADAPTER_DIR
           PeftModel.from_pretrained on transformers' model (reported: lora_modules, the LoRA layers
           PEFT made)
Results are reported through tests/support/oracle.py, never printed as bare text.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import oracle  # noqa: E402  (first: before anything imports bitsandbytes)


def lr_schedule(name, warmup, total, steps):
    import torch
    import transformers
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    s = transformers.get_scheduler(name if name != "constant" else "constant_with_warmup", opt,
                                   num_warmup_steps=warmup, num_training_steps=total)
    oracle.report(factors=[f(i) for f in s.lr_lambdas for i in range(steps)])


def mongodb_version(uri):
    import pymongo
    oracle.report(version=pymongo.MongoClient(uri).admin.command("buildInfo")["version"])


def peft_load(model_dir, adapter):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM
    m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    oracle.report(lora_modules=sum(isinstance(x, LoraLayer) for x in m.modules()))


if __name__ == "__main__":
    mode, args = (sys.argv[1] if len(sys.argv) > 1 else ""), sys.argv[2:]
    if mode == "lr-schedule":
        lr_schedule(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif mode == "mongodb-version":
        mongodb_version(args[0])
    elif mode == "peft-load":
        peft_load(args[0], args[1])
    else:
        sys.exit(__doc__)
