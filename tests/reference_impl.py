"""An independent, element-by-element implementation of the numerics contract (docs/numerics.md).

It is deliberately slow and plain: Python floats rounded to float32 one operation at a time, exact
rational arithmetic (``fractions.Fraction``) wherever a rounding decision is made, and loops over blocks.
It shares no code with ``fp4compile.formats``; the tests compare the two bit for bit.

Conventions: arrays are numpy; codes are uint8 E2M1 codes (sign << 3 | index into ``E2M1_GRID``);
scales are the raw scale bytes (E4M3 for NVFP4, E8M0 for MXFP4).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = 448.0
E4M3_NAN = 0x7F
E8M0_NAN = 0xFF
M32 = (1 << 32) - 1


# ----------------------------------------------------------------------------------------------
# float32 arithmetic on Python floats
# ----------------------------------------------------------------------------------------------


def f32(x: float) -> float:
    """Round a Python float (double) to the nearest float32 (ties to even; overflow gives +-inf).

    A single +, *, / of two float32 values done in double and then rounded with f32 is the correctly
    rounded float32 result (double has more than 2*24+2 bits, so the double rounding is innocuous).
    """
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def f32_mul(a: float, b: float) -> float:
    return f32(a * b)


def f32_div(a: float, b: float) -> float:
    """a / b in float32, IEEE semantics for division by zero."""
    if b == 0.0:
        if a == 0.0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return f32(a / b)


def _round_half_even(q: Fraction) -> int:
    """Nearest integer to a non-negative rational, ties to the even integer."""
    n = math.floor(q)
    rest = q - n
    if rest > Fraction(1, 2):
        return n + 1
    if rest < Fraction(1, 2):
        return n
    return n if n % 2 == 0 else n + 1


# ----------------------------------------------------------------------------------------------
# E2M1
# ----------------------------------------------------------------------------------------------


def e2m1_code(v: float) -> int:
    """E2M1 code of a float32 value: nearest grid value, ties to the even code, saturating at +-6.

    NaN has no code; it maps to a zero of the NaN's sign (callers keep NaN visible via the scales).
    """
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    if math.isnan(v):
        return sign
    m = abs(v)
    if m >= 6.0:
        return sign | 7
    mf = Fraction(m)
    best, best_dist = 0, None
    for idx, g in enumerate(E2M1_GRID):
        dist = abs(mf - Fraction(g))
        if best_dist is None or dist < best_dist or (dist == best_dist and idx % 2 == 0):
            best, best_dist = idx, dist
    return sign | best


def e2m1_value(code: int) -> float:
    mag = E2M1_GRID[code & 7]
    return -mag if code & 8 else mag


def e2m1_neighbours(m: float) -> tuple[float, float]:
    """The grid values lo <= m <= hi around a magnitude (both 6 at or above 6)."""
    m = min(abs(m), 6.0)
    lo = max(g for g in E2M1_GRID if g <= m)
    hi = min(g for g in E2M1_GRID if g >= m)
    return lo, hi


def sr_draw_hi(m: float, bits: int) -> bool:
    """Whether stochastic rounding of magnitude m takes the upper neighbour, for 16 random bits.

    The documented draw: u = bits * 2**-16, and the upper neighbour is taken when
    u < (m - lo) / (hi - lo).
    """
    lo, hi = e2m1_neighbours(m)
    if hi == lo:
        return False
    frac = (Fraction(min(m, 6.0)) - Fraction(lo)) / (Fraction(hi) - Fraction(lo))
    return Fraction(bits, 1 << 16) < frac


def e2m1_code_sr(v: float, bits: int) -> int:
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    if math.isnan(v):
        return sign
    m = min(abs(v), 6.0)
    lo, hi = e2m1_neighbours(m)
    target = hi if sr_draw_hi(m, bits) else lo
    return sign | E2M1_GRID.index(target)


# ----------------------------------------------------------------------------------------------
# E4M3 (float8_e4m3fn): bias 7, 3 mantissa bits, subnormal step 2**-9, max 448, 0x7F = NaN
# ----------------------------------------------------------------------------------------------


def e4m3_bits(x: float) -> int:
    """float32 -> E4M3 byte: round to nearest even, subnormals kept, saturating at +-448."""
    if math.isnan(x):
        return E4M3_NAN
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    m = abs(x)
    if m >= E4M3_MAX:  # includes +-inf: satfinite
        return sign | 0x7E
    if m == 0.0:
        return sign
    mf = Fraction(m)
    e = math.frexp(m)[1] - 1  # m = 1.f * 2**e
    quantum = Fraction(2) ** (max(e, -6) - 3)  # 8 steps per binade; subnormals share the 2**-6 binade's step
    r = _round_half_even(mf / quantum) * quantum
    if r >= E4M3_MAX:
        return sign | 0x7E
    if r == 0:
        return sign
    if r < Fraction(1, 64):  # subnormal: exponent field 0, value = mant * 2**-9
        return sign | int(r / Fraction(1, 512))
    e = math.floor(math.log2(r))
    while Fraction(2) ** e > r:
        e -= 1
    while Fraction(2) ** (e + 1) <= r:
        e += 1
    mant = int((r / Fraction(2) ** e - 1) * 8)
    return sign | ((e + 7) << 3) | mant


def e4m3_value(bits: int) -> float:
    sign = -1.0 if bits & 0x80 else 1.0
    exp, mant = (bits >> 3) & 0xF, bits & 7
    if exp == 0xF and mant == 7:
        return math.nan
    if exp == 0:
        return sign * mant * 2.0**-9
    return sign * (1 + mant / 8) * 2.0 ** (exp - 7)


def e8m0_value(bits: int) -> float:
    return math.nan if bits == E8M0_NAN else 2.0 ** (bits - 127)


# ----------------------------------------------------------------------------------------------
# Stochastic-rounding random bits: lowbias32 hash of (element index, 64-bit seed)
# ----------------------------------------------------------------------------------------------


def lowbias32(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def sr_bits(index: int, seed: int) -> int:
    """The 16 random bits of element ``index``: the low (even index) or high (odd) half of its pair's word."""
    seed &= (1 << 64) - 1
    k0, k1 = seed & M32, seed >> 32
    pair = index >> 1
    word = lowbias32((pair & M32) ^ k0 ^ lowbias32((pair >> 32) ^ k1))
    return (word >> (16 * (index & 1))) & 0xFFFF


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------

_ONE_SIXTH = f32(1.0 / 6.0)
_ONE_OVER_2688 = f32(1.0 / 2688.0)


def _abs_max(values) -> float:
    m = 0.0
    for v in values:
        v = abs(float(v))
        if math.isnan(v):
            return math.nan
        m = max(m, v)
    return m


def _global_amax(x: np.ndarray, override: float | None) -> float:
    """max |x|, or the override; a NaN/Inf in x wins over an override so that it stays visible."""
    own = _abs_max(x.ravel())
    if override is None or not math.isfinite(own):
        return own
    return f32(float(override))


def global_scales(amax: float) -> tuple[float, float]:
    """(S_enc, S_dec) for a global amax."""
    if math.isnan(amax):
        return math.nan, math.nan
    s_enc = f32_div(2688.0, amax) if amax != 0.0 else math.inf
    s_enc = min(s_enc, FLT_MAX)
    if amax == 0.0 or s_enc == 0.0:
        s_enc = 1.0
    return s_enc, f32_div(1.0, s_enc)


def _tiles(shape, block: str):
    """Yield lists of (index tuple) per block of a tensor of ``shape``; 1x16 along the last dim,
    16x16 over the last two."""
    *lead, k = shape
    if block == "1x16":
        for idx in np.ndindex(*lead):
            for b in range(k // 16):
                yield [idx + (b * 16 + j,) for j in range(16)]
    elif block == "16x16":
        *lead2, r = lead
        for idx in np.ndindex(*lead2):
            for ti in range(r // 16):
                for tj in range(k // 16):
                    yield [idx + (ti * 16 + i, tj * 16 + j) for i in range(16) for j in range(16)]
    else:
        raise ValueError(block)


def nvfp4_quantize(x: np.ndarray, block: str = "1x16", amax: float | None = None, rounding: str = "rne", seed: int = 0):
    """NVFP4 quantization of a float32 array. Returns (codes, scale_bytes, amax).

    ``scale_bytes`` has shape [..., K/16]; with 16x16 tiles every row carries its tile's scale.
    SR uses ``sr_bits(flat row-major element index, seed)``.
    """
    x = np.asarray(x, dtype=np.float32)
    g_amax = _global_amax(x, amax)
    s_enc, s_dec = global_scales(g_amax)
    c = f32_mul(s_enc, _ONE_SIXTH)
    codes = np.zeros(x.shape, dtype=np.uint8)
    scales = np.zeros(x.shape[:-1] + (x.shape[-1] // 16,), dtype=np.uint8)
    for cells in _tiles(x.shape, block):
        bamax = _abs_max(x[i] for i in cells)
        sf = e4m3_bits(f32_mul(bamax, c))
        sf_val = e4m3_value(sf)
        enc = min(f32_div(1.0, f32_mul(sf_val, s_dec)), FLT_MAX)
        for i in cells:
            v = f32_mul(float(x[i]), enc)
            if rounding == "rne":
                codes[i] = e2m1_code(v)
            else:
                flat = int(np.ravel_multi_index(i, x.shape))
                codes[i] = e2m1_code_sr(v, sr_bits(flat, seed))
            scales[i[:-1] + (i[-1] // 16,)] = sf
    return codes, scales, g_amax


def nvfp4_scaled_values(x: np.ndarray, block: str = "1x16", amax: float | None = None) -> np.ndarray:
    """v = x * enc for every element (float64 array holding float32 values): what E2M1 rounds."""
    x = np.asarray(x, dtype=np.float32)
    g_amax = _global_amax(x, amax)
    s_enc, s_dec = global_scales(g_amax)
    c = f32_mul(s_enc, _ONE_SIXTH)
    out = np.zeros(x.shape, dtype=np.float64)
    for cells in _tiles(x.shape, block):
        bamax = _abs_max(x[i] for i in cells)
        sf_val = e4m3_value(e4m3_bits(f32_mul(bamax, c)))
        enc = min(f32_div(1.0, f32_mul(sf_val, s_dec)), FLT_MAX)
        for i in cells:
            out[i] = f32_mul(float(x[i]), enc)
    return out


def nvfp4_decode_scale(sf_bits: int, amax: float) -> float:
    """(fp32(sf) * amax) * fp32(1/2688), each product rounded to float32."""
    return f32_mul(f32_mul(e4m3_value(sf_bits), amax), _ONE_OVER_2688)


def nvfp4_dequantize(codes: np.ndarray, scales: np.ndarray, amax: float) -> np.ndarray:
    out = np.zeros(codes.shape, dtype=np.float32)
    for i in np.ndindex(*codes.shape):
        sf = int(scales[i[:-1] + (i[-1] // 16,)])
        out[i] = f32_mul(e2m1_value(int(codes[i])), nvfp4_decode_scale(sf, amax))
    return out


# ----------------------------------------------------------------------------------------------
# MXFP4: 32-element blocks, E8M0 scale 2**(floor(log2(bamax)) - 2)
# ----------------------------------------------------------------------------------------------


def mxfp4_scale_exponent(bamax: float) -> int:
    """floor(log2(bamax)) - 2, clamped to the E8M0 range [-127, 127]; an all-zero block gets -127."""
    if bamax == 0.0:
        return -127
    return max(-127, min(127, math.frexp(bamax)[1] - 1 - 2))


def mxfp4_quantize(x: np.ndarray, rounding: str = "rne", seed: int = 0):
    """Returns (codes, scale_bytes[..., K/32])."""
    x = np.asarray(x, dtype=np.float32)
    codes = np.zeros(x.shape, dtype=np.uint8)
    scales = np.zeros(x.shape[:-1] + (x.shape[-1] // 32,), dtype=np.uint8)
    for idx in np.ndindex(*x.shape[:-1]):
        for b in range(x.shape[-1] // 32):
            cells = [idx + (b * 32 + j,) for j in range(32)]
            bamax = _abs_max(x[i] for i in cells)
            if not math.isfinite(bamax):
                scales[idx + (b,)] = E8M0_NAN
                e = 0
            else:
                e = mxfp4_scale_exponent(bamax)
                scales[idx + (b,)] = e + 127
            for i in cells:
                v = f32(float(x[i]) / 2.0**e)
                if rounding == "rne":
                    codes[i] = e2m1_code(v)
                else:
                    flat = int(np.ravel_multi_index(i, x.shape))
                    codes[i] = e2m1_code_sr(v, sr_bits(flat, seed))
    return codes, scales


def mxfp4_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    out = np.zeros(codes.shape, dtype=np.float32)
    for i in np.ndindex(*codes.shape):
        out[i] = f32_mul(e2m1_value(int(codes[i])), e8m0_value(int(scales[i[:-1] + (i[-1] // 32,)])))
    return out


# ----------------------------------------------------------------------------------------------
# Random Hadamard transform and the swizzled scale layout
# ----------------------------------------------------------------------------------------------

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard16(signs=RHT_SIGNS) -> np.ndarray:
    """diag(signs) @ H16 * 0.25 with H16[i, j] = (-1)**popcount(i & j) (Sylvester)."""
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)], dtype=np.float64)
    return np.diag(np.asarray(signs, dtype=np.float64)) @ h * 0.25


def round_f32(value: Fraction) -> float:
    """An exact rational rounded to the nearest float32 (ties to even), as a Python float; +-inf past
    the largest finite float32, +0.0 for zero."""
    if value == 0:
        return 0.0
    sign = -1.0 if value < 0 else 1.0
    a = abs(value)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2**e <= a < 2**(e + 2)
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)  # below the normal range the grid step stays 2**-149
    step = Fraction(2) ** (e - 23)
    q = a / step
    n = math.floor(q)
    rem = q - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
        n += 1
    result = n * step
    if result > Fraction(FLT_MAX):
        return sign * math.inf
    return sign * float(result)


def rht_fma_chain(x: np.ndarray, signs=RHT_SIGNS) -> np.ndarray:
    """The same transform summed another way (not formats.rht's order): per 16-chunk c and output j, y = 0, then
    y = fma(c[i], H[i, j], y) for i = 0..15, each step rounded once to float32 (exact rationals here)."""
    h = hadamard16(signs)
    flat = np.asarray(x, dtype=np.float32).reshape(-1, 16)
    out = np.empty_like(flat)
    for r, chunk in enumerate(flat):
        for j in range(16):
            y = 0.0
            for i in range(16):
                product = Fraction(float(chunk[i])) * Fraction(h[i, j])
                if math.isfinite(y):
                    y = round_f32(Fraction(y) + product)
                else:  # inf stays inf (or becomes NaN against -inf), as in float arithmetic
                    y = y + float(product)
            out[r, j] = y
    return out.reshape(np.shape(x))


def _f32_op(a: float, b: float, subtract: bool) -> float:
    """a + b or a - b rounded once to float32 (exact rationals), with float semantics for inf/NaN."""
    if not (math.isfinite(a) and math.isfinite(b)) or (a == 0 and b == 0):
        return float(np.float32(a - b if subtract else a + b))  # inf, NaN and signed zeros as IEEE
    return round_f32(Fraction(a) - Fraction(b) if subtract else Fraction(a) + Fraction(b))


def rht_butterfly(x: np.ndarray, signs=RHT_SIGNS) -> np.ndarray:
    """formats.rht's contract on float32 [..., K]: per 16-chunk c, z[i] = fp32(c[i] * s[i] / 4), then for
    h = 8, 4, 2, 1 every pair (z[i], z[i + h]) with i & h == 0 becomes (z[i] + z[i + h], z[i] - z[i + h]),
    each operation rounded once to float32 (exact rationals here)."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1, 16)
    out = np.empty_like(flat)
    for r, chunk in enumerate(flat):
        z = []
        for i in range(16):
            c = float(chunk[i])
            exact = math.isfinite(c) and c != 0
            z.append(round_f32(Fraction(c) * Fraction(signs[i], 4)) if exact else c * signs[i] / 4)
        h = 8
        while h >= 1:
            for i in range(16):
                if i & h == 0:
                    z[i], z[i + h] = _f32_op(z[i], z[i + h], False), _f32_op(z[i], z[i + h], True)
            h //= 2
        out[r] = z
    return out.reshape(np.shape(x))


def swizzle_offset(r: int, c: int, cols: int) -> int:
    """Byte offset of scale (r, c) of a [rows, cols] scale matrix in the 128x4 tiled layout."""
    col_tiles = -(-cols // 4)
    tile = (r // 128) * col_tiles + c // 4
    return (tile * 32 + r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle(scales: np.ndarray) -> np.ndarray:
    """[rows, cols] bytes -> flat tiled layout, zero padded to round_up(rows,128) x round_up(cols,4)."""
    rows, cols = scales.shape
    out = np.zeros((-(-rows // 128) * 128) * (-(-cols // 4) * 4), dtype=np.uint8)
    for r in range(rows):
        for c in range(cols):
            out[swizzle_offset(r, c, cols)] = scales[r, c]
    return out
