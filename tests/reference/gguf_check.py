"""GGUF reference for tests/io/test_gguf.cpp: what llama.cpp's gguf-py (the `gguf` package) reads.

  gguf_check.py dump FILE   reports the file as gguf-py's GGUFReader sees it: version, alignment, data
                            offset, every metadata key (type, item type, value) and every tensor (type,
                            dims in GGUF order, offset, size) with a digest of its float32
                            dequantisation by gguf.quants.dequantize (sha256 of the bytes, NaNs made
                            canonical; sum; the values at a few indices)
  gguf_check.py make FILE   writes a small file with gguf-py's GGUFWriter holding a key of every value
                            type (arrays and an array of arrays too), alignment 64, and tensors of every
                            type lorarun dequantises filled with seeded random blocks (every finite
                            fp16 scale, subnormals included); F16 and BF16 tensors hold all 65,536 bit
                            patterns. Reports the nested array's value as written ("nested"): gguf-py's
                            reader does not unpack arrays of arrays.
  gguf_check.py quant DIR   writes DIR/finite.f32 and DIR/special.f32 (raw float32) and what
                            gguf.quants.quantize makes of them: DIR/finite.{F16,BF16,Q8_0} and
                            DIR/special.{F16,BF16}. finite holds Q8_0 blocks of normal values at
                            magnitudes 1e-38..1e36, all-zero and signed-zero blocks, blocks whose
                            x / d fall exactly on .5 (d a power of two), fp16 and bf16 rounding ties,
                            float32 subnormals; special adds infinities and quiet and signalling NaNs.

Results are reported on marked lines (oracle.report); gguf-py's progress output is not read.
"""
import hashlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from oracle import report  # noqa: E402

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q, GGUFValueType as V  # noqa: E402

SAMPLES = 16


def digest(values: np.ndarray) -> dict:
    """sha256 of the float32 values with every NaN replaced by 0x7fc00000 (numpy's fp16 -> fp32
    keeps a NaN's payload on some CPUs and quietens it on others), the sum of the finite ones, and samples."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    bits = flat.view(np.uint32).copy()
    bits[np.isnan(flat)] = 0x7FC00000
    n = flat.size
    idx = sorted({0, n - 1, *((i * 7919 * 104729) % n for i in range(1, SAMPLES - 1))}) if n else []
    return {
        "sha256": hashlib.sha256(bits.tobytes()).hexdigest(),
        "sum": float(np.sum(flat[np.isfinite(flat)], dtype=np.float64)),  # of the finite values
        "samples": [[int(i), float(bits[i:i + 1].view(np.float32)[0])] for i in idx],
    }


def field_value(field):
    """A field's value as JSON: gguf-py's own contents(); floats are float32 values as doubles."""
    if field.types[0] == V.ARRAY and len(field.types) > 1 and field.types[1] == V.ARRAY:
        return None  # gguf-py leaves arrays of arrays unparsed
    return field.contents()


def dump(path):
    r = gguf.GGUFReader(path)
    keys = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue  # gguf-py's own entries for the header
        keys.append({"key": name, "type": f.types[0].name,
                     "item_type": f.types[1].name if f.types[0] == V.ARRAY else None,
                     "value": field_value(f)})
    tensors = []
    for t in r.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert values.size == t.n_elements, t.name
        tensors.append({"name": t.name, "type": t.tensor_type.name, "dims": [int(d) for d in t.shape],
                        "offset": int(t.data_offset) - int(r.data_offset), "nbytes": int(t.n_bytes),
                        # PyTorch's shape: what gguf-py gives the dequantised array
                        "torch_shape": list(values.shape), **digest(values)})
    report(version=int(r.fields["GGUF.version"].contents()), alignment=int(r.alignment),
           data_offset=int(r.data_offset), keys=keys, tensors=tensors)


# Byte ranges of the fp16 scales in one block of each quantised type (ggml-common.h's block_*).
F16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
              Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(rng, qtype, n_blocks):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        # Any finite fp16 (exponent field not all ones): zeros, subnormals and both signs included.
        h = rng.integers(0, 1 << 16, size=n_blocks, dtype=np.uint32).astype(np.uint16)
        h = np.where((h & 0x7C00) == 0x7C00, h & 0xBFFF, h).astype(np.uint16)
        blocks[:, at:at + 2] = h.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def make(path):
    rng = np.random.default_rng(1234)
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_custom_alignment(64)
    w.add_key_value("test.u8", 200, V.UINT8)
    w.add_key_value("test.i8", -100, V.INT8)
    w.add_key_value("test.u16", 60000, V.UINT16)
    w.add_key_value("test.i16", -30000, V.INT16)
    w.add_key_value("test.u32", 4000000000, V.UINT32)
    w.add_key_value("test.i32", -2000000000, V.INT32)
    w.add_key_value("test.f32", 0.1, V.FLOAT32)
    w.add_key_value("test.bool", True, V.BOOL)
    w.add_key_value("test.string", "héllo, 世界 🙂", V.STRING)
    w.add_key_value("test.empty_string", "", V.STRING)
    w.add_key_value("test.u64", 18000000000000000000, V.UINT64)
    w.add_key_value("test.i64", -9000000000000000000, V.INT64)
    w.add_key_value("test.f64", 1e-300, V.FLOAT64)
    for sub, vals in [(V.UINT8, [0, 255]), (V.INT8, [-128, 127]), (V.UINT16, [1, 65535]),
                      (V.INT16, [-32768, 7]), (V.UINT32, [3, 4294967295]), (V.INT32, [-5, 2147483647]),
                      (V.FLOAT32, [1.5, -0.3, 3e38]), (V.BOOL, [True, False, True]),
                      (V.STRING, ["a", "", "ü\n\t\"\\"]), (V.UINT64, [2**64 - 1]), (V.INT64, [-2**63]),
                      (V.FLOAT64, [0.1, -2.5e300])]:
        w.add_key_value(f"test.array.{sub.name.lower()}", vals, V.ARRAY, sub_type=sub)
    nested = [[1, 2, 3], [4], [5, 6]]
    w.add_key_value("test.array.nested", nested, V.ARRAY, sub_type=V.ARRAY)

    for qtype in F16_FIELDS:
        block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = 3, 2 * max(block_size, 256)
        blocks = random_blocks(rng, qtype, rows * cols // block_size)
        w.add_tensor(f"q.{qtype.name}", blocks.reshape(rows, -1), raw_dtype=qtype)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    w.add_tensor("all.F16", every.view(np.float16), raw_dtype=Q.F16)
    w.add_tensor("all.BF16", every.view(np.uint8).reshape(256, 512), raw_dtype=Q.BF16)
    w.add_tensor("f32.4d", rng.standard_normal((2, 3, 4, 5)).astype(np.float32))
    w.add_tensor("q8.3d", random_blocks(rng, Q.Q8_0, 2 * 3 * 2).reshape(2, 3, -1), raw_dtype=Q.Q8_0)
    w.add_tensor("f32.1d", np.array([1.0, -2.0, 3.5], dtype=np.float32))
    # A type lorarun reads but does not dequantise.
    w.add_tensor("unsupported.IQ4_NL", rng.integers(0, 256, size=(2, 18), dtype=np.uint8), raw_dtype=Q.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    report(nested=nested)


def quant_inputs(rng):
    """(finite, special) float32 arrays, whole Q8_0 blocks, with the cases the rounding rules decide."""
    blocks = []
    for exp in range(-38, 37, 2):  # normal values, one magnitude per block
        blocks.append(rng.standard_normal((4, 32)) * 10.0 ** exp)
    blocks.append(np.zeros((2, 32)))
    blocks.append(np.full((1, 32), -0.0))
    for shift in range(-6, 7, 3):  # d = amax / 127 a power of two: x * (1 / d) = k + 0.5 exactly
        d = 2.0 ** shift
        ties = (rng.integers(-127, 127, size=(4, 32)) + 0.5) * d
        ties[:, 0] = 127 * d
        blocks.append(ties)
    h = rng.integers(0, 0x7BFF, size=(8, 32)).astype(np.uint16)  # fp16 ties: halfway between neighbours
    lo, hi = h.view(np.float16).astype(np.float32), (h + 1).view(np.float16).astype(np.float32)
    blocks.append((lo.astype(np.float64) + hi) / 2 * np.where(rng.random((8, 32)) < 0.5, -1, 1))
    b = (rng.integers(0, 0x7F7F, size=(8, 32), dtype=np.uint32) << 16) | 0x8000  # bf16 ties
    blocks.append(b.view(np.float32))
    blocks.append((rng.integers(1, 1 << 23, size=(2, 32), dtype=np.uint32)).view(np.float32))  # subnormals
    finite = np.concatenate([np.asarray(x, dtype=np.float32).reshape(-1, 32) for x in blocks])
    special = finite[:16].copy()
    bits = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FA00000, 0x7F802000,
                     0xFF812345, 0x7F7FFFFF, 0x477FF000, 0x477FEFFF], dtype=np.uint32)
    special[:, :bits.size] = bits.view(np.float32)
    return finite.reshape(-1), special.reshape(-1)


def quant(out):
    os.makedirs(out, exist_ok=True)
    finite, special = quant_inputs(np.random.default_rng(77))
    written = {}
    for name, data, types in [("finite", finite, [Q.F16, Q.BF16, Q.Q8_0]), ("special", special, [Q.F16, Q.BF16])]:
        data.tofile(os.path.join(out, f"{name}.f32"))
        for qtype in types:
            with np.errstate(all="ignore"):
                q = gguf.quants.quantize(data.reshape(-1, 32), qtype)
            np.ascontiguousarray(q).view(np.uint8).tofile(os.path.join(out, f"{name}.{qtype.name}"))
            written[f"{name}.{qtype.name}"] = int(data.size)
    report(written=written)


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    {"dump": dump, "make": make, "quant": quant}[mode](path)
