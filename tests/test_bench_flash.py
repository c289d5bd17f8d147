"""bench_flash's bookkeeping on CPU: goal checks, step rows, route floors, and each route's work."""

import pytest
import torch

import bench_flash
from flash import engine as flash_clip


def result(trainer, batch, seq, dtype, ms, peak, status="ok"):
    return {
        "config": {"trainer": trainer, "batch_size": batch, "seq_len": seq, "dtype": dtype},
        "status": status,
        "median_time_ms": ms if status == "ok" else None,
        "peak_memory_mb": peak if status == "ok" else None,
    }


def test_step_rows_and_misses():
    results = [
        result("standard", 8, 1024, "bfloat16", 100.0, 1000.0),
        result("flash", 8, 1024, "bfloat16", 130.0, 1040.0),
        result("ghost", 8, 1024, "bfloat16", 180.0, 1200.0),
        result("dpsgd", 8, 1024, "bfloat16", 0, 0, status="oom"),
    ]
    (row,) = bench_flash.step_rows(results)
    assert row["time_x"] == pytest.approx(1.3) and row["time_goal"] == 1.20
    assert row["peak_x"] == pytest.approx(1.04)
    assert row["ghost_over_flash"] == pytest.approx(180 / 130)
    assert row["dpsgd_over_flash"] is None
    misses = row["misses"]
    assert misses[0] == "flash/standard time 1.30 vs goal <= 1.20 (+8.3%)"
    assert misses[1].startswith("ghost/flash time 1.38 vs goal >= 1.60")
    assert misses[2] == "dpsgd/flash time: not measured"
    assert len(misses) == 3  # the peak goal is met
    assert "all met" not in bench_flash.format_step_table([row])


def test_all_goals_met():
    results = [
        result("standard", 2, 4096, "float32", 100.0, 1000.0),
        result("flash", 2, 4096, "float32", 110.0, 1000.0),
        result("ghost", 2, 4096, "float32", 200.0, 1000.0),
        result("dpsgd", 2, 4096, "float32", 111.0, 1000.0),
    ]
    (row,) = bench_flash.step_rows(results)
    assert row["misses"] == []
    assert "all met" in bench_flash.format_step_table([row])


def test_step_plan_skips_fp32_at_16384():
    configs = bench_flash.step_configs(["float32", "bfloat16"], steps=3, warmup_steps=1)
    shapes = {(c.dtype, c.batch_size, c.seq_len) for c in configs}
    assert ("float32", 1, 16384) not in shapes and ("bfloat16", 1, 16384) in shapes
    assert len(configs) == len(bench_flash.TRAINERS) * 7
    assert {c.attention for c in configs if c.dtype == "bfloat16"} == {"sdpa"}
    assert all(c.model == "1b" and not c.trace for c in configs)


def test_route_floors_match_a_hand_count():
    B, T, d, p = 2, 1024, 64, 32
    costs = bench_flash.route_costs(B, T, d, p, elem=2)
    # Gram: lower triangles of the two T x T Gram matrices (T^2/2 dots of length d or p, 2 FLOPs
    # each) per sample, plus the clipped-gradient GEMM 2BTdp; A and G (2 bytes) read twice.
    assert costs["gram"] == (B * T * T * (d + p) + 2 * B * T * d * p, 2 * 2 * B * T * (d + p))
    assert costs["direct"][0] == 2 * 2 * B * T * d * p
    assert costs["product"] == (2 * B * T * d * p, 2 * (B * T * (d + p) + 3 * B * d * p))


@pytest.mark.parametrize("route", ["gram", "direct", "product"])
def test_each_route_computes_the_layer_work(route):
    module = torch.nn.Linear(6, 5, bias=False)
    layer = flash_clip.Layer(
        "l",
        module,
        flash_clip.NORM_RULES[torch.nn.Linear],
        {"weight": module.weight},
        route=route,
        tile_size=4,
    )
    A, G = torch.randn(3, 7, 6), torch.randn(3, 7, 5)
    clip = torch.rand(3)
    norms, clipped = bench_flash.run_route(layer, A, G, clip, route)
    per_sample = torch.einsum("btp,btd->bpd", G, A)  # brute force: G_b^T A_b
    torch.testing.assert_close(norms, per_sample.square().sum((1, 2)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(clipped, torch.einsum("b,bpd->pd", clip, per_sample))


def test_cli_rejects_bad_shapes(capsys):
    assert bench_flash.main(["steps", "--shapes", "8by512"]) == 2
    assert "BxT" in capsys.readouterr().err
