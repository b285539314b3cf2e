"""A seeded, orthonormal block-Hadamard rotation along K: the pure-PyTorch reference.

Issue 34 item 3 proposes rotating each weight along K (the reduction dim) before quantizing it,
as a versioned option of the format. A rotation ``R`` (``[K, K]``, orthonormal) leaves a Linear's
output unchanged when the activations turn with it:

    (x R) (W R)^T = x R R^T W^T = x W^T

so the stored weight is ``W R`` and a kernel multiplies by ``x R`` instead of ``x``. Rotating mixes
each weight with its neighbours along K, which spreads an outlier over the block and makes the
block's values closer to Gaussian: a codebook fitted to the layer and one scale per 32 elements
then lose less. This module defines ``R`` and applies it; nothing here knows about the format,
the kernels or transformers.

The rotation
------------
``R = diag(s) B``, with

- ``s``: a sign vector, ``s[i] = -1`` when bit 63 of the ``i``-th output of SplitMix64 seeded with
  ``seed`` is set, else ``+1``. That output is ``mix(seed + (i + 1) * 0x9E3779B97F4A7C15 mod 2**64)``
  (:func:`splitmix64`), a counter-based hash: ``s[i]`` depends on ``(seed, i)`` alone, not on ``K``,
  so any runtime can rebuild it in a few integer instructions (or from a ``K``-bit table) without
  torch's generator, and every weight that reads the same ``x`` (fused q/k/v, gate/up, all experts
  of a projection) turns ``x`` the same way.
- ``B``: block diagonal, normalised Sylvester Hadamard matrices ``H_b / sqrt(b)`` on consecutive
  segments of K (``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``; symmetric, so ``B = B^T =
  B^-1``). Segments are ``block`` long (a power of two, :data:`DEFAULT_BLOCK` = 8, the format's).
  **Tail**: when ``block`` does not divide K, the remaining ``r = K mod block`` elements are split by
  the binary digits of ``r`` into power-of-two segments, largest first (K = 200, block 64: 64, 64,
  64, 8). Every element is rotated, ``R`` stays orthonormal and square in K (no padding, so the
  format's rule "columns past K are zero and never read" still holds), and a segment never
  straddles a format block of 32 unless it is larger than one. The real models of interest have
  K a multiple of 64 (576, 896, 1536, 2048, 4864, ...); at block 128 some leave a 64 tail.

``x R`` is ``(x * s)`` followed by a Walsh-Hadamard transform of each segment
(:func:`fwht_segments`: ``log2(b)`` butterfly stages of adds and subtracts, then one multiply by
``1/sqrt(b)``); ``y R^T`` (:func:`unrotate`) is the transform followed by ``* s``. Weights
``[..., N, K]`` rotate exactly like activations ``[..., K]``: row by row along the last dim.

What the kernels do
-------------------
A rotated weight is an ordinary format tensor: decode, planes, scales and tiling do not change.
Only the activation operand does, from ``x`` to ``x R``, on every path, turned before it meets the
decoded weights (``csrc/rotation.cuh``; costs measured in docs/kernels.md#rotation):

- **Work per activation element**, segment ``b = 8`` (the format's): 3 butterfly stages (one add or
  subtract each), a sign flip and one multiply by ``1/sqrt(8)`` rounded to float32 (the reference
  multiplies by the same float32 constant, so both round alike). A thread that loads 8 consecutive
  16-bit values (one 16-byte load) holds a whole segment: no shuffles, ~5 instructions per element,
  per element of x, never per weight element.
- **Signs**: the kernels read ``s`` as sign words (:func:`sign_words`: int32 ``[K / 32]``, bit ``e & 31``
  of word ``e >> 5`` set where ``s[e] = -1``), a buffer of the module that checkpoints carry
  (``<module>.rotation_signs``).
- **Where**: the GEMV and the grouped GEMV rotate as they stage x (and after a fused prologue); the
  wgmma GEMM in its x rewrite; the mma.sync GEMM, dequantize + cuBLAS and the GEMV above its
  measured crossover after a standalone rotation (``kbit_rotate``); dequantize and the gradients
  unrotate.
- **Rounding**: the mma operand is ``x R`` rounded to the activation dtype (bf16/fp16), one rounding
  per element as for ``x``; the CPU reference rotates in float32 and rounds the same way.

Format (``docs/format.md``, version 3): a rotated layer stores its quantized ``W R`` with ``block`` 8
(:data:`hf_kbit.format.ROTATION_BLOCK`) and its sign words; only layers with K a multiple of 64
(:data:`hf_kbit.format.ROTATION_MULTIPLE`) rotate. :func:`rotate_words` and :func:`unrotate_words` are the
rotation the format and the ops' references read from those words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_SEED",
    "BlockHadamard",
    "fwht_segments",
    "rotate",
    "rotate_words",
    "sign_words",
    "segments",
    "signs",
    "splitmix64",
    "unrotate",
    "unrotate_words",
    "word_signs",
]

DEFAULT_BLOCK = 8  # the format's segment (hf_kbit.format.ROTATION_BLOCK): 3 butterfly stages in a thread's registers
WORD_BITS = 32  # signs per sign word
DEFAULT_SEED = 0
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (2**64 / golden ratio, odd)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's finaliser multipliers
_U64 = (1 << 64) - 1


def _check_block(block: int) -> int:
    if not isinstance(block, int) or isinstance(block, bool) or block < 2 or block & (block - 1):
        raise ValueError(f"rotation block must be a power of two >= 2, got {block!r}")
    return block


def _check_seed(seed: int) -> int:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= _U64:
        raise ValueError(f"rotation seed must be an int in [0, 2**64), got {seed!r}")
    return seed


def splitmix64(seed: int, count: int) -> list[int]:
    """The first ``count`` outputs of SplitMix64 seeded with ``seed``, as Python ints in [0, 2**64)."""
    out = []
    for i in range(count):
        z = (seed + (i + 1) * _GOLDEN) & _U64
        z = ((z ^ (z >> 30)) * _MIX1) & _U64
        z = ((z ^ (z >> 27)) * _MIX2) & _U64
        out.append(z ^ (z >> 31))
    return out


@lru_cache(maxsize=64)
def _sign_bits(seed: int, k: int) -> tuple[bool, ...]:
    import numpy as np

    # splitmix64 vectorised: uint64 arrays wrap modulo 2**64, as the hash wants.
    z = np.uint64(seed) + np.arange(1, k + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    z = z ^ (z >> np.uint64(31))
    return tuple(bool(b) for b in (z >> np.uint64(63)))


def signs(k: int, seed: int = DEFAULT_SEED, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The sign vector ``s`` ``[k]`` (+-1 in ``dtype``): ``-1`` where bit 63 of SplitMix64 output ``i`` is set."""
    _check_seed(seed)
    negative = torch.tensor(_sign_bits(seed, k), dtype=torch.bool, device="cpu")
    return torch.where(negative, -1.0, 1.0).to(dtype=dtype, device=device)


def sign_words(k: int, seed: int = DEFAULT_SEED, device=None) -> torch.Tensor:
    """The sign vector ``s`` of :func:`signs` as int32 words ``[k / 32]``: bit ``e & 31`` of word ``e >> 5`` is
    set where ``s[e] = -1``. ``k`` must be a multiple of 32."""
    import numpy as np

    _check_seed(seed)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0 or k % WORD_BITS:
        raise ValueError(f"sign_words: k must be a non-negative multiple of {WORD_BITS}, got {k!r}")
    bits = np.array(_sign_bits(seed, k), dtype=np.uint32).reshape(-1, WORD_BITS)
    words = (bits << np.arange(WORD_BITS, dtype=np.uint32)).sum(-1, dtype=np.uint32)
    return torch.from_numpy(words.view(np.int32).copy()).to(device)


def word_signs(words: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sign words int32 ``[W]`` (:func:`sign_words`) -> the sign vector ``[32 W]`` (+-1 in ``dtype``), on their device."""
    if words.dtype != torch.int32 or words.dim() != 1:
        raise ValueError(f"sign words must be a 1-D int32 tensor, got {words.dtype} of shape {tuple(words.shape)}")
    shifts = torch.arange(WORD_BITS, device=words.device, dtype=torch.int64)
    negative = (words.long()[:, None] >> shifts) & 1
    return torch.where(negative.bool(), -1.0, 1.0).to(dtype).reshape(-1)


def _check_words(x: torch.Tensor, words: torch.Tensor) -> None:
    if x.shape[-1] != WORD_BITS * words.numel():
        raise ValueError(f"sign words: {words.numel()} words sign {WORD_BITS * words.numel()} elements, the tensor's "
                         f"last dim has {x.shape[-1]}")


def rotate_words(x: torch.Tensor, words: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``x [..., K] @ R`` with the signs of ``words`` (:func:`sign_words`), computed in float32 (float64 stays
    float64) and returned in ``x``'s dtype: one rounding."""
    _check_words(x, words)
    w = _working(x)
    return fwht_segments(w * word_signs(words, w.dtype), block).to(x.dtype)


def unrotate_words(y: torch.Tensor, words: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``y [..., K] @ R^T``, the inverse of :func:`rotate_words`, in float32 and returned in ``y``'s dtype."""
    _check_words(y, words)
    w = _working(y)
    return (fwht_segments(w, block) * word_signs(words, w.dtype)).to(y.dtype)


def segments(k: int, block: int = DEFAULT_BLOCK) -> list[tuple[int, int]]:
    """``(start, size)`` of each Hadamard segment of K: whole ``block``s, then the tail ``K mod block``
    split into powers of two by its binary digits, largest first."""
    _check_block(block)
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be a non-negative int, got {k!r}")
    out = [(start, block) for start in range(0, k - k % block, block)]
    start, tail = k - k % block, k % block
    for size in (1 << j for j in reversed(range(tail.bit_length()))):
        if tail & size:
            out.append((start, size))
            start += size
    return out


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform (Sylvester order) of the last dim, a power of two."""
    *lead, n = x.shape
    h = 1
    while h < n:
        pairs = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return x


def fwht_segments(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``x [..., K] @ B``: the normalised Hadamard transform of each segment (:func:`segments`) of the last dim.

    ``O(K log2 block)`` adds per row. Runs in ``x``'s dtype (a floating dtype); ``B`` is its own inverse.
    """
    k = x.shape[-1]
    parts, i, segs = [], 0, segments(k, block)
    while i < len(segs):
        start, size = segs[i]
        j = i
        while j < len(segs) and segs[j][1] == size:
            j += 1
        run = x[..., start : start + (j - i) * size]
        run = _fwht(run.reshape(*x.shape[:-1], j - i, size)) * (1.0 / math.sqrt(size))
        parts.append(run.reshape(*x.shape[:-1], (j - i) * size))
        i = j
    return torch.cat(parts, dim=-1) if parts else x.clone()


def _working(x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise TypeError(f"rotation needs a floating point tensor, got {x.dtype}")
    return x if x.dtype == torch.float64 else x.float()


def rotate(x: torch.Tensor, block: int = DEFAULT_BLOCK, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """``x [..., K] @ R``: activations ``[..., K]`` or weights ``[..., N, K]`` (row by row), in float32
    (float64 stays float64)."""
    x = _working(x)
    return fwht_segments(x * signs(x.shape[-1], seed, x.dtype, x.device), block)


def unrotate(y: torch.Tensor, block: int = DEFAULT_BLOCK, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """``y [..., K] @ R^T``, the inverse of :func:`rotate`: a rotated weight back in the original basis."""
    y = _working(y)
    return fwht_segments(y, block) * signs(y.shape[-1], seed, y.dtype, y.device)


@dataclass(frozen=True)
class BlockHadamard:
    """One rotation: ``block`` (a power of two >= 2) and ``seed`` (in [0, 2**64)), validated on creation."""

    block: int = DEFAULT_BLOCK
    seed: int = DEFAULT_SEED

    def __post_init__(self):
        _check_block(self.block)
        _check_seed(self.seed)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ R`` (:func:`rotate`)."""
        return rotate(x, self.block, self.seed)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """``y @ R^T`` (:func:`unrotate`)."""
        return unrotate(y, self.block, self.seed)

    def to_dict(self) -> dict[str, object]:
        """What a config would record: ``{"rotation": "block-hadamard", "block": b, "seed": s}``."""
        return {"rotation": "block-hadamard", "block": self.block, "seed": self.seed}
