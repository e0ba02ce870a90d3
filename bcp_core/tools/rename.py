"""Key rules ('REGEX=REPLACEMENT', shared by rename, export and import) and `bcp rename`."""

from __future__ import annotations

import re

from ..errors import ToolError
from ..metadata import METADATA_FILE, CheckpointMetadata, ObjectValue
from .read import open_checkpoint


def parse_rules(rules: list[str] | None) -> list[tuple[re.Pattern, str]]:
    """'REGEX=REPLACEMENT' rules (split at the first '='; write a literal '=' in REGEX as \\x3d)."""
    out = []
    for r in rules or []:
        pat, sep, repl = r.partition("=")
        if not sep or not pat:
            raise ToolError(f"rename rule {r!r} must look like 'REGEX=REPLACEMENT' (e.g. '^module\\.=')")
        try:
            out.append((re.compile(pat), repl))
        except re.error as e:
            raise ToolError(f"rename rule {r!r}: bad regular expression: {e}") from None
    return out


def apply_rules(key: str, rules: list[tuple[re.Pattern, str]]) -> str:
    for pat, repl in rules:
        key = pat.sub(repl, key)
    return key


def rename_map(keys, rules) -> dict[str, str]:
    new = {k: apply_rules(k, rules) for k in keys}
    seen: dict[str, str] = {}
    for old, n in new.items():
        if not n:
            raise ToolError(f"rename rules turn key {old!r} into an empty key")
        if n in seen:
            raise ToolError(f"rename rules map both {seen[n]!r} and {old!r} to {n!r}")
        seen[n] = old
    return new


def rename_checkpoint(path: str, rules: list[str], dry_run: bool = False) -> dict[str, str]:
    """Rewrite keys in the metadata only (data files untouched). Returns {old: new} for changed keys.

    Optimizer param_groups list parameters by FQN; where the rules rename the optimizer
    state keys `<opt>.state.<param>.<name>`, the param lists follow.
    """
    st, md = open_checkpoint(path)
    rules_c = parse_rules(rules)
    mapping = rename_map(md.keys(), rules_c)
    changed = {k: v for k, v in mapping.items() if k != v}
    if dry_run or not changed:
        return changed
    # Parameter FQN renames implied by optimizer state key renames, per optimizer.
    groups_keys = [k for k in md.objects if k.endswith(".param_groups")]
    objects = {}
    for k, o in md.objects.items():
        enc = o.encoded
        if k in groups_keys and isinstance(enc, list):
            opt = k[: -len(".param_groups")]
            params: dict[str, str] = {}
            for old, new in changed.items():
                prefix_old, prefix_new = f"{opt}.state.", f"{mapping[k][: -len('.param_groups')]}.state."
                if old.startswith(prefix_old) and new.startswith(prefix_new):
                    params[old[len(prefix_old): old.rindex(".")]] = new[len(prefix_new): new.rindex(".")]
            enc = [{**g, "params": [params.get(p, p) for p in g["params"]]}
                   if isinstance(g, dict) and isinstance(g.get("params"), list) else g for g in enc]
        objects[mapping[k]] = ObjectValue(enc)
    new_md = CheckpointMetadata(
        world_size=md.world_size, framework=md.framework, files=md.files,
        tensors={mapping[k]: v for k, v in md.tensors.items()}, objects=objects,
        per_rank={mapping[k]: v for k, v in md.per_rank.items()},
        sharded_objects={mapping[k]: v for k, v in md.sharded_objects.items()},
        checksum_block_bytes=md.checksum_block_bytes,
        user=md.user, version=md.version)
    st.write_atomic(METADATA_FILE, new_md.dumps())
    return changed
