"""The README's condensed table from a results JSON written by benchmarks.run: per case and backend of ours, its
time, eager's, the best alternative's, the two speedups, and the peak memory of ours and of that alternative. GPU
results add the device times alone (graph ms, benchmarks.timing.graph_ms): ours, and the ratio to the alternative
fastest by that measure.

    python -m benchmarks.summary benchmarks/results/<device>.json
"""

import json
import sys

from benchmarks.run import fmt, is_ours


def summary(results):
    graphs = any("graph_ms" in r for case in results for r in case["rows"])
    lines = [
        "| case | fused ms | eager ms | best alternative (ms) | vs eager | vs best alternative | "
        f"peak MB: fused / best alt. |{' graph ms: fused / best alt. | vs best alt. (graph) |' if graphs else ''}",
        f"|---|---:|---:|---|---:|---:|---:|{'---:|---:|' if graphs else ''}",
    ]
    for case in results:
        rows = [r for r in case["rows"] if r["ms"]]
        eager = next((r["ms"] for r in rows if r["impl"] == "eager"), None)
        alternatives = [r for r in rows if not is_ours(r["impl"])]
        best = min(alternatives, key=lambda r: r["ms"], default=None)
        best_text = f"{best['impl']} ({best['ms']:.3f})" if best else "-"
        best_graph = min((r["graph_ms"] for r in alternatives if r.get("graph_ms")), default=None)
        for r in rows:
            if not is_ours(r["impl"]):
                continue
            name = case["name"] if r["impl"] == "fused" else f"{case['name']} [{r['impl']}]"
            lines.append(
                f"| {name} | {r['ms']:.3f} | {fmt(eager, '.3f')} | {best_text} | "
                f"{fmt(r.get('vs_eager'), '.2f')}{'x' if r.get('vs_eager') else ''} | "
                f"{fmt(r.get('vs_best_alt'), '.2f')}{'x' if r.get('vs_best_alt') else ''} | "
                f"{fmt(r.get('peak_mb'), '.1f')} / {fmt(best and best.get('peak_mb'), '.1f')} |"
                + (graph_cells(r.get("graph_ms"), best_graph) if graphs else "")
            )
    return "\n".join(lines)


def graph_cells(ours, best):
    ratio = best / ours if ours and best else None
    return f" {fmt(ours, '.3f')} / {fmt(best, '.3f')} | {fmt(ratio, '.2f')}{'x' if ratio else ''} |"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(summary(json.load(f)["results"]))
