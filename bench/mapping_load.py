"""A mapped load (Megatron-core layout -> Hugging Face Llama, Mixtral or DeepSeek-V3) against the same load
without a mapping, and against converting offline with `bcp export --mapping` then loading with
`from_pretrained`.

    python bench/mapping_load.py [--hidden 512] [--layers 8] [--vocab 32000] [--dir /tmp/bcp_mapbench] [--repeat 2]
    python bench/mapping_load.py --family mixtral [--layers 4] [--experts 8] [--expert-ffn 512]
    python bench/mapping_load.py --family deepseek_v3 [--layers 4] [--experts 8] [--expert-ffn 512]

Setup (not timed): a LlamaForCausalLM (MixtralForCausalLM, DeepseekV3ForCausalLM: transformers 5's fused
3-D experts; DeepSeek-V3's multi-latent attention, a shared expert, its first layer dense) of the given
size trains 2 AdamW steps and is saved by bcp (Hugging Face keys, `{"model", "optimizer"}`); the same
state is then written in Megatron's layout (stacked layers, or per layer for DeepSeek-V3, fused
[q; k; v] per query group and [gate; up], experts stacked on an axis of their own, vocabulary padded
to 128, the DistributedOptimizer's fully_reshardable keys) through `bcp_integrations.megatron.save`:
the two checkpoints hold the same numbers. Each measurement runs in a fresh process (its own peak RSS),
the kinds alternated `--repeat` times, best time and lowest peak kept:

- `mapped`: `bcp.load(megatron_ckpt, {"model", "optimizer"}, mapping=megatron_to_hf(config))`
- `plain`: `bcp.load(hf_ckpt, {"model", "optimizer"})` (the same bytes, no mapping)
- `mapped_weights`, `plain_weights`: the same with the model only
- `export` + `from_pretrained`: `bcp export megatron_ckpt out --to hf --mapping megatron-to-hf`, then
  `from_pretrained(out)` (weights only: an HF directory has no optimizer state; Mixtral's experts are
  written one tensor each, as Hugging Face files hold them, and fused by from_pretrained);
  time summed, peak RSS the larger of the two processes.

Only the load call (or the export, and from_pretrained) is timed, and the peak RSS is the
process's high-water mark reset just before it (/proc/self/clear_refs), so it includes the model
and optimizer state the call fills in (from_pretrained: the model it builds); imports and building
the model and a fresh AdamW are not timed. Prints a JSON report with the ratios. No assertion: this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def config(args):
    from transformers import DeepseekV3Config, LlamaConfig, MixtralConfig
    dims = dict(hidden_size=args.hidden, num_attention_heads=args.hidden // 64, num_key_value_heads=max(
        1, args.hidden // 256), num_hidden_layers=args.layers, vocab_size=args.vocab, max_position_embeddings=128,
        tie_word_embeddings=False)
    if args.family == "deepseek_v3":  # DeepSeek-V3's proportions: latent ranks 1/2 and 1/4 of hidden, 1 dense layer
        return DeepseekV3Config(**{**dims, "num_key_value_heads": dims["num_attention_heads"]},
                                intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                                moe_intermediate_size=args.expert_ffn,
                                n_routed_experts=args.experts, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                topk_group=1, first_k_dense_replace=1, q_lora_rank=args.hidden // 2,
                                kv_lora_rank=args.hidden // 4, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                                num_mtp_layers=0)
    if args.family == "mixtral":
        return MixtralConfig(**dims, intermediate_size=args.expert_ffn, num_local_experts=args.experts,
                             num_experts_per_tok=2)
    return LlamaConfig(**dims, intermediate_size=args.hidden * 8 // 3 // 64 * 64)


def model_class(args):
    from transformers import DeepseekV3ForCausalLM, LlamaForCausalLM, MixtralForCausalLM
    return {"mixtral": MixtralForCausalLM, "deepseek_v3": DeepseekV3ForCausalLM}.get(args.family, LlamaForCausalLM)


def setup(args) -> None:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import bcp_core as bcp
    import bcp_integrations.megatron as bm
    cfg = config(args)
    torch.manual_seed(0)
    model = model_class(args)(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (2, 16))
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
    hf = os.path.join(args.dir, "hf")
    bcp.save(hf, {"model": model, "optimizer": opt}).wait()
    cfg.to_json_file(os.path.join(args.dir, "config.json"))
    # the same numbers in Megatron's layout, through the inverse mapping (a plain dict target)
    inverse = bcp.mapping.hf_to_megatron(cfg, padded_vocab_size=128 * -(-cfg.vocab_size // 128))
    md = inverse.bind(bcp.inspect(hf)).metadata
    other_names = tuple(inverse.alternatives.values())  # the pre-MLP norm is offered under both its names
    target = {k: torch.empty(tm.shape, dtype=tm.dtype) for k, tm in md.tensors.items() if not k.endswith(other_names)}
    bcp.load(hf, target, mapping=inverse)
    bm.save({k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in target.items()},
            os.path.join(args.dir, "megatron")).wait()


def reset_peak() -> None:
    """Start this process's peak RSS (VmHWM) afresh: imports and the model built before the timed call
    are the same for every kind and not what is compared."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(args) -> dict:
    import torch

    import bcp_core as bcp
    kind, d = args.child, args.dir
    meg, hf = os.path.join(d, "megatron"), os.path.join(d, "hf")
    out = os.path.join(d, "export")
    if kind == "export":
        from bcp_core.tools.convert import export_checkpoint
        shutil.rmtree(out, ignore_errors=True)
        reset_peak()
        t = time.perf_counter()
        export_checkpoint(meg, out, mapping="megatron-to-hf", config=os.path.join(d, "config.json"))
        seconds = time.perf_counter() - t
    elif kind == "from_pretrained":
        reset_peak()
        t = time.perf_counter()
        model_class(args).from_pretrained(out)
        seconds = time.perf_counter() - t
    else:
        cfg = config(args)
        model = model_class(args)(cfg)
        state = {"model": model}
        if not kind.endswith("_weights"):
            state["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mapping = bcp.mapping.megatron_to_hf(cfg).with_step(2) if kind.startswith("mapped") else None
        reset_peak()
        t = time.perf_counter()
        bcp.load(meg if mapping else hf, state, mapping=mapping)
        seconds = time.perf_counter() - t
    return {"seconds": seconds, "peak_rss_mib": peak_mib()}


def run_child(args, kind: str) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--dir", args.dir, "--hidden", str(args.hidden),
           "--layers", str(args.layers), "--vocab", str(args.vocab), "--family", args.family,
           "--experts", str(args.experts), "--expert-ffn", str(args.expert_ffn)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=("llama", "mixtral", "deepseek_v3"), default="llama")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=None, help="default: 8 (llama), 4 (mixtral, deepseek_v3)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dir", default="/tmp/bcp_mapbench")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--child", default=None)
    args = p.parse_args()
    if args.layers is None:
        args.layers = 8 if args.family == "llama" else 4
    if args.child:
        print(json.dumps(child(args)))
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    setup(args)
    kinds = ["mapped", "plain", "mapped_weights", "plain_weights", "export", "from_pretrained"]
    best: dict[str, dict] = {}
    for _ in range(args.repeat):
        for kind in kinds:
            r = run_child(args, kind)
            b = best.setdefault(kind, r)
            b["seconds"], b["peak_rss_mib"] = min(b["seconds"], r["seconds"]), min(b["peak_rss_mib"],
                                                                                    r["peak_rss_mib"])
    offline = {"seconds": best["export"]["seconds"] + best["from_pretrained"]["seconds"],
               "peak_rss_mib": max(best["export"]["peak_rss_mib"], best["from_pretrained"]["peak_rss_mib"])}
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(args.dir, "megatron"))
               for f in fs)
    model = {"family": args.family, "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}
    if args.family != "llama":
        model.update(experts=args.experts, expert_ffn=args.expert_ffn)
    report = {"model": {**model, "checkpoint_mib": round(size / 2**20, 1)},
              "runs": {k: {"seconds": round(v["seconds"], 3), "peak_rss_mib": round(v["peak_rss_mib"], 1)}
                       for k, v in best.items()},
              "ratios": {
                  "mapped_over_plain_time": best["mapped"]["seconds"] / best["plain"]["seconds"],
                  "mapped_over_plain_peak_rss": best["mapped"]["peak_rss_mib"] / best["plain"]["peak_rss_mib"],
                  "mapped_weights_over_plain_weights_time":
                      best["mapped_weights"]["seconds"] / best["plain_weights"]["seconds"],
                  "mapped_weights_over_plain_weights_peak_rss":
                      best["mapped_weights"]["peak_rss_mib"] / best["plain_weights"]["peak_rss_mib"],
                  "mapped_weights_over_export_then_load_time": best["mapped_weights"]["seconds"] / offline["seconds"],
                  "mapped_weights_over_export_then_load_peak_rss":
                      best["mapped_weights"]["peak_rss_mib"] / offline["peak_rss_mib"]}}
    report["ratios"] = {k: round(v, 3) for k, v in report["ratios"].items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
