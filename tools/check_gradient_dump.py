#!/usr/bin/env python3
"""Recomputes softmax attention's gradients in float64 from an `xfbench run --pass train --dump DIR`
of an exact model (vanilla, exact-tiled) and compares them with the dumped dq, dk, dv.

Plain Python (no NumPy), so keep dumps small (B·H·N²·D of a few million). Exit 0 when every
gradient element is within the dtype's tolerance (tolerance()) of the largest magnitude of its
tensor's recomputation, or of a tenth of the largest of all three where that is larger (a
gradient that is exactly 0, dq and dk with a single visible key, is compared with the scale of the
others, not with its own rounding noise); 1 otherwise; 2 for a dump it cannot check.
"""
import json
import math
import os
import struct
import sys


def read_npy(path):
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            raise ValueError(path + " is not an .npy file")
        major = f.read(2)[0]
        header_len = struct.unpack("<H" if major == 1 else "<I", f.read(2 if major == 1 else 4))[0]
        header = f.read(header_len).decode("latin1")
        if "'<f4'" not in header or "'fortran_order': False" not in header:
            raise ValueError(path + ": expected little-endian float32 in C order")
        data = f.read()
    return list(struct.unpack("<%df" % (len(data) // 4), data))


def read_manifest(folder, tool):
    """A dump's manifest.json, or None after saying on stderr why the folder is not a dump."""
    try:
        with open(os.path.join(folder, "manifest.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        print("%s: %s is not a dump (%s)" % (tool, folder, error), file=sys.stderr)
        return None


def tolerance(manifest):
    """Error allowed relative to a tensor's scale: fp32 1e-4 (about 10³ float32 roundings of the
    largest element); bf16 4·2⁻⁸, since its inputs, probabilities (P, dS) and stored results are
    each rounded to bf16 (unit roundoff u = 2⁻⁸, 8 significant bits): a few such roundings, far
    below a wrong mask's O(1)."""
    return 4 * 2.0 ** -8 if manifest.get("dtype") == "bf16" else 1e-4


def head_gradients(q, k, v, dout, n, d, causal):
    """dq, dk, dv of one head ([n·d] lists) for O = softmax(q·kᵀ/√d)·v."""
    scale = 1.0 / math.sqrt(d)
    dq, dk, dv = [0.0] * (n * d), [0.0] * (n * d), [0.0] * (n * d)
    for i in range(n):
        keys = range(i + 1) if causal else range(n)
        scores = [scale * sum(q[i * d + c] * k[j * d + c] for c in range(d)) for j in keys]
        peak = max(scores)
        weights = [math.exp(s - peak) for s in scores]
        total = sum(weights)
        probs = [w / total for w in weights]
        dp = [sum(dout[i * d + c] * v[j * d + c] for c in range(d)) for j in keys]
        delta = sum(p * g for p, g in zip(probs, dp))
        for p, g, j in zip(probs, dp, keys):
            ds = p * (g - delta)
            for c in range(d):
                dv[j * d + c] += p * dout[i * d + c]
                dq[i * d + c] += scale * ds * k[j * d + c]
                dk[j * d + c] += scale * ds * q[i * d + c]
    return dq, dk, dv


def main(folder):
    manifest = read_manifest(folder, "check_gradient_dump")
    if manifest is None:
        return 2
    if manifest.get("scope", "attention") != "attention":
        print("check_gradient_dump: attention-scope dumps only (a layer dump's dout is the layer's)", file=sys.stderr)
        return 2
    if manifest["model"] not in ("vanilla", "exact-tiled"):
        print("check_gradient_dump: only the exact models' gradients are recomputed here", file=sys.stderr)
        return 2
    b, h, n, d = manifest["batch"], manifest["heads"], manifest["seq_len"], manifest["head_dim"]
    causal = manifest["causal"]
    tensors = {name: read_npy(folder + "/" + name + ".npy") for name in ("q", "k", "v", "dout", "dq", "dk", "dv")}
    heads = [slice(head * n * d, (head + 1) * n * d) for head in range(b * h)]
    wants = [head_gradients(*(tensors[t][part] for t in ("q", "k", "v", "dout")), n, d, causal) for part in heads]
    largest = [max(abs(x) for want in wants for x in want[index]) for index in range(3)]
    worst = 0.0
    for index, name in enumerate(("dq", "dk", "dv")):
        scale = max(largest[index], 0.1 * max(largest)) or 1.0
        for part, want in zip(heads, wants):
            worst = max(worst, max(abs(g - w) for g, w in zip(tensors[name][part], want[index])) / scale)
    print("largest gradient error relative to the tensor's scale: %.3g (tolerance %.3g)" % (worst, tolerance(manifest)))
    return 0 if worst <= tolerance(manifest) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
