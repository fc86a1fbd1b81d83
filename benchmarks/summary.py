"""The README's condensed table from a results JSON written by benchmarks.run: per case and backend of ours, its
time, eager's, the best alternative's, the two speedups, and the peak memory of ours and of that alternative.

    python -m benchmarks.summary benchmarks/results/<device>.json
"""

import json
import sys

from benchmarks.run import OURS, fmt


def summary(results):
    lines = [
        "| case | fused ms | eager ms | best alternative (ms) | vs eager | vs best alternative | "
        "peak MB: fused / best alt. |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for case in results:
        rows = [r for r in case["rows"] if r["ms"]]
        eager = next((r["ms"] for r in rows if r["impl"] == "eager"), None)
        alternatives = [r for r in rows if r["impl"] not in OURS]
        best = min(alternatives, key=lambda r: r["ms"], default=None)
        best_text = f"{best['impl']} ({best['ms']:.3f})" if best else "-"
        for r in rows:
            if r["impl"] not in OURS:
                continue
            name = case["name"] if r["impl"] == "fused" else f"{case['name']} [{r['impl']}]"
            lines.append(
                f"| {name} | {r['ms']:.3f} | {fmt(eager, '.3f')} | {best_text} | "
                f"{fmt(r.get('vs_eager'), '.2f')}{'x' if r.get('vs_eager') else ''} | "
                f"{fmt(r.get('vs_best_alt'), '.2f')}{'x' if r.get('vs_best_alt') else ''} | "
                f"{fmt(r.get('peak_mb'), '.1f')} / {fmt(best and best.get('peak_mb'), '.1f')} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(summary(json.load(f)["results"]))
