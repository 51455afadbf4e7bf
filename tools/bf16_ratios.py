#!/usr/bin/env python3
"""bf16/f32 ratios of a report that holds both dtypes of each point (issue 31).

Usage: tools/bf16_ratios.py REPORT.json [--out FILE.md]

Reads an xfbench report (a sweep with `--dtype f32,bf16`) and prints, per model, pass, causal flag
and sequence length, the ratio bf16/f32 of the median time and of the tracked peak memory
(`peak_owned_bytes`: inputs, output, workspace, state), as a Markdown table. A point whose bf16 row
is not `ok` shows its status and reason instead (e.g. "no bf16 form yet"); a ratio < 1 means bf16
is faster or smaller. Decode rows compare time per step and `state_bytes` as well.
"""
import argparse
import json
import sys


def key(row):
    return (row["model"], row.get("pass", "forward"), bool(row.get("causal", False)), int(row["seq_len"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--out")
    args = parser.parse_args()
    with open(args.report, encoding="utf-8") as handle:
        report = json.load(handle)
    rows = {}
    for row in report["results"]:
        rows[(key(row), row.get("dtype", "f32"))] = row
    keys = sorted({k for k, _ in rows}, key=lambda k: (k[0], k[1], k[2], k[3]))
    lines = ["| model | pass | causal | N | f32 median | bf16/f32 time | bf16/f32 memory | note |",
             "|---|---|---|---|---|---|---|---|"]
    for k in keys:
        f32, bf16 = rows.get((k, "f32")), rows.get((k, "bf16"))
        if f32 is None or bf16 is None:
            continue
        model, pass_name, causal, n = k
        head = f"| {model} | {pass_name} | {'yes' if causal else 'no'} | {n} |"
        if f32.get("status") != "ok":
            lines.append(f"{head} — | — | — | f32 {f32.get('status')}: {f32.get('reason', '')} |")
            continue
        f32_ms = f32["median_ns"] / 1e6
        if bf16.get("status") != "ok":
            lines.append(f"{head} {f32_ms:.3f} ms | — | — | bf16 {bf16.get('status')}: {bf16.get('reason', '')} |")
            continue
        time = bf16["median_ns"] / f32["median_ns"]
        memory = bf16["peak_owned_bytes"] / f32["peak_owned_bytes"]
        note = ""
        if pass_name == "decode" and f32.get("state_bytes"):
            note = f"state {bf16['state_bytes'] / f32['state_bytes']:.3f}×"
        if bf16.get("unstable") or f32.get("unstable"):
            note = (note + "; " if note else "") + "unstable"
        lines.append(f"{head} {f32_ms:.3f} ms | {time:.3f} | {memory:.3f} | {note} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
