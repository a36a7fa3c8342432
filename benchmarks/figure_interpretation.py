"""The figure of docs/interpretation.md: attention statistics of two genomics-style layers.

    python benchmarks/figure_interpretation.py                    # writes docs/interpretation.svg
    python benchmarks/figure_interpretation.py --out /tmp/f.svg --heads 2

Two layers with random weights and three planted "enhancers" (key bins whose keys point
along the promoter's queries), at the models' real lengths:

* Enformer-style: 1,536 bins, relative-position logits (``rel_q``/``rel_k``), 8 heads;
* AlphaGenome-style: 8,192 positions, one key/value head shared by the query heads, a pair map
  at 1/16 resolution (``bias_block=16``), the soft cap after the bias.

Panels: the attention the promoter's bins give each position (``received`` with
``query_weights`` 1 on the promoter), and each query's entropy, both averaged over heads. The
SVG is written by hand (no plotting library needed).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import cuonline

ROOT = Path(__file__).resolve().parents[1]


def planted(rng, heads, length, d, promoter, enhancers, strength):
    """q, k with the keys at the enhancer bins along the promoter queries' direction."""
    q = rng.standard_normal((1, heads, length, d), dtype=np.float32)
    k = rng.standard_normal((1, heads, length, d), dtype=np.float32)
    direction = rng.standard_normal((1, heads, 1, d), dtype=np.float32)
    q[:, :, promoter] += direction
    for e in enhancers:
        k[:, :, e - 2:e + 3] += strength * direction
    return q, k


def enformer(rng, heads):
    length, d = 1536, 64
    promoter = slice(762, 774)                          # 12 bins of 128 bp: 1.5 kb
    q, k = planted(rng, heads, length, d, promoter, (300, 1100, 1400), 1.5)
    r = 0.1 * rng.standard_normal((heads, 2 * length - 1, d), dtype=np.float32)
    qs = q / np.float32(np.sqrt(d))
    weights = np.zeros(length, dtype=np.float32)
    weights[promoter] = 1
    st = cuonline.attention_stats(qs, k, scale=1.0, rel_q=qs, rel_k=r, received=True,
                                  query_weights=weights, top_k=5)
    return st, promoter


def alphagenome(rng, heads):
    length, d, block = 8192, 128, 16
    promoter = slice(4080, 4112)
    q, k = planted(rng, heads, length, d, promoter, (1000, 5200, 7600), 2.0)
    k = k[:, :1]                                        # one key head for every query head
    pair = 0.5 * rng.standard_normal((1, heads, length // block, length // block),
                                     dtype=np.float32)
    weights = np.zeros(length, dtype=np.float32)
    weights[promoter] = 1
    st = cuonline.attention_stats(q, k, bias=pair, bias_block=block, softcap=5.0,
                                  softcap_bias=True, received=True, query_weights=weights)
    return st, promoter


def polyline(values, x0, y0, width, height, colour):
    values = np.asarray(values, dtype=np.float64)
    if values.size > 1024:                             # one point per group: the group's max
        values = values[:values.size // 8 * 8].reshape(-1, 8).max(axis=1)
    top = values.max() if values.max() > 0 else 1.0
    xs = x0 + np.linspace(0, width, values.size)
    ys = y0 + height - height * values / top
    points = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
    return f'<polyline fill="none" stroke="{colour}" stroke-width="1" points="{points}"/>'


def panel(title, values, x0, y0, promoter, length, colour):
    width, height = 420, 120
    parts = [f'<text x="{x0}" y="{y0 - 6}" font-size="12">{title}</text>',
             f'<rect x="{x0}" y="{y0}" width="{width}" height="{height}" fill="none" '
             f'stroke="#999"/>']
    px = x0 + width * promoter.start / length
    pw = max(1.0, width * (promoter.stop - promoter.start) / length)
    parts.append(f'<rect x="{px:.1f}" y="{y0}" width="{pw:.1f}" height="{height}" '
                 f'fill="#fc6" opacity="0.6"/>')
    parts.append(polyline(values, x0, y0, width, height, colour))
    parts.append(f'<text x="{x0}" y="{y0 + height + 14}" font-size="10">0</text>')
    parts.append(f'<text x="{x0 + width - 30}" y="{y0 + height + 14}" font-size="10">'
                 f'{length}</text>')
    return parts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "interpretation.svg"))
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(21)
    ef, ef_promoter = enformer(rng, args.heads)
    ag, ag_promoter = alphagenome(rng, args.heads)
    body = []
    body += panel("Enformer-style (1,536 bins): attention received from the promoter",
                  ef.received[0].mean(axis=0), 20, 30, ef_promoter, 1536, "#1f4e9c")
    body += panel("Enformer-style: entropy of each query (nats)",
                  ef.entropy[0].mean(axis=0), 480, 30, ef_promoter, 1536, "#555")
    body += panel("AlphaGenome-style (8,192): attention received from the promoter",
                  ag.received[0].mean(axis=0), 20, 200, ag_promoter, 8192, "#9c1f4e")
    body += panel("AlphaGenome-style: entropy of each query (nats)",
                  ag.entropy[0].mean(axis=0), 480, 200, ag_promoter, 8192, "#555")
    svg = ('<svg xmlns="http://www.w3.org/2000/svg" width="920" height="350" '
           'font-family="sans-serif">\n' + "\n".join(body) + "\n</svg>\n")
    Path(args.out).write_text(svg, encoding="utf-8")
    top = ef.top_indices[0, 0, 768]
    print(f"wrote {args.out}; Enformer-style head 0, promoter bin 768: top keys "
          f"{[int(j) for j in top]}")


if __name__ == "__main__":
    main()
