#!/usr/bin/env python3
"""Recomputes a mixture-of-experts layer in float64 from an `xfbench run --scope layer --ffn switch|gshard
--dump DIR` (or `-m switch|gshard --scope layer`): the router's probabilities, the choices, the capacity pass
(groups, first choices before second ones, GShard's draw), the gates and y = h + moe(LN₂(h)), as
docs/layer.md#mixture-of-experts defines them, against the dumped routing and out.npy.

Plain Python (no NumPy), so keep dumps small. Exit 0 when the routing matches exactly and every output
element is within 1e-4 of the largest |y|, 1 otherwise, 2 for a folder that is not a dump.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_gradient_dump import read_manifest, read_npy  # noqa: E402


def layer_norm(row):
    mean = sum(row) / len(row)
    var = sum((z - mean) ** 2 for z in row) / len(row)
    return [(z - mean) / math.sqrt(var + 1e-5) for z in row]  # γ = 1, β = 0


def main(d):
    m = read_manifest(d, "check_moe_dump")
    if m is None:
        return 2
    load = lambda name: read_npy(os.path.join(d, name + ".npy"))  # noqa: E731
    b, n, heads, dim = m["batch"], m["seq_len"], m["heads"], m["head_dim"]
    e, f, x, t_rows = heads * dim, m["d_ff"], m["experts"], m["batch"] * m["seq_len"]
    k = 2 if m["ffn"] == "gshard" else 1
    cf, size = m["capacity_factor"], (m["group_size"] or t_rows)
    size = min(size, t_rows)
    xs, o, w_o = load("x"), load("attention_out"), load("layer_w_o")
    w_r, w_1, w_2 = load("moe_w_router"), load("moe_w_1"), load("moe_w_2")
    choice, slot, gate, out = load("moe_choice"), load("moe_slot"), load("moe_gate"), load("out")
    draw = load("moe_second_draw") if k == 2 else None
    problems = []
    # h = x + merge(o)·W_o; a = LN₂(h); p = softmax(a·W_r).
    h, a, p = [], [], []
    for bi in range(b):
        for t in range(n):
            merged = [o[((bi * heads + hd) * n + t) * dim + c] for hd in range(heads) for c in range(dim)]
            row = [xs[(bi * n + t) * e + j] + sum(merged[i] * w_o[i * e + j] for i in range(e)) for j in range(e)]
            h.append(row)
            a.append(layer_norm(row))
    for row in a:
        z = [sum(row[i] * w_r[i * x + c] for i in range(e)) for c in range(x)]
        peak = max(z)
        ex = [math.exp(v - peak) for v in z]
        p.append([v / sum(ex) for v in ex])
    # Choices, gates, the capacity pass.
    first = [max(range(x), key=lambda c: (p[t][c], -c)) for t in range(t_rows)]
    second = [max((c for c in range(x) if c != first[t]), key=lambda c: (p[t][c], -c)) if k == 2 else -1
              for t in range(t_rows)]
    chosen = [[first[t]] + ([second[t]] if k == 2 else []) for t in range(t_rows)]
    raw = [[p[t][first[t]]] if k == 1 else
           [p[t][c] / (p[t][first[t]] + p[t][second[t]]) for c in chosen[t]] for t in range(t_rows)]
    expected_slot = [[-1] * k for _ in range(t_rows)]
    count = [0] * x
    for begin in range(0, t_rows, size):
        rows = min(t_rows, begin + size) - begin
        cap = min(rows, max(4, math.floor(k * rows * cf / x)))
        taken = [0] * x
        for j in range(k):
            for t in range(begin, begin + rows):
                c = chosen[t][j]
                if (j == 0 or draw[t] < raw[t][1] / 0.2) and taken[c] < cap:
                    taken[c] += 1
                    expected_slot[t][j] = count[c]
                    count[c] += 1
    for t in range(t_rows):
        for j in range(k):
            if int(choice[t * k + j]) != chosen[t][j]:
                problems.append(f"row {t} choice {j}: dumped {choice[t * k + j]}, recomputed {chosen[t][j]}")
            if int(slot[t * k + j]) != expected_slot[t][j]:
                problems.append(f"row {t} choice {j}: dumped slot {slot[t * k + j]}, recomputed {expected_slot[t][j]}")
    # y = h + Σ_kept g·GELU(a·W₁)·W₂.
    largest, worst = 0.0, 0.0
    for t in range(t_rows):
        y = list(h[t])
        for j in range(k):
            if expected_slot[t][j] < 0:
                continue
            c, g = chosen[t][j], raw[t][j]
            if abs(gate[t * k + j] - g) > 1e-5:
                problems.append(f"row {t} choice {j}: dumped gate {gate[t * k + j]}, recomputed {g}")
            hidden = []
            for col in range(f):
                z = sum(a[t][i] * w_1[(c * e + i) * f + col] for i in range(e))
                hidden.append(0.5 * z * (1 + math.erf(z / math.sqrt(2))))
            for i in range(e):
                y[i] += g * sum(hidden[col] * w_2[(c * f + col) * e + i] for col in range(f))
        for i in range(e):
            largest = max(largest, abs(y[i]))
            worst = max(worst, abs(y[i] - out[t * e + i]))
    if worst > 1e-4 * max(1.0, largest):
        problems.append(f"out differs by {worst} (largest |y| {largest})")
    print("\n".join(problems[:10]) if problems else f"routing and out agree (max error {worst:.2e})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
