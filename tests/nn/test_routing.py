"""Fused routers (KbitRouter) and their ops on the CPU: the fused routing against each family's own router,
where the swap happens, save/reload and the way back. The CUDA kernels: tests/gpu/test_moe_gpu.py."""

from __future__ import annotations

import io

import pytest
import torch
import transformers

import hf_kbit
from hf_kbit.nn.experts import replace_kbit_experts_with_float
from hf_kbit.nn.routing import RULES, KbitRouter, fuse_router, fuse_routers, unfuse_router
from tiny_models import tiny_moe_model

transformers.utils.logging.set_verbosity_error()


def _router_config(class_name: str, norm_topk_prob: bool):
    """A config the router class of ``class_name`` builds from: 16 experts, top 4, hidden 32 (grouped routers: 4
    groups of 4, the best 2 kept, scaling 2.5)."""
    family = RULES[class_name].family
    config_cls = getattr(transformers, transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES[family])
    return family, config_cls(hidden_size=32, num_experts=16, num_local_experts=16, n_routed_experts=16,
                              num_experts_per_tok=4, norm_topk_prob=norm_topk_prob, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5)


def _router(class_name: str, norm_topk_prob: bool, dtype: torch.dtype) -> torch.nn.Module:
    family, config = _router_config(class_name, norm_topk_prob)
    module = getattr(transformers.models, family)
    router = getattr(getattr(module, f"modeling_{family}"), class_name)(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=g)
        for name in ("bias", "e_score_correction_bias"):  # GPT-OSS's matmul bias; the grouped routers' choice bias
            if getattr(router, name, None) is not None:
                getattr(router, name).normal_(0, 0.3, generator=g)
    return router.to(dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm_topk_prob"])
@pytest.mark.parametrize("class_name", sorted(RULES))
def test_fused_routing_is_the_family_routers(class_name, norm, dtype):
    """route() (the op's reference here) gives the router's own (logits, scores, indices): the same rule, dtypes
    and values. This is what keeps RULES true to each transformers version the CI runs."""
    router = _router(class_name, norm, dtype)
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(0)).to(dtype)  # the [T, H] a block passes
    with torch.inference_mode():
        expected = router(x)
        fused = fuse_router(router)
        assert isinstance(fused, KbitRouter) and isinstance(fused, fused.source_class)
        assert type(fused).__name__ == f"Kbit{class_name}" and fused.source_class.__name__ == class_name
        routed = fused.route(x)
        plain = fused(x)  # the CPU: the family's forward
    for got in (routed, plain):
        assert [t.dtype for t in got] == [t.dtype for t in expected]
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


def test_router_softmax_topk_is_the_matmul_then_softmax_topk():
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(5, 24, generator=g).bfloat16(), torch.randn(16, 24, generator=g).bfloat16()
    logits, weights, indices = torch.ops.kbit.router_softmax_topk(x, weight, 4, True, True)
    assert torch.equal(logits, torch.nn.functional.linear(x, weight))
    for got, expected in zip((weights, indices), torch.ops.kbit.softmax_topk(logits, 4, True, True)):
        assert torch.equal(got, expected)
    message = r"x must be \[T, H\] and weight \[E, H\], got shapes \(5, 24\) and \(16, 20\)"
    with pytest.raises(ValueError, match=message):
        torch.ops.kbit.router_softmax_topk(x, weight[:, :20], 4, True)


def test_routing_references_reject_bad_k():
    with pytest.raises(ValueError, match="1 <= k <= E"):
        torch.ops.kbit.softmax_topk(torch.zeros(2, 4), 5, True)
    with pytest.raises(ValueError, match=r"topk_softmax: logits must be \[T, E\] with 1 <= k <= E"):
        torch.ops.kbit.topk_softmax(torch.zeros(2, 4), 0)
    with pytest.raises(ValueError, match="E a multiple of groups, got shape .2, 6., k=2, groups=4"):
        torch.ops.kbit.sigmoid_group_topk(torch.zeros(2, 6), torch.zeros(6), 2, 4, 2, True, 1.0)


def test_routing_references_opcheck():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 16, generator=g)
    torch.library.opcheck(torch.ops.kbit.softmax_topk.default, (logits, 4, True))
    torch.library.opcheck(torch.ops.kbit.router_softmax_topk.default,
                          (torch.randn(3, 12, generator=g).bfloat16(), torch.randn(16, 12, generator=g).bfloat16(), 4,
                           True, True))
    torch.library.opcheck(torch.ops.kbit.topk_softmax.default, (logits.bfloat16(), 4))
    torch.library.opcheck(torch.ops.kbit.sigmoid_group_topk.default,
                          (logits, torch.randn(16, generator=g), 4, 4, 2, True, 2.5))


def test_fuse_router_refuses_other_classes_and_fused_routers():
    with pytest.raises(ValueError, match="router must be one of"):
        fuse_router(torch.nn.Linear(4, 4))
    router = fuse_router(_router("MixtralTopKRouter", True, torch.float32))
    with pytest.raises(ValueError, match="already fused"):
        fuse_router(router)
    assert type(unfuse_router(router)).__name__ == "MixtralTopKRouter" and not hasattr(router, "kbit_renormalize")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_quantize_model_fuses_the_routers_and_keeps_their_keys(family):
    model = tiny_moe_model(family)
    keys = set(model.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    quantized = hf_kbit.quantize_model(model, hf_kbit.KbitConfig(bits=4), progress=False)
    routers = [n for n, m in quantized.named_modules() if isinstance(m, KbitRouter)]
    assert routers == [f"model.layers.{i}.mlp.gate" for i in range(2)]
    router_keys = {f"{name}.weight" for name in routers}
    assert router_keys <= keys and router_keys <= set(quantized.state_dict())
    with torch.inference_mode():
        logits = quantized(ids).logits
    buf = io.BytesIO()
    torch.save(quantized, buf)
    buf.seek(0)
    reloaded = torch.load(buf, weights_only=False)
    with torch.inference_mode():
        assert torch.equal(reloaded(ids).logits, logits)
    source = type(tiny_moe_model(family).model.layers[0].mlp.gate)
    replace_kbit_experts_with_float(quantized)
    assert all(type(quantized.get_submodule(name)) is source for name in routers)


def test_a_fused_router_unpickles_in_a_new_process(tmp_path):
    """The Kbit<router> classes are made on demand, so a pickle loads where none was made yet."""
    import subprocess
    import sys

    quantized = hf_kbit.quantize_model(tiny_moe_model("qwen3_moe"), hf_kbit.KbitConfig(bits=4), progress=False)
    torch.save(quantized.model.layers[0].mlp.gate, tmp_path / "router.pt")
    code = ("import torch, sys; r = torch.load(sys.argv[1], weights_only=False); "
            "print(type(r).__module__, type(r).__name__, r.kbit_renormalize)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "router.pt")], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["hf_kbit.nn.routing", "KbitQwen3MoeTopKRouter", "False"]


def test_output_recorders_still_find_the_fused_routers():
    """transformers records router logits by the router's class (output_router_logits): a fused router is one."""
    model = tiny_moe_model("qwen3_moe")
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    quantized = hf_kbit.quantize_model(model, hf_kbit.KbitConfig(bits=4), progress=False)
    with torch.inference_mode():
        out = quantized(ids, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (5, quantized.config.num_experts)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_every_familys_router_is_fused_and_routes_as_before(family):
    """quantize_model fuses the router beside each converted experts module; on the CPU the model's logits are the
    same as with the family's router (its forward runs there), and route() gives the family's routing."""
    model = tiny_moe_model(family)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    quantized = hf_kbit.quantize_model(model, hf_kbit.KbitConfig(bits=4), progress=False)
    routers = [m for m in quantized.modules() if isinstance(m, KbitRouter)]
    assert routers and all(isinstance(m, m.source_class) for m in routers)
    x = torch.randn(6, quantized.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(quantized.dtype)
    with torch.inference_mode():
        fused = quantized(ids).logits
        routed = [r.route(x) for r in routers]
        unfuse_router(routers[0])
        assert torch.equal(quantized(ids).logits, fused)
        for got, expected in zip(routed[0], routers[0](x)):
            assert torch.equal(got, expected)


def test_a_router_named_in_modules_to_not_convert_keeps_its_class():
    model = tiny_moe_model("qwen3_moe")
    config = hf_kbit.KbitConfig(bits=4, modules_to_not_convert=["lm_head", "model.layers.0.mlp.gate"])
    quantized = hf_kbit.quantize_model(model, config, progress=False)
    assert not isinstance(quantized.model.layers[0].mlp.gate, KbitRouter)
    assert isinstance(quantized.model.layers[1].mlp.gate, KbitRouter)


def test_fuse_routers_only_beside_the_given_experts():
    model = tiny_moe_model("qwen3_moe")
    assert fuse_routers(model, ["model.layers.1.mlp.experts"], []) == ["model.layers.1.mlp.gate"]
    assert not isinstance(model.model.layers[0].mlp.gate, KbitRouter)


def test_gradients_take_the_familys_forward():
    """With gradients flowing the router is the family's differentiable forward (the fused op has no backward)."""
    fused = fuse_router(_router("Qwen3MoeTopKRouter", True, torch.float32).requires_grad_(True))
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    _, scores, _ = fused(x)
    scores.sum().backward()
    assert x.grad is not None and fused.weight.grad is not None
