"""Issue 17: Megatron-Core's own GPTModel (local layer spec, CPU initialisation, gloo):
its ``sharded_state_dict()`` saved by shardstore at tensor parallelism 2, loaded into a
fresh model at TP 1 (``model.load_state_dict`` takes the result unchanged), saved again,
loaded at TP 4; the three checkpoints hold the same 17 arrays bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core.models.gpt.gpt_model", reason="megatron-core not installed")

from shardstore import load, load_plain_tensors, save  # noqa: E402
from tests.dist import run_distributed  # noqa: E402


def _gpt(tp: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    torch.manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, tensor_model_parallel_size=tp)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16)


def save_model(rank: int, world: int, ckpt: str) -> int:
    model = _gpt(world)
    save(model.sharded_state_dict(), ckpt)
    return sum(p.numel() for p in model.parameters())


def reload_and_save(rank: int, world: int, ckpt: str, again: str) -> None:
    model = _gpt(world)
    for p in model.parameters():
        p.data.fill_(float("nan"))  # whatever is not loaded shows
    result = model.load_state_dict(load(model.sharded_state_dict(), ckpt))
    assert not result.missing_keys and not result.unexpected_keys, result
    assert not any(torch.isnan(p).any() for p in model.parameters()), "a parameter was not loaded"
    save(model.sharded_state_dict(), again)


def test_gpt_model_reshards_between_tensor_parallel_sizes(tmp_path: Path) -> None:
    tp2, tp1, tp4 = (str(tmp_path / name) for name in ("tp2", "tp1", "tp4"))
    run_distributed(save_model, 2, tp2)
    run_distributed(reload_and_save, 1, tp2, tp1)
    run_distributed(reload_and_save, 4, tp1, tp4)
    saved = [load_plain_tensors(c) for c in (tp2, tp1, tp4)]
    arrays = sorted(k for k, v in saved[0].items() if isinstance(v, torch.Tensor))
    assert len(arrays) == 17 and "decoder.layers.self_attention.linear_qkv.weight" in arrays
    for key in arrays:
        assert torch.equal(saved[0][key], saved[1][key]) and torch.equal(saved[0][key], saved[2][key]), key
