"""SVG of a saturated e-graph without a Graphviz binary: e-classes laid out in layers by
their depth from the program's roots (networkx BFS), each box listing its e-nodes'
constructors, edges from a class to its children's classes."""
from __future__ import annotations

from html import escape

import networkx as nx

from .extract import EGraphView

BOX_W, BOX_H, GAP_X, GAP_Y = 170, 18, 20, 60


def egraph_svg(view: EGraphView, max_classes: int = 400) -> str:
    g = nx.DiGraph()
    for c, nodes in view.classes.items():
        g.add_node(c)
        for n in nodes:
            for k in n.children:
                if k in view.classes:
                    g.add_edge(c, k)
    roots = [view.roots[r] for r in sorted(view.roots) if view.roots[r] in g]
    depth: dict[str, int] = {}
    for r in roots:
        for c, d in nx.single_source_shortest_path_length(g, r).items():
            depth[c] = min(d, depth.get(c, d))
    keep = sorted(depth, key=lambda c: (depth[c], c))[:max_classes]
    layers: dict[int, list[str]] = {}
    for c in keep:
        layers.setdefault(depth[c], []).append(c)
    pos, height = {}, {}
    for d, cs in layers.items():
        for k, c in enumerate(cs):
            ops = sorted({n.op for n in view.classes[c]})
            height[c] = BOX_H * max(1, len(ops))
            pos[c] = (20 + k * (BOX_W + GAP_X), 20 + d * (BOX_H * 4 + GAP_Y))
    width = 40 + max(len(cs) for cs in layers.values()) * (BOX_W + GAP_X) if layers else 100
    tall = 40 + (max(layers) + 1 if layers else 1) * (BOX_H * 4 + GAP_Y)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{tall}" '
           'font-family="monospace" font-size="11">']
    for a, b in g.edges():
        if a in pos and b in pos:
            (x1, y1), (x2, y2) = pos[a], pos[b]
            out.append(f'<line x1="{x1 + BOX_W / 2}" y1="{y1 + height[a]}" x2="{x2 + BOX_W / 2}" '
                       f'y2="{y2}" stroke="#999" stroke-width="0.6"/>')
    root_of = {v: k for k, v in view.roots.items()}
    for c in keep:
        x, y = pos[c]
        fill = "#fde9c8" if c in root_of else "#eef3fb"
        out.append(f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{height[c]}" rx="4" '
                   f'fill="{fill}" stroke="#456"/>')
        label = [f"{root_of[c]}: " if c in root_of else ""]
        for k, op in enumerate(sorted({n.op for n in view.classes[c]})):
            text = (label[0] if k == 0 else "") + op
            out.append(f'<text x="{x + 4}" y="{y + 13 + k * BOX_H}">{escape(text[:26])}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
