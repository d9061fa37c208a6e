"""clover_desk/bench/ is split by job (issue 29): no module over the house limit of 800 lines."""

from __future__ import annotations

from pathlib import Path

MAX_MODULE_LINES = 800
BENCH = Path(__file__).resolve().parents[2] / "clover_desk" / "bench"


def test_no_bench_module_is_over_the_limit() -> None:
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in BENCH.glob("*.py")}
    assert {"speed.py", "random_model.py", "timing.py", "count.py", "compare.py", "moe_only.py"} <= set(sizes)
    assert not {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
