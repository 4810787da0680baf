"""The rounded drafts (specdec.weights.rounded): every decoder weight on its group's grid, the rest as it
was, the alias built once in the cache and loadable by transformers."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file

from specdec.weights import embedded, models, rounded
from tests.conftest import make_tiny_model


def test_a_rounded_weight_lies_on_its_groups_grid_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    for bits in (3, 4):
        r = rounded.round_weight(w, bits)
        assert r.shape == w.shape
        for g, q in zip(w.reshape(-1, rounded.GROUP), r.reshape(-1, rounded.GROUP), strict=True):
            step = g.abs().max() / (2 ** (bits - 1) - 1)
            assert len(set(q.tolist())) <= 2**bits
            assert torch.allclose(q / step, torch.round(q / step), atol=1e-4)  # on the grid
            assert (q - g).abs().max() <= step / 2 + 1e-6  # the nearest level
            assert torch.isclose(q.abs().max(), g.abs().max())  # the largest magnitude kept
    assert not torch.equal(rounded.round_weight(w, 3), rounded.round_weight(w, 4))


def test_the_alias_is_built_once_from_the_conversion(tmp_path, monkeypatch, capfd):
    base = make_tiny_model(tmp_path / "base", seed=5, layers=2)
    shutil.copytree(base, tmp_path / "SmolLM2-135M-Instruct")
    monkeypatch.setattr(embedded, "_cache", tmp_path)  # the cache the CLI would set from $SPECDEC_CACHE
    path = models.resolve("smollm2-135m-int3")
    assert path == str(tmp_path / "SmolLM2-135M-Instruct-int3")
    assert "rounding SmolLM2-135M-Instruct to 3 bits" in capfd.readouterr().err
    before, after = load_file(f"{base}/model.safetensors"), load_file(f"{path}/model.safetensors")
    assert before.keys() == after.keys()
    for name, w in before.items():
        if w.dim() == 2 and name.startswith("model.layers."):
            assert torch.equal(after[name], rounded.round_weight(w, 3)), name
        else:
            assert torch.equal(after[name], w), name  # embeddings, norms, the output layer
    config = json.loads((tmp_path / "SmolLM2-135M-Instruct-int3" / "config.json").read_text())
    assert config["specdec_rounded_bits"] == 3
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)
    assert models.resolve("smollm2-135m-int3") == path  # a second resolve builds nothing
    assert "rounding" not in capfd.readouterr().err
    assert not list(tmp_path.glob(".convert-*"))
