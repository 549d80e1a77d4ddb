"""bitsandbytes 0.50.2 on the CPU: the paths that depend on the CPU's features, and a way around them.

Two code paths change with the CPU, so a QLoRA reference computed through them is not portable:

1. dequantize_4bit: the native kernel (cdequantize_blockwise_cpu_{nf4,fp4}_{fp32,bf16,fp16} in
   libbitsandbytes_cpu.so) checks has_avx512f() at run time. With AVX-512F, when the last
   dimension n is a multiple of 16 and the block size at least 16, it takes an AVX-512 branch that
   reads each row's scales as absmax[row * (n // blocksize) + col // blocksize]. That is right only
   when every row starts a new block; bitsandbytes quantises the flattened weight, so with n not a
   multiple of the block size (64) blocks run across rows and most values get another block's scale
   (a llama fixture's o_proj/down_proj, 96 inputs). Without AVX-512F the scalar branch indexes the
   flat block. (backends/cpu/ops.py sends block sizes >= 2048 to the PyTorch code on AVX-512 CPUs
   "for accuracy", and odd n everywhere; n % 64 != 0 is not caught.)
2. Linear4bit.forward: with has_avx512bf16() (read when the layer is made), in eval mode on an
   input that needs no gradient, the layer rewrites its own weight into a blocked layout with the
   block scales in bf16 (_convert_weight_packed_for_cpu, which asserts out_features % 32 == 0) and
   computes through gemv_4bit in bf16: the input and the output are rounded to bf16. The kernel is
   kernels-community's gemm_4bit_forward when the `kernels` package loads, otherwise the native
   gemv_4bit_inference_cpu_nf4_bf16; without `kernels` bitsandbytes logs a warning at import.

dequantize_nf4() is dequantize_4bit by bitsandbytes' own PyTorch implementation (backends/default,
the one its CPU backend falls back to), the same on every CPU; equal, bit for bit, to the native
scalar branch. The references use it and never run a Linear4bit forward in the numbers compared.

force_avx512bf16_paths() makes a CPU without AVX-512 take both paths, so that the references can be
shown not to depend on them (LORARUN_TEST_FORCE_BNB_AVX512BF16=1, applied by oracle.py):
has_avx512bf16() and has_avx512f_cpu() answer yes, and the native entry points the AVX-512 branches
live in are replaced by PyTorch code doing what those branches do (their AVX-512 instructions do
not run here): the row-wise scale indexing of (1), and for (2) bf16 inputs times the bf16 NF4 table,
float32 sums per block, times the bf16 scale, rounded to bf16. Everything around them is
bitsandbytes' own Python: the checks, the repacking, the fallbacks, the import-time warning.
"""
import ctypes as ct
import importlib.abc
import importlib.util
import sys

FORCED = False  # (torch is imported where it is used: oracle.py's readers need none of this)


def dequantize_nf4(packed, state):
    """dequantize_4bit(packed, state) by bitsandbytes' PyTorch implementation: the same on every CPU."""
    import bitsandbytes.functional as F
    import torch
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code
    assert not getattr(state, "packing_format_for_cpu", False), "a weight Linear4bit.forward has repacked"
    absmax = state.absmax
    if state.nested:  # the 8-bit absmax: one scalar kernel on every CPU (quantize_cpu / dequantizeBlockwise8bitCpu)
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    A = packed.view(torch.uint8).reshape(-1)
    compute = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)  # eager, not torch.compile
    return compute(A, absmax.float(), _get_4bit_code(state.quant_type, A.device), state.blocksize, state.shape,
                   state.dtype)


def linear4bit_cpu_path():
    """None where Linear4bit's CPU forward computes dequantize_4bit(W) in the input's dtype, or why not."""
    import bitsandbytes.functional as F
    if F.has_avx512bf16():
        return ("bitsandbytes' Linear4bit takes its AVX-512 BF16 CPU path here (weights repacked, computed in bf16), "
                "not the reference's dequantize_4bit(W) in float32")
    return None


def _view(ptr, count, dtype):
    """A tensor over `count` elements of `dtype` at the address of a ctypes pointer."""
    import torch
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ct.c_ubyte * (count * size)).from_address(ptr.value), dtype=dtype, count=count)


def _unpack(packed):
    """[rows, n/2] bytes, high nibble first -> [rows, n] codes."""
    import torch
    return torch.stack([packed >> 4, packed & 0xF], -1).reshape(packed.shape[0], -1).long()


class _Avx512Lib:
    """libbitsandbytes_cpu as an AVX-512 BF16 CPU runs it: the branches of the module docstring."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        parts = name.split("_")
        if name.startswith("cdequantize_blockwise_cpu_") and parts[-2] in ("nf4", "fp4"):
            return lambda *a: self._dequantize_4bit(name, parts[-2], parts[-1], *a)
        if name.startswith("gemv_4bit_inference_cpu_"):
            return lambda *a: self._gemv_4bit(parts[-2], *a)
        if name in ("has_avx512f_cpu", "has_avx512bf16_cpu"):
            return lambda: 1
        return getattr(self._lib, name)

    def _dequantize_4bit(self, name, quant_type, dtype_name, A, absmax, out, blocksize, m, n):
        bs, m, n = blocksize.value, m.value, n.value
        if not (n % 16 == 0 and bs >= 16):  # the scalar branch, as on every CPU
            return getattr(self._lib, name)(A, absmax, out, blocksize, ct.c_longlong(m), ct.c_longlong(n))
        import bitsandbytes.functional as F
        import torch
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        codes = _unpack(_view(A, m * n // 2, torch.uint8).reshape(m, n // 2))
        scales = _view(absmax, -(-m * n // bs), torch.float32)
        index = torch.arange(m).unsqueeze(1) * (n // bs) + torch.arange(n).unsqueeze(0) // bs  # row-wise: the bug
        values = F.get_4bit_type(quant_type, device="cpu")[codes] * scales[index]
        _view(out, m * n, dtype).copy_(values.reshape(-1).to(dtype))

    def _gemv_4bit(self, quant_type, M, N, K, A, B, absmax, out, blocksize, x_stride, out_stride):
        import bitsandbytes.functional as F
        import torch
        M, N, K, bs, xs, os_ = M.value, N.value, K.value, blocksize.value, x_stride.value, out_stride.value
        x = _view(A, (M - 1) * xs + K, torch.bfloat16).as_strided((M, K), (xs, 1)).float()
        # The blocked layout of _convert_weight_packed_for_cpu, undone as its inverse does.
        packed = _view(B, N * K // 2, torch.uint8).reshape(-1, 32)
        codes = torch.cat([packed & 0xF, packed >> 4], -1).reshape(N // 32, K // 2, 32, 2).transpose(1, 2).reshape(N, K)
        table = F.get_4bit_type(quant_type, device="cpu").bfloat16().float()
        w = table[codes.long()].reshape(N, K // bs, bs)
        scales = _view(absmax, (K // bs) * N, torch.bfloat16).reshape(K // bs, N).float()
        partial = torch.einsum("mgk,ngk->mgn", x.reshape(M, K // bs, bs), w)  # float32 sums per block
        y = (partial * scales.unsqueeze(0)).sum(1).bfloat16()
        _view(out, (M - 1) * os_ + N, torch.bfloat16).as_strided((M, N), (os_, 1)).copy_(y)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs patch(module) right after `name` is executed, before any importer sees it."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)
        spec.loader.exec_module = exec_module
        return spec


def force_avx512bf16_paths():
    """Makes bitsandbytes, imported after this, take its AVX-512 (BF16) CPU paths on any x86 CPU."""
    global FORCED
    assert "bitsandbytes" not in sys.modules, "force_avx512bf16_paths() must run before bitsandbytes is imported"
    FORCED = True

    def functional(module):
        module.has_avx512bf16 = lambda: True

    def cpu_ops(module):
        module._has_avx512 = True  # torch's capability on such a CPU: the blocksize >= 2048 fallback
        module.lib = _Avx512Lib(module.lib)
    sys.meta_path.insert(0, _AfterImport("bitsandbytes.functional", functional))
    sys.meta_path.insert(0, _AfterImport("bitsandbytes.backends.cpu.ops", cpu_ops))
