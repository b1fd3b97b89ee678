"""FP4 number formats: the bit-level reference every kernel is checked against.

This module is the executable form of the numerics contract (docs/numerics.md): NVFP4 (E2M1 values,
16-element blocks with E4M3 scales and an FP32 per-tensor scale), MXFP4 (32-element blocks with E8M0
scales), stochastic rounding, the 16x16 random Hadamard transform, and the 128x4 swizzled scale layout
of Blackwell block-scaled GEMMs. Everything is plain PyTorch on float32 so that it runs on any device;
GPU kernels elsewhere in the package must produce the same bits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import numpy as np
import torch

__all__ = [
    "E2M1_VALUES",
    "DEFAULT_RHT_SIGNS",
    "QTensor",
    "quantize",
    "dequantize",
    "block_decode",
    "global_decode_scale",
    "decode_factor",
    "gemm_alpha",
    "SCALE_RULES",
    "global_constant",
    "quantization_stats",
    "encode_e2m1",
    "decode_e2m1",
    "pack_e2m1",
    "unpack_e2m1",
    "sr_random_bits",
    "rht",
    "hadamard_matrix",
    "swizzle_scales",
    "unswizzle_scales",
    "swizzled_offset",
]

FLT_MAX = torch.finfo(torch.float32).max
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# 2688 = E2M1_MAX * E4M3_MAX: the global scale maps amax to the largest representable product.
NVFP4_GLOBAL = E2M1_MAX * E4M3_MAX
# Block scale rules of NVFP4: "6" scales each block's maximum to 6 (the recipe's rule); "4/6" ("Four Over
# Six") also tries scaling it to 4 (the first candidate's scale times 1.5) and keeps, per block, the
# candidate with the smaller squared error. Its global scale maps amax to 6 * 256 = 1536 instead of 2688,
# so that a block scale expanded by 1.5 still fits E4M3 (256 * 1.5 = 384 <= 448).
SCALE_RULES = ("6", "4/6")
FOUR_OVER_SIX_E4M3_MAX = 256.0
FOUR_OVER_SIX_GLOBAL = E2M1_MAX * FOUR_OVER_SIX_E4M3_MAX
FOUR_OVER_SIX_EXPANSION = 1.5

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Magnitude thresholds between neighbouring E2M1 values, with whether a tie goes up (to the
# neighbour with the even code). Codes 0..7 index E2M1_VALUES; even codes win ties.
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

DEFAULT_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

_FORMAT_BLOCKS = {
    "nvfp4": ("1x16", "16x16"),
    "mxfp4": ("1x32",),
}
_BLOCK_SHAPES = {"1x16": (1, 16), "16x16": (16, 16), "1x32": (1, 32)}
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass
class QTensor:
    """A tensor quantized to an FP4 format.

    ``data`` holds two E2M1 codes per byte (``torch.float4_e2m1fn_x2``, shape ``[..., K/2]``, the element
    with the even index in the low nibble). ``scales`` holds one block scale per block along the last
    dim (``[..., K/block]``, row-major, unswizzled; for 16x16 tiles each row carries its tile's scale).
    ``amax`` is the global absolute maximum (float32, 0-dim) for NVFP4 and ``None`` for MXFP4.
    """

    data: torch.Tensor
    scales: torch.Tensor
    amax: Optional[torch.Tensor]
    fmt: str
    block: str
    shape: torch.Size
    dtype: torch.dtype
    scale_rule: str = "6"

    def codes(self) -> torch.Tensor:
        """The unpacked 4-bit codes as uint8, shape ``self.shape``."""
        return unpack_e2m1(self.data)

    def transpose(self) -> "QTensor":
        """The quantized transpose of a 16x16-tile quantized matrix (same codes, transposed).

        Only 16x16 tiles are transpose-invariant: the tile scale serves its rows and its columns.
        """
        if self.block != "16x16":
            raise ValueError(f"only 16x16-tile quantized tensors can be transposed, got block={self.block!r}")
        codes = self.codes().transpose(-1, -2).contiguous()
        tiles = self.scales[..., ::16, :]  # one row of scales per 16-row tile: [..., R/16, C/16]
        scales = tiles.transpose(-1, -2).repeat_interleave(16, dim=-2).contiguous()
        shape = self.shape[:-2] + (self.shape[-1], self.shape[-2])
        return QTensor(pack_e2m1(codes), scales, self.amax, self.fmt, self.block, torch.Size(shape), self.dtype,
                       self.scale_rule)


# ----------------------------------------------------------------------------------------------
# E2M1 element codes
# ----------------------------------------------------------------------------------------------


def _e2m1_index_rne(mag: torch.Tensor) -> torch.Tensor:
    """Index into E2M1_VALUES of the nearest value to ``mag`` (>= 0), ties to even, saturating at 6."""
    idx = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    for threshold, tie_up in _E2M1_THRESHOLDS:
        idx += mag >= threshold if tie_up else mag > threshold
    return idx


def _e2m1_index_sr(mag: torch.Tensor, rand_bits: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of ``mag`` (>= 0) onto the E2M1 grid, saturating at 6.

    With lo <= mag < hi the two grid neighbours, the result is hi with probability (mag - lo)/(hi - lo).
    The draw is u = bits * 2**-16 from 16 random bits, and hi is taken when u < (mag - lo)/(hi - lo).
    Grid steps are powers of two and hi <= 2*lo, so the fraction is exact in float32.
    """
    values = _e2m1_table(mag.device)[:8]
    mag = torch.clamp(mag, max=E2M1_MAX)
    # Index of the largest grid value <= mag.
    lo_idx = torch.zeros(mag.shape, dtype=torch.int64, device=mag.device)
    for v in E2M1_VALUES[1:]:
        lo_idx += mag >= v
    hi_idx = torch.clamp(lo_idx + 1, max=7)
    lo = values[lo_idx]
    step = values[hi_idx] - lo
    frac = torch.where(step > 0, (mag - lo) / torch.where(step > 0, step, 1.0), 0.0)
    u = rand_bits.to(torch.float32) * (2.0**-16)
    return torch.where(u < frac, hi_idx, lo_idx).to(torch.uint8)


def _device_constant(build):
    """A cache for a function that builds a constant tensor on a device. A missing entry is built
    outside any fake-tensor mode: the cache must hold a real tensor even when first asked for by code
    running on fake tensors (the ops' implementations run on them when ``lower_kernels`` traces them)."""
    cache: dict = {}

    @functools.wraps(build)
    def get(*args):
        value = cache.get(args)
        if value is None:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                value = cache.setdefault(args, build(*args))
        return value

    get.cache_clear = cache.clear
    return get


@_device_constant
def _e2m1_table(device: torch.device) -> torch.Tensor:
    """float32 value of each 4-bit code on ``device``, built once per device (a copy to a GPU made
    on every call would wait for the device's queue)."""
    return torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=torch.float32, device=device)


def encode_e2m1(v: torch.Tensor, rounding: str = "rne", rand_bits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 values -> 4-bit codes (uint8, sign << 3 | index), saturating at +-6.

    NaN has no E2M1 encoding; callers keep NaN visible through the scales (see ``quantize``).
    """
    mag = v.abs()
    if rounding == "rne":
        idx = _e2m1_index_rne(mag)
    elif rounding == "sr":
        if rand_bits is None:
            raise ValueError("stochastic rounding needs rand_bits")
        idx = _e2m1_index_sr(mag, rand_bits)
    else:
        raise ValueError(f"rounding must be 'rne' or 'sr', got {rounding!r}")
    sign = (torch.signbit(v)).to(torch.uint8) << 3
    return sign | idx


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) -> float32 values."""
    return _e2m1_table(codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> ``torch.float4_e2m1fn_x2`` [..., K/2], even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of E2M1 codes along the last dim: shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.contiguous().view(torch.float4_e2m1fn_x2)


def unpack_e2m1(data: torch.Tensor) -> torch.Tensor:
    """``torch.float4_e2m1fn_x2`` (or uint8) [..., K/2] -> uint8 codes [..., K]."""
    raw = data.view(torch.uint8)
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(*raw.shape[:-1], raw.shape[-1] * 2)


# ----------------------------------------------------------------------------------------------
# Stochastic rounding bits: a counter-based generator, identical on every device
# ----------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xorshift-multiply, 'lowbias32') on int64 tensors holding uint32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def _hash32_uint32(x: np.ndarray) -> np.ndarray:
    """lowbias32 on a uint32 array, in place (numpy's uint32 arithmetic wraps modulo 2**32)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def sr_random_bits(numel: int, seed: int, device=None) -> torch.Tensor:
    """The 16 random bits (int64 holding uint16) stochastic rounding uses for elements 0..numel-1.

    Elements 2p and 2p + 1 share the 32-bit word w[p] = h((p mod 2**32) xor k0 xor h((p >> 32) xor k1)),
    with k0, k1 the low and high 32 bits of ``seed`` and h the lowbias32 mixer: element 2p takes its low
    16 bits, element 2p + 1 its high 16 bits. One hash per word: the inner one depends only on the
    pair's high 32 bits (the same for the first 2**32 pairs), so kernels compute it once per block of
    pairs. Counter-based, so any kernel on any device can produce the same bits for the same (seed,
    element index).
    """
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    device = torch.device(device) if device is not None else torch.get_default_device()
    pairs = (numel + 1) // 2
    if device.type == "cpu" and pairs <= 2**32:
        # The same function in uint32 arithmetic: a few times faster than the int64 emulation below.
        key = _hash32_uint32(np.array([k1], dtype=np.uint32))[0] ^ np.uint32(k0)  # p >> 32 is 0 for every pair here
        x = np.arange(pairs, dtype=np.uint32)
        x ^= key
        words = torch.from_numpy(_hash32_uint32(x).astype(np.int64))
    else:
        p = torch.arange(pairs, dtype=torch.int64, device=device)
        words = _hash32((p & _M32) ^ k0 ^ _hash32((p >> 32) ^ k1))
    return torch.stack([words & 0xFFFF, words >> 16], dim=-1).reshape(-1)[:numel]


# ----------------------------------------------------------------------------------------------
# Quantize / dequantize
# ----------------------------------------------------------------------------------------------


def _check_args(x: torch.Tensor, fmt: str, block: str, rounding: str) -> None:
    if fmt not in _FORMAT_BLOCKS:
        raise ValueError(f"unknown FP4 format {fmt!r}; expected one of {sorted(_FORMAT_BLOCKS)}")
    if block not in _FORMAT_BLOCKS[fmt]:
        raise ValueError(f"block {block!r} is not valid for {fmt}; expected one of {_FORMAT_BLOCKS[fmt]}")
    if rounding not in ("rne", "sr"):
        raise ValueError(f"rounding must be 'rne' or 'sr', got {rounding!r}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"quantize takes float32, bfloat16 or float16 tensors, got {x.dtype} of shape {tuple(x.shape)}")
    rows, cols = _BLOCK_SHAPES[block]
    if x.dim() < (2 if rows > 1 else 1):
        raise ValueError(f"block {block} needs a tensor with at least {2 if rows > 1 else 1} dims, got shape {tuple(x.shape)}")
    if x.shape[-1] % cols:
        raise ValueError(
            f"last dim of shape {tuple(x.shape)} is not a multiple of the block size {cols} (block {block}); pad it first"
        )
    if rows > 1 and x.shape[-2] % rows:
        raise ValueError(
            f"dim -2 of shape {tuple(x.shape)} is not a multiple of the tile height {rows} (block {block}); pad it first"
        )


def _block_amax(xf: torch.Tensor, block: str) -> torch.Tensor:
    """Per-block absolute maximum, broadcast back to one value per 1xK-block row: shape [..., K/cols]."""
    rows, cols = _BLOCK_SHAPES[block]
    a = xf.abs()
    k = a.shape[-1]
    a = a.reshape(*a.shape[:-1], k // cols, cols).amax(dim=-1)  # [..., R, K/cols]
    if rows > 1:
        r = a.shape[-2]
        tiles = a.reshape(*a.shape[:-2], r // rows, rows, k // cols).amax(dim=-2)  # [..., R/16, K/16]
        a = tiles.repeat_interleave(rows, dim=-2)
    return a


def _per_block(xf: torch.Tensor, cols: int, op, per_block: torch.Tensor) -> torch.Tensor:
    """``op(x, s)`` elementwise, with s [..., K/cols] the value of each x's block along the last dim."""
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // cols, cols)
    return op(blocks, per_block.unsqueeze(-1)).reshape(xf.shape)


def _check_scale_rule(scale_rule: str, fmt: str = "nvfp4") -> None:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if scale_rule != "6" and fmt != "nvfp4":
        raise ValueError(
            f"scale_rule={scale_rule!r} (Four Over Six) is an NVFP4 block scale rule: {fmt} has power-of-two "
            "block scales and no per-tensor scale to give it room; use scale_rule='6' with it"
        )


def global_constant(scale_rule: str = "6") -> float:
    """The value a tensor's amax is mapped to by its global scale: 6 * 448 = 2688 for the rule "6",
    6 * 256 = 1536 for "4/6" (room for the block scales expanded by 1.5)."""
    _check_scale_rule(scale_rule)
    return NVFP4_GLOBAL if scale_rule == "6" else FOUR_OVER_SIX_GLOBAL


def global_encode_scale(amax: torch.Tensor, scale_rule: str = "6") -> torch.Tensor:
    """S_enc = min(G / amax, FLT_MAX), replaced by 1 where amax == 0 or S_enc == 0; G = 2688 (the rule
    "6") or 1536 ("4/6"), ``global_constant``."""
    # An IEEE division (``G / tensor`` in PyTorch would be reciprocal-then-multiply: two roundings).
    s = torch.clamp(torch.full_like(amax, global_constant(scale_rule)).div(amax), max=FLT_MAX)  # clamp keeps NaN
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def decode_factor(scale_rule: str = "6") -> float:
    """fp32(1/G), the factor the decode formula multiplies an amax by, as the Python float of that
    float32 value (exact: multiplying a float32 tensor by it multiplies by the float32 value)."""
    return float(torch.tensor(1.0 / global_constant(scale_rule), dtype=torch.float32))


def global_decode_scale(amax: torch.Tensor, scale_rule: str = "6") -> torch.Tensor:
    """amax / G as the decode formula computes it: amax * fp32(1/G) (G = 2688, or 1536 for "4/6")."""
    return amax.float() * torch.tensor(decode_factor(scale_rule), dtype=torch.float32)


def gemm_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor, scale_rule: str = "6") -> torch.Tensor:
    """alpha = (amax_A / G) * (amax_B / G) in float32: the one factor an NVFP4 GEMM's epilogue
    multiplies the fp32 sum of block-decoded products by (``out = cast(alpha * acc)``); G as
    ``global_decode_scale``."""
    return global_decode_scale(amax_a, scale_rule) * global_decode_scale(amax_b, scale_rule)


def _pair_tree_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) in a fixed order: adjacent pairs, level by level
    (((v0 + v1) + (v2 + v3)) + ...), one float32 rounding per addition; kernels add in the same order."""
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def four_over_six_errors(xf, sf6, sf4, g_amax, cols: int, rows: int = 1):
    """(err6, err4): each block's squared error sum(x^ - x)^2 after dequantization with the E4M3 scale
    sf6 (block maximum scaled to 6) and sf4 (scaled to 4), both rounding to nearest even; one value per
    1xcols block row [..., K/cols], a 16x16 tile's error (``rows`` 16) repeated on its 16 rows.

    x^ = value(code) * ((sf * amax) * fp32(1/1536)), as ``dequantize``; the squares are summed over each
    row's 16 elements and then over the tile's 16 rows, both in ``_pair_tree_sum``'s order."""
    s_enc = global_encode_scale(g_amax, "4/6")
    s_dec = 1.0 / s_enc
    inv = torch.tensor(1.0 / FOUR_OVER_SIX_GLOBAL, dtype=torch.float32)
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // cols, cols)
    errors = []
    for sf in (sf6, sf4):
        sfv = sf.float()
        enc = torch.clamp(1.0 / (sfv * s_dec), max=FLT_MAX)
        values = decode_e2m1(encode_e2m1(blocks * enc.unsqueeze(-1)))
        d = values * ((sfv * g_amax) * inv).unsqueeze(-1) - blocks
        err = _pair_tree_sum(d * d)  # [..., R, K/cols]
        if rows > 1:
            r = err.shape[-2]
            tiles = err.reshape(*err.shape[:-2], r // rows, rows, err.shape[-1]).transpose(-1, -2)
            err = _pair_tree_sum(tiles).repeat_interleave(rows, dim=-2)
        errors.append(err)
    return errors[0], errors[1]


def nvfp4_encode(xf, bamax, g_amax, cols: int, rounding: str, rand_bits=None, scale_rule: str = "6",
                 rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed E2M1 codes, E4M3 block scales) of fp32 ``xf`` with block amaxes ``bamax`` [..., K/cols]
    and the global amax ``g_amax``: a scalar, or one value per block broadcast against ``bamax`` (the
    grouped quantization of MoE experts, one global amax per expert). The NUMERICS formulas.

    ``scale_rule="4/6"`` (Four Over Six): S_enc maps amax to 1536; each block (a ``rows`` x ``cols``
    tile) has two candidate scales, sf6 = E4M3(bamax * (S_enc * fp32(1/6))) and sf4 = E4M3(min(fp32 of
    that product before rounding * 1.5, 448)), and keeps sf4 where its squared error after
    dequantization (``four_over_six_errors``, round to nearest even) is strictly smaller, else sf6. The
    codes are then rounded with the kept scale: stochastically under SR (the choice itself never depends
    on the random bits, so SR stays unbiased for the kept scale)."""
    _check_scale_rule(scale_rule)
    s_enc = global_encode_scale(g_amax, scale_rule)
    s_dec = 1.0 / s_enc
    sf32 = torch.clamp(bamax * (s_enc * torch.tensor(1.0 / 6.0, dtype=torch.float32)), max=E4M3_MAX)
    sf = sf32.to(torch.float8_e4m3fn)
    if scale_rule == "4/6":
        sf4 = torch.clamp(sf32 * FOUR_OVER_SIX_EXPANSION, max=E4M3_MAX).to(torch.float8_e4m3fn)
        err6, err4 = four_over_six_errors(xf, sf, sf4, g_amax, cols, rows)
        sf = torch.where(err4 < err6, sf4.float(), sf.float()).to(torch.float8_e4m3fn)  # NaN keeps sf6
    enc = torch.clamp(1.0 / (sf.float() * s_dec), max=FLT_MAX)
    v = _per_block(xf, cols, torch.mul, enc)
    return pack_e2m1(encode_e2m1(v, rounding, rand_bits)), sf


def quantize(
    x: torch.Tensor,
    fmt: str = "nvfp4",
    block: str = "1x16",
    rounding: str = "rne",
    generator: Optional[torch.Generator] = None,
    amax: Optional[torch.Tensor] = None,
    seed: Optional[int] = None,
    scale_rule: str = "6",
) -> QTensor:
    """Quantize ``x`` to an FP4 format, blocks along the last dim (or 16x16 tiles over the last two).

    ``rounding="sr"`` rounds the E2M1 codes stochastically (scales stay round-to-nearest-even). Its
    random bits come from ``sr_random_bits(x.numel(), seed)``; without ``seed`` the seed is drawn from
    ``generator`` (or torch's default generator), so a seeded generator reproduces the same bits.
    ``amax`` overrides the global absolute maximum (e.g. one all-reduced across ranks); a NaN/Inf
    amax of ``x`` itself still wins, so non-finite input stays visible.
    ``scale_rule``: NVFP4's block scale rule, "6" (the recipe's) or "4/6" (Four Over Six, ``nvfp4_encode``);
    MXFP4 takes "6" only.
    """
    _check_args(x, fmt, block, rounding)
    _check_scale_rule(scale_rule, fmt)
    xf = x.float()
    rand_bits = None
    if rounding == "sr":
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device if generator else "cpu"))
        rand_bits = sr_random_bits(xf.numel(), seed, device=xf.device).reshape(xf.shape)
    cols = _BLOCK_SHAPES[block][1]
    bamax = _block_amax(xf, block)
    if fmt == "nvfp4":
        # max |x|: the largest block maximum (NaN propagates); 0 for an empty tensor (no tokens), which
        # quantizes to an empty result like an all-zero one
        g_amax = bamax.amax() if bamax.numel() else bamax.new_zeros(())
        if amax is not None:
            # A finite override must not hide NaN/Inf in x: a non-finite amax of x wins over it.
            g_amax = torch.where(torch.isfinite(g_amax), amax.detach().float().reshape(()), g_amax)
        codes, sf = nvfp4_encode(xf, bamax, g_amax, cols, rounding, rand_bits, scale_rule, _BLOCK_SHAPES[block][0])
        return QTensor(codes, sf, g_amax.reshape(()).clone(), fmt, block, x.shape, x.dtype, scale_rule)
    # MXFP4: scale = 2**(floor(log2(bamax)) - 2), an E8M0 power of two clamped to [2**-127, 2**127].
    _, e = torch.frexp(bamax)
    exp = torch.where(bamax > 0, e.to(torch.int32) - 1 - 2, torch.full_like(e, -127, dtype=torch.int32))
    exp = torch.clamp(exp, -127, 127)
    biased = (exp + 127).to(torch.uint8)
    biased = torch.where(torch.isfinite(bamax), biased, torch.full_like(biased, 0xFF))  # 0xFF is NaN
    scales = biased.view(torch.float8_e8m0fnu)
    scale32 = torch.exp2(exp.to(torch.float32))
    v = _per_block(xf, cols, torch.div, scale32)
    codes = encode_e2m1(v, rounding, rand_bits)
    return QTensor(pack_e2m1(codes), scales, None, fmt, block, x.shape, x.dtype)


def block_decode(q: QTensor) -> torch.Tensor:
    """value(code) * block scale, in float32: what the tensor core multiplies before alpha is applied.

    Every E2M1 x E4M3 (or E2M1 x E8M0) product is exact in float32 and in bfloat16.
    """
    cols = _BLOCK_SHAPES[q.block][1]
    vals = decode_e2m1(q.codes())
    return vals * q.scales.float().repeat_interleave(cols, dim=-1)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The exact inverse used by the emulated GEMM: value(code) * ((sf * amax) * fp32(1/2688)) for NVFP4
    (fp32(1/1536) with the scale rule "4/6"), value(code) * scale for MXFP4."""
    cols = _BLOCK_SHAPES[q.block][1]
    vals = decode_e2m1(q.codes())
    if q.fmt == "nvfp4":
        inv = 1.0 / global_constant(q.scale_rule)
        scale = (q.scales.float() * q.amax.float()) * torch.tensor(inv, dtype=torch.float32)
    else:
        scale = q.scales.float()
    return (vals * scale.repeat_interleave(cols, dim=-1)).to(dtype)


# The statistics ``quantization_stats`` returns, in the order ``quantization_stats_tensor`` holds them.
STATS = ("zero_fraction", "scale_saturated", "scale_underflow", "relative_error", "amax")


def quantization_stats(x: torch.Tensor, q: QTensor) -> dict:
    """What NVFP4 quantization ``q`` of ``x`` (the tensor as quantized: after the RHT where the recipe
    applies it) lost, as Python numbers:

    - ``zero_fraction``: of the finite nonzero elements of x, the fraction whose code is +-0;
    - ``scale_saturated``: of the blocks, the fraction whose E4M3 scale is its largest value, 448, and
      whose largest element still lands above 6 (its values clip);
    - ``scale_underflow``: of the blocks holding a nonzero element, the fraction whose scale is 0 (the
      block decodes to zeros);
    - ``relative_error``: ||dequantize(q) - x|| / ||x|| in float64 (0 for an all-zero x);
    - ``amax``: the global amax q was made with.

    The values of ``quantization_stats_tensor``, which computes them on x's device.
    """
    return dict(zip(STATS, quantization_stats_tensor(x, q).tolist()))


def quantization_stats_tensor(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """``quantization_stats`` as a float64 tensor [5] on x's device, in the order of ``STATS``, computed
    with tensor ops only (no value is read back to the host: what the compiled graphs record with
    ``fp4.record_stats``). Each fraction is a count divided by a count in float64 (counts below 2**53
    are exact, so the division is the one correctly rounded quotient); the error is the float64 norm
    of the difference over the float64 norm of x, both summed over contiguous copies, so that x's
    memory layout (a transposed operand) does not change the summation order: the same bits on the
    same device and thread count; across devices the norms' order differs (the error agrees to float64
    rounding, about 1e-15 relative)."""
    if q.fmt != "nvfp4":
        raise ValueError(f"quantization_stats takes an NVFP4 quantization, got {q.fmt}")
    xf = x.detach().float().reshape(q.shape).contiguous()
    codes = q.codes()
    finite_nonzero = torch.isfinite(xf) & (xf != 0)
    zeros = finite_nonzero & ((codes & 7) == 0)
    sf = q.scales.float()
    bamax = _block_amax(xf, q.block)
    enc = torch.clamp(1.0 / (sf * (1.0 / global_encode_scale(q.amax, q.scale_rule))), max=FLT_MAX)
    saturated = (sf == E4M3_MAX) & (bamax * enc > E2M1_MAX)
    occupied = bamax > 0
    deq = dequantize(q).double()
    xd = xf.double()
    norm = xd.norm()
    one = torch.ones((), dtype=torch.float64, device=xf.device)

    def count(mask):
        return mask.sum().double()

    return torch.stack((
        count(zeros) / torch.maximum(count(finite_nonzero), one),
        count(saturated) / max(sf.numel(), 1),
        count(occupied & (sf == 0)) / torch.maximum(count(occupied), one),
        torch.where(norm != 0, (deq - xd).norm() / torch.where(norm != 0, norm, one), torch.zeros_like(norm)),
        q.amax.double().reshape(()).to(xf.device),
    ))


# ----------------------------------------------------------------------------------------------
# Random Hadamard transform
# ----------------------------------------------------------------------------------------------


def hadamard_matrix(size: int = 16, signs=None, device=None) -> torch.Tensor:
    """diag(signs) @ H_size / sqrt(size) in float32, H the Sylvester Hadamard matrix."""
    s = _rht_signs(size, signs)
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (s[:, None] * h * (1.0 / math.sqrt(size))).to(device)


def _rht_signs(size: int, signs) -> torch.Tensor:
    """The sign vector (float32, ``size`` entries; the default one for size 16) after checking the size."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
    if signs is None:
        if size != len(DEFAULT_RHT_SIGNS):
            raise ValueError(f"the default sign vector has 16 entries; pass signs for size {size}")
        signs = DEFAULT_RHT_SIGNS
    s = torch.as_tensor(signs, dtype=torch.float32)
    if s.shape != (size,):
        raise ValueError(f"signs must have {size} entries, got shape {tuple(s.shape)}")
    return s


def rht(x: torch.Tensor, size: int = 16, signs=None) -> torch.Tensor:
    """Blockwise random Hadamard transform along the last dim: each ``size`` chunk c -> c @ H.

    Computed in float32 in a fixed order, the same on every device (a fast Walsh-Hadamard butterfly):
    ``z[i] = c[i] * fp32(s[i] / sqrt(size))``, then for ``h = size/2, size/4, .., 1`` each pair
    ``(z[i], z[i + h])`` with ``i & h == 0`` becomes ``(z[i] + z[i + h], z[i] - z[i + h])``, one float32
    rounding per operation; the result is returned in ``x.dtype``. ``log2(size)`` additions per element
    instead of ``size`` multiply-adds. Applying it to both operands along a GEMM's reduction dim leaves
    the product unchanged (H is orthogonal).
    """
    if x.shape[-1] % size:
        raise ValueError(f"RHT of size {size} needs the last dim to be a multiple of {size}, got shape {tuple(x.shape)}")
    scale = _default_rht_scale(size, x.device) if signs is None else _rht_scale(size, signs, x.device)
    lead = x.shape[:-1]
    chunks = x.shape[-1] // size
    z = x.float().reshape(*lead, chunks, size) * scale
    h = size // 2
    while h >= 1:
        pairs = z.reshape(*lead, chunks, size // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        z = torch.stack((a + b, a - b), dim=-2).reshape(*lead, chunks, size)
        h //= 2
    return z.reshape(x.shape).to(x.dtype)


def _rht_scale(size: int, signs, device) -> torch.Tensor:
    """fp32(s[i] / sqrt(size)) on ``device``: what each chunk element is multiplied by first."""
    return (_rht_signs(size, signs) * (1.0 / math.sqrt(size))).to(device)


@_device_constant
def _default_rht_scale(size: int, device: torch.device) -> torch.Tensor:
    """``_rht_scale`` of the default signs, kept on each device: copied there once, not on every call
    (a host-to-device copy cannot be recorded in a CUDA graph)."""
    return _rht_scale(size, None, device)


# ----------------------------------------------------------------------------------------------
# Swizzled scale layout of Blackwell block-scaled GEMMs
# ----------------------------------------------------------------------------------------------


def swizzled_offset(r, c, cols: int):
    """Byte offset of scale (r, c) of a [rows, cols] scale matrix in the 128x4 tiled layout.

    Tiles of 128 rows x 4 scale columns, row-major over tiles; inside a tile the 32-row groups
    interleave: ((r//128 * ceil(cols/4) + c//4) * 32 + r%32) * 16 + ((r%128)//32) * 4 + c%4.
    """
    return (((r // 128) * ((cols + 3) // 4) + c // 4) * 32 + r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """[rows, cols] scales -> flat tiled layout of round_up(rows,128) * round_up(cols,4) bytes, zero padded."""
    if scales.dim() != 2:
        raise ValueError(f"swizzle_scales takes a 2-D scale matrix, got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    raw = torch.zeros(pr, pc, dtype=torch.uint8, device=scales.device)
    raw[:rows, :cols] = scales.view(torch.uint8)
    # [pr/128, 4, 32, pc/4, 4] -> [pr/128, pc/4, 32, 4(row groups), 4(cols)]
    tiled = raw.reshape(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4)
    return tiled.reshape(-1).view(scales.dtype)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle_scales``: the [rows, cols] scales, padding dropped."""
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    raw = swizzled.reshape(-1).view(torch.uint8)
    if raw.numel() != pr * pc:
        raise ValueError(f"swizzled scales hold {raw.numel()} bytes; [{rows}, {cols}] needs {pr * pc}")
    tiled = raw.reshape(pr // 128, pc // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(pr, pc)
    return tiled[:rows, :cols].contiguous().view(swizzled.dtype)
