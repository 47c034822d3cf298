"""`python -m minidist.bench all`: every benchmark in one go, and one report.md; and the
plotting every benchmark shares. Chapter 08 (chapters/08_at_scale.md). Exercised by
`python -m minidist.bench all --quick` and tests/test_cost_model.py (with stub benchmarks).
minidist/bench/__main__.py hands it the benchmarks by name, so this module imports none.

Runs them in ORDER (scale last: it compares its model with what the others just measured),
each writing its NAME.json and NAME.png into --out as when run alone. A benchmark that fails
leaves its traceback in the report and the others still run; the exit status is then 1.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ORDER = ("collectives", "ddp", "zero", "muon", "tp", "pp", "cp", "ep", "checksums", "scale")


class _Tee(io.StringIO):
    """Keeps what a benchmark prints while still printing it."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def write(self, s):
        self.stream.write(s)
        return super().write(s)


def machine() -> dict:
    cuda = torch.cuda.is_available()
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.machine()})",
            "gpus": torch.cuda.device_count() if cuda else 0, "platform": platform.platform()}


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "/").replace("\n", " ")


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def to_markdown(obj, title: str = "", depth: int = 0) -> str:
    """Markdown tables for a benchmark's result: a list of flat dicts becomes a table with
    a row each, a dict of scalars a two-column table, a dict of flat dicts a table with a
    row per key; anything else is walked into, with its key as a heading. Long lists of
    numbers (curves) stay in the JSON."""
    head = f"{'#' * min(2 + depth, 6)} {title}\n\n" if title else ""
    if isinstance(obj, list) and obj and all(isinstance(r, dict) and all(map(_scalar, r.values())) for r in obj):
        cols = list(dict.fromkeys(k for r in obj for k in r))
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in obj]
        return head + "\n".join(lines) + "\n\n"
    if not isinstance(obj, dict) or not obj:
        return ""
    if all(map(_scalar, obj.values())):
        lines = ["| key | value |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in obj.items()]
        return head + "\n".join(lines) + "\n\n"
    if all(isinstance(v, dict) and v and all(map(_scalar, v.values())) for v in obj.values()):
        return to_markdown([{"": k, **v} for k, v in obj.items()], title, depth)
    parts = [to_markdown({k: v for k, v in obj.items() if _scalar(v)}, title, depth)]
    for k, v in obj.items():
        if not _scalar(v) and depth < 3:
            parts.append(to_markdown(v, f"{title} / {k}" if title else str(k), depth + 1))
    return "".join(parts)


def render(sections: list[dict], info: dict, argv: str) -> str:
    lines = ["# minidist benchmarks", "",
             f"`python -m minidist.bench all {argv}` on {info['date']}", "",
             to_markdown(info, "Machine"), "| benchmark | status | seconds |", "|---|---|---:|"]
    lines += [f"| [{s['name']}](#{s['name']}) | {'ok' if s['error'] is None else 'FAILED'} | {s['seconds']:.0f} |"
              for s in sections]
    for s in sections:
        lines += ["", f"## {s['name']}", ""]
        if s["error"] is not None:
            lines += ["**Failed:**", "", "```text", s["error"].rstrip(), "```"]
        else:
            if s["png"]:
                lines += [f"![{s['name']}]({s['png']})", ""]
            result = s["result"] if isinstance(s["result"], dict) else {"result": s["result"]}
            table = result.get("table_md")  # a benchmark's own table stands for its rows
            rest = {k: v for k, v in result.items() if not (table and k in ("table_md", "rows"))}
            lines.append((table + "\n\n" if table else "") + to_markdown(rest))
        if s["printed"].strip():
            lines += ["<details><summary>printed</summary>", "", "```text", s["printed"].rstrip(), "```",
                      "", "</details>"]
    return "\n".join(lines) + "\n"


def run_all(args, benchmarks: dict) -> dict:
    """Run benchmarks[name](args) for each name of ORDER; write report.md and all.png."""
    out = Path(args.out)
    sections = []
    for name in ORDER:
        print(f"\n===== {name} =====", flush=True)
        t0, tee = time.perf_counter(), _Tee(sys.stdout)
        result = error = None
        try:
            with contextlib.redirect_stdout(tee):
                result = benchmarks[name](args)
            (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        except (Exception, SystemExit):  # record it and go on: one broken benchmark must not hide
            # the rest (SystemExit too: an argparse error inside a benchmark raises it)
            error = traceback.format_exc()
            print(error, file=sys.stderr)
        png = f"{name}.png" if error is None and (out / f"{name}.png").exists() else None
        sections.append(dict(name=name, result=result, error=error, png=png, printed=tee.getvalue(),
                             seconds=time.perf_counter() - t0))
    argv = f"--out {args.out}" + (" --quick" if args.quick else "") + \
        f" --world-sizes {' '.join(map(str, args.world_sizes))}"
    info = machine()
    (out / "report.md").write_text(render(sections, info, argv))
    _overview([out / s["png"] for s in sections if s["png"]], out / "all.png")
    failed = [s["name"] for s in sections if s["error"] is not None]
    summary = {"machine": info, "failed": failed,
               "seconds": {s["name"]: s["seconds"] for s in sections}}
    print(f"\nwrote {out}/report.md" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if failed:  # the report is written; now say so in the exit status
        (out / "all.json").write_text(json.dumps(summary, indent=1))
        raise SystemExit(f"benchmarks failed: {', '.join(failed)} (tracebacks in {out}/report.md)")
    return summary


def pyplot():
    """matplotlib.pyplot drawing into files (Agg), imported only when a benchmark plots."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi: int = 110) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def _overview(pngs: list[Path], path: Path) -> None:
    """all.png: every benchmark's plot, one above the other."""
    plt = pyplot()
    images = [plt.imread(p) for p in pngs]
    fig, axes = plt.subplots(max(1, len(images)), 1, figsize=(12, 4.5 * max(1, len(images))), squeeze=False)
    for ax, img, p in zip(axes[:, 0], images, pngs):
        ax.imshow(img)
        ax.set_title(p.stem)
    for ax in axes[:, 0]:
        ax.axis("off")
    save_figure(fig, path, dpi=80)
