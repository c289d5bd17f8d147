"""A hand-made card table (``capacity.card_rates``' schema) with rates simple enough to
compute a step's time by hand: every GEMM at ``tflops``, attention at ``attention_tflops``,
memory at ``gbps`` with a ``floor_us`` kernel floor; the standard trainer's host costs per op and
(``fixed_us``, none by default) per phase; ``collectives``: the section of several ranks'
collectives, none by default."""

SIDES = (16, 1024, 16384)
THIN_RATE = 1000.0  # elements a µs of a thin GEMM's dot products (batch x K)


def card_table(
    card="Test Card", tflops=100.0, attention_tflops=50.0, gbps=1000.0, floor_us=2.0,
    forward_us=10.0, backward_us=5.0, finish_us=8.0, sync_us=20.0, memory_ops=None, fixed_us=None,
    collectives=None,
):  # fmt: skip
    def gemm_us(m, n, k):
        return max(2 * m * n * k / (tflops * 1e6), floor_us)

    gemm = [[m, n, k, gemm_us(m, n, k)] for m in SIDES for n in SIDES for k in SIDES]
    thin = [[b, k, b * k / THIN_RATE] for b in (1, 64) for k in (2**14, 2**24)]
    memory = [[b, max(b / (gbps * 1e3), floor_us)] for b in (2**10, 2**20, 2**30)]
    rates = [[t, attention_tflops] for t in (128, 4096)]
    table = {
        "schema": 2,
        "card": card,
        "measured": {"date": "2026-11-29", "commit": "test", "command": "hand-made"},
        "gemm": {"bfloat16": gemm, "float32": gemm},
        "thin_gemm": {"bfloat16": thin, "float32": thin},
        "attention": {"bfloat16": {"128": {"forward": rates, "backward": rates}}},
        "memory": memory,
        "memory_ops": memory_ops or {},
        "host": {
            "sync_us": sync_us,
            "by_trainer": {"standard": {
                "op_us": {"forward": forward_us, "backward": backward_us, "finish": finish_us},
                "fixed_us": fixed_us or {"forward": 0.0, "backward": 0.0, "finish": 0.0},
            }},
        },
    }  # fmt: skip
    if collectives is not None:
        table["collectives"] = collectives
    return table
