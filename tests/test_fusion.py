"""hf_kbit.fusion: the fused ops' references and the inductor pass that rewrites compiled graphs to them."""

import pytest
import torch

import hf_kbit
from hf_kbit import _ops, fusion
from hf_kbit import format as fmt
from hf_kbit.eval.timing import cache_argument
from tiny_models import tiny_dense_model

# Compiled (inductor, CPU) against eager: float32 summation order only; bf16 logits of the tiny models are O(1)
LOGITS_ATOL_BF16 = 2e-2


def greedy_eager(model, ids, **kwargs):
    """Eager greedy tokens and the logits of each step (transformers' own decoding, compile disabled)."""
    with torch.inference_mode():
        out = model.generate(ids, disable_compile=True, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits, 1).float()


def assert_same_tokens_until_a_tie(tokens, eager_tokens, eager_logits):
    """``tokens`` equal the eager ones, or where they first differ the eager logits of both tokens are equal:
    an exact tie in the bf16 logits, which another op order (inductor's) may break either way. Past that
    step the two continuations differ legitimately."""
    prompt = eager_tokens.shape[1] - eager_logits.shape[1]
    for row, (got, want) in enumerate(zip(tokens.tolist(), eager_tokens.tolist())):
        diff = next((i for i in range(prompt, len(want)) if got[i] != want[i]), None)
        if diff is not None:
            logits = eager_logits[row, diff - prompt]
            assert logits[got[diff]] == logits[want[diff]] == logits.max(), (
                f"row {row}, step {diff - prompt}: token {got[diff]} (eager logit {float(logits[got[diff]])}) "
                f"where eager took {want[diff]} ({float(logits[want[diff]])}), not a tie")


def packed(n, k, bits=4):
    torch.manual_seed(0)
    cb = fmt.make_codebook(None, bits)
    return (*torch.ops.kbit.quantize(torch.randn(n, k), cb), cb)


def packed_records(n, k, bits=4):
    """packed() with its codes made block records (format v4's default), random offsets."""
    planes, codes, rs, cb = packed(n, k, bits)
    offsets = torch.randint(-fmt.OFFSET_MAX, fmt.OFFSET_MAX + 1, codes.shape, generator=torch.Generator().manual_seed(1))
    return planes, fmt.pack_records(codes, offsets), rs, cb


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_opcheck_fused_ops(dtype):
    n, k = 20, 130
    weights = packed(n, k)
    x, r, g = (torch.randn(3, k, dtype=dtype) for _ in range(3))
    w = torch.rand(k, dtype=dtype) + 0.5
    torch.library.opcheck(torch.ops.kbit.mm_rmsnorm.default, (x, w, 1e-6, *weights, k))
    torch.library.opcheck(torch.ops.kbit.mm_add_rmsnorm.default, (x, r, w, 1e-6, *weights, k))
    torch.library.opcheck(torch.ops.kbit.mm_silu_mul.default, (g, x, *weights, k))


def test_fused_ops_are_their_unfused_ops():
    n, k = 24, 64
    weights = packed(n, k)
    x, r, g = (torch.randn(2, 5, k, dtype=torch.bfloat16) for _ in range(3))
    w = torch.rand(k, dtype=torch.bfloat16) + 0.5
    mm = lambda a: torch.ops.kbit.mm(a, *weights, k)  # noqa: E731
    torch.testing.assert_close(torch.ops.kbit.mm_rmsnorm(x, w, 1e-5, *weights, k), mm(_ops.rms_norm(x, w, 1e-5)),
                               rtol=0, atol=0)
    out, total = torch.ops.kbit.mm_add_rmsnorm(x, r, w, 1e-5, *weights, k)
    torch.testing.assert_close(total, x + r, rtol=0, atol=0)
    torch.testing.assert_close(out, mm(_ops.rms_norm(x + r, w, 1e-5)), rtol=0, atol=0)
    torch.testing.assert_close(torch.ops.kbit.mm_silu_mul(g, x, *weights, k),
                               mm(torch.nn.functional.silu(g.float()).to(g.dtype) * x), rtol=0, atol=0)


def test_rms_norm_is_transformers_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(48, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
    h = torch.randn(3, 48, dtype=torch.bfloat16)
    torch.testing.assert_close(_ops.rms_norm(h, norm.weight, 1e-5), norm(h), rtol=0, atol=0)


def test_fused_ops_name_what_does_not_match():
    k = 64
    weights = packed(8, k)
    x = torch.randn(2, k, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"residual must match x \(torch.bfloat16 \(2, 64\)\), got torch.float32"):
        torch.ops.kbit.mm_add_rmsnorm(x, x.float(), torch.ones(k, dtype=torch.bfloat16), 1e-6, *weights, k)
    with pytest.raises(RuntimeError, match=r"norm_weight must be \[64\], got \(63,\)"):
        torch.ops.kbit.mm_rmsnorm(x, torch.ones(63, dtype=torch.bfloat16), 1e-6, *weights, k)
    with pytest.raises(RuntimeError, match=r"up must match x"):
        torch.ops.kbit.mm_silu_mul(x, x[:1], *weights, k)


# family -> rewrites of a 2-layer model's forward. The tiny models' gate and up stay two weights (200 rows,
# not whole 16-row tiles: not fused), so each post-attention norm goes into both: the add into gate's
# projection, which hands the sum to up's (mm_rmsnorm). Layer 0's input norm reads the embedding (no add),
# layer 1's and the final one (before the LM head, quantized here) the sum at the end of a layer. gemma3
# normalizes with (1 + weight) and gates with GELU: left alone.
EXPECTED = {
    "llama": {"mm_add_rmsnorm": 4, "mm_rmsnorm": 3, "mm_silu_mul": 2, "glu": 0},
    "qwen3": {"mm_add_rmsnorm": 4, "mm_rmsnorm": 3, "mm_silu_mul": 2, "glu": 0},
    "mistral": {"mm_add_rmsnorm": 4, "mm_rmsnorm": 3, "mm_silu_mul": 2, "glu": 0},
    "gemma3_text": {"mm_add_rmsnorm": 0, "mm_rmsnorm": 0, "mm_silu_mul": 0, "glu": 0},
}


def _compile_and_compare(model, expected):
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        eager = model(input_ids=ids, use_cache=False).logits
    torch._dynamo.reset()
    rewrite = fusion.fusion_pass(max_tokens=None)  # a 6-token forward
    options = {**fusion.compile_options(rewrite), "fx_graph_cache": False}  # the pass must run, not a cache hit
    compiled = torch.compile(model, fullgraph=True, options=options)
    with torch.inference_mode():
        logits = compiled(input_ids=ids, use_cache=False).logits
    torch._dynamo.reset()
    assert rewrite.rewrites == expected
    torch.testing.assert_close(logits, eager, atol=LOGITS_ATOL_BF16 * eager.abs().max().item(), rtol=0)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_the_pass_rewrites_a_compiled_forward_and_keeps_its_result(family):
    model = hf_kbit.quantize_model(tiny_dense_model(family), hf_kbit.KbitConfig(bits=4))
    _compile_and_compare(model, EXPECTED[family])


def test_the_pass_follows_fused_gate_up_and_leaves_a_bf16_lm_head():
    # gate/up in whole tiles: one fused weight, whose output SiLU-mul reads through a split: the SiLU-mul goes
    # into the gate/up norm op (glu) and down_proj stays a plain kbit.mm; the final norm feeds the bf16 LM head
    # (not a kbit projection): not rewritten.
    model = tiny_dense_model("llama", intermediate_size=192)
    model = hf_kbit.quantize_model(model, hf_kbit.KbitConfig(bits=4), modules_to_not_convert=["lm_head"])
    assert hasattr(model.model.layers[0].mlp, "gate_up_proj")
    _compile_and_compare(model, {"mm_add_rmsnorm": 3, "mm_rmsnorm": 1, "mm_silu_mul": 0, "glu": 2})


def test_the_pass_hands_rotated_projections_their_sign_words():
    """With rotation, every projection's sign words go into its fused op: the compiled result stays the eager one
    (which rotates x after the norm / SiLU-mul). K = 128 and 192: every kbit Linear rotates, the LM head too. A
    rotated gate/up keeps its SiLU-mul in down_proj's prologue (no GLU epilogue on rotated layers)."""
    model = tiny_dense_model("llama", hidden_size=128, intermediate_size=192)
    model = hf_kbit.quantize_model(model, hf_kbit.KbitConfig(bits=4, rotation=True))
    assert all(m.rotated for m in model.modules() if isinstance(m, hf_kbit.KbitLinear))
    _compile_and_compare(model, {"mm_add_rmsnorm": 4, "mm_rmsnorm": 1, "mm_silu_mul": 2, "glu": 0})


def test_compile_config_runs_the_pass_in_generate():
    # generate's own compile (static cache) with the pass; transformers compiles on CUDA only unless told.
    model = hf_kbit.quantize_model(tiny_dense_model("llama"), hf_kbit.KbitConfig(bits=4))
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    eager, eager_logits = greedy_eager(model, ids, **kwargs)
    torch._dynamo.reset()
    config = fusion.compile_config(fullgraph=True)
    assert config.mode is None and config.options["triton.cudagraphs"] is True
    rewrite = config.options["post_grad_custom_post_pass"]
    config.options["fx_graph_cache"] = False
    config._compile_all_devices = True
    with torch.inference_mode():
        compiled = model.generate(ids, compile_config=config, **kwargs)
    torch._dynamo.reset()
    assert rewrite.rewrites["mm_silu_mul"] > 0 and rewrite.rewrites["mm_add_rmsnorm"] > 0, rewrite.rewrites
    assert_same_tokens_until_a_tie(compiled, eager, eager_logits)


# ---------------------------------------------------------------------------- the default (KbitConfig.fusion_pass)


def test_a_kbit_model_compiles_generate_with_the_pass_by_default(monkeypatch):
    """quantize_model (and quantize-on-load, test_quantizer) give the model fusion.compile_config() as its default
    compile config: generate() with a static cache compiles so with nothing opted in, and its greedy tokens are the
    eager ones (the pass keeps each rounding of the unfused ops; inductor's own kernels may break an exact tie of
    the bf16 logits the other way)."""
    model = hf_kbit.quantize_model(tiny_dense_model("llama"), hf_kbit.KbitConfig(bits=4))
    assert model.generation_config.compile_config is None  # a set one is the user's: transformers warns about it
    config = fusion.generate_compile_config(model)
    assert fusion.is_kbit_compile_config(config) and config.options["combo_kernels"] is True
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    eager, eager_logits = greedy_eager(model, ids, **kwargs)
    torch._dynamo.reset()
    config.options["fx_graph_cache"] = False
    # transformers compiles on CUDA only (unless a compile_config of the generation config says otherwise)
    monkeypatch.setattr(model, "_valid_auto_compile_criteria", lambda *args, **kwargs: True)
    with torch.inference_mode():
        compiled = model.generate(ids, **kwargs)
    torch._dynamo.reset()
    rewrites = config.options["post_grad_custom_post_pass"].rewrites
    assert rewrites["mm_silu_mul"] > 0 and rewrites["mm_add_rmsnorm"] > 0, rewrites
    assert_same_tokens_until_a_tie(compiled, eager, eager_logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", [1, 4])
def test_the_default_compile_of_a_moe_decode_step_keeps_its_logits(dtype, batch):
    """The default compile options (pass, combo kernels) on a MoE model's single-token step (the pass rewrites
    batch 1 only, its default max_tokens) against the eager unfused step."""
    from transformers import StaticCache

    from tiny_models import tiny_moe_model

    model = hf_kbit.quantize_model(tiny_moe_model("qwen3_moe", dtype), hf_kbit.KbitConfig(bits=4))
    cache = StaticCache(config=model.config, max_cache_len=16)
    ids = torch.randint(0, model.config.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(3))
    cache_kwarg = {cache_argument(model): cache}
    step = dict(input_ids=ids[:, -1:], position_ids=torch.full((batch, 1), 5), use_cache=True, **cache_kwarg)
    with torch.inference_mode():
        model(input_ids=ids[:, :5], use_cache=True, **cache_kwarg)
        eager = model(**step).logits
        for layer in cache.layers:
            layer.cumulative_length.fill_(5)
        torch._dynamo.reset()
        options = {**fusion.generate_compile_config(model).options, "fx_graph_cache": False}
        logits = torch.compile(model, fullgraph=True, options=options)(**step).logits
    torch._dynamo.reset()
    torch.testing.assert_close(logits, eager, atol=LOGITS_ATOL_BF16 * eager.abs().max().item(), rtol=0)


def test_fusion_pass_off_or_a_users_compile_config_leave_generate_alone():
    from transformers import CompileConfig

    model = hf_kbit.quantize_model(tiny_dense_model("llama"), hf_kbit.KbitConfig(bits=4, fusion_pass=False))
    assert model.generation_config.compile_config is None
    assert not fusion.is_kbit_compile_config(fusion.generate_compile_config(model))
    model = tiny_dense_model("llama")
    mine = model.generation_config.compile_config = CompileConfig(fullgraph=True)
    hf_kbit.quantize_model(model, hf_kbit.KbitConfig(bits=4))
    assert model.generation_config.compile_config is mine and fusion.generate_compile_config(model) is mine


def test_a_transformers_without_the_default_hook_gets_the_generation_config_entry(monkeypatch):
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "_default_compile_config", None)
    model = hf_kbit.quantize_model(tiny_dense_model("llama"), hf_kbit.KbitConfig(bits=4))
    assert fusion.is_kbit_compile_config(model.generation_config.compile_config)
    assert fusion.generate_compile_config(model) is model.generation_config.compile_config


def test_a_kbit_model_pickles_and_copies_with_its_compile_config():
    """torch.save of a whole model (pickle) and copy.deepcopy keep the weights and the default compile config."""
    import copy
    import io

    model = hf_kbit.quantize_model(tiny_dense_model("llama"), hf_kbit.KbitConfig(bits=4))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert fusion.is_kbit_compile_config(fusion.generate_compile_config(other))
        with torch.inference_mode():
            assert torch.equal(other(ids).logits, model(ids).logits)


def test_generate_that_does_not_compile_says_nothing_of_a_compile_config(monkeypatch):
    """The default compile config is the model's, not its generation config's: transformers would read the latter
    as the user's and warn that it cannot compile on every generate() that does not (dynamic cache, CPU)."""
    import transformers.generation.utils as generation_utils

    warned = []
    monkeypatch.setattr(generation_utils.logger, "warning_once", lambda message, *args, **kwargs: warned.append(message))
    model = hf_kbit.quantize_model(tiny_dense_model("llama"), hf_kbit.KbitConfig(bits=4))
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        for cache in (None, "static"):  # neither compiles on a CPU
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation=cache)
    assert not [m for m in warned if "compile_config" in m], warned
    assert fusion.is_kbit_compile_config(fusion.generate_compile_config(model))


def test_pdl_only_where_inductor_and_the_device_support_it():
    assert fusion.pdl_supported() is False  # no CUDA device here
    assert "triton.enable_pdl" not in fusion.compile_options()
    assert "triton.enable_pdl" not in fusion.compile_options(pdl=False)
    assert fusion.compile_options(pdl=True)["triton.enable_pdl"] is True


def test_compile_config_names_what_it_sets_itself():
    with pytest.raises(TypeError, match="mode"):
        fusion.compile_config(mode="max-autotune")


# ---------------------------------------------------------------------------- the matcher on traced graphs

K = 64


def traced(fn, *args):
    """``fn`` traced to ATen with inductor's decompositions: the IR the pass sees after post-grad."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, decomposition_table=select_decomp_table())(*args)


def rewrite_and_run(fn, *args, max_tokens=None):
    gm = traced(fn, *args)
    made = fusion.fuse(gm.graph, max_tokens)
    gm.graph.lint()
    gm.recompile()
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    return made, {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def inputs():
    weights = packed(16, K)
    a, b = (torch.randn(2, K, dtype=torch.bfloat16) for _ in range(2))
    return a, b, torch.rand(K, dtype=torch.bfloat16) + 0.5, weights


def test_fuse_takes_the_add_and_hands_its_sum_on():
    a, b, w, weights = inputs()

    def fn(a, b, w, *weights):
        h = a + b
        return torch.ops.kbit.mm(_ops.rms_norm(h, w, 1e-6), *weights, K), h * 2

    made, targets = rewrite_and_run(fn, a, b, w, *weights)
    assert made == {"mm_add_rmsnorm": 1, "mm_rmsnorm": 0, "mm_silu_mul": 0, "glu": 0}
    assert "kbit.mm.default" not in targets and "aten.rsqrt.default" not in targets


def test_fuse_leaves_calls_of_more_tokens_than_max_tokens():
    a, b, _, weights = inputs()  # 2 tokens

    def fn(g, u, *ws):
        return (torch.ops.kbit.mm(_ops.silu_mul(g, u), *ws, K),)

    assert rewrite_and_run(fn, a, b, *weights, max_tokens=2)[0]["mm_silu_mul"] == 1
    made, targets = rewrite_and_run(fn, a, b, *weights, max_tokens=1)
    assert made["mm_silu_mul"] == 0 and "kbit.mm.default" in targets
    assert fusion.fusion_pass().max_tokens == fusion.DEFAULT_MAX_TOKENS == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_tokens must be a positive int or None"):
            fusion.fusion_pass(bad)


def test_fuse_takes_silu_mul_in_either_operand_order():
    a, b, _, weights = inputs()
    made, targets = rewrite_and_run(lambda g, u, *ws: (torch.ops.kbit.mm(_ops.silu_mul(g, u), *ws, K),), a, b, *weights)
    assert made["mm_silu_mul"] == 1 and "aten.exp.default" not in targets

    def up_first(g, u, *ws):
        return (torch.ops.kbit.mm(u * torch.nn.functional.silu(g.float()).to(g.dtype), *ws, K),)

    assert rewrite_and_run(up_first, a, b, *weights)[0]["mm_silu_mul"] == 1


def test_fuse_leaves_a_norm_whose_parts_are_used_elsewhere():
    a, b, w, weights = inputs()

    def normed_used_twice(a, b, w, *weights):  # the normalized x also feeds a non-kbit op
        x = _ops.rms_norm(a + b, w, 1e-6)
        return torch.ops.kbit.mm(x, *weights, K), x.sum()

    def float_used_twice(a, b, w, *weights):  # the float32 copy of the sum is used again
        h = (a + b).float()
        x = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(a.dtype)
        return torch.ops.kbit.mm(x, *weights, K), h.exp()

    def gemma_norm(a, b, w, *weights):  # (1 + weight), applied in float32: another norm
        h = (a + b).float()
        x = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(a.dtype)
        return (torch.ops.kbit.mm(x, *weights, K),)

    def gelu_gate(a, b, w, *weights):  # not SiLU
        return (torch.ops.kbit.mm(torch.nn.functional.gelu(a.float()).to(a.dtype) * b, *weights, K),)

    for fn in (normed_used_twice, float_used_twice, gemma_norm, gelu_gate):
        made, targets = rewrite_and_run(fn, a, b, w, *weights)
        assert made == {"mm_add_rmsnorm": 0, "mm_rmsnorm": 0, "mm_silu_mul": 0, "glu": 0}, fn.__name__
        assert "kbit.mm.default" in targets


GATE_UP_SPLITS = {
    "split": lambda y, i: y.split([i, i], -1),
    "split_int": lambda y, i: y.split(i, dim=-1),
    "chunk": lambda y, i: y.chunk(2, -1),
    "slices": lambda y, i: (y[..., :i], y[..., i:]),
}


@pytest.mark.parametrize("norm", ["add_rmsnorm", "rmsnorm"])
@pytest.mark.parametrize("split", sorted(GATE_UP_SPLITS))
def test_fuse_folds_a_fused_gate_ups_silu_mul_into_its_norm_op(split, norm):
    """A SiLU-mul of the two halves of a gate/up projection on block records goes into its norm op (glu=True):
    down_proj becomes a plain kbit.mm of that op's output, bit for bit the unfused ops' result (the references)."""
    a, b, w, _ = inputs()
    inter = 32
    gate_up, down = packed_records(2 * inter, K), packed_records(16, inter)

    def mlp(a, b, w, *ws):
        h = a + b if norm == "add_rmsnorm" else a
        y = torch.ops.kbit.mm(_ops.rms_norm(h, w, 1e-6), *ws[:4], K)
        gate, up = GATE_UP_SPLITS[split](y, inter)
        return torch.ops.kbit.mm(_ops.silu_mul(gate, up), *ws[4:], inter), h * 2

    made, targets = rewrite_and_run(mlp, a, b, w, *gate_up, *down)
    assert made == {"mm_add_rmsnorm": int(norm == "add_rmsnorm"), "mm_rmsnorm": int(norm == "rmsnorm"),
                    "mm_silu_mul": 0, "glu": 1}
    assert "kbit.mm_silu_mul.default" not in targets and "aten.exp.default" not in targets
    assert "kbit.mm.default" in targets


def test_fuse_leaves_gate_and_up_halves_that_are_used_elsewhere_come_from_two_products_or_codes():
    """No GLU rewrite where a half has another use, where gate and up are two products, or on uint8 codes (whose
    GEMV has no GLU epilogue: down_proj's SiLU-mul prologue stays cheaper than the SiLU-mul as torch ops)."""
    a, b, w, _ = inputs()
    inter = 32
    gate_up, down = packed_records(2 * inter, K), packed_records(16, inter)
    gate_w, up_w = packed_records(inter, K), packed_records(inter, K)

    def gate_used_again(a, b, w, *ws):
        y = torch.ops.kbit.mm(_ops.rms_norm(a + b, w, 1e-6), *ws[:4], K)
        gate, up = y.split([inter, inter], -1)
        return torch.ops.kbit.mm(_ops.silu_mul(gate, up), *ws[4:], inter), gate.sum()

    def codes_mlp(a, b, w, *ws):
        y = torch.ops.kbit.mm(_ops.rms_norm(a + b, w, 1e-6), *ws[:4], K)
        gate, up = y.split([inter, inter], -1)
        return (torch.ops.kbit.mm(_ops.silu_mul(gate, up), *ws[4:], inter),)

    def two_products(a, b, w, *ws):
        x = _ops.rms_norm(a + b, w, 1e-6)
        gate, up = torch.ops.kbit.mm(x, *ws[:4], K), torch.ops.kbit.mm(x, *ws[4:8], K)
        return (torch.ops.kbit.mm(_ops.silu_mul(gate, up), *ws[8:], inter),)

    made, _ = rewrite_and_run(gate_used_again, a, b, w, *gate_up, *down)
    assert made["glu"] == 0 and made["mm_silu_mul"] == 1
    made, _ = rewrite_and_run(two_products, a, b, w, *gate_w, *up_w, *down)
    assert made["glu"] == 0 and made["mm_silu_mul"] == 1
    made, _ = rewrite_and_run(codes_mlp, a, b, w, *packed(2 * inter, K), *packed(16, inter))
    assert made["glu"] == 0 and made["mm_silu_mul"] == 1


def test_glu_ops_are_their_unfused_ops_and_refuse_an_odd_weight():
    gate_up = packed(48, K)
    x, r = (torch.randn(2, 3, K, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(K, dtype=torch.bfloat16) + 0.5
    y = torch.ops.kbit.mm(_ops.rms_norm(x + r, w, 1e-5), *gate_up, K)
    want = torch.nn.functional.silu(y[..., :24].float()).to(y.dtype) * y[..., 24:]
    out, total = torch.ops.kbit.mm_add_rmsnorm(x, r, w, 1e-5, *gate_up, K, glu=True)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(total, x + r, rtol=0, atol=0)
    y = torch.ops.kbit.mm(_ops.rms_norm(x, w, 1e-5), *gate_up, K)
    torch.testing.assert_close(torch.ops.kbit.mm_rmsnorm(x, w, 1e-5, *gate_up, K, glu=True), _ops.silu_mul_halves(y),
                               rtol=0, atol=0)
    torch.library.opcheck(torch.ops.kbit.mm_add_rmsnorm.default, (x, r, w, 1e-5, *gate_up, K), {"glu": True})
    with pytest.raises(RuntimeError, match="glu=True takes a fused gate/up weight of an even out_features, got 7"):
        torch.ops.kbit.mm_rmsnorm(x, w, 1e-5, *packed(7, K), K, glu=True)


def test_compile_options_turn_on_combo_kernels_unless_told():
    assert fusion.compile_options()["combo_kernels"] is True
    assert "combo_kernels" not in fusion.compile_options(combo_kernels=False)
    assert fusion.compile_config().options["combo_kernels"] is True
    assert "combo_kernels" not in fusion.compile_config(combo_kernels=False).options
