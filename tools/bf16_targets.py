#!/usr/bin/env python3
"""Issue 31's targets from interleaved `xfbench ab --b-dtype bf16` reports (written by tools/bf16_targets.sh).

Usage: tools/bf16_targets.py DIR

DIR holds ab-forward.json (exact-tiled forward, 4K and 16K), ab-decode.json (vanilla and exact-tiled
decoding at a 16K context), ab-train.json (exact-tiled training step at 4K), ab-8k.json (local,
performer, linear-transformer, reformer forward at 8K) and gflops.json (a bf16 sweep of exact-tiled
at 4K and 16K: its FLOP counts, over ab's bf16 median, give the share of the measured bf16
dot-product peak). Prints a Markdown table: each
target, the measured f32/bf16 speed-up (the inverse of ab's B/A ratio of medians, all rounds), ab's
verdict, and whether the target is met. A ratio comes from one interleaved run; a verdict "noisy"
means too few clean rounds for ab's 99% interval, not that the ratio is wrong.
"""
import json
import os
import sys


def load(directory, name):
    with open(os.path.join(directory, name), encoding="utf-8") as handle:
        return json.load(handle)


def points(report):
    return {(p["model_a"], p["seq_len"]): p for p in report["points"]}


def median(values):
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def b_ms(point):
    return median([r["b_median_ns"] for r in point["rounds"]]) / 1e6


def row(target, point, wanted_speedup, extra=""):
    if point is None or point.get("ratio") is None:
        return f"| {target} | — | — | not measured |"
    speedup = 1 / point["ratio"]
    met = "yes" if speedup >= wanted_speedup else "**no**"
    note = f"; {extra}" if extra else ""
    return (f"| {target} | {speedup:.2f}× (bf16 {b_ms(point):.3f} ms) | {point['verdict']} | {met}"
            f" (≥ {wanted_speedup:g}×{note}) |")


def main():
    directory = sys.argv[1]
    forward, decode = points(load(directory, "ab-forward.json")), points(load(directory, "ab-decode.json"))
    train, eight = points(load(directory, "ab-train.json")), points(load(directory, "ab-8k.json"))
    sweep = load(directory, "gflops.json")
    context = sweep["context"]
    peak = context.get("bf16_dot_peak_gflops") or 0
    commit = context["git_commit"][:7] + ("-dirty" if context["git_commit"].endswith("-dirty") else "")
    print(f"Machine: {context['cpu_model']}, kernels {context['kernel_isa']}, bf16 kernels "
          f"{context['bf16_kernels']}, oneDNN {context['onednn_isa']}; bf16 dot peak {peak:.0f} GFLOP/s, "
          f"fp32 FMA peak {context['fma_peak_gflops']:.0f} GFLOP/s, triad {context['triad_bandwidth_gbs']:.0f} GB/s; "
          f"commit {commit}, {context['date'][:10]}.")
    print()
    print("| target | f32/bf16 speed-up | ab verdict | met |")
    print("|---|---|---|---|")
    for n in (4096, 16384):
        print(row(f"exact-tiled forward N={n}", forward.get(("exact-tiled", n)), 1.5))
    for r in sweep["results"]:
        p = forward.get(("exact-tiled", r["seq_len"]))
        if r["model"] == "exact-tiled" and r.get("status") == "ok" and peak and p is not None:
            gflops = r["flops"] / (b_ms(p) * 1e6)  # the point's FLOPs over ab's bf16 median
            share = gflops / peak
            met = "yes" if share >= 0.6 else "**no**"
            print(f"| exact-tiled forward N={r['seq_len']}: share of the bf16 peak | {gflops:.0f} GFLOP/s = "
                  f"{100 * share:.0f}% | ab's bf16 median | {met} (≥ 60%) |")
    settings = load(directory, "ab-decode.json")["settings"]
    for model in ("vanilla", "exact-tiled"):
        p = decode.get((model, 16384))
        # The bf16 K and V of the whole context (N + T tokens) each step reads, over its time.
        cache_bytes = 2 * settings["batch"] * settings["heads"] * (16384 + settings["decode_tokens"]) * \
            settings["head_dim"] * 2
        per_token = (f"bf16 {b_ms(p):.3f} ms per token = {cache_bytes / (b_ms(p) * 1e6):.0f} GB/s of cache; "
                     f"target ≤ 0.5 ms at a ~75 GB/s triad") if p else ""
        print(row(f"{model} decode, 16K context", p, 1.7, per_token))
    print(row("exact-tiled training step N=4096", train.get(("exact-tiled", 4096)), 1.3))
    for model in ("local", "performer", "linear-transformer", "reformer"):
        print(row(f"{model} forward N=8192 (no slower)", eight.get((model, 8192)), 1.0))


if __name__ == "__main__":
    main()
