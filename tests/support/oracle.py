"""What a Python oracle tells the code that runs it, on marked lines: nothing else is read as a result.

Oracles run under transformers, PEFT and bitsandbytes, which print warnings, notices and progress
bars on either stream (bitsandbytes logs a line at import on a CPU with AVX-512 BF16); a test that
merges the streams, or reads the last line, would parse those. An oracle therefore tells its
results only through report(): one line, MARK followed by one JSON object, written and flushed in
one piece. Everything else it prints is for people. The readers look for MARK anywhere in a line
(a progress bar on stderr may still be open when it comes): reported() here, test::reported() in
tests/support/oracle.hpp, and scripts/gpu-check.

Importing this module first also applies LORARUN_TEST_FORCE_BNB_AVX512BF16=1 (bnb_cpu.py), before
anything imports bitsandbytes.
"""
import json
import math
import os
import sys

MARK = "@lorarun-oracle "


def _json_safe(x):
    """JSON has no NaN or infinity: those become the strings "nan", "inf", "-inf"."""
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def report(**fields):
    """Writes MARK + fields as one line of JSON on stdout."""
    line = MARK + json.dumps(_json_safe(fields), allow_nan=False) + "\n"
    sys.stdout.flush()
    sys.stdout.write(line)
    sys.stdout.flush()


def warn(text):
    """Reports a check this oracle could not make here, and why: the C++ tests show it as a WARN."""
    print(f"warning: {text}", file=sys.stderr, flush=True)
    report(warning=text)


def reported(text):
    """The fields report() wrote into `text` (an oracle's output), later reports overriding earlier,
    and the warnings under "warnings"."""
    fields, warnings = {}, []
    for line in text.splitlines():
        at = line.find(MARK)
        if at >= 0:
            for key, value in json.loads(line[at + len(MARK):]).items():
                if key == "warning":
                    warnings.append(value)
                else:
                    fields[key] = value
    return dict(fields, warnings=warnings)


if os.environ.get("LORARUN_TEST_FORCE_BNB_AVX512BF16") == "1":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bnb_cpu
    bnb_cpu.force_avx512bf16_paths()
