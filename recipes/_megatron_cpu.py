"""Megatron-core's DDP, DistributedOptimizer and GPT forward on CPU (gloo): for the recipes and tests
that run Megatron's real training components on a machine without a GPU (recipes/megatron_to_hf.py,
tests/test_mapping_megatron.py). On a GPU machine do not use it.

Megatron hard-codes CUDA in a few places even for CPU tensors: `device="cuda"` /
`torch.cuda.current_device()` for its buffers, `Tensor.cuda()`, `Tensor.type()` compared with
"torch.cuda.FloatTensor", CUDA streams, and the CUDA RNG tracker around attention dropout.
`cuda_on_cpu()` redirects exactly those, and puts everything back on exit.

It also mends one thing of the path Megatron takes without Apex or Transformer Engine (torch's
Adam, the only one on CPU): loading `fully_reshardable` optimizer state copies every key of the
inner optimizer's state from the loaded tensors, including the `step` that `load_state_dict` has
just set from the param groups and that loaded tensors never hold (KeyError: 'step'), and that
step is one tensor shared by every parameter, which torch's Adam then increments once per
parameter per step; here keys the loaded tensors lack are left as they are, and each parameter
gets its own copy of the step.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "empty_like", "zeros_like",
              "ones_like", "full_like")


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


@contextlib.contextmanager
def cuda_on_cpu():
    from megatron.core.tensor_parallel import random as mrandom

    saved = []

    def patch(obj, name, new):
        saved.append((obj, name, getattr(obj, name)))
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
        for key, dst in {"param": main_param, **state}.items():
            if key in tensors:
                dst.copy_(tensors[key])
            elif key == "step":
                state[key] = dst.clone()

    patch(DistributedOptimizer, "_set_main_param_and_optimizer_states", set_loaded_states)
    try:
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)
