#!/usr/bin/env python3
"""Decode tokens/s of HF transformers (eager attention, bf16) on a randomly initialised model of
the llama-3.1-8b shape: the baseline bench_gpu_decode is compared with in bench/gpu/device_check.sh.

For each context length x requests: a DynamicCache of `ctx` random bf16 K/V per request (built
directly, layer by layer, no prefill compute), one warm-up decode step, then `steps` timed decode
steps (model(input_ids [R, 1], past_key_values=cache, use_cache=True), greedy next token), with
torch.cuda.synchronize() around the timer. tokens/s = steps * R / seconds. Nothing is downloaded.
A configuration that runs out of memory is recorded as {"status": "OOM"} and its memory freed
before the next one; no single failure stops the script. The JSON is rewritten after every
configuration, so a run stopped from outside keeps what it measured.

    python3 bench/gpu/hf_decode.py --out bench_out/hf_decode.json [--contexts 16384,32768
        --requests 1,8,32 --steps 32 --time-budget-s 140]
"""

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback

# The shape of Llama-3.1-8B (its config.json), rope scaling included.
LLAMA_31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=128000,
    eos_token_id=128001,
)
ROPE_THETA = 500000.0
ROPE_LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def write_json(path, doc):
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def log(msg):
    print("hf_decode: " + msg, file=sys.stderr, flush=True)


def major_version(version):
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


def rope_is_llama3(cfg, attempt, v5):
    """Whether the config really carries llama3 rope scaling with theta 500000. v5 keeps it in
    rope_parameters (and converts a legacy rope_scaling there); v4 keeps rope_scaling +
    rope_theta, and stores an unknown keyword such as rope_parameters silently, so that spelling
    only counts on v5."""
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
        rp = rp["full_attention"]
    in_parameters = (isinstance(rp, dict) and rp.get("rope_type") == "llama3"
                     and float(rp.get("rope_theta") or 0) == ROPE_THETA)
    if attempt == "rope_parameters":
        return v5 and in_parameters
    rs = getattr(cfg, "rope_scaling", None)
    in_scaling = (isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "llama3"
                  and float(getattr(cfg, "rope_theta", 0) or 0) == ROPE_THETA)
    return in_scaling or in_parameters


def make_config(transformers, layers):
    shape = dict(LLAMA_31_8B)
    if layers > 0:
        shape["num_hidden_layers"] = layers
    v5 = major_version(transformers.__version__) >= 5
    attempts = [
        ("rope_parameters", dict(rope_parameters=dict(ROPE_LLAMA3, rope_theta=ROPE_THETA))),
        ("rope_scaling", dict(rope_theta=ROPE_THETA, rope_scaling=dict(ROPE_LLAMA3))),
    ]
    if not v5:
        attempts.reverse()
    errors = []
    for name, extra in attempts:
        for with_attn in (True, False):
            kwargs = dict(shape, **extra)
            if with_attn:
                kwargs["attn_implementation"] = "eager"
            try:
                cfg = transformers.LlamaConfig(**kwargs)
            except Exception as e:  # noqa: BLE001 - any API difference: try the next spelling
                errors.append("%s%s: %s: %s" % (name, "+attn" if with_attn else "", type(e).__name__, e))
                continue
            if not rope_is_llama3(cfg, name, v5):
                errors.append("%s: rope scaling not taken up by the config" % name)
                continue
            return cfg, name, errors
    # RoPE scaling only changes the rotation angles, not the work: rather than no baseline, one
    # with plain RoPE, saying so.
    cfg = transformers.LlamaConfig(**shape)
    return cfg, "plain rope (llama3 scaling not taken up; decode speed is unaffected)", errors


def no_init_context(transformers):
    """transformers' context that skips the default weight initialisation, if this version has
    one (the weights are initialised explicitly afterwards either way)."""
    import contextlib
    for module_name in ("transformers.modeling_utils", "transformers.initialization"):
        try:
            module = __import__(module_name, fromlist=["no_init_weights"])
        except Exception:  # noqa: BLE001
            continue
        fn = getattr(module, "no_init_weights", None)
        if fn is not None:
            try:
                return fn(), module_name + ".no_init_weights"
            except TypeError:
                try:
                    return fn(True), module_name + ".no_init_weights"
                except Exception:  # noqa: BLE001
                    pass
    return contextlib.nullcontext(), "none"


def build_model(torch, transformers, cfg):
    ctx, how = no_init_context(transformers)
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"), ctx:
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    if any(p.dtype != torch.bfloat16 for p in model.parameters()):
        model.to(dtype=torch.bfloat16)  # (this would also cast float buffers such as inv_freq)
    model.eval()
    # Random weights on the device: N(0, 0.02) for matrices, ones for the norms (the default
    # init of Llama), so no uninitialised memory reaches the kernels.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != "eager":
        setter = getattr(model, "set_attn_implementation", None)
        if callable(setter):
            setter("eager")
        else:
            model.config._attn_implementation = "eager"
        attn = getattr(model.config, "_attn_implementation", None)
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    info = {
        "no_init": how,
        "attn_implementation": attn,
        "rotary_rope_type": getattr(rotary, "rope_type", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype),
    }
    return model, info


def make_cache(torch, transformers, model, requests, ctx, kv_heads, head_dim, layers):
    try:
        cache = transformers.DynamicCache(config=model.config)
        how = "DynamicCache(config=...)"
    except TypeError:
        cache = transformers.DynamicCache()
        how = "DynamicCache()"
    for layer in range(layers):
        k = torch.randn(requests, kv_heads, ctx, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(requests, kv_heads, ctx, head_dim, device="cuda", dtype=torch.bfloat16)
        cache.update(k, v, layer)
        del k, v
    length = cache.get_seq_length()
    if length != ctx:
        raise RuntimeError("cache holds %s tokens after filling %d" % (length, ctx))
    return cache, how


def run_config(torch, transformers, model, cfg, ctx, requests, steps, budget_left):
    layers = cfg.num_hidden_layers
    out = {"ctx": ctx, "requests": requests, "method": "hf-eager"}
    with torch.inference_mode():
        torch.cuda.synchronize()
        t = time.perf_counter()
        cache, how = make_cache(torch, transformers, model, requests, ctx, cfg.num_key_value_heads,
                                cfg.head_dim, layers)
        torch.cuda.synchronize()
        out["cache"] = how
        out["fill_seconds"] = time.perf_counter() - t
        gen = torch.Generator(device="cuda")
        gen.manual_seed(ctx + requests)
        ids = torch.randint(0, cfg.vocab_size, (requests, 1), device="cuda", generator=gen)

        def step(ids, cache):
            res = model(input_ids=ids, past_key_values=cache, use_cache=True)
            return res.logits[:, -1, :].argmax(dim=-1, keepdim=True)

        t = time.perf_counter()
        ids = step(ids, cache)
        torch.cuda.synchronize()
        warm = time.perf_counter() - t
        out["warmup_seconds"] = warm
        step_s = []
        stopped = None
        t0 = time.perf_counter()
        for s in range(steps):
            ts = time.perf_counter()
            ids = step(ids, cache)
            torch.cuda.synchronize()  # per step, for the per-step times; the total is the same
            step_s.append(time.perf_counter() - ts)
            if budget_left is not None and budget_left() <= 0 and s + 1 < steps:
                stopped = "time budget reached after %d timed steps" % (s + 1)
                break
        secs = time.perf_counter() - t0
        if cache.get_seq_length() != ctx + 1 + len(step_s):
            raise RuntimeError("cache length %s after %d steps from %d" % (cache.get_seq_length(), len(step_s) + 1, ctx))
        step_s.sort()
        out.update({
            "status": "ok",
            "steps": len(step_s),
            "seconds": secs,
            "tokens_per_s": len(step_s) * requests / secs if secs > 0 else 0.0,
            "step_seconds": {"min": step_s[0], "median": step_s[len(step_s) // 2], "max": step_s[-1]},
            "device_max_allocated_bytes": torch.cuda.max_memory_allocated(),
            "kv_cache_bytes": 2 * layers * requests * cfg.num_key_value_heads * (ctx + 1 + len(step_s)) * cfg.head_dim * 2,
        })
        if stopped:
            out["stopped_early"] = stopped
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out/hf_decode.json")
    ap.add_argument("--contexts", type=int_list, default=[16384, 32768])
    ap.add_argument("--requests", type=int_list, default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--layers", type=int, default=0, help="cut the model to this many layers (0 = 32)")
    ap.add_argument("--time-budget-s", type=float, default=0, help="stop launching configurations after this; 0 = none")
    args = ap.parse_args()
    start = time.perf_counter()
    doc = {
        "command": " ".join([sys.executable] + sys.argv),
        "note": "HF transformers eager attention, bf16, random weights, DynamicCache filled with random K/V: speed, not quality",
        "python": platform.python_version(),
        "figures_produced": False,
        "status": "starting",
    }
    write_json(args.out, doc)
    try:
        import torch
        doc["torch"] = torch.__version__
        doc["torch_cuda"] = getattr(torch.version, "cuda", None)
        import transformers
        doc["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001 - ImportError and whatever a broken install raises
        doc["status"] = "torch or transformers missing"
        doc["error"] = "%s: %s" % (type(e).__name__, e)
        log(doc["status"] + ": " + doc["error"] + "; no figures were produced")
        write_json(args.out, doc)
        return 0
    if not torch.cuda.is_available():
        doc["status"] = "no device"
        doc["error"] = "torch.cuda.is_available() is False"
        log("no CUDA device; no figures were produced")
        write_json(args.out, doc)
        return 0
    doc["device"] = torch.cuda.get_device_name(0)
    doc["device_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    oom_types = tuple(t for t in (getattr(torch.cuda, "OutOfMemoryError", None), getattr(torch, "OutOfMemoryError", None))
                      if isinstance(t, type))

    try:
        t = time.perf_counter()
        cfg, rope_how, cfg_notes = make_config(transformers, args.layers)
        model, info = build_model(torch, transformers, cfg)
        torch.cuda.synchronize()
        info["build_seconds"] = time.perf_counter() - t
        info["config_rope"] = rope_how
        if cfg_notes:
            info["config_attempts_failed"] = cfg_notes
        info["layers"] = cfg.num_hidden_layers
        info["weight_bytes"] = torch.cuda.memory_allocated()
        doc["model"] = info
        log("model: %s parameters, attention %s, rope %s, built in %.1f s" % (
            info["parameters"], info["attn_implementation"], info["rotary_rope_type"], info["build_seconds"]))
    except Exception as e:  # noqa: BLE001
        doc["status"] = "error"
        doc["error"] = "model: %s: %s" % (type(e).__name__, e)
        doc["traceback"] = traceback.format_exc()[-4000:]
        log(doc["error"])
        write_json(args.out, doc)
        return 1

    def budget_left():
        return args.time_budget_s - (time.perf_counter() - start)

    configs = []
    doc["configs"] = configs
    doc["status"] = "running"
    write_json(args.out, doc)
    for ctx in args.contexts:
        for requests in args.requests:
            t = time.perf_counter()
            if args.time_budget_s > 0 and budget_left() <= 0:
                res = {"ctx": ctx, "requests": requests, "method": "hf-eager", "status": "skipped",
                       "reason": "time budget of %g s reached before this configuration" % args.time_budget_s}
            else:
                torch.cuda.reset_peak_memory_stats()
                try:
                    res = run_config(torch, transformers, model, cfg, ctx, requests, args.steps,
                                     budget_left if args.time_budget_s > 0 else None)
                except Exception as e:  # noqa: BLE001 - OOM and anything else: record, free, go on
                    is_oom = (oom_types and isinstance(e, oom_types)) or "out of memory" in str(e).lower()
                    res = {"ctx": ctx, "requests": requests, "method": "hf-eager",
                           "status": "OOM" if is_oom else "error",
                           "error": "%s: %s" % (type(e).__name__, str(e)[:600])}
                    if not is_oom:
                        res["traceback"] = traceback.format_exc()[-3000:]
                # The exception (and the frames holding the cache) is gone here: free the memory.
                gc.collect()
                torch.cuda.empty_cache()
            res["wall_seconds"] = time.perf_counter() - t
            if res["status"] == "ok":
                log("ctx %6d  R %3d  hf-eager    %9.1f tok/s  (%d steps, %.3f s)" % (
                    ctx, requests, res["tokens_per_s"], res["steps"], res["seconds"]))
                doc["figures_produced"] = True
            else:
                log("ctx %6d  R %3d  hf-eager    %s: %.300s" % (
                    ctx, requests, res["status"], res.get("error", res.get("reason", ""))))
            configs.append(res)
            doc["elapsed_seconds"] = time.perf_counter() - start
            write_json(args.out, doc)
    doc["status"] = "done"
    doc["elapsed_seconds"] = time.perf_counter() - start
    write_json(args.out, doc)
    log("wrote " + args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
