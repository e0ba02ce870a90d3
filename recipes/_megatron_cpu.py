"""Megatron-core's DDP, DistributedOptimizer and GPT forward on CPU (gloo): for the recipes and tests
that run Megatron's real training components on a machine without a GPU (recipes/megatron_to_hf.py,
tests/test_mapping_megatron.py, tests/test_mapping_moe.py). On a GPU machine do not use it.

Megatron hard-codes CUDA in a few places even for CPU tensors: `device="cuda"` /
`torch.cuda.current_device()` for its buffers, `Tensor.cuda()`, `Tensor.type()` compared with
"torch.cuda.FloatTensor", CUDA streams, and the CUDA RNG tracker around attention dropout.
`cuda_on_cpu()` redirects exactly those, and puts everything back on exit.

Mixture-of-experts layers (SequentialMLP, the alltoall and allgather token dispatchers, shared
experts) need four more: the router's `te_general_gemm` name, defined only with Transformer Engine,
is set to None (Megatron's plain-torch path); the dispatcher's device-to-host stream records an
event it then synchronizes with (`_Stream.record_event`); `maybe_move_tensor_to_cpu` converts CPU
tensors to numpy when asked (`as_numpy`: the split sizes gloo's `all_to_all_single` takes as a list,
which Megatron only converts for CUDA tensors); and `WrappedTorchNorm` accepts `sequence_parallel`
(which MoE at TP>1 requires): the norm is built without it and its weight is marked
`sequence_parallel`, as Megatron's own norms are, so that `finalize_model_grads` sums its gradient
over the TP group.

HybridModel (megatron-core 0.19) builds its layers from Transformer Engine's modules
(`hybrid_stack_spec`); `hybrid_local_spec()` is the same stack of Megatron's local modules, saving
the keys Transformer Engine's saves, and the stack's final norm (`TENorm`) is Megatron's
`WrappedTorchNorm` where Transformer Engine is absent.

Multi-latent attention (MLA, DeepSeek-V3's) needs two: its core attention takes separate key and value
head sizes, which only Transformer Engine's `TEDotProductAttention` accepts (`PlainAttention` below is
that interface in plain torch, for the layer specs: `use_plain_attention(specs)`); and
`multi_latent_attention.HAVE_TE` is set False where Transformer Engine is absent: Megatron then takes
it for present and checks `isinstance(..., TELinear)` against a mock that is no class.

It also mends two things of the path Megatron takes without Apex or Transformer Engine (torch's
Adam, the only one on CPU). Torch's Adam keeps its step in each parameter's state, where
`DistributedOptimizer.state_dict()` reads it and asserts one; a fresh optimizer has no state yet, so
building the sharded state dict a load fills (`opt.sharded_state_dict(..., is_loading=True)`) stops
at `assert len(steps) == 1`: here a fresh optimizer's step is 0 (Apex's and Transformer Engine's Adam
keep the step in the param groups; on a GPU nothing is needed). And loading `fully_reshardable`
optimizer state copies every key of the
inner optimizer's state from the loaded tensors, including the `step` that `load_state_dict` has
just set from the param groups and that loaded tensors never hold (KeyError: 'step'; the
`dp_reshardable` ones hold the step of the optimizer that asked, not the saved one), and that
step is one tensor shared by every parameter, which torch's Adam then increments once per
parameter per step; here the step is the param groups' and each parameter gets its own copy, keys
the loaded tensors lack are left as they are, and the copies run without autograd
(`dp_reshardable`'s load calls this with it on, and an fp32 model's main parameters are views of
the model's).
"""

from __future__ import annotations

import contextlib
import functools

import torch

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "empty_like", "zeros_like",
              "ones_like", "full_like")


_ABSENT = object()  # an attribute a stand-in adds, removed again on exit


def _cpu(device):
    if isinstance(device, int) or (device is not None and str(device).startswith("cuda")):
        return torch.device("cpu")
    return device


class _Stream:
    """What Megatron's DDP does with a CUDA stream: nothing to wait for on CPU."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _Event()


class _Event:
    """An event recorded on a `_Stream`: already complete."""

    def synchronize(self):
        pass

    def wait(self, *a, **k):
        pass

    def query(self):
        return True


@contextlib.contextmanager
def cuda_on_cpu():
    from megatron.core.tensor_parallel import random as mrandom

    saved = []

    def patch(obj, name, new):
        saved.append((obj, name, getattr(obj, name, _ABSENT)))
        setattr(obj, name, new)

    def factory(fn):
        @functools.wraps(fn)
        def call(*a, **k):
            if "device" in k:
                k["device"] = _cpu(k["device"])
            return fn(*a, **k)
        return call

    for name in _FACTORIES:
        patch(torch, name, factory(getattr(torch, name)))
    to = torch.Tensor.to

    def tensor_to(self, *a, **k):
        a = tuple(_cpu(x) if isinstance(x, (str, torch.device, int)) and not isinstance(x, bool) else x for x in a)
        if "device" in k:
            k["device"] = _cpu(k["device"])
        return to(self, *a, **k)

    tensor_type = torch.Tensor.type

    def type_(self, dtype=None, *a, **k):
        if dtype is None:  # Megatron checks parameters against the CUDA type names
            return tensor_type(self).replace("torch.", "torch.cuda.", 1)
        return tensor_type(self, dtype, *a, **k)

    patch(torch.Tensor, "to", tensor_to)
    patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
    patch(torch.Tensor, "type", type_)
    patch(torch.cuda, "current_device", lambda: "cpu")
    patch(torch.cuda, "synchronize", lambda *a, **k: None)
    patch(torch.cuda, "Stream", _Stream)
    patch(torch.cuda, "default_stream", lambda *a, **k: _Stream())
    patch(torch.cuda, "current_stream", lambda *a, **k: _Stream())
    patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    patch(mrandom.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_loaded_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return set_states(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        with torch.no_grad():  # dp_reshardable's load calls this with autograd on (fp32: main params are views)
            for key, dst in {"param": main_param, **state}.items():
                if key == "step":  # the param groups' step, just set by load_state_dict: one copy each
                    state[key] = dst.clone()
                elif key in tensors:
                    dst.copy_(tensors[key])

    patch(DistributedOptimizer, "_set_main_param_and_optimizer_states", set_loaded_states)
    from megatron.core.optimizer import distrib_optimizer
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        state_dict = DistributedOptimizer.state_dict

        def fresh_state_dict(self):
            if self.optimizer.state:
                return state_dict(self)
            for group in self.optimizer.param_groups:  # before the first step: Adam's step is 0
                for param in group["params"]:
                    self.optimizer.state[param] = {"step": torch.tensor(0.0)}
            try:
                return state_dict(self)
            finally:
                self.optimizer.state.clear()

        patch(DistributedOptimizer, "state_dict", fresh_state_dict)
    _moe_on_cpu(patch)
    from megatron.core.transformer import multi_latent_attention
    if not isinstance(getattr(multi_latent_attention, "TELinear", None), type):  # Transformer Engine absent
        patch(multi_latent_attention, "HAVE_TE", False)
    try:  # megatron-core 0.19+: HybridModel's final norm is Transformer Engine's
        from megatron.core.models.hybrid import hybrid_block
    except ImportError:
        hybrid_block = None
    if hybrid_block is not None and not _have_te():
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        patch(hybrid_block, "TENorm", WrappedTorchNorm)
    try:
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


def _moe_on_cpu(patch) -> None:
    """The mixture-of-experts stand-ins (see the module's docstring)."""
    import copy

    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):  # defined only when Transformer Engine imports
        patch(moe_utils, "te_general_gemm", None)
    to_cpu = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    patch(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    new_norm = torch_norm.WrappedTorchNorm.__new__

    def norm(cls, config, *a, **k):
        if not config.sequence_parallel:
            return new_norm(cls, config, *a, **k)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        module = new_norm(cls, plain, *a, **k)
        for p in module.parameters():
            p.sequence_parallel = True
        return module

    patch(torch_norm.WrappedTorchNorm, "__new__", norm)


class PlainAttention(torch.nn.Module):
    """Transformer Engine's `TEDotProductAttention` interface (key and value head sizes of their own, as
    multi-latent attention needs) in plain torch: causal softmax attention of [s, b, heads, d] query, key
    and value, scaled by `softmax_scale`; returns [s, b, heads * d_v]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None,
                 **kwargs):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                               enable_gqa=k.shape[1] != q.shape[1])
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def use_plain_attention(layer_specs) -> None:
    """Make the multi-latent attention of each of Megatron's transformer layer specs
    (`get_gpt_decoder_block_spec(...).layer_specs`, or a HybridModel's layer specs) use `PlainAttention`
    as its core attention."""
    for spec in layer_specs:
        attention = getattr(spec.submodules, "self_attention", None)
        if attention is not None and "MLA" in getattr(attention.module, "__name__", ""):
            attention.submodules.core_attention = PlainAttention


def _have_te() -> bool:
    import importlib.util
    return importlib.util.find_spec("transformer_engine") is not None


def hybrid_local_spec(config):
    """HybridModel's stack spec (megatron-core 0.19) with Megatron's local modules where
    `hybrid_layer_specs.hybrid_stack_spec` has Transformer Engine's, saving the same keys: '*' attention
    (its input norm as `self_attention.linear_qkv.layer_norm_weight`), '+' multi-latent attention
    (`input_layernorm`, the latent norms by `config.qk_layernorm`), '-' an MLP (its norm as
    `mlp.linear_fc1.layer_norm_weight`), 'E' MoE (`pre_mlp_layernorm`, SequentialMLP)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                             TransformerLayerSubmodules)

    mla = bool(getattr(config, "multi_latent_attention", False))
    norm = config.normalization
    dense = get_gpt_layer_local_spec(normalization=norm, multi_latent_attention=mla,
                                     qk_layernorm=bool(config.qk_layernorm)).submodules
    moe = get_gpt_layer_local_spec(num_experts=config.num_moe_experts or 1, normalization=norm,
                                   multi_latent_attention=mla, qk_layernorm=bool(config.qk_layernorm)).submodules
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=dense.input_layernorm, self_attention=dense.self_attention, self_attn_bda=dense.self_attn_bda,
        sharded_state_dict_keys_map={} if mla else {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}))
    use_plain_attention([attention])
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda,
        sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}))
    moe_layer = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=attention, mla_layer=attention, mlp_layer=mlp, moe_layer=moe_layer))
