#!/usr/bin/env python3
"""Recomputes in float64, from an `xfbench run --pass decode --dump DIR`, the decoded tokens'
outputs (the last T rows of out.npy) and compares them with the dump.

Models: the exact baselines (vanilla, exact-tiled: token i sees 0..i), local (its block so far),
image-transformer (its query block so far and the memory flange before it) and linear-transformer
(elu(x) + 1 features over 0..i); and, from the parameters the dump holds at the size decoding read
them (the decode_* files beside parameters()), synthesizer (every variant, with its vanilla_weight)
and sinkhorn (its open block so far and the sorted block the network chose over the blocks before).
The decode state files are checked too: a KV cache holds the sequence's keys and values, a window
ring the last tokens' in their slots.

A bf16 dump (manifest dtype "bf16") is checked against the same float64 recomputation of its bf16
inputs, within check_gradient_dump's bf16 tolerance. linear-transformer's bf16 recurrent state is
rounded after every decoded token and drifts (small increments are rounded away: docs/measurement.md#bf16),
so its long bf16 decodes fail this check (0.0146 at T = 1000, 0.035 at T = 3000): the check reports
that drift rather than allowing for it. The bf16 KV cache of vanilla and exact-tiled
(D a multiple of 16) is held in the tile kernels' layouts, which state_errors reads: keys in key
pair panels of 16 tokens, values in row pairs (lib/core/tile_kernels_bf16.hpp).

Plain Python (no NumPy). Exit 0 when every decoded element is within the dtype's tolerance (fp32
1e-4) of the largest output magnitude and the state holds exactly the keys and values it should,
1 otherwise, 2 for a dump this script cannot check.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_gradient_dump import read_manifest, read_npy, tolerance  # noqa: E402


def visible_keys(model, params, i):
    if model in ("vanilla", "exact-tiled", "linear-transformer"):
        return range(i + 1)
    if model == "local":
        return range(i // params["block"] * params["block"], i + 1)
    block_start = i // params["query_block"] * params["query_block"]
    return range(max(0, block_start - params["memory_flange"]), i + 1)


def feature(x):
    return [xi + 1.0 if xi > 0 else math.exp(xi) for xi in x]


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def softmax_mix(scores, rows):
    """Σ_j softmax(scores)_j · rows[j]."""
    peak = max(scores)
    weights = [math.exp(s - peak) for s in scores]
    total = sum(weights)
    return [sum(w * r[c] for w, r in zip(weights, rows)) / total for c in range(len(rows[0]))]


class Dump:
    """A dump's files by name, read when first asked for, with their shapes from the manifest."""

    def __init__(self, folder, manifest):
        self.folder, self.cache = folder, {}
        self.shapes = {f["name"]: f["shape"] for f in manifest["files"]}

    def __getitem__(self, name):
        if name not in self.cache:
            if name not in self.shapes:
                raise KeyError("the dump has no " + name + ".npy")
            self.cache[name] = read_npy(self.folder + "/" + name + ".npy")
        return self.cache[name]


def synthesizer_row(params, dump, head, n, q, k, v, i, d):
    """Token i's output: softmax over keys 0..i of (1 − α)·L_syn + α·q·kᵀ/√d, times v."""
    alpha, variant = params["vanilla_weight"], params["variant"]
    keys = range(i + 1)
    if variant == "dense":
        w1, b1, stacked = dump["w1"], dump["b1"], dump["decode_w2_b2"]
        total = dump.shapes["decode_w2_b2"][2]
        hidden = [max(0.0, b1[head * d + c] + sum(q[i * d + r] * w1[(head * d + r) * d + c] for r in range(d)))
                  for c in range(d)] + [1.0]
        synthetic = [sum(hidden[r] * stacked[(head * (d + 1) + r) * total + j] for r in range(d + 1)) for j in keys]
    elif variant == "random":
        rows = dump["decode_r_decoded_rows"]
        tokens, total = dump.shapes["decode_r_decoded_rows"][1:]
        synthetic = [rows[(head * tokens + i - n) * total + j] for j in keys]
    else:
        r1, r2 = dump["decode_r1_decoded_rows"], dump["decode_r2"]
        tokens, rank = dump.shapes["decode_r1_decoded_rows"][1:]
        total = dump.shapes["decode_r2"][1]
        first = r1[(head * tokens + i - n) * rank:(head * tokens + i - n + 1) * rank]
        synthetic = [dot(first, r2[(head * total + j) * rank:(head * total + j + 1) * rank]) for j in keys]
    scale = 1.0 / math.sqrt(d)
    scores = [(1.0 - alpha) * synthetic[j] + (alpha * scale * dot(q[i * d:(i + 1) * d], k[j * d:(j + 1) * d])
                                              if alpha > 0 else 0.0) for j in keys]
    return softmax_mix(scores, [v[j * d:(j + 1) * d] for j in keys])


def sinkhorn_row(params, dump, q, k, v, i, d):
    """Token i of block β = ⌊i/b⌋ attends to its block's tokens up to i and, when β > 0, to the sorted
    block Σ_{j<β} P_j·block_j, P = softmax_j((ReLU(E·w1 + b1)·w2[:, j] + b2[j])/τ), E = Σ of the keys
    before block β; one softmax of q·key/√d over both."""
    b, tau = params["block"], params["temperature"]
    beta = i // b
    row = lambda t, j: t[j * d:(j + 1) * d]  # noqa: E731
    keys = [row(k, j) for j in range(beta * b, i + 1)]
    values = [row(v, j) for j in range(beta * b, i + 1)]
    if beta > 0:
        w1, b1, w2, b2 = dump["w1"], dump["b1"], dump["decode_w2"], dump["decode_b2"]
        blocks = dump.shapes["decode_w2"][1]
        e = [sum(k[t * d + c] for t in range(beta * b)) for c in range(d)]
        hidden = [max(0.0, b1[c] + sum(e[r] * w1[r * d + c] for r in range(d))) for c in range(d)]
        scores = [(sum(hidden[r] * w2[r * blocks + j] for r in range(d)) + b2[j]) / tau for j in range(beta)]
        peak = max(scores)
        weights = [math.exp(s - peak) for s in scores]
        p = [w / sum(weights) for w in weights]
        for source, into in ((k, keys), (v, values)):
            for r in range(b):
                into.append([sum(p[j] * source[(j * b + r) * d + c] for j in range(beta)) for c in range(d)])
    scale = 1.0 / math.sqrt(d)
    return softmax_mix([scale * dot(row(q, i), key) for key in keys], values)


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


PANEL = 16  # keys per key pair panel of the bf16 tile kernels


def plain_row(state, head_size, head, slot, d):
    return state[head * head_size + slot * d:head * head_size + (slot + 1) * d]


def panel_row(state, head_size, head, token, d):
    """Key `token` from key pair panels: packed[p·d·16 + (c2·16 + t)·2 + e] = K[p·16 + t][2·c2 + e]."""
    base, (p, t) = head * head_size, divmod(token, PANEL)
    return [state[base + p * d * PANEL + ((c // 2) * PANEL + t) * 2 + c % 2] for c in range(d)]


def pair_row(state, head_size, head, token, d):
    """Row `token` from row pairs: pairs[(r2·d + f)·2 + e] = X[2·r2 + e][f]."""
    base, (r2, e) = head * head_size, divmod(token, 2)
    return [state[base + (r2 * d + f) * 2 + e] for f in range(d)]


def state_errors(model, params, dump, k, v, heads, length, d, bf16):
    """Largest difference between the dumped cache or window and the keys and values it should hold."""
    if model in ("vanilla", "exact-tiled"):
        names, capacity = ("state_key_cache", "state_value_cache"), length
        kernel_layouts = bf16 and d % PANEL == 0  # Bf16KvCache; else plain rows
        readers = (panel_row, pair_row) if kernel_layouts else (plain_row, plain_row)
    elif model in ("local", "image-transformer"):
        names = ("state_key_window", "state_value_window")
        capacity = params["block"] if model == "local" else params["query_block"] + params["memory_flange"]
        readers = (plain_row, plain_row)
    else:
        return 0.0
    worst = 0.0
    for name, source, read_row in zip(names, (k, v), readers):
        state = dump[name]
        head_size = len(state) // heads
        for head in range(heads):
            for token in range(max(0, length - capacity), length):
                got = read_row(state, head_size, head, token % capacity, d)
                want = source[(head * length + token) * d:(head * length + token + 1) * d]
                worst = max(worst, max(abs(g - w) for g, w in zip(got, want)))
    return worst


def main(folder):
    manifest = read_manifest(folder, "check_decode_dump")
    if manifest is None:
        return 2
    model, params = manifest["model"], manifest["params"]
    if manifest.get("pass") != "decode" or model not in (
            "vanilla", "exact-tiled", "local", "image-transformer", "linear-transformer", "synthesizer", "sinkhorn"):
        print("check_decode_dump: decode dumps of vanilla, exact-tiled, local, image-transformer, "
              "linear-transformer, synthesizer or sinkhorn only", file=sys.stderr)
        return 2
    heads = manifest["batch"] * manifest["heads"]
    n, tokens, d = manifest["seq_len"], manifest["decode_tokens"], manifest["head_dim"]
    length = n + tokens
    dump = Dump(folder, manifest)
    q, k, v, out = (dump[name] for name in ("q", "k", "v", "out"))
    largest = max(abs(x) for x in out) or 1.0
    worst = 0.0
    for head in range(heads):
        part = slice(head * length * d, (head + 1) * length * d)
        for i in range(n, length):
            if model == "synthesizer":
                want = synthesizer_row(params, dump, head % manifest["heads"], n, q[part], k[part], v[part], i, d)
            elif model == "sinkhorn":
                want = sinkhorn_row(params, dump, q[part], k[part], v[part], i, d)
            else:
                want = output_row(model, params, q[part], k[part], v[part], i, d)
            got = out[part][i * d:(i + 1) * d]
            worst = max(worst, max(abs(g - w) for g, w in zip(got, want)) / largest)
    state = state_errors(model, params, dump, k, v, heads, length, d, manifest.get("dtype") == "bf16")
    allowed = tolerance(manifest)
    print("largest decoded-output error relative to the largest output: %.3g (tolerance %.3g); state error %.3g"
          % (worst, allowed, state))
    return 0 if worst <= allowed and state == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
