"""The engines a CPU user would run instead of specdec, as `specdec bench compare` rows.

- `llamacpp-target`: llama.cpp target-only through llama-cpp-python (`llama_cpp.Llama`) on the
  F32 GGUF, which holds the same weights as the fp32 transformers target. In process, on the
  same prompt token ids, with the threads hf-target uses; EOS is masked until max tokens, as
  `min_new_tokens` does for the hf rows. Wall time includes the prefill, as for the hf rows.
- `llama-speculative`: llama.cpp's own speculative decoding example binary (`make llama-tools`
  builds it) on the F32 target GGUF with the default Q8_0 draft (the embedded GGUF requantised),
  one process per generation.
  The prompt goes in as text with the chat template applied (`-f`, no escapes); the binary's
  own count of prompt tokens must equal ours. Tokens/s = its decoded tokens over its prefill
  plus decode time (model loading excluded); the acceptance rate is its n_accept / n_drafted.

This module runs the engines and reads their output; bench.run owns the plan and the table.
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
import time
from pathlib import Path

from specdec.weights import models

N_CTX = 4096  # positions of the llama.cpp contexts: the longest prompt plus max tokens fit


# -- llamacpp-target ----------------------------------------------------------------------------
class LlamaCppTarget:
    """Target-only decoding with llama_cpp.Llama: prefill, then one token a forward."""

    def __init__(self, path: Path, threads: int):
        try:
            import llama_cpp
        except ImportError as err:
            raise RuntimeError(
                "the llamacpp-target row needs llama-cpp-python: pip install 'specdec[llamacpp]'"
            ) from err
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.eog = [t for t in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
        self.threads = threads

    def generate(self, ids: list[int], max_tokens: int, temperature: float, seed: int) -> dict:
        """`max_tokens` new tokens after `ids` (EOS masked); greedy at temperature 0, else plain
        sampling at that temperature (no top-k, top-p or min-p: as the hf rows)."""
        from llama_cpp import _internals

        assert len(ids) + max_tokens <= N_CTX, f"{len(ids)} + {max_tokens} tokens exceed the context ({N_CTX})"
        sampler = _internals.LlamaSampler()
        sampler.add_logit_bias(self.llm.n_vocab(), dict.fromkeys(self.eog, -math.inf))
        if temperature > 0:
            sampler.add_temp(temperature)
            sampler.add_dist(seed)
        else:
            sampler.add_greedy()
        t0 = time.perf_counter()
        self.llm.reset()
        self.llm.eval(ids)
        out: list[int] = []
        while True:
            out.append(sampler.sample(self.llm._ctx, -1))
            if len(out) == max_tokens:
                break
            self.llm.eval(out[-1:])
        wall = time.perf_counter() - t0
        sampler.close()
        return {"tokens": len(out), "wall": wall, "tokens_per_second": len(out) / wall, "token_ids": out}


# -- llama-speculative ---------------------------------------------------------------------------
_PATTERNS = {
    "prompt_tokens": r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds",
    "tokens": r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds",
    "drafted": r"n_drafted\s*=\s*(\d+)",
    "accepted": r"n_accept\s*=\s*(\d+)",
}


def parse_speculative_output(text: str) -> dict:
    """The figures llama-speculative prints at its end (stdout and stderr together):

        encoded   48 tokens in    0.101 seconds, speed:  476.2 t/s
        decoded   65 tokens in    1.234 seconds, speed:   52.7 t/s
        n_drafted = 56
        n_accept  = 50

    Raises ValueError, quoting the output's end, when a line is missing."""
    found = {key: re.search(pattern, text) for key, pattern in _PATTERNS.items()}
    if missing := [key for key, match in found.items() if match is None]:
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise ValueError(f"llama-speculative output not recognised (no {', '.join(missing)}); its end:\n{tail}")
    prompt_tokens, prefill = int(found["prompt_tokens"][1]), float(found["prompt_tokens"][2])
    tokens, decode = int(found["tokens"][1]), float(found["tokens"][2])
    drafted, accepted = int(found["drafted"][1]), int(found["accepted"][1])
    rounds = max(tokens - accepted, 1)  # each round ends with one token of the target's own
    return {
        "prompt_tokens": prompt_tokens,
        "tokens": tokens,
        "wall": prefill + decode,
        "tokens_per_second": tokens / (prefill + decode),
        "decode_tokens_per_second": tokens / decode,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_round": tokens / rounds,
        "drafts_per_round": drafted / rounds,
    }


def speculative_command(
    binary: Path, prompt_file: Path, max_tokens: int, k: int | None, temperature: float, seed: int, threads: int
) -> list[str]:
    """k: its drafts a round at most (--spec-draft-n-max); None: its own defaults, as a user runs it."""
    # -n counts from 0 and the binary stops after the round that passes it: -n max - 1 stops
    # at the first round reaching max tokens (a round may run past it by up to k tokens).
    drafts = [] if k is None else ["--spec-draft-n-max", str(k)]
    return [
        str(binary),
        "-m", str(models.f32_gguf_path()),
        "-md", str(models.draft_gguf_path()),
        "-f", str(prompt_file), "--no-escape",
        "-n", str(max_tokens - 1),
        "-c", str(N_CTX),
        *drafts,
        "-t", str(threads), "-tb", str(threads), "-td", str(threads), "-tbd", str(threads),
        "--temp", str(temperature), "--top-k", "0", "--top-p", "1", "--min-p", "0",
        "--seed", str(seed), "--ignore-eos",
    ]  # fmt: skip


def run_speculative(
    binary: Path,
    prompt_text: str,
    prompt_tokens: int,
    max_tokens: int,
    k: int | None,
    temperature: float,
    seed: int,
    threads: int,
) -> dict:
    """One llama-speculative generation of `prompt_text` (the chat template already applied,
    `prompt_tokens` long in our tokenizer); the parsed figures."""
    with tempfile.TemporaryDirectory(prefix="specdec-llama-") as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        prompt_file.write_text(prompt_text + "\n")  # -f drops one trailing newline
        cmd = speculative_command(binary, prompt_file, max_tokens, k, temperature, seed, threads)
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if out.returncode != 0:
        tail = "\n".join(out.stdout.strip().splitlines()[-15:])
        raise RuntimeError(f"{binary} exited with {out.returncode}:\n{tail}")
    result = parse_speculative_output(out.stdout)
    if result["prompt_tokens"] != prompt_tokens:
        raise RuntimeError(
            f"llama-speculative read {result['prompt_tokens']} prompt tokens where the other rows have "
            f"{prompt_tokens}: it did not tokenize the templated prompt as transformers does"
        )
    return result
