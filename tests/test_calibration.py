"""Calibration (hf_kbit.calibration): the GPTQ quantizer against slow references on small matrices, its
reduction to the data-free result, and the layer-by-layer driver against a whole-model reference."""

import dataclasses

import pytest
import torch
from test_fitting import heavy_tailed

from hf_kbit import calibration, fitting
from hf_kbit import format as fmt

# (N, K): N not a multiple of the 16-row tile, K not a multiple of the 32-element block or the 128-column lazy batch.
SHAPES = [(16, 128), (20, 200), (7, 45)]
# In float32 the lazy batches sum in another order than per-column updates; a near-tie between two levels can
# then go either way and the columns after it follow, so float32 runs are compared by their output error.
PROXY_RTOL = 0.02


def correlated_hessian(k, seed=0, tokens=512):
    """X^T X / tokens of inputs with a few strong shared directions and per-channel scales, as activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) + 2 * torch.randn(tokens, 4, generator=g) @ torch.randn(4, k, generator=g)
    x = x * torch.rand(k, generator=g).add(0.2)
    return x.T @ x / tokens


def packed_indices(planes, n, k):
    return fmt.unpack_indices(planes)[:n, :k]


def proxy_loss(weight, approx, hessian):
    """tr((W - Q) H (W - Q)^T): the output error over the calibration inputs."""
    d = (approx.double() - weight.double())
    return float(torch.einsum("nk,kl,nl->", d, hessian.double(), d))


# ---------------------------------------------------------------------------- slow references


def reference_gptq(weight, hessian, codebook, codes_below, codes_above, damp=calibration.DEFAULT_DAMP):
    """Optimal Brain Quantization in its plain form, float64, one column at a time with the whole inverse
    Hessian: quantize column i (its block's code chosen on the updated weights when the block starts), move
    the error onto the later columns by -err / Hinv[i, i] * Hinv[i, i+1:], then remove i from Hinv.
    Returns the indices and the quantized weight."""
    w = weight.double().clone()
    n, k = w.shape
    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += damp * float(torch.diagonal(h).mean()) * torch.eye(k, dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    rows = fmt.row_scales(weight)
    table = fmt.e4m4_table()
    indices = torch.zeros(n, k, dtype=torch.int64)
    for i in range(k):
        if i % fmt.BLOCK_SIZE == 0:
            block = w[:, i : i + fmt.BLOCK_SIZE].float()
            scale = table[fitting.search_block_codes(block, rows, codebook, codes_below, codes_above)[:, 0]] * rows
        for r in range(n):
            x = float(w[r, i]) / float(scale[r]) if scale[r] > 0 else 0.0
            indices[r, i] = int(torch.argmin((codebook.double() - x).abs()))  # nearest level
        q = (codebook[indices[:, i]] * scale).double()
        err = w[:, i] - q
        w[:, i + 1 :] -= err[:, None] / hinv[i, i] * hinv[i, i + 1 :][None, :]
        hinv = hinv - hinv[:, i : i + 1] @ hinv[i : i + 1, :] / hinv[i, i]
        w[:, i] = q
    return indices, w


def reference_gptq_cholesky(weight, hessian, codebook, codes_below, codes_above, damp=calibration.DEFAULT_DAMP,
                            offsets=False):
    """The Cholesky form without lazy batches, float64: after each column the whole trailing matrix is updated
    by -err / U[i, i] * U[i, i:], U the upper Cholesky factor of the damped H^-1. ``offsets``: at each block's
    first column, the midrange of its updated weights in OFFSET_STEP row scales (rounded, clamped) is its offset,
    and the code search and the indices see the weights less it (every block keeps its offset, the rule at
    k <= 4). Returns the indices, and with ``offsets`` the offset codes ``[N, blocks]`` too."""
    w = weight.double().clone()
    n, k = w.shape
    u = calibration.inverse_cholesky(hessian.double(), damp)
    rows = fmt.row_scales(weight)
    table = fmt.e4m4_table()
    mids = ((codebook[1:] + codebook[:-1]) / 2).double()
    indices = torch.zeros(n, k, dtype=torch.int64)
    offset_codes = torch.zeros(n, -(-k // fmt.BLOCK_SIZE), dtype=torch.int64)
    shift = torch.zeros(n, dtype=torch.float64)
    for i in range(k):
        if i % fmt.BLOCK_SIZE == 0:
            block = w[:, i : i + fmt.BLOCK_SIZE].float()
            if offsets:
                mid = (block.amax(1) + block.amin(1)) / 2
                code = torch.round(mid / (fmt.OFFSET_STEP * rows)).clamp(-fmt.OFFSET_MAX, fmt.OFFSET_MAX)
                offset_codes[:, i // fmt.BLOCK_SIZE] = code.long()
                shift = (code * fmt.OFFSET_STEP * rows).double()
                block = block - shift[:, None].float()
            scale = table[fitting.search_block_codes(block, rows, codebook, codes_below, codes_above)[:, 0]] * rows
        x = torch.where(scale > 0, (w[:, i] - shift) / torch.where(scale > 0, scale, 1.0), 0.0)
        indices[:, i] = torch.searchsorted(mids, x)
        err = (w[:, i] - (codebook[indices[:, i]] * scale).double() - shift) / u[i, i]
        w[:, i:] -= err[:, None] * u[i, i:][None, :]
    return (indices, offset_codes) if offsets else indices


# ---------------------------------------------------------------------------- one weight


def off_centre(weight, seed=0):
    """``weight`` with each block of 32 along K shifted by its own constant (as GGUF Q4_1 blocks sit), so that block
    offsets matter."""
    n, k = weight.shape
    g = torch.Generator().manual_seed(seed)
    shift = torch.randn(n, -(-k // fmt.BLOCK_SIZE), generator=g) * weight.std()
    return weight + shift.repeat_interleave(fmt.BLOCK_SIZE, 1)[:, :k]


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS, ids=lambda b: f"k{b}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("diagonal", [False, True], ids=["identity", "diagonal"])
@pytest.mark.parametrize("offsets", [False, True], ids=["scales", "offsets"])
def test_diagonal_hessian_is_the_data_free_result(bits, shape, diagonal, offsets):
    """Nothing propagates when H is diagonal: the bytes are quantize_fitted's (with offsets: its int16 block
    records, each k's rule of which blocks keep theirs)."""
    weight = off_centre(heavy_tailed(shape, seed=bits), seed=bits) if offsets else heavy_tailed(shape, seed=bits)
    settings = dataclasses.replace(fitting.DEFAULT_SETTINGS[bits], offsets=offsets)
    codebook = fitting.fit_codebook(weight, bits, settings)
    h = torch.diag(torch.rand(shape[1]).add(0.1)) if diagonal else torch.eye(shape[1])
    got = calibration.gptq_quantize(weight, h, codebook, settings.codes_below, settings.codes_above, offsets=offsets)
    want = fitting.quantize_fitted(weight, codebook, settings.codes_below, settings.codes_above, offsets)
    for name, a, b in zip(("planes", "block_scales", "row_scales"), got, want):
        assert torch.equal(a, b), name
    if offsets:
        assert got[1].dtype == fmt.RECORD_DTYPE and bool((fmt.block_records(got[1])[1] != 0).any())


@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"k{b}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_blocked_equals_per_column_references(bits, shape):
    """In float64 (where the references work) the lazy-batched quantizer picks the indices of the per-column
    Cholesky form and of plain OBQ; in float32, its lazy batch does not change the result's quality."""
    n, k = shape
    weight = heavy_tailed(shape, seed=10 + bits)
    h = correlated_hessian(k, seed=bits)
    settings = fitting.DEFAULT_SETTINGS[bits]
    codebook = fitting.fit_codebook(weight, bits, settings)
    below, above = settings.codes_below, settings.codes_above
    planes, block_scales, rows = calibration.gptq_quantize(weight.double(), h.double(), codebook, below, above)
    got = packed_indices(planes, n, k)
    assert torch.equal(got, reference_gptq_cholesky(weight, h, codebook, below, above))
    obq_indices, obq_weight = reference_gptq(weight, h, codebook, below, above)
    assert torch.equal(got, obq_indices)
    approx = fmt.dequantize(planes, block_scales, rows, codebook, k)
    assert torch.allclose(approx.double(), obq_weight, rtol=0, atol=0)
    for lazy in (32, 128):
        p32, s32, r32 = calibration.gptq_quantize(weight, h, codebook, below, above, lazy_columns=lazy)
        loss32 = proxy_loss(weight, fmt.dequantize(p32, s32, r32, codebook, k), h)
        assert loss32 == pytest.approx(proxy_loss(weight, approx, h), rel=PROXY_RTOL)


@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"k{b}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_offsets_equal_the_per_column_reference(bits, shape):
    """With block offsets, in float64: each block's offset comes from its weights as the error feedback left them
    and the indices are the per-column Cholesky form's on the weights less it; decoded, the records give the
    weight that reference quantized."""
    n, k = shape
    weight = off_centre(heavy_tailed(shape, seed=20 + bits), seed=bits)
    h = correlated_hessian(k, seed=bits)
    settings = dataclasses.replace(fitting.DEFAULT_SETTINGS[bits], offsets=True)
    codebook = fitting.fit_codebook(weight, bits, settings)
    below, above = settings.codes_below, settings.codes_above
    planes, records, rows = calibration.gptq_quantize(weight.double(), h.double(), codebook, below, above, offsets=True)
    want_indices, want_offsets = reference_gptq_cholesky(weight, h, codebook, below, above, offsets=True)
    assert records.dtype == fmt.RECORD_DTYPE and bool((want_offsets != 0).any())
    assert torch.equal(packed_indices(planes, n, k), want_indices)
    assert torch.equal(fmt.untile(fmt.block_records(records)[1])[:n, : want_offsets.shape[1]], want_offsets)
    # Calibration with offsets quantizes a shifted weight with less output error than without them.
    plain = calibration.gptq_quantize(weight, h, fitting.fit_codebook(weight, bits, fitting.DEFAULT_SETTINGS[bits]),
                                      below, above)
    with_offsets = proxy_loss(weight, fmt.dequantize(planes, records, rows, codebook, k), h)
    assert with_offsets < proxy_loss(weight, fmt.dequantize(*plain, fitting.fit_codebook(
        weight, bits, fitting.DEFAULT_SETTINGS[bits]), k), h)


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS, ids=lambda b: f"k{b}")
def test_lowers_the_output_error_against_data_free(bits):
    """Quality as a number: tr((W - Q) H (W - Q)^T) well below the data-free quantizer's on correlated inputs."""
    weight = heavy_tailed((48, 256), seed=bits)
    h = correlated_hessian(256, seed=bits)
    planes, scales, rows, codebook = calibration.calibrate_quantize(weight, h, bits)
    free = fitting.fit_quantize(weight, bits)
    calibrated = proxy_loss(weight, fmt.dequantize(planes, scales, rows, codebook, 256), h)
    data_free = proxy_loss(weight, fmt.dequantize(*free, 256), h)
    assert torch.equal(codebook, free[3])  # the same data-free codebook
    assert calibrated < 0.8 * data_free


def test_dead_inputs_and_validation():
    weight = heavy_tailed((16, 64))
    h = correlated_hessian(64)
    h[5, :] = 0
    h[:, 5] = 0
    codebook = fitting.fit_codebook(weight, 3)
    planes, scales, rows = calibration.gptq_quantize(weight, h, codebook, 12, 4)
    approx = fmt.dequantize(planes, scales, rows, codebook, 64)
    assert bool(torch.isfinite(approx).all())
    with pytest.raises(ValueError, match="hessian must be a float"):
        calibration.gptq_quantize(weight, h[:10, :10], codebook)
    with pytest.raises(ValueError, match="non-finite"):
        calibration.gptq_quantize(weight, h * float("nan"), codebook)
    with pytest.raises(ValueError, match="lazy_columns"):
        calibration.CalibrationSettings(lazy_columns=48)
    with pytest.raises(ValueError, match="damp"):
        calibration.CalibrationSettings(damp=0)


# ---------------------------------------------------------------------------- siblings


@pytest.mark.parametrize("bits", [3, 4], ids=lambda b: f"k{b}")
def test_group_shares_the_data_free_codebook_and_runs_each_member_through_gptq(bits):
    """Siblings (q/k/v) get the codebook quantization without data gives them (fitted on their stacked rows), then
    each its own error feedback; a member without a Hessian is quantized data-free with that codebook."""
    weights = [heavy_tailed((20, 96), seed=1), heavy_tailed((8, 96), seed=2), heavy_tailed((8, 96), seed=3)]
    h = correlated_hessian(96, seed=bits)
    settings = fitting.DEFAULT_SETTINGS[bits]
    got = calibration.calibrate_group(weights, [h, h, None], bits)
    codebook = fitting.group_codebook(weights, bits, settings)
    assert not torch.equal(codebook, fitting.fit_codebook(weights[0], bits, settings))  # really the group's
    for (planes, scales, rows, cb), weight, hessian in zip(got, weights, [h, h, None]):
        assert torch.equal(cb, codebook)
        if hessian is None:
            want = fitting.quantize_fitted(weight, codebook, settings.codes_below, settings.codes_above)
        else:
            want = calibration.gptq_quantize(weight, hessian, codebook, settings.codes_below, settings.codes_above)
        assert all(torch.equal(a, b) for a, b in zip((planes, scales, rows), want))
    assert got[1][3].data_ptr() != got[0][3].data_ptr()  # saved as separate tensors
    with pytest.raises(ValueError, match="one Hessian"):
        calibration.calibrate_group(weights, [h], bits)


@pytest.mark.parametrize("offsets", [False, True], ids=["codes", "records"])
def test_siblings_with_one_hessian_run_as_one_weight(monkeypatch, offsets):
    """q/k/v-like siblings (whole tiles of rows, equal Hessians) take one gptq_quantize call over their stacked rows,
    and each gets what it gets alone (float64: the lazy batches' matmuls cannot flip a near-tie); a member with
    another Hessian, or with a partial tile, sends every member through its own call."""
    weights = [heavy_tailed((n, 192), seed=n).double() for n in (48, 16, 16)]
    h = correlated_hessian(192, seed=5).double()
    settings = calibration.CalibrationSettings(block_offsets=offsets)
    fit = settings.fit_settings(4)
    codebook = fitting.group_codebook(weights, 4, fit)
    alone = [calibration.gptq_quantize(w, h, codebook, fit.codes_below, fit.codes_above, offsets=fit.offsets,
                                       offset_choice=fit.offset_choice) for w in weights]
    calls = []
    real = calibration.gptq.gptq_quantize

    def counted(weight, *args, **kwargs):
        calls.append(weight.shape)
        return real(weight, *args, **kwargs)

    monkeypatch.setattr(calibration.gptq, "gptq_quantize", counted)
    got = calibration.calibrate_group(weights, [h, h.clone(), h.clone()], 4, settings)
    assert calls == [(80, 192)]
    for (planes, scales, rows, cb), want in zip(got, alone):
        assert torch.equal(cb, codebook)
        assert all(torch.equal(a, b) for a, b in zip((planes, scales, rows), want))
    storages = {t.untyped_storage().data_ptr() for packed in got for t in packed[:3]}
    assert len(storages) == 9  # each member's tensors are its own, as a checkpoint saves them

    calls.clear()
    calibration.calibrate_group(weights, [h, h * 2, h], 4, settings)
    assert calls == [(48, 192), (16, 192), (16, 192)]
    calls.clear()
    calibration.calibrate_group([heavy_tailed((20, 192), seed=1).double(), *weights[1:]], [h, h, h], 4, settings)
    assert calls == [(20, 192), (16, 192), (16, 192)]


@pytest.mark.parametrize("bits", [2, 3], ids=lambda b: f"k{b}")
def test_absmax_fitting_keeps_the_configured_codebook_and_absmax_codes(bits):
    """KbitConfig(fitting="absmax"): the codebook as configured and each block's absmax code, so with a diagonal H
    the bytes are format.quantize's."""
    weight = heavy_tailed((20, 200), seed=bits)
    settings = calibration.CalibrationSettings(fitting="absmax", codebook="nf")
    planes, scales, rows, cb = calibration.calibrate_quantize(weight, torch.eye(200), bits, settings)
    assert torch.equal(cb, fmt.make_codebook("nf", bits))
    assert all(torch.equal(a, b) for a, b in zip((planes, scales, rows), fmt.quantize(weight, cb)))
    levels = [-1.0, -0.3, 0.3, 1.0] if bits == 2 else [-1.0, -0.6, -0.3, -0.1, 0.1, 0.3, 0.6, 1.0]
    explicit = calibration.CalibrationSettings(codebook=levels)  # "fit": codes searched, the levels kept
    assert calibration.calibrate_quantize(weight, torch.eye(200), bits, explicit)[3].tolist() == pytest.approx(levels)
    with pytest.raises(ValueError, match="fitting"):
        calibration.CalibrationSettings(fitting="gptq")


# ---------------------------------------------------------------------------- MoE experts


def test_stacked_weights_quantize_as_each_alone():
    """gptq_quantize of a stack [E, N, K] with Hessians [E, K, K] is each expert's own result (float64: the
    lazy batches' matmuls cannot flip a near-tie)."""
    weights = torch.stack([heavy_tailed((20, 200), seed=e) for e in range(3)]).double()
    hessians = torch.stack([correlated_hessian(200, seed=e) for e in range(3)]).double()
    codebook = fitting.fit_codebook(weights[0], 3)
    stacked = calibration.gptq_quantize(weights, hessians, codebook, 12, 4)
    for e in range(3):
        alone = calibration.gptq_quantize(weights[e], hessians[e], codebook, 12, 4)
        assert all(torch.equal(a[e], b) for a, b in zip(stacked, alone)), e
    upper = calibration.inverse_cholesky(hessians)
    assert all(torch.equal(upper[e], calibration.inverse_cholesky(hessians[e])) for e in range(3))


def test_experts_share_the_data_free_codebook_and_an_expert_without_tokens_is_data_free(monkeypatch):
    weight = torch.stack([heavy_tailed((24, 96), seed=e) for e in range(4)])
    hessian = torch.stack([correlated_hessian(96, seed=e) for e in range(4)])
    hessian[2] = 0  # no token reached expert 2
    monkeypatch.setattr(calibration.moe, "EXPERT_CHUNK_ELEMENTS", 96 * (128 + 32))  # one expert at a time
    planes, scales, rows, codebook = calibration.calibrate_experts(weight, hessian, 3)
    settings = fitting.DEFAULT_SETTINGS[3]
    assert torch.equal(codebook, fitting.layer_codebook(fitting.codebook_sample(weight, settings), 3, settings))
    data_free = fitting.quantize_fitted(weight[2], codebook, settings.codes_below, settings.codes_above)
    assert all(torch.equal(a[2], b) for a, b in zip((planes, scales, rows), data_free))
    calibrated = calibration.gptq_quantize(weight[1], hessian[1], codebook, settings.codes_below, settings.codes_above)
    assert all(torch.equal(a[1], b) for a, b in zip((planes, scales, rows), calibrated))


# ---------------------------------------------------------------------------- text


def test_calibration_batches_take_the_end_of_the_text():
    from tiny_models import TINY_TEXT, char_tokenizer

    tok = char_tokenizer(TINY_TEXT)
    batches = calibration.calibration_batches(tok, TINY_TEXT, samples=5, seq_len=20, batch_size=2)
    assert [tuple(b.shape) for b in batches] == [(2, 20), (2, 20), (1, 20)]
    ids = torch.cat(batches).reshape(-1).tolist()
    assert ids == tok(TINY_TEXT, add_special_tokens=False)["input_ids"][-100:]
    with pytest.raises(ValueError, match="fewer than samples x seq_len"):
        calibration.calibration_batches(tok, TINY_TEXT, samples=100, seq_len=20)


def test_config_batches_tokenize_the_configs_text_and_name_the_field_on_errors(tmp_path):
    from tiny_models import TINY_TEXT, char_tokenizer, tiny_dense_model

    from hf_kbit import KbitConfig

    tok = char_tokenizer(TINY_TEXT)
    model = tiny_dense_model("llama", dtype=torch.float32)
    config = KbitConfig(calibration_data=[TINY_TEXT, TINY_TEXT], calibration_samples=3, calibration_seq_len=50,
                        calibration_tokenizer=tok)
    want = calibration.calibration_batches(tok, TINY_TEXT + "\n\n" + TINY_TEXT, 3, 50)
    assert all(torch.equal(a, b) for a, b in zip(calibration.config_batches(config, model), want))
    tok.save_pretrained(tmp_path / "tok")
    by_name = KbitConfig(calibration_data=TINY_TEXT, calibration_samples=3, calibration_seq_len=50,
                         calibration_tokenizer=str(tmp_path / "tok"))
    assert all(torch.equal(a, b) for a, b in zip(calibration.config_batches(by_name, model),
                                                 calibration.calibration_batches(tok, TINY_TEXT, 3, 50)))
    short = KbitConfig(calibration_data="a b c", calibration_samples=3, calibration_seq_len=50, calibration_tokenizer=tok)
    with pytest.raises(ValueError, match="calibration_data: .*fewer than samples x seq_len.*not as a file name"):
        calibration.config_batches(short, model)
    with pytest.raises(ValueError, match="calibration_tokenizer"):  # a config-built model has no folder
        calibration.config_batches(KbitConfig(calibration_data=TINY_TEXT), model)


# ---------------------------------------------------------------------------- a model


def reference_expert_hooks(experts, sums, counts):
    """Per expert of a Qwen3-MoE experts module, x^T x of the tokens routed to it and of act(gate) * up."""
    def hook(module, args):
        x, index = args[0].float(), args[1]
        for e in range(module.num_experts):
            xe = x[(index == e).any(-1)]
            gate, up = (xe @ module.gate_up_proj[e].float().T).chunk(2, -1)
            act = module.act_fn(gate) * up
            sums[e] = (sums[e][0] + xe.T @ xe, sums[e][1] + act.T @ act)
            counts[e] += xe.shape[0]
    return experts.register_forward_pre_hook(hook)


def reference_calibrate_model(model, batches, bits, settings, groups=(), experts=False):
    """Module by module, in layer order: the inputs of each Linear come from a full forward of the model with
    every earlier layer already fake-quantized (the slow, obvious form of the driver). Members of a group share a
    codebook (calibrate_group); ``experts``: each Qwen3-MoE expert quantized alone with its Hessian and the
    codebook of all the experts' rows."""
    prefix, layers = calibration.decoder_layers(model)
    results = {}
    for i, layer in enumerate(layers):
        linears = {f"{prefix}.{i}.{n}": m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        sums = {name: 0 for name in linears}
        counts = {name: 0 for name in linears}
        moe = getattr(layer.mlp, "experts", None) if experts else None
        expert_sums, expert_counts = [(0, 0)] * (moe.num_experts if moe else 0), [0] * (moe.num_experts if moe else 0)

        def hook_for(name, sums=sums, counts=counts):
            def hook(module, args, output):
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                sums[name] = sums[name] + x.T @ x
                counts[name] += x.shape[0]
            return hook

        handles = [m.register_forward_hook(hook_for(name)) for name, m in linears.items()]
        if moe is not None:
            handles.append(reference_expert_hooks(moe, expert_sums, expert_counts))
        with torch.no_grad():
            for batch in batches:
                model(input_ids=batch, use_cache=False)
        for handle in handles:
            handle.remove()
        units = dict.fromkeys(next((tuple(g) for g in groups if name in g), (name,)) for name in linears)
        for unit in units:
            members = [linears[name] for name in unit]
            hessians = [sums[name] / counts[name] for name in unit]
            packed = calibration.calibrate_group([m.weight.detach() for m in members], hessians, bits, settings)
            for name, m, p in zip(unit, members, packed):
                m.weight.data.copy_(fmt.dequantize(*p[:3], p[3], m.in_features).to(m.weight.dtype))
                results[name] = p
        if moe is None:
            continue
        for j, projection in enumerate(("gate_up_proj", "down_proj")):
            param = getattr(moe, projection)
            fit = settings.fit_settings(bits)
            codebook = fitting.layer_codebook(fitting.codebook_sample(param.detach(), fit), bits, fit)
            packed = []
            for e in range(moe.num_experts):
                h = expert_sums[e][j] / max(expert_counts[e], 1) if expert_counts[e] else torch.zeros(
                    param.shape[-1], param.shape[-1])
                packed.append(calibration.gptq_quantize(param[e].detach(), h, codebook, fit.codes_below,
                                                        fit.codes_above, settings.damp))
            stacked = (*(torch.stack(t) for t in zip(*packed)), codebook)
            param.data.copy_(fmt.dequantize(*stacked, param.shape[-1]).to(param.dtype))
            results[f"{prefix}.{i}.mlp.experts.{projection}"] = stacked
    return results


def test_driver_equals_whole_model_reference():
    from tiny_models import tiny_dense_model

    settings = calibration.CalibrationSettings(fit=fitting.FitSettings(codes_below=4, codes_above=1, lloyd_iters=1))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 24), generator=g), torch.randint(0, 256, (2, 24), generator=g)]
    model = tiny_dense_model("llama", dtype=torch.float32)
    want = reference_calibrate_model(tiny_dense_model("llama", dtype=torch.float32), batches, 3, settings)
    got = calibration.calibrate_model(model, batches, 3, settings=settings, progress=False)
    assert list(got) == list(want) and len(got) == 2 * 7
    for name in want:
        for a, b in zip(got[name], want[name]):
            assert torch.equal(a, b), name
        planes, scales, rows, codebook, signs = got[name]
        assert signs is None  # no rotation asked for
        module = model.get_submodule(name)
        assert torch.equal(module.weight, fmt.dequantize(planes, scales, rows, codebook, module.in_features))


def test_driver_with_sibling_groups_equals_whole_model_reference():
    from tiny_models import tiny_dense_model

    settings = calibration.CalibrationSettings(fit=fitting.FitSettings(codes_below=4, codes_above=1, lloyd_iters=1))
    batches = [torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))]
    groups = [[f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"] for i in range(2)]
    groups += [[f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up")] for i in range(2)]
    model = tiny_dense_model("llama", dtype=torch.float32)
    want = reference_calibrate_model(tiny_dense_model("llama", dtype=torch.float32), batches, 3, settings, groups)
    got = calibration.calibrate_model(model, batches, 3, settings=settings, progress=False, groups=groups)
    assert sorted(got) == sorted(want)
    for name in want:
        assert all(torch.equal(a, b) for a, b in zip(got[name], want[name])), name
    assert torch.equal(got["model.layers.1.self_attn.q_proj"][3], got["model.layers.1.self_attn.v_proj"][3])
    with pytest.raises(ValueError, match="one decoder layer"):
        calibration.calibrate_model(model, batches, 3, progress=False,
                                    groups=[["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]])
    with pytest.raises(ValueError, match="not among the modules"):
        calibration.calibrate_model(model, batches, 3, modules=["model.layers.0.mlp.up_proj"], progress=False,
                                    groups=[["model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_proj"]])


def test_driver_calibrates_moe_experts_as_the_whole_model_reference():
    """Experts: each with the Hessian of the tokens the router sent it (and of its gated activations for the down
    projection), the codebook shared by all of a projection's experts; later layers see them quantized."""
    from tiny_models import tiny_moe_model

    settings = calibration.CalibrationSettings(fit=fitting.FitSettings(codes_below=4, codes_above=1, lloyd_iters=1))
    batches = [torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))]
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    model = tiny_moe_model("qwen3_moe", dtype=torch.float32)
    want = reference_calibrate_model(tiny_moe_model("qwen3_moe", dtype=torch.float32), batches, 3, settings,
                                     experts=True)
    got = calibration.calibrate_model(model, batches, 3, settings=settings, progress=False, experts=experts)
    assert sorted(got) == sorted(want) and "model.layers.1.mlp.experts.down_proj" in got
    for name in want:
        assert all(torch.equal(a, b) for a, b in zip(got[name], want[name])), name
    with pytest.raises(ValueError, match="not inside a decoder layer"):
        calibration.calibrate_model(model, batches, 3, progress=False, experts=["model"])


def test_driver_quantizes_outside_modules_data_free_and_refuses_non_linears():
    from tiny_models import tiny_dense_model

    model = tiny_dense_model("llama", dtype=torch.float32)
    head = model.lm_head.weight.detach().clone()
    batches = [torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))]
    out = calibration.calibrate_model(model, batches, {"lm_head": 4, "model.layers.1.mlp.down_proj": 2},
                                      modules=["model.layers.1.mlp.down_proj", "lm_head"], progress=False)
    assert all(torch.equal(a, b) for a, b in zip(out["lm_head"], fitting.fit_quantize(head, 4)))
    assert out["model.layers.1.mlp.down_proj"][3].numel() == 4
    with pytest.raises(TypeError, match="not an nn.Linear"):
        calibration.calibrate_model(model, batches, 3, modules=["model.layers.0.mlp"], progress=False)


@pytest.mark.parametrize("bits", [2, 3], ids=lambda b: f"k{b}")
def test_weighted_options_reduce_to_the_unweighted_ones_under_equal_weights(bits):
    weight = heavy_tailed((20, 200), seed=bits)
    settings = fitting.DEFAULT_SETTINGS[bits]
    equal = fitting.fit_codebook(weight, bits, settings)
    assert torch.equal(fitting.fit_codebook(weight, bits, settings, column_weights=torch.full((200,), 3.0)), equal)
    assert not torch.equal(fitting.fit_codebook(weight, bits, settings, column_weights=torch.rand(200)), equal)
    got = calibration.gptq_quantize(weight, torch.eye(200), equal, settings.codes_below, settings.codes_above,
                                    weighted_codes=True)
    want = fitting.quantize_fitted(weight, equal, settings.codes_below, settings.codes_above)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="column_weights"):
        fitting.fit_codebook(weight, bits, settings, column_weights=-torch.ones(200))


# ---------------------------------------------------------------------------- rotation (format v3)

# Relative weight error of a calibrated k = 3 weight (N(0, 0.1) weights; data-free k = 3 is ~0.2).
MAX_REL_ERROR_K3 = 0.5


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_rotated_group_is_calibrated_as_w_r_with_the_rotated_inputs_hessian(monkeypatch, moe):
    """calibrate_model with rotation=True hands GPTQ ``W R`` and ``R^T H R`` (H of the unrotated run, whose first
    decoder layer sees the same inputs), returns the sign words, and writes back weights in the original basis."""
    from tiny_models import tiny_dense_model, tiny_moe_model

    from hf_kbit import rotation, rotation_policy
    from hf_kbit.calibration import model as driver

    make = (lambda: tiny_moe_model("qwen3_moe", torch.float32, hidden_size=128, moe_intermediate_size=64)) if moe \
        else (lambda: tiny_dense_model("llama", torch.float32, hidden_size=128, intermediate_size=192))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 24), generator=g)]
    seen = {}
    real_group, real_experts = driver.calibrate_group, driver.calibrate_experts

    def group(weights, hessians, bits, settings):  # clones: the driver writes the weights back in place
        seen.setdefault(settings.rotation, []).append(([w.clone() for w in weights], hessians))
        return real_group(weights, hessians, bits, settings)

    def experts(weight, hessian, bits, settings):
        seen.setdefault(settings.rotation, []).append(([weight.clone()], [hessian]))
        return real_experts(weight, hessian, bits, settings)

    monkeypatch.setattr(driver, "calibrate_group", group)
    monkeypatch.setattr(driver, "calibrate_experts", experts)
    names = ["model.layers.0.mlp.experts"] if moe else []
    results = {}
    for rotate in (False, True):
        model = make()
        original = {n: p.detach().clone() for n, p in model.named_parameters()}
        settings = calibration.CalibrationSettings(fitting="absmax", rotation=rotate)
        results[rotate] = calibration.calibrate_model(model, batches, 3, settings=settings, progress=False,
                                                      experts=names)
    words = rotation.sign_words(128, 0)
    (w_plain, h_plain), (w_rot, h_rot) = seen[False][0], seen[True][0]  # layer 0's first group: the same inputs
    for a, b in zip(w_plain, w_rot):
        assert torch.equal(rotation_policy.rotate_weight(a, words), b)
    for a, b in zip(h_plain, h_rot):
        assert torch.equal(rotation_policy.rotate_hessian(a, words), b)
    first = next(iter(results[True]))
    assert torch.equal(results[True][first][4], words) and results[False][first][4] is None
    for name, packed in results[True].items():  # written back in the original basis, as the ops compute
        key = name if ".experts." in name else f"{name}.weight"
        param = model.get_parameter(key).detach()
        recon = rotation_policy.reconstruction(packed[:4], param.shape[-1], packed[4])
        assert torch.equal(param, recon.to(param.dtype)), name
        assert (param - original[key]).norm() / original[key].norm() < MAX_REL_ERROR_K3, name
    with pytest.raises(ValueError, match="CalibrationSettings.rotation must be one of"):
        calibration.CalibrationSettings(rotation="yes")
