"""The one-token decode step of each shape, bf16, random weights: transformers' forward over its static
cache (256 positions, 100 filled), captured as one CUDA graph and replayed (on a CPU: eager, a check
that the script runs). The embedded base and its growths (specdec.weights.grow's configs) against the shapes
of Llama-3.2-1B and Llama-3.1-8B. Part of scripts/gpu/wide.sh; `--tiny` shrinks every shape."""

import json
import os
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

sys.path.insert(0, os.getcwd())
from specdec.weights import grow, models  # noqa: E402

LLAMA = {  # the published configs' shapes
    "Llama-3.2-1B": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "Llama-3.1-8B": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}


def shapes(tiny: bool) -> dict[str, dict]:
    base = json.loads((models.ensure_default_converted() / "config.json").read_text())
    out = {"smollm2-135m": base}
    for factor in ("x8", "w4", "w4x4"):
        out[f"smollm2-135m-{factor}"] = grow.grown_config(base, grow.GROWTH[factor].shape(base), "base", factor)
    out.update({name: {**base, **shape} for name, shape in LLAMA.items()})
    if tiny:  # a CPU check: two layers, a small vocabulary
        out = {name: {**c, "num_hidden_layers": 2, "vocab_size": 512} for name, c in out.items()}
    return out


def step_ms(config: dict, device: str, dtype) -> float:
    keep = {k: v for k, v in config.items() if not k.startswith("specdec_")}
    keep.pop("torch_dtype", None), keep.pop("dtype", None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**keep)).to(dtype).eval()
    cache = StaticCache(config=model.config, max_cache_len=256)
    with torch.no_grad():
        model(
            torch.randint(0, 500, (1, 100), device=device),
            past_key_values=cache,
            cache_position=torch.arange(100, device=device),
        )
        ids = torch.randint(0, 500, (1, 1), device=device)
        position = torch.tensor([100], device=device)

        def forward():
            return model(ids, past_key_values=cache, cache_position=position, logits_to_keep=1).logits

        if device == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            run = graph.replay
        else:
            run = forward
        times = []
        for _ in range(5 if device == "cpu" else 60):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[len(times) // 4 :])


def main() -> None:
    tiny = "--tiny" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    results = {}
    for name, config in shapes(tiny).items():
        try:
            results[name] = step_ms(config, device, dtype)
            if device == "cuda":
                torch.cuda.empty_cache()  # the shape's model is gone with step_ms's frame
        except Exception as err:  # noqa: BLE001 - one shape's failure is reported, the others still run
            print(f"    {name}: failed: {type(err).__name__}: {err}", flush=True)
            continue
        params = grow.parameter_count(config) / 1e9
        how = "graphed" if device == "cuda" else "eager"
        print(f"    {name:20s} {params:5.2f}B parameters  one-token step {results[name]:6.2f} ms ({how})", flush=True)
    if "Llama-3.2-1B" in results and "Llama-3.1-8B" in results:
        print(f"    8B / 1B step ratio {results['Llama-3.1-8B'] / results['Llama-3.2-1B']:.2f}", flush=True)


if __name__ == "__main__":
    main()
