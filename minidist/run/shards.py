"""`python -m minidist.run.shards`: write the embedded corpus as token shards in the llm.c
.bin format, or read shards back. Chapter 01 (chapters/01_gpt.md); minidist/data.py does
the work."""

from __future__ import annotations

import argparse
import json

from minidist.data import default_data_dir, prepare_shakespeare, read_shard


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Write token shards in the llm.c .bin format.")
    p.add_argument("--out", help="output folder (default: the cache train_gpt reads, "
                   "$MINIDIST_DATA or ~/.cache/minidist, per tokenizer)")
    p.add_argument("--tokenizer", default="gpt2", help="gpt2 or gpt2-<V> (default: gpt2)")
    p.add_argument("--check", nargs="*", default=None, metavar="SHARD",
                   help="instead: read these shards back and print their token counts")
    a = p.parse_args(argv)
    for f in a.check or []:
        print(f"{f}: {len(read_shard(f))} tokens")
    if a.check is None:
        print(json.dumps(prepare_shakespeare(a.out or default_data_dir(a.tokenizer), a.tokenizer), indent=1))


if __name__ == "__main__":
    main()
