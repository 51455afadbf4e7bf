#!/usr/bin/env python3
"""Recomputes in float64, from an `xfbench run --pass decode --dump DIR`, the decoded tokens'
outputs (the last T rows of out.npy) and compares them with the dump.

Models: the exact baselines (vanilla, exact-tiled: token i sees 0..i), local (its block so far),
image-transformer (its query block so far and the memory flange before it) and linear-transformer
(elu(x) + 1 features over 0..i). The decode state files are checked too: a KV cache holds the
sequence's keys and values, a window ring the last tokens' in their slots.

Plain Python (no NumPy). Exit 0 when every decoded element is within 1e-4 of the largest output
magnitude, 1 otherwise, 2 for a dump this script cannot check.
"""
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_gradient_dump import read_npy  # noqa: E402


def visible_keys(model, params, i):
    if model in ("vanilla", "exact-tiled", "linear-transformer"):
        return range(i + 1)
    if model == "local":
        return range(i // params["block"] * params["block"], i + 1)
    block_start = i // params["query_block"] * params["query_block"]
    return range(max(0, block_start - params["memory_flange"]), i + 1)


def feature(x):
    return [xi + 1.0 if xi > 0 else math.exp(xi) for xi in x]


def output_row(model, params, q, k, v, i, d):
    row = lambda t, j: t[j * d:(j + 1) * d]  # noqa: E731
    keys = visible_keys(model, params, i)
    if model == "linear-transformer":
        fq = feature(row(q, i))
        weights = [sum(a * b for a, b in zip(fq, feature(row(k, j)))) for j in keys]
    else:
        scale = 1.0 / math.sqrt(d)
        scores = [scale * sum(a * b for a, b in zip(row(q, i), row(k, j))) for j in keys]
        peak = max(scores)
        weights = [math.exp(s - peak) for s in scores]
    total = sum(weights)
    return [sum(w * v[j * d + c] for w, j in zip(weights, keys)) / total for c in range(d)]


def state_errors(model, params, folder, k, v, heads, length, d):
    """Largest difference between the dumped cache or window and the keys and values it should hold."""
    if model in ("vanilla", "exact-tiled"):
        names, capacity = ("state_key_cache", "state_value_cache"), length
    elif model in ("local", "image-transformer"):
        names = ("state_key_window", "state_value_window")
        capacity = params["block"] if model == "local" else params["query_block"] + params["memory_flange"]
    else:
        return 0.0
    worst = 0.0
    for name, source in zip(names, (k, v)):
        state = read_npy(folder + "/" + name + ".npy")
        for head in range(heads):
            for token in range(max(0, length - capacity), length):
                slot = token % capacity
                got = state[(head * capacity + slot) * d:(head * capacity + slot + 1) * d]
                want = source[(head * length + token) * d:(head * length + token + 1) * d]
                worst = max(worst, max(abs(g - w) for g, w in zip(got, want)))
    return worst


def main(folder):
    manifest = json.load(open(folder + "/manifest.json"))
    model, params = manifest["model"], manifest["params"]
    if manifest.get("pass") != "decode" or model not in (
            "vanilla", "exact-tiled", "local", "image-transformer", "linear-transformer"):
        print("check_decode_dump: decode dumps of vanilla, exact-tiled, local, image-transformer or "
              "linear-transformer only", file=sys.stderr)
        return 2
    heads = manifest["batch"] * manifest["heads"]
    n, tokens, d = manifest["seq_len"], manifest["decode_tokens"], manifest["head_dim"]
    length = n + tokens
    q, k, v, out = (read_npy(folder + "/" + name + ".npy") for name in ("q", "k", "v", "out"))
    largest = max(abs(x) for x in out) or 1.0
    worst = 0.0
    for head in range(heads):
        part = slice(head * length * d, (head + 1) * length * d)
        for i in range(n, length):
            want = output_row(model, params, q[part], k[part], v[part], i, d)
            got = out[part][i * d:(i + 1) * d]
            worst = max(worst, max(abs(g - w) for g, w in zip(got, want)) / largest)
    state = state_errors(model, params, folder, k, v, heads, length, d)
    print("largest decoded-output error relative to the largest output: %.3g; state error %.3g" % (worst, state))
    return 0 if worst <= 1e-4 and state == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
