"""Tables and plots of the routing benchmark (bench/routing.py) and its scenarios
(bench/routing_scenarios.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from bench.routing import Result
    from bench.routing_scenarios import (
        BurstRun,
        FailingResult,
        Scenarios,
        SlowdownRun,
        UniformResult,
    )


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
    floor = report.get("floor_ms")
    if floor:
        lines += [
            "",
            f"The workload's floor (every request on the fastest engine, idle, holding every "
            f"prefix sent before it): TTFT p50 {floor['p50']:.0f} ms, p99 {floor['p99']:.0f} ms.",
        ]
    for r in results:
        if r.prediction_error:
            errors = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r.prediction_error.items())
            lines.append(f"{r.system}: prediction error (absolute, of the measured TTFT) {errors}.")
    lines += ["", "How each system was started:", ""]
    lines += [f"- {r.system}: `{r.command}`" for r in results]
    return "\n".join(lines)


# -- the scenarios (bench/routing_scenarios.py) ----------------------------------------------


def plot_slowdown(runs: list[SlowdownRun], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run in runs:
        seconds = list(range(1, len(run.shares) + 1))
        shares = [float("nan") if s is None else 100 * s for s in run.shares]
        smoothed = [100 * s for s in run.smoothed]
        (line,) = ax.plot(seconds, smoothed, label=f"{run.system} (3 s trailing)")
        ax.plot(seconds, shares, ".", color=line.get_color(), alpha=0.5)
        ax.axhline(100 * run.threshold, color=line.get_color(), linestyle=":", linewidth=1)
    if runs:
        ax.axvline(runs[0].change_s, color="grey", linestyle="--", linewidth=1)
        ax.set_title(
            f"{runs[0].slowed}'s share of requests served, {runs[0].factor:.0f}x slower "
            "from the dashed line (dotted: 0.6 x before)",
            fontsize=10,
        )
    ax.set_xlabel("second of the run")
    ax.set_ylabel("share (%)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_burst(runs: list[BurstRun], path: Path) -> Path:
    """Tenant B's time to first token in the window: its distribution (left) and each
    request by the time it was sent (right, the burst shaded)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (cdf, timeline) = plt.subplots(1, 2, figsize=(14, 4.5))
    for run in runs:
        values = sorted(run.b_ttft_ms)
        label = run.label
        if values:
            fractions = [(n + 1) / len(values) for n in range(len(values))]
            cdf.step(values, fractions, where="post", label=label)
        points = [(sent, ttft) for sent, ttft in run.b_timeline if ttft is not None]
        timeline.plot([p[0] for p in points], [p[1] for p in points], ".-", label=label)
    if runs:
        timeline.axvspan(runs[0].window[0], runs[0].burst_end, color="grey", alpha=0.15)
    cdf.set_xscale("log")
    cdf.set_xlabel("tenant B time to first token (ms, log scale)")
    cdf.set_ylabel("fraction of B's requests in the window")
    cdf.set_title("tenant B while tenant A bursts")
    timeline.set_yscale("log")
    timeline.set_xlabel("second B's request was sent (burst shaded)")
    timeline.set_ylabel("time to first token (ms, log scale)")
    timeline.set_title("tenant B, request by request")
    for ax in (cdf, timeline):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right" if ax is cdf else "upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _targets(results: Scenarios) -> list[str]:
    lines = ["| scenario | what | target | measured | verdict |", "| --- | --- | --- | --- | --- |"]
    for t in results.targets:
        verdict = "met" if t.met else "**not met**"
        lines.append(f"| {t.scenario} | {t.what} | {t.goal} | {t.measured} | {verdict} |")
    return lines


def _uniform(u: UniformResult) -> list[str]:
    engines = list(u.share)
    return [
        f"**uniform**: four identical simulators, {u.clients} clients one request after "
        f"another for {u.seconds:.0f} s, random prompts (no shared prefix), 32 tokens out.",
        "",
        "| system | done | errors | TTFT p50 ms | TTFT p99 ms | " + " | ".join(engines) + " |",
        "| --- | --: | --: | --: | --: | " + " | ".join("--:" for _ in engines) + " |",
        f"| {u.system} | {u.requests} | {u.errors} | {u.ttft_p50_ms:.0f} | "
        f"{u.ttft_p99_ms:.0f} | " + " | ".join(_pct(u.share[e]) for e in engines) + " |",
    ]


def _failing(f: FailingResult) -> list[str]:
    if not f.breaker_reported:
        breaker = "no breaker section in /admin/routing-table"
    else:
        first = "never" if f.first_open_s is None else f"{f.first_open_s:.1f} s"
        others = sum(f.other_opens.values())
        breaker = (
            f"opened_after {f.opened_after} (all seen: {f.opened_after_seen}), first open at "
            f"{first}, {f.opens} opens; healthy agents' breakers opened {others} times"
        )
    engines = list(f.received)
    return [
        f"**failing**: the main workload's fleet and sessions; {f.failing_engine} answers "
        "half its generations with HTTP 500. Breaker, from /admin/routing-table polled "
        f"four times a second ({f.polls} polls): {breaker}.",
        "",
        "| system | done | errors | client error rate | TTFT p50 ms | TTFT p99 ms | "
        + " | ".join(f"{e} got / served" for e in engines)
        + " |",
        "| --- | --: | --: | --: | --: | --: | " + " | ".join("--:" for _ in engines) + " |",
        f"| {f.system} | {f.requests} | {f.errors} | {_pct(f.client_error_rate)} | "
        f"{f.ttft_p50_ms:.0f} | {f.ttft_p99_ms:.0f} | "
        + " | ".join(f"{f.received[e]:.0f} / {_pct(f.share[e])}" for e in engines)
        + " |",
    ]


def _slowdown(runs: list[SlowdownRun], image: Path) -> list[str]:
    first = runs[0]
    lines = [
        f"**slowdown**: four identical simulators, 16 clients; at {first.change_s} s "
        f"{first.slowed} becomes {first.factor:.0f}x slower. Its share of the requests "
        "served, from the simulators' TTFT counts read every second (dots: each second; "
        "lines: 3-second trailing windows); reaction: the first second after the change "
        "from which the 3-second share stays below 0.6 x the share before (in brackets: "
        "judged on single seconds).",
        "",
        f"![slowdown](img/{image.name})",
        "",
        "| system | done | errors | share before | share after | 0.6 x before | reaction |",
        "| --- | --: | --: | --: | --: | --: | --: |",
    ]
    for r in runs:
        seconds = "never" if r.reaction_s is None else f"{r.reaction_s} s"
        seconds += " (" + ("never" if r.reaction_raw_s is None else f"{r.reaction_raw_s} s") + ")"
        lines.append(
            f"| {r.system} | {r.requests} | {r.errors} | {_pct(r.share_before)} | "
            f"{_pct(r.share_after)} | {_pct(r.threshold)} | {seconds} |"
        )
    return lines


def _burst(runs: list[BurstRun], image: Path) -> list[str]:
    base = runs[0].b_ttft_p99_ms
    window = runs[0].window
    lines = [
        "**burst**: two simulators of 4 sequences behind agents of capacity 4; tenant B sends "
        "3 requests/s throughout, tenant A 3/s or 30/s in the burst window "
        f"({window[0]:.0f} to {window[1]:.0f} s, B measured there). 32 tokens out. Queue "
        "peaks: requests waiting in the router, from /admin/health twice a second.",
        "",
        f"![burst](img/{image.name})",
        "",
        "| run | keys | A rate | B sent | B errors | B TTFT p50 ms | B TTFT p99 ms "
        "| B p99 / baseline | A sent | A errors | A TTFT p50 ms | A TTFT p99 ms "
        "| queue peak (fair / global) |",
        "| --- | --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for r in runs:
        lines.append(
            f"| {r.label} | {r.keys} | {r.a_rate:.0f}/s | {r.b_requests} | {r.b_errors} | "
            f"{r.b_ttft_p50_ms:.0f} | {r.b_ttft_p99_ms:.0f} | {r.b_ttft_p99_ms / base:.1f}x | "
            f"{r.a_requests} | {r.a_errors} | {r.a_ttft_p50_ms:.0f} | {r.a_ttft_p99_ms:.0f} | "
            f"{r.queue_peak} / {r.global_queue_peak} |"
        )
    return lines


def render_scenarios(report: dict[str, Any], results: Scenarios, images: Path) -> str:
    """The scenarios' markdown; draws the slowdown and burst plots into `images`."""
    quick = " (--quick)" if report["quick"] else ""
    lines = [
        f"Measured {report['started']} on {report['machine']}{quick}; this router only, "
        f"strategy under test {report['strategy']}.",
        "",
        *_targets(results),
    ]
    if results.notes:
        lines += ["", *[f"- {note}" for note in results.notes]]
    if results.uniform:
        lines += ["", *_uniform(results.uniform)]
    if results.failing:
        lines += ["", *_failing(results.failing)]
    if results.slowdown:
        image = plot_slowdown(results.slowdown, images / "routing-slowdown.png")
        lines += ["", *_slowdown(results.slowdown, image)]
    if results.burst:
        image = plot_burst(results.burst, images / "routing-burst.png")
        lines += ["", *_burst(results.burst, image)]
    commands: dict[str, str] = {}
    if results.uniform:
        commands["uniform"] = results.uniform.command
    if results.failing:
        commands["failing"] = results.failing.command
    for slow in results.slowdown:
        commands[f"slowdown, {slow.system}"] = slow.command
    for burst in results.burst:
        commands.setdefault("burst", burst.command)
    lines += ["", "How this router was started:", ""]
    lines += [f"- {where}: `{command}`" for where, command in commands.items()]
    return "\n".join(lines)
