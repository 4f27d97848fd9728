"""List the STOF nodes of a rewritten model and save one PNG picture per distinct mask layout (tile classes:
full / partial / empty, per layout).

examples:
  stof inspect bert.stof.onnx
  stof inspect bert.stof.onnx --out-dir masks/ --json
"""

from __future__ import annotations

import os
import textwrap

from .._files import write_file_atomic
from ..errors import StofError
from .common import load_model, output_dir_kept_on_success, print_json, print_table

STOF_DOMAIN = "stof"


def add_args(p):
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--out-dir", metavar="DIR", help="where to save the PNGs (default: MODEL.masks/ beside the model)")
    p.add_argument("--no-png", action="store_true", help="do not draw the mask layouts")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def draw_layout(layout, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    n = min(layout.num_layouts, 4)
    grid = layout.tile_classes()
    fig, axes = plt.subplots(1, n, figsize=(max(6.5, 4.2 * n), 5.0), squeeze=False)
    cmap = ListedColormap(["#f4f4f4", "#1f5fa8", "#f2a33a"])  # empty, full, partial
    for h in range(n):
        ax = axes[0, h]
        ax.imshow(grid[h], cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
        ax.set_title(f"layout {h}" if layout.num_layouts > 1 else "tiles", fontsize=9)
        ax.set_xlabel(f"key tile ({layout.tile_n})")
        ax.set_ylabel(f"query tile ({layout.tile_m})")
    c = layout.class_counts()
    title = textwrap.fill(title, 72, break_long_words=True, max_lines=2, placeholder="...")
    fig.suptitle(f"{title}\n{layout.seq_q}x{layout.seq_k}, density {layout.density():.4f}; tiles: full {c['full']} "
                 f"(blue), partial {c['partial']} (orange), empty {c['empty']}", fontsize=9)
    fig.tight_layout()
    try:
        write_file_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110), suffix=".png")
    finally:
        plt.close(fig)


def run(args) -> int:
    if args.out_dir == "":
        raise StofError("--out-dir is empty: give a directory (or leave it out for MODEL.masks/)")
    from ..nodes import attention_nodes

    model = load_model(args.model)
    nodes = [n for n in model.graph.node if n.domain == STOF_DOMAIN]
    layouts = {}
    attention = []
    for nd in attention_nodes(model):
        layout = nd.layout
        sig = layout.signature()
        layouts.setdefault(sig, (layout, []))[1].append(nd.name)
        attention.append({"node": nd.name, "layout": sig[:12], "seq": [layout.seq_q, layout.seq_k],
                          "tile": [layout.tile_m, layout.tile_n], "layouts": layout.num_layouts,
                          "density": layout.density(), "tile_classes": layout.class_counts(),
                          "mask_spec": layout.mask_spec, "layout_spec": nd.layout_spec, "scale": nd.scale})
    pngs = []
    if not args.no_png and layouts:
        out_dir = args.out_dir or os.path.splitext(args.model)[0] + ".masks"
        with output_dir_kept_on_success(out_dir, "--out-dir"):
            for sig, (layout, names) in layouts.items():
                path = os.path.join(out_dir, f"layout-{sig[:12]}.png")
                draw_layout(layout, path, f"{layout.mask_spec or 'mask'} — used by {len(names)} node(s)")
                pngs.append(path)
    counts = {}
    for n in nodes:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    info = {"model": args.model, "stof_nodes": counts, "attention": attention, "distinct_layouts": len(layouts),
            "pngs": pngs, "functions": sorted(f.name for f in model.functions if f.domain == STOF_DOMAIN)}
    if args.json:
        print_json(info)
        return 0
    if not nodes:
        print(f"{args.model}: no STOF nodes")
        return 0
    print_table([[k, v] for k, v in sorted(counts.items())], ["STOF op", "count"])
    if attention:
        print()
        print_table([[a["node"], a["layout"], f"{a['seq'][0]}x{a['seq'][1]}", f"{a['tile'][0]}x{a['tile'][1]}",
                      f"{a['density']:.4f}", a["tile_classes"]["full"], a["tile_classes"]["partial"],
                      a["tile_classes"]["empty"]] for a in attention],
                    ["attention node", "layout", "seq", "tile", "density", "full", "partial", "empty"])
    for p in pngs:
        print(f"saved {p}")
    return 0
