"""`ddpkit plan project` against torch DDP's published V100 table, row by row.

    .venv/bin/python benchmarks/plan_published.py [--csv PUBLISHED.csv]

--csv defaults to benchmarks/data/torch_ddp_v100_published.csv. For every model of
the table: the command that predicts it, then per GPU count the
published p50 step time, the prediction (the best algorithm's row of plan.csv) and the
error; the last column is the error with the device spread set to 0 (the model without
its synchronisation term), to show what that term carries. Prints Markdown.
"""

from __future__ import annotations

import argparse
import os

from ddpkit.plan import published

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CSV = os.path.join(ROOT, "benchmarks", "data", "torch_ddp_v100_published.csv")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", default=DEFAULT_CSV, help="published rows (default: %(default)s)")
    args = p.parse_args()
    worst = 0.0
    print("| model | GPUs | published | predicted | error | error, spread 0 |")
    print("|---|---|---|---|---|---|")
    commands = []
    for row in published.read_rows(args.csv):
        commands.append(published.command(row))
        plain = {c.gpus: c for c in published.predict_row(row, spread=0.0)}
        for c in published.predict_row(row):
            worst = max(worst, abs(c.error))
            print(f"| {c.model} | {c.gpus} | {c.published_s * 1e3:.0f} ms | "
                  f"{c.predicted_s * 1e3:.1f} ms | {c.error:+.1%} | {plain[c.gpus].error:+.1%} |")
    print()
    print(f"Worst |error|: {worst:.1%}. Commands:")
    print()
    for cmd in commands:
        print(f"    {cmd}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
