"""`prima tokenize`: show how a model's vocabulary splits some text (ids equal llama.cpp's)."""

from __future__ import annotations

import argparse
import json
import sys

from prima.model.gguf_file import GGUFFile
from prima.model.registry import DEFAULT_MODEL, resolve_model
from prima.model.tokenizer import Tokenizer


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tokenize", help="print the token ids of some text")
    parser.add_argument(
        "-m", "--model", default=DEFAULT_MODEL, help=f"model name or GGUF path (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--json", action="store_true", help='print {"ids": [...], "tokens": [...]}')
    parser.add_argument("--bos", action="store_true", help="prepend the BOS token")
    parser.add_argument(
        "--special", action="store_true", help="parse control-token text such as <|im_start|>"
    )
    parser.add_argument("text", help="text to tokenize ('-' reads stdin)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    with GGUFFile(resolve_model(args.model)) as gguf:
        tokenizer = Tokenizer.from_gguf(gguf.metadata)
    ids = tokenizer.encode(text, add_bos=args.bos, parse_special=args.special)
    if args.json:
        # A token may hold part of a UTF-8 character; such pieces show as U+FFFD.
        tokens = [tokenizer.token_piece(i, special=True).decode("utf-8", errors="replace") for i in ids]
        print(json.dumps({"ids": ids, "tokens": tokens}, ensure_ascii=False))
    else:
        print(" ".join(map(str, ids)))
    return 0
