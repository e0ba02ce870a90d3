"""Declared mappings between two models' tensors: load a checkpoint of one model family into another.

A `Mapping` says, for every parameter of the target model, which regions of which source parameters
it is made of (`Copy`: a box of a target parameter := a box of a source parameter). Everything else
follows from that list: the model weights, the optimizer state kept per parameter (Adam's moments,
a master copy), the step counter. A mapped load is an ordinary bcp load whose targets are assembled
from source boxes: each rank reads only the byte ranges of the source pieces its own boxes need,
verified, all or nothing; nothing is gathered and no full tensor is built in between.

    m = bcp.mapping.megatron_to_hf(hf_model.config)          # any family of the registry
    bcp.load(path, {"model": hf_model, "optimizer": opt}, mapping=m)
    bcp.load(path2, megatron_state, framework="megatron", mapping=m.inverse())

Every mapping has an exact inverse (`Mapping.inverse`). A source whose shape disagrees with the
declaration, a missing source, a target of another shape or two sources for one element raise
`MappingError` naming the key and the shapes. Target elements no copy covers (vocabulary padding)
are zero. docs/mapping.md has the rules and the layout facts the declared families rely on.

The package's modules, lowest first: `rules.py` (Region, Copy, KeyScheme, the primitives),
`mapped_read.py` (a mapping bound to a checkpoint: what a mapped load reads), `declaration.py`
(`Mapping`), `families.py` (the registry of model families: names, dimensions, layout rules),
`decoder.py` (`megatron_to_hf` / `hf_to_megatron` for every registered family, GPTModel and
HybridModel), `auto.py` (`mapping="auto"`).
"""

from ..errors import MappingError
from .auto import resolve_mapping
from .declaration import Mapping
from .decoder import MegatronLayout, hf_to_megatron, layout_of, megatron_to_hf
from .families import Dims, ModelFamily, declared, family_of, register_family
from .mapped_read import MappedCheckpoint
from .rules import (Copy, KeyScheme, Region, megatron_scheme, qkv_split, rename, rows, stack, torch_scheme, unstack,
                    whole)

__all__ = ["Mapping", "Copy", "Region", "KeyScheme", "MappedCheckpoint", "torch_scheme", "megatron_scheme",
           "whole", "rename", "stack", "unstack", "rows", "qkv_split", "megatron_to_hf", "hf_to_megatron",
           "MegatronLayout", "layout_of", "resolve_mapping", "ModelFamily", "Dims", "register_family", "family_of",
           "declared", "MappingError"]
