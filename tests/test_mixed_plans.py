"""Mixed-degree plans (plain autograd path): every region at its own TP degree, activations
resharded along the batch between them, gradients reduced per region; equal to one device in
float64 (1e-10, tests/exactness.py)."""

import copy

import pytest
import torch
import torch.distributed as dist

import oases
from exactness import EXACT64, to64
from oases.parallel.apply import reduce_gradients, shard_spec, shard_tensor
from oases.plan import ParallelPlan, RegionPlan, region_names

B, S = 8, 16


def region_of(name: str) -> str:
    """The plan region a parameter of the single-device model belongs to."""
    if name.startswith(("embed", "pos_embed")):
        return "embed"
    if name.startswith("blocks."):
        layer, part = name.split(".")[1:3]
        return f"blocks.{layer}.{'attn' if part.startswith('attn') else 'mlp'}"
    return "head"


def layout_rows(t: torch.Tensor, rank: int, world: int, tp: int) -> torch.Tensor:
    """This rank's rows of a global batch in the layout of degree ``tp``: TP group
    g = rank // tp holds rows [g * B tp / W, (g + 1) * B tp / W), replicated over its ranks."""
    per = t.shape[0] * tp // world
    g = rank // tp
    return t[g * per : (g + 1) * per]


def _rank_mixed(rank, world_size, degrees_list):
    results = []
    for arch, degrees in degrees_list:
        kv = 4 if arch == "gpt2" else max(degrees)  # GQA where the degrees allow it
        cfg = oases.ModelConfig(
            arch=arch, n_layers=2, dim=32, n_heads=4, n_kv_heads=kv, vocab_size=101, seq_len=S
        )
        names = region_names(cfg)
        plan = ParallelPlan([RegionPlan(n, t, world_size // t) for n, t in zip(names, degrees)])
        ctx = oases.init_distributed(tp=1, degrees=plan.degrees())
        torch.manual_seed(0)
        ref = to64(oases.build_model(cfg))
        model = oases.parallelize(copy.deepcopy(ref), ctx, plan)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 101, (B, S), generator=g)
        targets = torch.randint(0, 101, (B, S), generator=g)
        t_embed = plan.tp_of("embed")
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(2):
            expected = ref(tokens, targets)
            expected.backward()
            local = model(
                layout_rows(tokens, rank, world_size, t_embed),
                layout_rows(targets, rank, world_size, t_embed),
            )
            local.backward()
            reduce_gradients(model)
            mean = local.detach().clone()
            dist.all_reduce(mean)  # every head group appears tp_head times: mean over ranks
            mean /= world_size
            torch.testing.assert_close(mean, expected.detach(), **EXACT64)
            if step == 0:
                full = dict(ref.named_parameters())
                for n, p in model.named_parameters():
                    t = plan.tp_of(region_of(n))
                    spec = shard_spec(p)
                    want = (
                        full[n].grad
                        if spec is None
                        else shard_tensor(full[n].grad, spec, rank % t, t)
                    )
                    torch.testing.assert_close(p.grad, want, **EXACT64, msg=f"{arch} {degrees} {n}")
            opt_ref.step()
            opt.step()
            opt_ref.zero_grad()
            opt.zero_grad()
            losses.append(float(mean))
        results.append(losses)
    return results


@pytest.mark.exact
def test_mixed_plans_on_two_ranks(spawn_ranks):
    # half the layers at tp=1 x dp=2, half at tp=2; and alternating attention / MLP degrees
    cases = [("gpt2", (1, 1, 1, 2, 2, 2)), ("llama", (2, 2, 1, 2, 1, 1))]
    results = spawn_ranks(_rank_mixed, 2, cases)
    assert results[0] == results[1]


@pytest.mark.exact
def test_mixed_plans_on_four_ranks(spawn_ranks):
    cases = [("gpt2", (2, 4, 1, 2, 4, 1)), ("llama", (1, 2, 4, 4, 2, 2))]
    results = spawn_ranks(_rank_mixed, 4, cases, timeout_s=180)
    assert all(r == results[0] for r in results)


def test_plan_checks_and_json_round_trip(tmp_path):
    cfg = oases.ModelConfig(arch="llama", n_layers=1, dim=32, n_heads=4, n_kv_heads=2)
    plan = ParallelPlan.uniform(cfg, 4, 2, predicted_step_s=1.5)
    plan.check(cfg, 4)
    plan.save(tmp_path / "plan.json")
    assert ParallelPlan.load(tmp_path / "plan.json") == plan
    bad = ParallelPlan([RegionPlan(n, 4, 1) for n in region_names(cfg)])
    with pytest.raises(ValueError, match=r"blocks.0.attn: model.n_kv_heads=2 is not divisible"):
        bad.check(cfg, 4)
    with pytest.raises(ValueError, match="the plan was made for 4 ranks"):
        plan.check(cfg, 6)
    with pytest.raises(ValueError, match="not a plan"):
        ParallelPlan.from_json('{"regions": [{"name": 1}]}')
