#!/usr/bin/env python3
"""Extends the plot palette (apps/report/svg.cpp) greedily: candidates are OKLCH colours of lightness
0.40-0.70 (steps of 0.025) at the sRGB gamut's largest chroma, hue in 6-degree steps; each next colour is
the candidate farthest from those already taken, the distance being the least of normal vision's OKLab
distance and, weighted 3x, the OKLab distances under simulated protanopia and deuteranopia (Machado,
Oliveira and Fernandes 2009, severity 1). Usage: palette.py TOTAL HEX... (the palette so far, kept)."""
import math
import sys

PROTAN = ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216), (-0.003882, -0.048116, 1.051998))
DEUTAN = ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413), (-0.011820, 0.042940, 0.968881))


def mat(m, v):
    return tuple(sum(m[i][j] * v[j] for j in range(3)) for i in range(3))


def oklab_to_linear(lab):
    l_, m_, s_ = mat(((1, 0.3963377774, 0.2158037573), (1, -0.1055613458, -0.0638541728),
                      (1, -0.0894841775, -1.2914855480)), lab)
    lms = (l_ ** 3, m_ ** 3, s_ ** 3)
    return mat(((4.0767416621, -3.3077115913, 0.2309699292), (-1.2684380046, 2.6097574011, -0.3413193965),
                (-0.0041960863, -0.7034186147, 1.7076147010)), lms)


def linear_to_oklab(rgb):
    lms = mat(((0.4122214708, 0.5363325363, 0.0514459929), (0.2119034982, 0.6806675030, 0.1073969566),
               (0.0883024619, 0.2817188376, 0.6299787005)), rgb)
    cube = tuple(math.copysign(abs(x) ** (1 / 3), x) for x in lms)
    return mat(((0.2104542553, 0.7936177850, -0.0040720468), (1.9779984951, -2.4285922050, 0.4505937099),
                (0.0259040371, 0.7827717662, -0.8086757660)), cube)


def encode(x):
    x = min(1.0, max(0.0, x))
    return 12.92 * x if x <= 0.0031308 else 1.055 * x ** (1 / 2.4) - 0.055


def decode(c):
    return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4


def to_hex(rgb):
    return "#" + "".join("%02x" % round(255 * encode(x)) for x in rgb)


def from_hex(h):
    return tuple(decode(int(h[i:i + 2], 16) / 255) for i in (1, 3, 5))


def in_gamut(rgb):
    return all(-1e-9 <= x <= 1 + 1e-9 for x in rgb)


def at_gamut_chroma(lightness, hue):
    lo, hi = 0.0, 0.4
    for _ in range(40):
        c = (lo + hi) / 2
        lab = (lightness, c * math.cos(math.radians(hue)), c * math.sin(math.radians(hue)))
        lo, hi = (c, hi) if in_gamut(oklab_to_linear(lab)) else (lo, c)
    return to_hex(oklab_to_linear((lightness, lo * math.cos(math.radians(hue)), lo * math.sin(math.radians(hue)))))


def views(h):
    rgb = from_hex(h)
    clip = lambda v: tuple(min(1.0, max(0.0, x)) for x in v)
    return linear_to_oklab(rgb), linear_to_oklab(clip(mat(PROTAN, rgb))), linear_to_oklab(clip(mat(DEUTAN, rgb)))


def distance(a, b):
    va, vb = views(a), views(b)
    d = [math.dist(x, y) for x, y in zip(va, vb)]
    return min(d[0], 3 * d[1], 3 * d[2])


def main():
    total, taken = int(sys.argv[1]), [h.lower() for h in sys.argv[2:]]
    candidates = sorted({at_gamut_chroma(0.40 + 0.025 * i, 6 * j) for i in range(13) for j in range(60)})
    while len(taken) < total:
        best = max(candidates, key=lambda c: min(distance(c, t) for t in taken))
        taken.append(best)
    print(", ".join('"%s"' % h for h in taken))
    print("least distance:", round(min(distance(a, b) for i, a in enumerate(taken) for b in taken[:i]), 4))
    print("least normal-vision distance:",
          round(min(math.dist(views(a)[0], views(b)[0]) for i, a in enumerate(taken) for b in taken[:i]), 4))


main()
