"""Flags that choose where a model runs, shared by `prima run`, `prima chat` and `prima serve`.

Today: this device. The ring (`--local-ring`, `--nodes`, `--windows`, `--rounds`) plugs in here,
so every command that generates text gets it at once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from prima.engine.generate import Engine
from prima.engine.local import LocalEngine
from prima.model.loader import LoadedModel, load_model
from prima.model.registry import DEFAULT_MODEL


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", default=DEFAULT_MODEL, help=f"model name or GGUF path (default {DEFAULT_MODEL})")
    parser.add_argument("-c", "--ctx", type=int, default=2048, help="context size in tokens (default 2048)")
    parser.add_argument("-t", "--threads", type=int, default=None, help="compute threads (default: all cores)")
    parser.add_argument("--backend", default="cpu", help="compute backend (default cpu)")


@dataclass
class Session:
    """What a text-generating command needs: the model (tokenizer, metadata) and an engine."""

    loaded: LoadedModel
    engine: Engine

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close:
            close()


def open_session(args: argparse.Namespace) -> Session:
    loaded = load_model(args.model, backend=args.backend, threads=args.threads)
    return Session(loaded, LocalEngine(loaded.model, n_ctx=args.ctx))
