"""hf_kbit.rotation_policy: which weights KbitConfig.rotation rotates, and the basis "auto" keeps."""

import pytest
import torch

from hf_kbit import format as fmt
from hf_kbit import rotation, rotation_policy
from hf_kbit.nn.linear import quantize_group, quantize_siblings
from test_rotation import dense_rotation

# R^T H R by butterflies (float32) against the dense float64 product, relative to max |H|.
HESSIAN_ATOL = 1e-6


def on_the_grid(n: int, k: int, bits: int = 4, seed: int = 0) -> torch.Tensor:
    """Weights that already sit on the format's own grid: codebook levels of ``bits`` (nf, its default at k = 4)
    with the top level in every block, so the row and block scales round to ~1 and every element decodes back
    within ~1e-7. Rotating them mixes 64 levels into near-Gaussian values that no codebook holds."""
    cb = fmt.make_codebook("nf", bits)
    g = torch.Generator().manual_seed(seed)
    w = cb[torch.randint(0, cb.numel(), (n, k), generator=g)]
    w[:, :: fmt.BLOCK_SIZE] = 1.0
    return w


def with_outliers(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Gaussian weights with one outlier of 40 sigma in every block of 32 columns of each row: unrotated, each
    outlier's block scale crushes its 31 neighbours to the codebook's smallest levels; rotated, it spreads over
    its segment of 8."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    cols = torch.randint(0, 32, (n, k // 32), generator=g) + torch.arange(0, k, 32)
    w.scatter_(1, cols, 40.0)
    return w


def relative_errors(weights, packed):
    return [rotation_policy.relative_error(*rotation_policy.error_sums(w, p[:4], p[4])) for w, p in zip(weights, packed)]


@pytest.mark.parametrize("fitting", ["absmax", "fit"])
def test_auto_keeps_weights_on_the_grid_unrotated(fitting):
    weights = [on_the_grid(32, 128), on_the_grid(16, 128, seed=1)]
    auto = quantize_siblings(weights, 4, "nf", fitting, ["q", "k"], "auto")
    assert all(p[4] is None for p in auto)
    on = quantize_siblings(weights, 4, "nf", fitting, ["q", "k"], True)
    assert sum(relative_errors(weights, auto)) < 1e-6 < sum(relative_errors(weights, on))
    plain = quantize_group(weights, 4, "nf", fitting, ["q", "k"])
    assert all(torch.equal(a, b) for got, want in zip(auto, plain) for a, b in zip(got, want))


@pytest.mark.parametrize("bits", [3, 4], ids=lambda b: f"k{b}")
@pytest.mark.parametrize("fitting", ["absmax", "fit"])
def test_auto_rotates_weights_with_outliers(bits, fitting):
    weights = [with_outliers(32, 256), with_outliers(48, 256, seed=1)]
    auto = quantize_siblings(weights, bits, None, fitting, ["gate", "up"], "auto", rotation_seed=5)
    on = quantize_siblings(weights, bits, None, fitting, ["gate", "up"], True, rotation_seed=5)
    assert all(torch.equal(p[4], rotation.sign_words(256, 5)) for p in auto)
    assert all(torch.equal(a, b) for got, want in zip(auto, on) for a, b in zip(got, want))
    assert auto[0][4].data_ptr() != auto[1][4].data_ptr()  # each member its own copy (saved as separate tensors)
    off = quantize_siblings(weights, bits, None, fitting, ["gate", "up"], False)
    assert sum(relative_errors(weights, auto)) < sum(relative_errors(weights, off))


def test_rotation_true_is_quantize_group_of_the_rotated_weights():
    weights = [torch.randn(24, 192), torch.randn(8, 192)]
    words = rotation.sign_words(192, 0)
    got = quantize_siblings(weights, 3, None, None, None, True)
    want = quantize_group([rotation.rotate(w, fmt.ROTATION_BLOCK, 0) for w in weights], 3)
    assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert all(torch.equal(g[4], words) for g in got)


@pytest.mark.parametrize("rotation_choice", [True, "auto"], ids=str)
def test_in_features_not_a_multiple_of_64_stay_unrotated(rotation_choice):
    weights = [with_outliers(16, 192)[:, :96].contiguous()]  # K = 96: whole blocks, not whole segments
    got = quantize_siblings(weights, 4, None, None, None, rotation_choice)
    assert got[0][4] is None
    assert rotation_policy.layer_words(96, rotation_choice, 0) is None
    assert rotation_policy.layer_words(128, False, 0) is None


@pytest.mark.parametrize(("names", "want"), [
    (["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"], True),
    (["model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight"], True),
    (["model.layers.3.mlp.experts.gate_up_proj"], True),
    (["model.layers.0.self_attn.q_b_proj"], True),
    (["weight"], True),
    (["model.layers.0.self_attn.o_proj"], False),
    (["model.layers.3.mlp.down_proj.weight"], False),
    (["model.layers.3.mlp.experts.down_proj"], False),
    (["model.layers.3.linear_attn.out_proj"], False),
    (["transformer.h.0.mlp.c_proj"], False),
])
def test_inputs_rotates_all_but_the_output_projections(names, want):
    assert rotation_policy.for_weights("inputs", names) is want
    for other in (False, True, "auto"):
        assert rotation_policy.for_weights(other, names) is other


def test_inputs_is_resolved_per_group_before_quantizing():
    with pytest.raises(ValueError, match=r'rotation="inputs" depends on the layer: resolve it with for_weights'):
        rotation_policy.layer_words(128, "inputs", 0)
    weights = [torch.randn(16, 128)]
    rotated = quantize_siblings(weights, 3, None, None, ["model.layers.0.mlp.up_proj"], "inputs")
    assert all(torch.equal(a, b) for a, b in zip(rotated[0], quantize_siblings(weights, 3, None, None, None, True)[0]))
    plain = quantize_siblings(weights, 3, None, None, ["model.layers.0.mlp.down_proj"], "inputs")
    assert plain[0][4] is None


def test_siblings_of_different_in_features_are_refused():
    with pytest.raises(ValueError, match=r"\['a', 'b'\] have different in_features"):
        quantize_siblings([torch.randn(16, 64), torch.randn(16, 128)], 4, names=["a", "b"], rotation="auto")


def test_error_sums_are_per_weight_whatever_the_chunk():
    """Per expert, so that packing experts in chunks of any size gives the same sums (and the same choice)."""
    w = with_outliers(3 * 16, 128).reshape(3, 16, 128)
    cb = fmt.make_codebook(None, 4)
    words = rotation.sign_words(128, 0)
    packed = (*fmt.quantize(rotation.rotate_words(w, words), cb), cb)
    err, norm = rotation_policy.error_sums(w, packed, words)
    assert err.shape == norm.shape == (3,) and err.dtype == torch.float64
    for e in range(3):
        one = (*fmt.quantize(rotation.rotate_words(w[e], words), cb), cb)
        e_err, e_norm = rotation_policy.error_sums(w[e], one, words)
        assert torch.equal(e_err, err[e]) and torch.equal(e_norm, norm[e])
    recon = rotation.unrotate_words(fmt.dequantize(*packed, 128), words)
    torch.testing.assert_close(err, (w - recon).double().square().sum((-2, -1)))


def test_rotated_hessian_is_the_hessian_of_the_rotated_inputs():
    x = torch.randn(300, 128, dtype=torch.float64)
    words = rotation.sign_words(128, 2)
    r = dense_rotation(128, fmt.ROTATION_BLOCK, 2)
    h = (x.T @ x / 300).float()
    want = r.T @ h.double() @ r  # (x R)^T (x R) / n
    got = rotation_policy.rotate_hessian(h, words)
    torch.testing.assert_close(got.double(), want, atol=HESSIAN_ATOL * float(h.abs().max()), rtol=0)
    stacked = rotation_policy.rotate_hessian(torch.stack([h, 2 * h]), words)  # experts: [E, K, K]
    assert torch.equal(stacked[0], got) and torch.equal(stacked[1], rotation_policy.rotate_hessian(2 * h, words))


@pytest.mark.parametrize(("value", "ok"), [(False, True), (True, True), ("auto", True), ("inputs", True), ("on", False),
                                           (1, False), (0, False), (None, False)], ids=str)
def test_check_rotation_is_a_closed_set(value, ok):
    if ok:
        rotation_policy.check_rotation(value)
    else:
        with pytest.raises(ValueError, match=r"KbitConfig.rotation must be one of \(False, True, 'auto', 'inputs'\)"):
            rotation_policy.check_rotation(value)


def test_decide_quantizes_only_what_auto_compares():
    """What calibration asks before quantizing a group with data: the words of choose(), quantizing nothing for
    False, True or a K that cannot rotate."""
    calls = []

    def quantize(group):
        calls.append(len(group))
        return quantize_group(group, 3)

    outliers, grid = [with_outliers(16, 128)], [on_the_grid(16, 128)]
    assert rotation_policy.decide(outliers, False, 0, quantize) is None
    assert torch.equal(rotation_policy.decide(outliers, True, 0, quantize), rotation.sign_words(128, 0))
    assert rotation_policy.decide([torch.randn(16, 96)], "auto", 0, quantize) is None
    assert calls == []
    assert torch.equal(rotation_policy.decide(outliers, "auto", 0, quantize), rotation.sign_words(128, 0))
    assert rotation_policy.decide(grid, "auto", 0, lambda g: quantize_group(g, 4, "nf", "absmax")) is None
    assert calls == [1, 1]
