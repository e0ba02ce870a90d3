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

It also mends one thing of the path Megatron takes without Apex or Transformer Engine (torch's
Adam, the only one on CPU): loading `fully_reshardable` optimizer state copies every key of the
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
    _moe_on_cpu(patch)
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
