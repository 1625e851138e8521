"""`prima chat`: an interactive multi-turn chat in the terminal.

Each turn re-renders the whole conversation through the model's chat template and regenerates
from the start of the context, which keeps the template logic in one place; `/reset` clears
the history, `/exit` (or Ctrl-D) quits."""

from __future__ import annotations

import argparse
import sys

from prima.cli.cmd_run import add_sampling_args, sampler_from_args
from prima.cli.engine_options import add_model_args, open_session
from prima.engine.prompt import chat_prompt_ids
from prima.errors import InputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal", description=__doc__)
    add_model_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=512, help="tokens per reply at most (default 512)")
    p.add_argument("-s", "--system", default=None, help="system prompt")
    add_sampling_args(p, temp=0.7)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    session = open_session(args)
    loaded = session.loaded
    tok = loaded.tokenizer
    sampler = sampler_from_args(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print(
            f"prima chat with {loaded.name} ({loaded.path.name}); /reset clears, /exit quits", file=sys.stderr
        )
    try:
        while True:
            if interactive:
                sys.stderr.write("> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = history[:1] if args.system else []
                continue
            history.append({"role": "user", "content": text})
            try:
                ids = chat_prompt_ids(loaded.gguf.metadata, tok, history)
                result = session.generate(
                    ids,
                    max_tokens=args.n_predict,
                    sampler=sampler,
                    stop_ids=sorted(tok.stop_ids),
                    stop_strings=args.stop,
                    decoder=tok.stream_decoder(),
                    on_text=_write,
                )
            except InputError as exc:
                history.pop()
                print(f"\nprima: {exc}", file=sys.stderr)
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            history.append({"role": "assistant", "content": result.text})
    finally:
        session.close()
    return 0


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
