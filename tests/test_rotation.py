"""The block-Hadamard rotation against a slow, obviously correct dense matrix built element by element."""

from __future__ import annotations

import pytest
import torch

from hf_kbit import format as fmt
from hf_kbit import rotation

# float64 butterflies against a float64 matrix product: both are sums of a handful of terms.
FLOAT64 = {"atol": 1e-12, "rtol": 1e-12}
# float32 butterflies (log2(block) <= 7 roundings of values ~1) against the float64 product.
FLOAT32 = {"atol": 2e-6, "rtol": 2e-6}

# (K, block): whole blocks, tails of one and several powers of two, K below one block, K = 1.
SHAPES = [(256, 64), (200, 64), (576, 128), (37, 64), (96, 32), (1, 64), (64, 2)]
SHAPE_IDS = ["whole", "tail-8", "tail-64", "below-block", "block32", "k1", "block2"]


def splitmix64_ref(seed: int, i: int) -> int:
    """Output i of SplitMix64 seeded with ``seed`` by running the generator (state += golden; mix)."""
    state, mask = seed, (1 << 64) - 1
    for _ in range(i + 1):
        state = (state + 0x9E3779B97F4A7C15) & mask
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def segments_ref(k: int, block: int) -> list[int]:
    """Sizes: whole blocks while they fit, then ever smaller powers of two while they fit."""
    sizes, left, size = [], k, block
    while left:
        if size <= left:
            sizes.append(size)
            left -= size
        else:
            size //= 2
    return sizes


def dense_rotation(k: int, block: int, seed: int) -> torch.Tensor:
    """R = diag(s) B in float64, B block diagonal with H[i, j] = (-1)**popcount(i & j) / sqrt(size)."""
    r = torch.zeros(k, k, dtype=torch.float64)
    start = 0
    for size in segments_ref(k, block):
        for i in range(size):
            for j in range(size):
                r[start + i, start + j] = (-1) ** bin(i & j).count("1") / size**0.5
        start += size
    s = torch.tensor([-1.0 if splitmix64_ref(seed, i) >> 63 else 1.0 for i in range(k)], dtype=torch.float64)
    return s[:, None] * r


def test_splitmix64_matches_the_published_stream():
    # SplitMix64 (Steele, Lea, Flood 2014; Java's SplittableRandom) seeded with 0 starts with these outputs.
    assert rotation.splitmix64(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert rotation.splitmix64(12345, 50) == [splitmix64_ref(12345, i) for i in range(50)]


@pytest.mark.parametrize("seed", [0, 1, 2**64 - 1])
def test_signs_are_bit_63_of_splitmix64_and_ignore_k(seed):
    s = rotation.signs(300, seed)
    expected = [-1.0 if splitmix64_ref(seed, i) >> 63 else 1.0 for i in range(300)]
    assert s.dtype == torch.float32 and s.tolist() == expected
    assert torch.equal(rotation.signs(100, seed), s[:100])  # element i's sign depends on (seed, i) only
    assert 100 < int((s > 0).sum()) < 200  # about half of each


def test_seeds_give_different_rotations_and_the_same_seed_the_same():
    x = torch.randn(4, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(rotation.rotate(x, 64, 7), rotation.rotate(x, 64, 7))
    assert not torch.equal(rotation.signs(256, 7), rotation.signs(256, 8))


@pytest.mark.parametrize(("k", "block"), SHAPES, ids=SHAPE_IDS)
def test_segments_cover_k_with_powers_of_two(k, block):
    segs = rotation.segments(k, block)
    assert [size for _, size in segs] == segments_ref(k, block)
    assert [start for start, _ in segs] == [sum(size for _, size in segs[:i]) for i in range(len(segs))]
    assert sum(size for _, size in segs) == k


def test_tail_is_split_by_binary_digits():
    assert rotation.segments(200, 64) == [(0, 64), (64, 64), (128, 64), (192, 8)]
    assert rotation.segments(576, 128)[-1] == (512, 64)
    assert rotation.segments(37, 64) == [(0, 32), (32, 4), (36, 1)]
    assert rotation.segments(0, 64) == []


@pytest.mark.parametrize(("k", "block"), SHAPES, ids=SHAPE_IDS)
def test_dense_reference_is_orthonormal(k, block):
    r = dense_rotation(k, block, seed=3)
    torch.testing.assert_close(r @ r.T, torch.eye(k, dtype=torch.float64), **FLOAT64)


@pytest.mark.parametrize(("k", "block"), SHAPES, ids=SHAPE_IDS)
def test_rotate_and_unrotate_are_the_dense_products(k, block):
    g = torch.Generator().manual_seed(k)
    r = dense_rotation(k, block, seed=3)
    x = torch.randn(2, 5, k, dtype=torch.float64, generator=g)  # weights [E, N, K] rotate row by row
    torch.testing.assert_close(rotation.rotate(x, block, 3), x @ r, **FLOAT64)
    torch.testing.assert_close(rotation.unrotate(x, block, 3), x @ r.T, **FLOAT64)
    torch.testing.assert_close(rotation.unrotate(rotation.rotate(x, block, 3), block, 3), x, **FLOAT64)


@pytest.mark.parametrize(("k", "block"), SHAPES, ids=SHAPE_IDS)
def test_rotated_product_equals_the_original(k, block):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, k, dtype=torch.float64, generator=g)
    w = torch.randn(7, k, dtype=torch.float64, generator=g)
    got = rotation.rotate(x, block, 11) @ rotation.rotate(w, block, 11).T
    torch.testing.assert_close(got, x @ w.T, **FLOAT64)


def test_fwht_is_the_unsigned_dense_transform():
    x = torch.randn(3, 200, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    unsigned = dense_rotation(200, 64, 0) * rotation.signs(200, 0, torch.float64)[:, None]  # diag(s) R = B
    torch.testing.assert_close(rotation.fwht_segments(x, 64), x @ unsigned, **FLOAT64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision_inputs_rotate_in_float32(dtype):
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(4)).to(dtype)
    out = rotation.rotate(x, 128, 0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), x.double() @ dense_rotation(576, 128, 0), **FLOAT32)
    torch.testing.assert_close(rotation.unrotate(out, 128, 0), x.float(), **FLOAT32)


def test_block_hadamard_object():
    r = rotation.BlockHadamard(block=32, seed=5)
    x = torch.randn(2, 96, dtype=torch.float64)
    assert torch.equal(r.rotate(x), rotation.rotate(x, 32, 5))
    assert torch.equal(r.unrotate(x), rotation.unrotate(x, 32, 5))
    assert r.to_dict() == {"rotation": "block-hadamard", "block": 32, "seed": 5}
    assert rotation.BlockHadamard() == rotation.BlockHadamard(rotation.DEFAULT_BLOCK, rotation.DEFAULT_SEED)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"block": 48}, "power of two"), ({"block": 1}, "power of two"), ({"block": True}, "power of two"),
    ({"seed": -1}, r"seed must be an int in \[0, 2\*\*64\)"), ({"seed": 2**64}, "seed must be"),
    ({"seed": 1.0}, "seed must be"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rotation.BlockHadamard(**kwargs)


def test_integer_tensors_are_refused():
    with pytest.raises(TypeError, match="floating point"):
        rotation.rotate(torch.ones(2, 64, dtype=torch.int32))


# ---------------------------------------------------------------------------- sign words (format v3)


@pytest.mark.parametrize("seed", [0, 5, 2**64 - 1])
def test_sign_words_bit_order_is_the_sign_vector(seed):
    k = 320
    words = rotation.sign_words(k, seed)
    assert words.dtype == torch.int32 and words.shape == (k // 32,)
    s = rotation.signs(k, seed)
    for e in range(k):  # bit (e & 31) of word (e >> 5) set <=> s[e] = -1
        bit = (int(words[e >> 5]) >> (e & 31)) & 1
        assert bit == (s[e] < 0), e
    assert torch.equal(rotation.word_signs(words), s)


def test_sign_words_refuse_k_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        rotation.sign_words(100)


@pytest.mark.parametrize("k", [64, 256, 200], ids=["one-block", "whole", "tail"])
def test_rotate_words_is_the_dense_product(k):
    k = k // 32 * 32
    x = torch.randn(3, 2, k, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
    words = rotation.sign_words(k, 9)
    r = dense_rotation(k, fmt.ROTATION_BLOCK, 9)
    torch.testing.assert_close(rotation.rotate_words(x, words), x @ r, **FLOAT64)
    torch.testing.assert_close(rotation.unrotate_words(x, words), x @ r.T, **FLOAT64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rotate_words_rounds_once_to_the_input_dtype(dtype):
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    words = rotation.sign_words(128, 0)
    out = rotation.rotate_words(x, words)
    assert out.dtype == dtype
    block = fmt.ROTATION_BLOCK
    assert torch.equal(out, rotation.rotate(x.float(), block, 0).to(dtype))  # float32 math, one rounding
    assert torch.equal(rotation.unrotate_words(out, words), rotation.unrotate(out.float(), block, 0).to(dtype))


def test_rotate_words_checks_the_word_count():
    with pytest.raises(ValueError, match="2 words sign 64 elements"):
        rotation.rotate_words(torch.randn(2, 128), rotation.sign_words(64))
    with pytest.raises(ValueError, match="1-D int32"):
        rotation.word_signs(rotation.sign_words(64).long())


def test_format_rotation_block_and_eligibility():
    assert fmt.ROTATION_BLOCK == rotation.DEFAULT_BLOCK == 8 and fmt.ROTATION_MULTIPLE == 64
    assert [fmt.rotatable(k) for k in (0, 32, 64, 96, 128, 4096)] == [False, False, True, False, True, True]
    assert fmt.rotation_signs_shape(4096) == (128,)
    assert fmt.bits_per_weight(16, 128, 4, rotated=True) - fmt.bits_per_weight(16, 128, 4) == 32 * (128 // 32) / (16 * 128)
