"""Issue 17: Megatron-Core's own GPTModel (local layer spec, CPU initialisation, gloo):
its ``sharded_state_dict()`` saved by shardstore at tensor parallelism 2, loaded into a
fresh model at TP 1 (``model.load_state_dict`` takes the result unchanged), saved again,
loaded at TP 4; the three checkpoints hold the same 17 arrays bit for bit."""

from __future__ import annotations

import re
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


# ------------------------------------------------ with Megatron's DistributedOptimizer (CUDA)

_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _trained(seed: int, grad: float):
    """Megatron's own GPTModel (bf16) in its DistributedDataParallel, with its
    DistributedOptimizer (fp32 main params, Adam), after one step with every gradient
    ``grad``. Only on CUDA: the optimizer checks ``torch.cuda`` tensor types and
    allocates its buffers on the current device."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               bf16=True, params_dtype=torch.bfloat16)
    # All in bf16, as Megatron-LM's Float16Module makes it: without Apex or Transformer
    # Engine the norms and the position embedding are created in fp32, and the
    # DistributedOptimizer then pairs parameters with the wrong main params (it puts a
    # group's fp32 parameters first, but indexes them in model order).
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                   max_sequence_length=16).cuda().bfloat16()
    ddp = DistributedDataParallel(
        config=config, module=gpt,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16,
                        use_distributed_optimizer=True),
        [ddp],
    )
    _step(gpt, ddp, optimizer, grad)
    return gpt, ddp, optimizer


def _step(gpt, ddp, optimizer, grad: float) -> None:
    ddp.zero_grad_buffer()
    for p in gpt.parameters():
        p.main_grad.fill_(grad)
    ddp.finish_grad_sync()
    success, _, _ = optimizer.step()
    assert success, "the optimizer step was skipped"


def _sharded(gpt, optimizer, is_loading: bool, sharding: str) -> dict:
    """The model's and the optimizer's sharded state dict. ``sharding``: the optimizer's
    layout (Megatron 0.16's default, ``fully_sharded_model_space``, raises: it uses the
    flattened ranges 0.16 dropped)."""
    model = gpt.sharded_state_dict()
    optimizer_state = optimizer.sharded_state_dict(
        model, is_loading=is_loading, metadata={"distrib_optim_sharding_type": sharding}
    )
    return {"model": model, "optimizer": optimizer_state}


def _unshare_steps(optimizer) -> None:
    """Megatron-Core 0.16's ``DistributedOptimizer.load_state_dict``, without Apex or
    Transformer Engine, gives torch's Adam ONE ``step`` tensor for every parameter's
    state, and each parameter's update increments it: the next step's bias correction is
    then not the saved optimizer's. A copy per parameter, so that the step after the load
    can be compared with the step before the save (a Megatron bug, not the checkpoint's)."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            state["step"] = state["step"].clone()


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_states(optimizer) -> list[torch.Tensor]:
    """Every fp32 main parameter and its Adam moments, in the optimizer's order."""
    out = []
    for inner in _inner_optimizers(optimizer):
        for group in inner.optimizer.param_groups:
            for main in group["params"]:
                state = inner.optimizer.state[main]
                out += [main.detach(), state["exp_avg"], state["exp_avg_sq"]]
    return out


def _bucket_params(optimizer) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(grad buffer, bucket) -> the element ranges its parameters hold in the bucket
    (world 1: a rank's local range is the bucket). ``dp_reshardable`` fills the gaps
    between them with ``torch.empty`` padding, whose bytes are whatever memory held."""
    (inner,) = _inner_optimizers(optimizer)
    ranges = {}
    for gbuf_idx, by_dtype in enumerate(inner.gbuf_ranges):
        for buckets in by_dtype.values():
            for bucket_idx, bucket in enumerate(buckets):
                ranges[gbuf_idx, bucket_idx] = sorted(
                    (r["gbuf_local"].start, r["gbuf_local"].end) for r in bucket["param_map"].values())
    return ranges


def distributed_optimizer_round_trip(
    rank: int, world: int, ckpt: str, again: str, sharding: str,
) -> tuple[int, dict[tuple[int, int], list[tuple[int, int]]]]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    gpt_a, ddp_a, optimizer_a = _trained(seed=1, grad=0.5)
    save(_sharded(gpt_a, optimizer_a, is_loading=False, sharding=sharding), ckpt)

    gpt_b, ddp_b, optimizer_b = _trained(seed=2, grad=-0.25)  # other weights and other moments
    assert not all(torch.equal(a, b) for a, b in zip(gpt_a.parameters(), gpt_b.parameters()))
    loaded = load(_sharded(gpt_b, optimizer_b, is_loading=True, sharding=sharding), ckpt)
    result = gpt_b.load_state_dict(loaded["model"], strict=False)
    assert not [k for k in result.missing_keys if not k.endswith("_extra_state")], result
    optimizer_b.load_state_dict(loaded["optimizer"])
    for i, (a, b) in enumerate(zip(_main_states(optimizer_a), _main_states(optimizer_b), strict=True)):
        assert torch.equal(a, b), f"main parameter or moment {i} differs after the load"
    # Both optimizers took one step, so Adam's step count is the same either way: with
    # torch's Adam, dp_reshardable keeps the loading optimizer's own per-parameter step
    # (Megatron saves it as a LocalNonpersistentObject), which this does not check.
    _unshare_steps(optimizer_b)
    save(_sharded(gpt_b, optimizer_b, is_loading=False, sharding=sharding), again)

    # training goes on identically from the loaded state: the same step, the same weights
    _step(gpt_a, ddp_a, optimizer_a, grad=0.125)
    _step(gpt_b, ddp_b, optimizer_b, grad=0.125)
    for (name, a), b in zip(gpt_a.named_parameters(), gpt_b.parameters()):
        assert torch.equal(a, b), f"{name} differs after a step from the loaded state"
    return sum(1 for _ in gpt_a.parameters()), _bucket_params(optimizer_a)


@pytest.mark.timeout(420)  # over run_distributed's 300 s, so its stacks come first
@pytest.mark.gpu
@_cuda
@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable"])
def test_gpt_model_with_distributed_optimizer_round_trips_on_cuda(tmp_path: Path, sharding: str) -> None:
    """Megatron-Core's GPTModel and DistributedOptimizer on CUDA (NCCL, world 1): the
    model's and the optimizer's sharded state (fp32 main params and Adam moments, in
    both of its reshardable layouts) saved, loaded into another model and optimizer,
    saved again bit-exact; a further step gives the same weights on both."""
    from megatron.core.optimizer import distrib_optimizer

    if sharding == "fully_reshardable" and not distrib_optimizer.HAVE_APEX_OR_TE:
        pytest.skip("Megatron-Core 0.16 cannot load fully_reshardable into torch's Adam (no Apex or Transformer "
                    "Engine here): DistributedOptimizer._set_main_param_and_optimizer_states raises KeyError 'step'")
    ckpt, again = str(tmp_path / "a"), str(tmp_path / "b")
    ((params, buckets),) = run_distributed(distributed_optimizer_round_trip, 1, ckpt, again, sharding,
                                           backend="nccl", timeout=300)
    assert params > 10
    first, second = load_plain_tensors(ckpt), load_plain_tensors(again)
    arrays = sorted(k for k, v in first.items() if isinstance(v, torch.Tensor))
    assert any("exp_avg" in k for k in arrays) and any("decoder.layers" in k for k in arrays), arrays
    for key in arrays:
        held = _held_elements(key, buckets)
        if held is None:
            assert torch.equal(first[key], second[key]), key
        else:  # a dp_reshardable bucket: its parameters' elements, not the padding between them
            assert all(torch.equal(first[key][lo:hi], second[key][lo:hi]) for lo, hi in held), key


def _held_elements(key: str, buckets: dict[tuple[int, int], list[tuple[int, int]]]) -> list[tuple[int, int]] | None:
    """The parameters' ranges in the bucket that ``key`` (``...gbuf_idx_G...bucket_idx_B...``)
    holds, or None for any other array (held whole)."""
    match = re.search(r"gbuf_idx_(\d+)\..*bucket_idx_(\d+)\.", key)
    return None if match is None else buckets[int(match[1]), int(match[2])]
