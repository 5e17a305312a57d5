"""Table and plot for the routing-quality benchmark (bench/routing.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from bench.routing import Result


def plot(results: list[Result], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [r.system for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    xs = range(len(names))
    axes[0].bar([x - 0.2 for x in xs], [r.ttft_p50_ms for r in results], 0.4, label="p50")
    axes[0].bar([x + 0.2 for x in xs], [r.ttft_p99_ms for r in results], 0.4, label="p99")
    axes[0].set_title("time to first token (ms)")
    axes[0].legend()
    axes[1].bar(xs, [100 * r.cache_hit_rate for r in results])
    axes[1].set_title("fleet prefix-cache hit rate (%)")
    engines = list(results[0].share) if results else []
    bottom = [0.0] * len(results)
    for engine in engines:
        shares = [100 * r.share.get(engine, 0.0) for r in results]
        axes[2].bar(xs, shares, bottom=bottom, label=engine)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    axes[2].set_title("share of requests per engine (%)")
    axes[2].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for ax in axes:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def render(report: dict[str, Any], results: list[Result], image: Path) -> str:
    engines = list(results[0].share) if results else []
    lines = [
        f"Measured {report['started']} on {report['machine']}; "
        f"{report['sessions']} sessions, {report['requests_per_system']} requests per system.",
        "",
        f"![routing quality](img/{image.name})",
        "",
        "| system | done | errors | TTFT p50 ms | TTFT p99 ms | req/s | output tok/s "
        "| cache hit | " + " | ".join(engines) + " |",
        "| --- | --: | --: | --: | --: | --: | --: | --: | "
        + " | ".join("--:" for _ in engines)
        + " |",
    ]
    for r in results:
        shares = " | ".join(f"{100 * r.share.get(e, 0.0):.0f}%" for e in engines)
        lines.append(
            f"| {r.system} | {r.requests} | {r.errors} | {r.ttft_p50_ms:.0f} | "
            f"{r.ttft_p99_ms:.0f} | {r.rps:.2f} | {r.output_tokens_per_s:.0f} | "
            f"{100 * r.cache_hit_rate:.1f}% | {shares} |"
        )
    lines += ["", "How each system was started:", ""]
    lines += [f"- {r.system}: `{r.command}`" for r in results]
    return "\n".join(lines)
