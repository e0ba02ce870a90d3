"""Declared mappings between two models' tensors: load a checkpoint of one model family into another.

A `Mapping` says, for every parameter of the target model, which regions of which source parameters
it is made of (`Copy`: a box of a target parameter := a box of a source parameter). Everything else
follows from that list: the model weights, the optimizer state kept per parameter (Adam's moments,
a master copy), the step counter. A mapped load is an ordinary bcp load whose targets are assembled
from source boxes: each rank reads only the byte ranges of the source pieces its own boxes need,
verified, all or nothing; nothing is gathered and no full tensor is built in between.

    m = bcp.mapping.megatron_to_hf(hf_model.config)          # bcp_core/mapping/llama.py
    bcp.load(path, {"model": hf_model, "optimizer": opt}, mapping=m)
    bcp.load(path2, megatron_state, framework="megatron", mapping=m.inverse())

Every mapping has an exact inverse (`Mapping.inverse`). A source whose shape disagrees with the
declaration, a missing source, a target of another shape or two sources for one element raise
`MappingError` naming the key and the shapes. Target elements no copy covers (vocabulary padding)
are zero. docs/mapping.md has the rules and the layout facts the declared families rely on.

The package's files: `rules.py` (Region, Copy, KeyScheme, Mapping, the primitives), `mapped_read.py`
(a mapping bound to a checkpoint: what a mapped load reads), `auto.py` (`mapping="auto"`), and the
declared families (`llama.py`: Llama, Mistral, Qwen2 and the decoders of Mixtral, Qwen2-MoE,
Qwen3-MoE, whose experts are `moe.py`'s).
"""

from ..errors import MappingError
from .auto import FAMILIES, resolve_mapping
from .llama import hf_to_megatron, megatron_to_hf
from .mapped_read import MappedCheckpoint
from .rules import (Copy, KeyScheme, Mapping, Region, megatron_scheme, qkv_split, rename, rows, stack, torch_scheme,
                    unstack, whole)

__all__ = ["Mapping", "Copy", "Region", "KeyScheme", "MappedCheckpoint", "torch_scheme", "megatron_scheme",
           "whole", "rename", "stack", "unstack", "rows", "qkv_split", "megatron_to_hf", "hf_to_megatron",
           "resolve_mapping", "FAMILIES", "MappingError"]
