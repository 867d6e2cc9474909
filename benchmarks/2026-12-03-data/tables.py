"""results.json -> the report's tables (Markdown), printed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median


def main(path: str) -> None:
    rows = json.loads(Path(path).read_text())
    print("## Prepare throughput\n")
    print("| corpus | tokenizer | workers | text MB | encode s | MB/s | MB/s per core | "
          "whole command s | shards | run for | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "prepare":
            mb = r["text_bytes"] / 1e6
            rate = mb / r["encode_s"]
            print(f"| {r['corpus']} | {r['tokenizer']} | {r['workers']} | {mb:.0f} | "
                  f"{r['encode_s']:.2f} | {rate:.1f} | {rate / r['workers']:.1f} | "
                  f"{r['wall_s']:.1f} | {r['shards']} | {r.get('purpose', '')} | "
                  f"{r['load']:.1f} |")
    print("\n## The tokenizers library, one encode_batch call on the same text\n")
    print("| corpus | tokenizer | text MB | s | MB/s (all cores) | MB/s per core | load |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "baseline":
            mb = r["text_bytes"] / 1e6
            print(f"| {r['corpus']} | {r['tokenizer']} | {mb:.0f} | {r['seconds']:.2f} | "
                  f"{mb / r['seconds']:.2f} | {mb / r['seconds'] / r['threads']:.2f} | "
                  f"{r['load']:.1f} |")
    print("\n## Opening a prepared dataset (a fresh process)\n")
    print("| corpus | windows (S=128) | import s | open + first batch s | process peak RSS MB |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "open":
            print(f"| {r['corpus']} | {r['windows']:,} | {r['import_s']:.2f} | "
                  f"{r['open_and_first_batch_s']:.3f} | {r['process_peak_rss_mb']:.0f} |")
    print("\n## oases train, 2 ranks (tp=2), 3 steps: medians over the runs (range)\n")
    print("| corpus | data path | runs | command start to first step s | launch to first step s "
          "| peak RSS rank 0 / rank 1 MB | load |")
    print("|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["kind"] == "startup":
            groups.setdefault((r["corpus"], r["code"]), []).append(r)
    for (corpus, code), rs in groups.items():
        first = [r["first_step_s"] for r in rs]
        launch = [r["launch_to_first_step_s"] for r in rs]
        peaks = [median([r["rank_peak_rss_mb"][i] for r in rs]) for i in range(2)]
        print(f"| {corpus} | {code} | {len(rs)} | {median(first):.1f} ({min(first):.1f}-"
              f"{max(first):.1f}) | {median(launch):.1f} ({min(launch):.1f}-{max(launch):.1f}) "
              f"| {peaks[0]:.0f} / {peaks[1]:.0f} | {median([r['load'] for r in rs]):.1f} |")
    print("\n## BPE (4096 tokens) trained on the first MiBs of the 1 GB corpus\n")
    print("| sample MiB | training s | process peak RSS MB | tokens per byte on the 10 MB corpus "
          "| load |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "bpe_sample":
            print(f"| {r['sample_mib']} | {r['train_s']:.1f} | {r['peak_rss_mb']:.0f} | "
                  f"{r['tokens_per_byte']:.4f} | {r['load']:.1f} |")
    print("\n## make train (configs/default.toml, 200 steps)\n")
    print("| code | wall s | first step s | final validation loss | peak RSS per rank MB | "
          "load |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "make_train":
            print(f"| {r['code']} | {r['wall_s']:.1f} | {r['first_step_s']:.1f} | "
                  f"{r['val_loss'][0]:.4f} | "
                  f"{' / '.join(f'{x:.0f}' for x in r['rank_peak_rss_mb'])} | "
                  f"{r['load']:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1])
