"""An inductor graph pass that hands kbit projections the elementwise op in front of them.

In a compiled decode step each kbit GEMV follows a small kernel of inductor's: the residual add and
RMSNorm before q/k/v and gate/up, the SiLU-gated product before down. At batch 1 such a kernel costs
1-2 us of the step (its launch, its dependency on the kernel before, its own latency), for work a
GEMV could do while staging its input. This pass rewrites the post-grad graph so that the projection
takes the op's inputs instead:

- ``kbit.mm(rms_norm(a + b))`` -> ``kbit.mm_add_rmsnorm(a, b)``, whose second output (the sum) takes
  over every other use of ``a + b`` (the residual stream);
- ``kbit.mm(rms_norm(h))`` -> ``kbit.mm_rmsnorm(h)``;
- ``kbit.mm(silu_mul(gate, up))`` -> ``kbit.mm_silu_mul(gate, up)``;
- where gate and up are the two halves of one norm op's product (a fused gate/up projection after its
  RMSNorm): ``kbit.mm(silu_mul(gate, up))`` -> ``kbit.mm(gate_up_op(..., glu=True))``, the SiLU-mul done once
  per element where gate/up writes its output instead of in every CTA of the down projection's staging.

A projection's packed tensors, ``in_features`` and ``signs`` (a rotated layer's sign words) go to the fused op as
they are: with signs, the prologue's output is rotated before it meets the weight, as ``kbit.mm`` rotates x.

``rms_norm`` and ``silu_mul`` are matched as transformers writes them (hf_kbit._ops), after inductor's
decompositions, and only where their intermediates have no other use. Use it through
:func:`compile_options` or, for ``generate``'s own compile, :func:`compile_config`::

    torch.compile(model, options=hf_kbit.fusion.compile_options())
    model.generate(..., cache_implementation="static", compile_config=hf_kbit.fusion.compile_config())

On CUDA the GEMV serves the fused ops at M <= 16: its x staging computes the prologue, the norm's
sum of squares over the whole row is loaded beside the staging, and the per-token rsqrt(mean + eps)
scales the sums in the epilogue (the rounding differs from the unfused ops at bf16-noise level); on block
records ``glu=True`` is its GLU epilogue where ``hf_kbit.backends.cuda.glu_serves``.
Other paths (M > 16) and devices run the references (the prologue in PyTorch, then ``kbit.mm``),
which launch more kernels than inductor's own. The pass is meant for batch-1 decoding: by default it
rewrites only projections of a static single token (``max_tokens``; ``DEFAULT_MAX_TOKENS`` says why).

Both also turn on inductor's combo kernels (``combo_kernels=False`` leaves them off), which launch
independent kernels as one: in a Llama-style decode step each layer's RoPE of q, RoPE and cache write of
k, cache write of v and attention mask are four small kernels otherwise. Measured on an H100 (Llama-3-8B,
batch 1, graph step, inductor PDL, same models compiled both ways, two passes): k = 4 2.855 -> 2.728 ms
with the LM head in bf16, 2.577 -> 2.453 with it quantized; bf16 6.36-6.66 ms either way.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

aten, prims, kbit = torch.ops.aten, torch.ops.prims, torch.ops.kbit
# Tokens per call up to which the pass rewrites by default. Measured on an H100 (Llama-3-8B k = 4,
# graph step): at 1 token the fused step is 1-2% faster; at 8 tokens 12% slower (each CTA reads the
# whole rows for the norm's sums, docs/kernels.md).
DEFAULT_MAX_TOKENS = 1
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return len(node.users) == 1 and user in node.users


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _to(node, dtypes) -> fx.Node | None:
    """The input of ``convert_element_type(input, dtype)`` with dtype in ``dtypes``, else None."""
    if _call(node, prims.convert_element_type.default) and node.args[1] in dtypes:
        return node.args[0]
    return None


def _operands(node: fx.Node) -> tuple:
    return tuple(node.args[:2]) if _call(node, aten.mul.Tensor) and not node.kwargs else ()


def _projections(x: fx.Node) -> list[fx.Node]:
    """The kbit.mm nodes that read ``x`` as their input, if every use of ``x`` is one (else [])."""
    users = list(x.users)
    ok = all(_call(u, kbit.mm.default) and u.args[0] is x and x not in u.args[1:] for u in users)
    return users if ok else []


def _match_rms_norm(x: fx.Node):
    """``x = w * to(f * rsqrt(mean(f ** 2, -1, keepdim) + eps), dtype)``, ``f = to(h, float32)``, each
    intermediate used once (``f`` twice): (the nodes to drop, h, w, eps), else None."""
    if not _operands(x):
        return None
    for low, weight in (_operands(x), _operands(x)[::-1]):
        scaled = _to(low, _LOW_PRECISION)
        if scaled is None or not _only_user(low, x) or not _only_user(scaled, low) or not _operands(scaled):
            continue
        for f, rsqrt in (_operands(scaled), _operands(scaled)[::-1]):
            h = _to(f, (torch.float32,))
            if h is None or not _call(rsqrt, aten.rsqrt.default) or not _only_user(rsqrt, scaled):
                continue
            add_eps = rsqrt.args[0]
            if not _call(add_eps, aten.add.Scalar, aten.add.Tensor) or not isinstance(add_eps.args[1], float):
                continue
            mean = add_eps.args[0]
            if not _call(mean, aten.mean.dim) or list(mean.args[1]) not in ([-1], [_val(f).dim() - 1]):
                continue
            if not (len(mean.args) > 2 and mean.args[2]) and not mean.kwargs.get("keepdim"):
                continue
            square = mean.args[0]
            if not _call(square, aten.pow.Tensor_Scalar) or square.args[0] is not f or square.args[1] != 2:
                continue
            if set(f.users) != {square, scaled} or not all(_only_user(n, u) for n, u in (
                    (square, mean), (mean, add_eps), (add_eps, rsqrt))):
                continue
            w_val, h_val = _val(weight), _val(h)
            if w_val is None or h_val is None or w_val.dim() != 1 or w_val.shape[0] != h_val.shape[-1] \
                    or w_val.dtype != h_val.dtype or _val(low).dtype != h_val.dtype:
                continue
            return [x, low, scaled, rsqrt, add_eps, mean, square, f], h, weight, add_eps.args[1]
    return None


def _match_silu_mul(x: fx.Node):
    """``x = to(silu(to(gate, float32)), dtype) * up`` with SiLU as ``f / (1 + exp(-f))`` or
    ``f * sigmoid(f)``, intermediates used once: (the nodes to drop, gate, up), else None."""
    if not _operands(x):
        return None
    for low, up in (_operands(x), _operands(x)[::-1]):
        silu = _to(low, _LOW_PRECISION)
        if silu is None or not _only_user(low, x) or not _only_user(silu, low):
            continue
        if _call(silu, aten.div.Tensor):
            f, denominator = silu.args
            if not (_call(denominator, aten.add.Tensor, aten.add.Scalar) and denominator.args[1] == 1):
                continue
            exp = denominator.args[0]
            neg = exp.args[0] if _call(exp, aten.exp.default) else None
            if not _call(neg, aten.neg.default) or neg.args[0] is not f:
                continue
            inner = [denominator, exp, neg]
        elif _call(silu, aten.mul.Tensor):
            f, sigmoid = silu.args
            if not _call(sigmoid, aten.sigmoid.default) or sigmoid.args[0] is not f:
                continue
            inner = [sigmoid]
        else:
            continue
        gate = _to(f, (torch.float32,))
        if gate is None or set(f.users) != {silu, inner[-1]} or not all(len(n.users) == 1 for n in inner):
            continue
        g_val, u_val = _val(gate), _val(up)
        if g_val is None or u_val is None or g_val.shape != u_val.shape or g_val.dtype != u_val.dtype:
            continue
        return [x, low, silu, *inner, f], gate, up
    return None


def _last_dim(node: fx.Node, dim) -> bool:
    val = _val(node)
    return isinstance(val, torch.Tensor) and dim in (-1, val.dim() - 1)


def _halves(gate: fx.Node, up: fx.Node):
    """``gate, up`` as the first and second half of one tensor's last dim, through ``split`` / ``split_with_sizes``
    or two slices, each used only once (by the SiLU-mul): (that tensor, the nodes to drop), else None."""
    if len(gate.users) != 1 or len(up.users) != 1:
        return None
    if _call(gate, operator.getitem) and _call(up, operator.getitem) and gate.args[0] is up.args[0] \
            and (gate.args[1], up.args[1]) == (0, 1):
        split = gate.args[0]
        if not _call(split, aten.split_with_sizes.default, aten.split.Tensor) or set(split.users) != {gate, up}:
            return None
        source, sizes = split.args[0], split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if set(source.users) != {split}:
            return None
        width = _val(source).shape[-1] if isinstance(_val(source), torch.Tensor) else None
        if not _last_dim(source, dim) or width is None or width % 2:
            return None
        if sizes not in ([width // 2, width // 2], width // 2):
            return None
        return source, [gate, up, split]
    if _call(gate, aten.slice.Tensor) and _call(up, aten.slice.Tensor) and gate.args[0] is up.args[0]:
        source = gate.args[0]
        val = _val(source)
        if not isinstance(val, torch.Tensor) or val.shape[-1] % 2 or set(source.users) != {gate, up}:
            return None
        half = val.shape[-1] // 2
        g_args, u_args = (tuple(n.args) + (0, None, None, 1)[len(n.args) - 1:] for n in (gate, up))  # defaults
        if not (_last_dim(source, g_args[1]) and _last_dim(source, u_args[1])):
            return None
        if g_args[2] in (0, None) and g_args[3] == half and g_args[4] == 1 and u_args[2] == half \
                and (u_args[3] is None or u_args[3] >= 2 * half) and u_args[4] == 1:
            return source, [gate, up]
    return None


def _glu_producer(source: fx.Node) -> fx.Node | None:
    """The norm op whose product ``source`` is (``mm_rmsnorm`` itself, or output 0 of ``mm_add_rmsnorm``) when it can
    take ``glu=True``, else None."""
    if _call(source, kbit.mm_rmsnorm.default):
        op = source
    elif _call(source, operator.getitem) and source.args[1] == 0 and _call(source.args[0], kbit.mm_add_rmsnorm.default):
        op = source.args[0]
    else:
        return None
    return op if not op.kwargs.get("glu") and _glu_folds(op) else None


def _glu_folds(op: fx.Node) -> bool:
    """Whether ``glu=True`` on ``op`` becomes the GEMV's GLU epilogue, so that the rewrite saves work: block records,
    no sign words, and on CUDA a GLU plan for the call (``hf_kbit.backends.cuda.glu_serves``); elsewhere the op would
    run the SiLU-mul as torch ops after its product (on the CPU, the references, both ways alike)."""
    from torch.fx.operator_schemas import normalize_function

    from . import format as fmt

    bound = normalize_function(op.target, op.args, op.kwargs, normalize_to_only_use_kwargs=True)
    if bound is None:
        return False
    args = bound.kwargs
    x, planes, block_scales, row_scales = (_val(args[name]) for name in ("x", "planes", "block_scales", "row_scales"))
    if args.get("signs") is not None or not isinstance(block_scales, torch.Tensor) \
            or block_scales.dtype != fmt.RECORD_DTYPE:
        return False
    if x.device.type != "cuda":
        return x.device.type == "cpu"
    dims = (*x.shape, row_scales.shape[-1], args["in_features"], planes.shape[-3])
    if not all(isinstance(d, int) for d in dims):
        return False
    from .backends import cuda as backend

    m, device = math.prod(x.shape[:-1]), x.device.index if x.device.index is not None else torch.cuda.current_device()
    return backend.glu_serves(m, row_scales.shape[-1], args["in_features"], planes.shape[-3], device, x.dtype)


def _defined_before(graph: fx.Graph, inputs, node: fx.Node) -> bool:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return all(not isinstance(i, fx.Node) or order[i] < order[node] for i in inputs)


def _same_shape_add(h: fx.Node) -> bool:
    """``h = a + b`` of two tensors of h's shape and dtype (no broadcast, no alpha)."""
    if not _call(h, aten.add.Tensor) or h.kwargs:
        return False
    vals = [_val(a) for a in h.args]
    out = _val(h)
    return all(isinstance(v, torch.Tensor) and v.shape == out.shape and v.dtype == out.dtype for v in vals)


def _tokens_at_most(x, max_tokens: int | None) -> bool:
    """Whether the projection input ``x`` has a static token count (all but its last dim) <= ``max_tokens``
    (None: any count, symbolic included)."""
    if max_tokens is None:
        return True
    val = _val(x)
    if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape[:-1]):
        return False
    return math.prod(val.shape[:-1]) <= max_tokens


# Ops by which a kbit module's format tensors are taken out of its one storage (KbitModule.format_tensors).
_VIEWS = (aten.slice.Tensor, aten.view.dtype, aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _storage_input(node: fx.Node) -> bool:
    val = _val(node)
    return node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dtype == torch.uint8 and val.dim() == 1


def hoist_input_views(graph: fx.Graph) -> int:
    """Move the views of 1-D uint8 graph inputs (the kbit modules' one storage each, whose views are their
    format tensors) to the top of ``graph``, right after its inputs; returns how many moved. They are traced
    where a module's forward ran, after the norm in front of it, and a rewrite places the fused op where the
    norm's inputs are: its weights must already be there. Views compute nothing, so the order is free."""
    anchor = None
    for node in graph.nodes:
        if node.op == "placeholder":
            anchor = node
    if anchor is None:
        return 0
    hoisted: set[fx.Node] = set()
    for node in list(graph.nodes):
        if not _call(node, *_VIEWS) or not all(_storage_input(i) or i in hoisted for i in node.all_input_nodes):
            continue
        anchor.append(node)
        anchor = node
        hoisted.add(node)
    return len(hoisted)


def _fold_glu(graph: fx.Graph, producer: fx.Node, source: fx.Node, gated_val, p: fx.Node) -> fx.Node:
    """Set ``glu=True`` on ``producer`` (its product ``source`` becomes ``gated_val``, the SiLU-mul's value) and
    return the plain ``kbit.mm`` of ``source`` that replaces the down projection ``p``."""
    producer.kwargs = {**producer.kwargs, "glu": True}
    source.meta["val"] = gated_val
    if _call(producer, kbit.mm_add_rmsnorm.default):
        producer.meta["val"] = (gated_val, producer.meta["val"][1])
    with graph.inserting_before(p):
        out = graph.call_function(kbit.mm.default, (source, *p.args[1:]), dict(p.kwargs))
    out.meta["val"] = _val(p)
    return out


# What :func:`fuse` counts.
REWRITES = ("mm_add_rmsnorm", "mm_rmsnorm", "mm_silu_mul", "glu")


def fuse(graph: fx.Graph, max_tokens: int | None = DEFAULT_MAX_TOKENS) -> dict[str, int]:
    """Rewrite ``graph`` (post-grad ATen) in place; returns how many of each rewrite it made.

    Only projections whose input has a static token count <= ``max_tokens`` (None: any) are rewritten.
    A norm read by several projections (siblings not fused into one weight) goes into each of them:
    the first one that adds takes the sum out, the others read that sum. A SiLU-mul of the two halves of a
    fused gate/up projection's norm op goes into that op (``glu=True``), and the projection after it becomes
    a plain ``kbit.mm`` (counted as ``glu``).
    """
    made = dict.fromkeys(REWRITES, 0)
    hoist_input_views(graph)
    erased: set[fx.Node] = set()
    for mm in list(graph.nodes):
        if mm in erased or not _call(mm, kbit.mm.default) or not _tokens_at_most(mm.args[0], max_tokens):
            continue
        x = mm.args[0]
        projections = _projections(x) if isinstance(x, fx.Node) else []
        if not projections:
            continue
        replaced: list[tuple[fx.Node, fx.Node]] = []  # (projection, its replacement)
        if (norm := _match_rms_norm(x)) is not None:
            dropped, h, weight, eps = norm
            inputs = (weight, *(a for p in projections for a in (*p.args[1:], *p.kwargs.values())))
            if _same_shape_add(h) and _defined_before(graph, (*h.args, *inputs), h):
                anchor, source = h, h
                for i, p in enumerate(projections):
                    with graph.inserting_after(anchor):
                        if i == 0:
                            args = (*h.args, weight, eps, *p.args[1:])
                            fused = graph.call_function(kbit.mm_add_rmsnorm.default, args, dict(p.kwargs))
                            fused.meta["val"] = (_val(p), _val(h))
                            with graph.inserting_after(fused):
                                out = graph.call_function(operator.getitem, (fused, 0))
                                total = graph.call_function(operator.getitem, (fused, 1))
                            out.meta["val"], total.meta["val"] = _val(p), _val(h)
                            anchor, source = total, total
                            made["mm_add_rmsnorm"] += 1
                        else:
                            out = graph.call_function(kbit.mm_rmsnorm.default, (source, weight, eps, *p.args[1:]),
                                                      dict(p.kwargs))
                            out.meta["val"] = _val(p)
                            anchor = out
                            made["mm_rmsnorm"] += 1
                    replaced.append((p, out))
                h.replace_all_uses_with(source)
                dropped.append(h)
            elif _defined_before(graph, inputs, mm):
                for p in projections:
                    with graph.inserting_before(p):
                        out = graph.call_function(kbit.mm_rmsnorm.default, (h, weight, eps, *p.args[1:]),
                                                  dict(p.kwargs))
                    out.meta["val"] = _val(p)
                    replaced.append((p, out))
                    made["mm_rmsnorm"] += 1
            else:
                continue
        elif (gated := _match_silu_mul(x)) is not None:
            dropped, gate, up = gated
            halves = _halves(gate, up) if len(projections) == 1 else None
            producer = _glu_producer(halves[0]) if halves is not None else None
            if producer is not None:
                (p,) = projections
                replaced.append((p, _fold_glu(graph, producer, halves[0], _val(x), p)))
                dropped.extend(halves[1])
                made["glu"] += 1
            else:
                for p in projections:
                    with graph.inserting_before(p):
                        out = graph.call_function(kbit.mm_silu_mul.default, (gate, up, *p.args[1:]), dict(p.kwargs))
                    out.meta["val"] = _val(p)
                    replaced.append((p, out))
                    made["mm_silu_mul"] += 1
        else:
            continue
        for p, out in replaced:
            p.replace_all_uses_with(out)
            graph.erase_node(p)
            erased.add(p)
        for node in dropped:  # consumers first
            graph.erase_node(node)
            erased.add(node)
    return made


def _pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class KbitFusionPass(str, CustomGraphPass):
        """:func:`fuse` as inductor's ``post_grad_custom_post_pass``; ``rewrites`` counts what it did.

        A str, the call that makes it, because its compile config may sit in a generation config (one passed
        to ``generate()``, or :func:`use_as_default`'s fallback) and transformers hashes and prints generation
        configs through JSON; passes of equal ``max_tokens`` compare equal, so ``generate()`` does not compile
        again for an equal config."""

        def __new__(cls, max_tokens: int | None):
            return super().__new__(cls, f"hf_kbit.fusion.fusion_pass(max_tokens={max_tokens})")

        def __getnewargs__(self):
            return (self.max_tokens,)

        def __reduce__(self):  # pickled as the call that makes it: the class is local to _pass_class
            return fusion_pass, (self.max_tokens,)

        def __init__(self, max_tokens: int | None) -> None:
            self.max_tokens = max_tokens
            self.rewrites = dict.fromkeys(REWRITES, 0)

        def __call__(self, graph: fx.Graph) -> None:
            for name, count in fuse(graph, self.max_tokens).items():
                self.rewrites[name] += count

        def uuid(self):
            return (get_hash_for_files((__file__,)), self.max_tokens)

        def __deepcopy__(self, memo):  # transformers' CompileConfig.to_dict deep-copies its options
            return self

    return KbitFusionPass


def fusion_pass(max_tokens: int | None = DEFAULT_MAX_TOKENS):
    """A new pass object (inductor's ``CustomGraphPass``) running :func:`fuse` with ``max_tokens``."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int or None (any token count), got {max_tokens!r}")
    return _pass_class()(max_tokens)


def pdl_supported() -> bool:
    """Whether inductor here can launch its Triton kernels as programmatic dependents (PDL): it has the
    switch (``TORCHINDUCTOR_ENABLE_PDL``) and the current CUDA device is sm_90 or newer."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config.triton, "enable_pdl") or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def compile_options(fusion=None, cudagraphs: bool = False, combo_kernels: bool = True, pdl: bool | None = None) -> dict:
    """``torch.compile`` options that run the pass (``fusion``, default a new :func:`fusion_pass`);
    ``cudagraphs``: inductor's CUDA graphs too, what ``mode="reduce-overhead"`` sets (torch.compile takes
    ``mode`` or ``options``, not both); ``combo_kernels``: inductor's horizontal fusion of independent
    kernels (see the module doc); ``pdl``: inductor's Triton kernels launch as programmatic dependents, so
    each overlaps its launch and prologue with the kernel before it (no effect on results); None: where
    :func:`pdl_supported`, False: as the environment says (``TORCHINDUCTOR_ENABLE_PDL``)."""
    options = {"post_grad_custom_post_pass": fusion if fusion is not None else fusion_pass()}
    if cudagraphs:
        options["triton.cudagraphs"] = True
    if combo_kernels:
        options["combo_kernels"] = True
    if pdl or (pdl is None and pdl_supported()):
        options["triton.enable_pdl"] = True
    return options


def compile_config(max_tokens: int | None = DEFAULT_MAX_TOKENS, combo_kernels: bool = True, pdl: bool | None = None,
                   **kwargs):
    """A transformers ``CompileConfig`` for ``generate``'s compile of the decode step: its default
    (reduce-overhead: CUDA graphs) with the pass (:func:`fusion_pass` with ``max_tokens``) and, unless
    ``combo_kernels`` is False, inductor's combo kernels, and PDL as ``pdl`` says (:func:`compile_options`).
    ``kwargs`` go to ``CompileConfig`` (``fullgraph``, ``dynamic``, ...).

    A kbit model compiles ``generate()``'s decode step with this by default (:func:`use_as_default`) unless
    ``KbitConfig(fusion_pass=False)``; a ``compile_config`` passed to ``generate()`` or set in its
    ``generation_config`` takes precedence."""
    from transformers import CompileConfig

    if "mode" in kwargs or "options" in kwargs:
        raise TypeError(f"compile_config sets mode and options itself (options: the pass and CUDA graphs), "
                        f"got {sorted(k for k in kwargs if k in ('mode', 'options'))}")
    options = compile_options(fusion_pass(max_tokens), cudagraphs=True, combo_kernels=combo_kernels, pdl=pdl)
    return CompileConfig(mode=None, options=options, **kwargs)


def is_kbit_compile_config(config) -> bool:
    """Whether ``config`` (a transformers ``CompileConfig`` or None) runs the pass (:func:`compile_config`)."""
    options = getattr(config, "options", None) or {}
    return type(options.get("post_grad_custom_post_pass")).__name__ == "KbitFusionPass"


class _DefaultCompileConfig:
    """A kbit model's ``_default_compile_config`` (:func:`use_as_default`): a callable that returns ``config``,
    held by the model (so copies and pickles of the model keep it)."""

    def __init__(self, config):
        self.config = config

    def __call__(self):
        return self.config


def use_as_default(model) -> bool:
    """Make :func:`compile_config` what ``generate()`` compiles ``model``'s decode step with when neither the call
    nor ``generation_config.compile_config`` names one (those stay the user's choice); returns whether the model
    now compiles with the pass (:func:`generate_compile_config`).

    The config becomes the model's default compile config (transformers' ``PreTrainedModel._default_compile_config``,
    which ``generate()`` falls back to), not its ``generation_config.compile_config``: transformers reads a set
    ``compile_config`` as the user's request and warns ("You have set `compile_config`, but we are unable to meet
    the criteria for compilation") on every generate() that does not compile, the default dynamic cache and the
    CPU included. A transformers without that hook gets the ``generation_config`` entry instead."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None or not hasattr(generation_config, "compile_config"):
        return False
    if generation_config.compile_config is None:
        if callable(getattr(model, "_default_compile_config", None)):
            model._default_compile_config = _DefaultCompileConfig(compile_config())
        else:
            generation_config.compile_config = compile_config()
    return is_kbit_compile_config(generate_compile_config(model))


def generate_compile_config(model):
    """The ``CompileConfig`` ``generate()`` compiles ``model``'s decode step with when the call names none: its
    ``generation_config.compile_config``, else the model's default (a kbit model's: :func:`use_as_default`); None
    for a model without either."""
    generation_config = getattr(model, "generation_config", None)
    config = getattr(generation_config, "compile_config", None)
    if config is None and callable(getattr(model, "_default_compile_config", None)):
        config = model._default_compile_config()
    return config
