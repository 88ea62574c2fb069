"""Same output cold and warm, with a real model (DESIGN property 16).

A small Llama (one KV head per query head) and a small Qwen2 with grouped-query
attention, random weights from a transformers config, saved and loaded from a temporary
directory. Their prefix K/V travel through the package's hierarchy (``HierarchySpec``,
real managers and handlers): stored from the "GPU" tensors, loaded back into zeroed ones
from the CPU tier, from disk after the storing engine stopped, from the shared tier
(Ceph RGW, sealed with the fleet key) by an engine with nothing else, from the warm-up's
blocks; and recomputed after a load that failed on a damaged block. Each continues 32
greedy tokens equal to the cold ones (one prefill of the whole prompt), every logit
within the dtype's tolerance, from K/V equal to the model's byte for byte. A block
served in the wrong place is caught by the same comparison. On a CUDA device (``gpu``),
the same at bf16 and fp16 with the KV cache in CUDA tensors, through the CPU tier's CUDA
copies and the disk tier both ways into the KV cache (through a CPU slot, and straight in
by ``GpuDiskHandler``)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from support.s3_server import BUCKET, missing_reason
from tiered_kv.config import TieredConfig
from tiered_kv.disk.worker.handlers import CpuDiskHandler, GpuDiskHandler
from tiered_kv.ops.equivalence import (
    PREFIX_TOKENS,
    SHAPES,
    STEPS,
    Cases,
    CaseResult,
    Engine,
    TinyModel,
    build_model,
    compare,
    engine_config,
    kv_equal,
    prompt_tokens,
    run_equivalence,
)

pytest.importorskip("transformers")

needs_rgw = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))


@pytest.fixture(scope="module", params=SHAPES, ids=[s.name for s in SHAPES])
def model(request, tmp_path_factory) -> TinyModel:
    torch.set_num_threads(1)  # the machine's other cores are for other test runs
    return build_model(request.param, tmp_path_factory.mktemp("models"))


def show(results: list[CaseResult]) -> None:
    """One line per case (``pytest -s``): the numbers behind the assertions."""
    for r in results:
        c = r.comparison
        diff = "-" if c is None else f"{c.max_logit_diff:.2e} (tol {c.tolerance:.1e})"
        print(f"{r.model:10} {r.case:9} {r.tier:6} {diff} load {1000 * r.load_seconds:.1f} ms {r.seconds:.2f} s")


def assert_cold_output(r: CaseResult, source: str | None, blocks: int) -> None:
    assert r.error is None, r.error
    assert r.comparison is not None and r.comparison.steps == STEPS
    assert r.comparison.tokens_equal, f"{r.case}: {r.comparison.matching} of {STEPS} tokens equal"
    assert r.comparison.max_logit_diff <= r.comparison.tolerance, r.comparison
    assert r.kv_equal, f"{r.case}: the K/V continued from are not the model's"
    assert r.sources == ({} if source is None else {source: blocks})
    assert r.load_failed == (r.case == "recompute") and r.ok


@pytest.mark.parametrize("block_tokens", [16, 32], ids=["block16", "block32"])
def test_every_tier_continues_as_computed_cold(model, tmp_path, block_tokens):
    cfg = TieredConfig.from_dict(
        {"block_size": block_tokens, "tiers": [{"type": "disk", "path": str(tmp_path / "disk"), "bytes": "8MiB"}]}
    )
    results = list(run_equivalence(model, cfg, warmup_dir=tmp_path / "warmup"))
    show(results)
    assert [(r.case, r.tier) for r in results] == [
        ("computed", "none"),
        ("cpu", "cpu"),
        ("tier", "disk"),
        ("warmup", "disk"),
        ("recompute", "disk"),
    ]
    blocks = PREFIX_TOKENS // block_tokens
    computed, cpu, disk, warm, recompute = results
    assert_cold_output(computed, None, blocks)
    assert_cold_output(cpu, "cpu", blocks)
    assert_cold_output(disk, "disk", blocks)
    assert_cold_output(warm, "disk", blocks)
    # The damaged block failed the load (every block of the job recomputed), and the
    # output is still the cold one.
    assert_cold_output(recompute, "disk", blocks)


@needs_rgw
def test_the_shared_tier_continues_as_computed_cold(model, tmp_path, remote_settings, rgw_server):
    cfg = TieredConfig.from_dict({"block_size": 16, "tiers": [{"type": "remote", **remote_settings}]})
    results = list(run_equivalence(model, cfg, recompute=False))
    show(results)
    shared = results[2]
    assert (shared.case, shared.tier) == ("tier", "remote")
    assert_cold_output(shared, "remote", PREFIX_TOKENS // 16)
    # The blocks really are objects in the bucket, and sealed: no object holds the
    # model's K bytes of the prefix's first block in the clear.
    s3 = rgw_server.admin_client()
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=remote_settings["prefix"] + "/")["Contents"]
    blocks = [o["Key"] for o in listed if not o["Key"].endswith(".json")]
    assert len(blocks) >= PREFIX_TOKENS // 16, [o["Key"] for o in listed]
    k0 = model.prefix_kv(prompt_tokens(model)[:PREFIX_TOKENS])[0][0][:, :16]  # layer 0, block 0
    plain = k0.permute(1, 0, 2).contiguous().numpy().tobytes()[:64]  # as the block's bytes begin
    for key in blocks:
        assert plain not in s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def test_another_prefixs_block_is_caught_by_the_output(model):
    """One block in the middle comes from another prompt's prefix (bytes a tier holds,
    loaded in the wrong place): the comparison that passes every tier above fails it.
    The prefix's own blocks in another order would not change the output (attention sums
    over the cached pairs, each key carrying its position), so ``kv_equal`` is checked too."""
    cases, other = (
        Cases(model, TieredConfig.from_dict({"block_size": 16})),
        Cases(model, TieredConfig.from_dict({}), seed=1),
    )
    with Engine(engine_config(cases.settings, model, (), 2 * cases.blocks), model, cases.blocks) as engine:
        for c in (other, cases):
            engine.write(c.kv, c.blocks)
            engine.store(engine.keys(c.prefix))
        keys, foreign = engine.keys(cases.prefix), engine.keys(other.prefix)
        engine.zero()
        assert engine.load([*keys[:5], foreign[5], *keys[6:]])
        kv = engine.read(cases.blocks)
        engine.zero()
        assert engine.load([keys[1], keys[0], *keys[2:]])
        reordered = engine.read(cases.blocks)
    wrong = compare(cases.cold, model.greedy(cases.tokens, kv), model.dtype)
    print(
        f"{model.shape.name}: a foreign block: max logit diff {wrong.max_logit_diff:.2e}, {wrong.matching} tokens equal"
    )
    assert not kv_equal(kv, cases.kv)
    assert not wrong.ok and wrong.max_logit_diff > 100 * wrong.tolerance
    assert not kv_equal(reordered, cases.kv)
    assert compare(cases.cold, model.greedy(cases.tokens, reordered), model.dtype).ok


def test_the_cold_reference_is_a_whole_prefill_and_repeats(model):
    """The cold output is the model's own prefill of the whole prompt, not the split the
    tiers feed (the two agree within the tolerance), and the same in every run: nothing
    random in a run, so a difference is the K/V's."""
    cases = Cases(model, TieredConfig.from_dict({}))
    again = model.greedy(cases.tokens)
    assert again.tokens == cases.cold.tokens and torch.equal(again.logits, cases.cold.logits)
    assert len(set(again.tokens)) > 1  # a real continuation, not one token repeated
    split = compare(cases.cold, model.greedy(cases.tokens, cases.kv), model.dtype)
    assert split.tokens_equal and split.max_logit_diff <= split.tolerance


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_kv_comes_back_as_computed(shape, dtype, tmp_path):
    """At bf16 and fp16 every tier returns the KV bytes the model computed, and the output
    from them is the output of the same split prefill with nothing loaded: a tier adds
    nothing. (At fp16 a prefill split at the prefix can itself flip a near-tied greedy
    token against one whole prefill, as with the tiny GQA model here: that is rounding, not
    a tier, so the tiers are held to the split run.)"""
    torch.set_num_threads(1)
    model = build_model(shape, tmp_path / "model", dtype=dtype)
    cfg = TieredConfig.from_dict(
        {"block_size": 16, "tiers": [{"type": "disk", "path": str(tmp_path / "disk"), "bytes": "8MiB"}]}
    )
    results = list(run_equivalence(model, cfg, warmup_dir=tmp_path / "warmup"))
    show(results)
    computed, *tiers = results
    assert computed.case == "computed" and [r.case for r in tiers] == ["cpu", "tier", "warmup", "recompute"]
    held_to_the_split_run(results, dtype)


def held_to_the_split_run(results: list[CaseResult], dtype: str) -> None:
    """Every tier's case returns the model's KV bytes and the output of the split prefill
    with nothing loaded (see ``test_half_precision_kv_comes_back_as_computed``)."""
    computed, *tiers = results
    for r in tiers:
        assert r.error is None and r.kv_equal, r
        assert r.load_failed == (r.case == "recompute"), r
        assert r.comparison is not None and computed.comparison is not None
        assert (r.comparison.matching, r.comparison.max_logit_diff) == (
            computed.comparison.matching,
            computed.comparison.max_logit_diff,
        ), (r.case, r.comparison, computed.comparison)
    if dtype == "bfloat16":
        assert all(r.ok for r in results), results


def through_both_disk_paths(shape, dtype: str, tmp_path, monkeypatch, device: str) -> None:
    """The cases on ``device``, through the CPU tier and the disk tier, the disk tier both
    ways a block reaches the KV cache: promoted into a CPU slot (``CpuDiskHandler``, then
    the CPU tier's copy) and read straight in (``GpuDiskHandler``); each disk read counted
    per handler, so the path each case took is asserted, not assumed."""
    torch.set_num_threads(1)
    model = build_model(shape, tmp_path / "model", dtype=dtype, device=device)
    assert next(model.engine.model.parameters()).device.type == device
    reads: Counter[str] = Counter()
    for cls in (GpuDiskHandler, CpuDiskHandler):

        def counted(self, ids, hashes, slots, real=cls._load_job, name=cls.__name__):
            reads[name] += len(hashes)
            return real(self, ids, hashes, slots)

        monkeypatch.setattr(cls, "_load_job", counted)
    blocks = PREFIX_TOKENS // 16
    for promote, handler in ((True, "CpuDiskHandler"), (False, "GpuDiskHandler")):
        disk = {"type": "disk", "path": str(tmp_path / f"disk-{handler}"), "bytes": "8MiB"}
        cfg = TieredConfig.from_dict({"block_size": 16, "promote_on_hit": promote, "tiers": [disk]})
        results, read_by = [], []
        for r in run_equivalence(model, cfg, device=device):
            results.append(r)
            read_by.append(dict(reads))
            reads.clear()
        show(results)
        assert [(r.case, r.tier) for r in results] == [
            ("computed", "none"),
            ("cpu", "cpu"),
            ("tier", "disk"),
            ("recompute", "disk"),
        ]
        held_to_the_split_run(results, dtype)
        assert results[2].sources == {"disk": blocks}
        # The cpu case reads no disk; the tier case reads every block through the one handler.
        assert read_by[:3] == [{}, {}, {handler: blocks}], read_by


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_kv_comes_back_as_computed_through_the_gpu_handlers(shape, dtype, tmp_path, monkeypatch):
    """On CUDA, at bf16 and fp16: the prefix's K/V stored from CUDA tensors and loaded back
    into zeroed ones through the CPU tier (copies on CUDA streams) and through the disk tier
    both ways, promoted through a CPU slot and straight into the KV cache by
    ``GpuDiskHandler`` (GPUDirect Storage where KvikIO has it, else its pinned bounce
    buffer); and a damaged block's failed load recomputed. Each continues as the split
    prefill with nothing loaded, from the model's KV bytes exactly."""
    through_both_disk_paths(shape, dtype, tmp_path, monkeypatch, "cuda")
