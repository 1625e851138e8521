"""`prima chat`: an interactive multi-turn chat in the terminal.

Each turn re-renders the whole conversation through the model's chat template, which keeps the
template logic in one place; on this device (--local) the engine keeps its KV cache between turns,
as does a ring whose head keeps sessions (primad --keep-sessions; --local-ring starts its daemons
so), so a turn computes only what the last one did not leave. `/reset` clears
the history, `/exit` (or Ctrl-D) quits. In a terminal, lines are edited with readline (history
kept in prima's cache directory) and Ctrl-C stops the reply being written."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from prima import paths
from prima.cli.arg_types import positive_int
from prima.cli.cmd_run import (
    add_chat_template_arg,
    add_sampling_args,
    chat_template_from_args,
    sampler_from_args,
    warn_if_no_chat_template,
)
from prima.cli.engine_options import add_model_args, open_session
from prima.engine.prompt import chat_prompt_ids
from prima.errors import InputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal", description=__doc__)
    add_model_args(p)
    p.add_argument(
        "-n", "--n-predict", type=positive_int, default=512, help="tokens per reply at most (default 512)"
    )
    p.add_argument("-s", "--system", default=None, help="system prompt")
    add_chat_template_arg(p)
    add_sampling_args(p, temp=0.7)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    template = chat_template_from_args(args)
    sampler = sampler_from_args(args)  # bad sampling flags fail before the model loads
    session = open_session(args)
    loaded = session.loaded
    tok = loaded.tokenizer
    warn_if_no_chat_template(loaded, template)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        _enable_line_editing()
        print(
            f"prima chat with {loaded.name} ({loaded.path.name}); /reset clears, /exit or Ctrl-D quits, "
            "Ctrl-C stops a reply",
            file=sys.stderr,
        )
    shown: list[str] = []  # the reply so far, kept if Ctrl-C stops it

    def show(piece: str) -> None:
        shown.append(piece)
        _write(piece)

    try:
        while (line := _read_line(interactive)) is not None:
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = history[:1] if args.system else []
                continue
            history.append({"role": "user", "content": text})
            shown.clear()
            try:
                ids = chat_prompt_ids(loaded.gguf.metadata, tok, history, template)
                request = session.request(ids, max_tokens=args.n_predict, sampler=sampler, keep_session=True)
                result = session.generate(
                    request, stop_strings=args.stop, decoder=tok.stream_decoder(), on_text=show
                )
                reply = result.text
            except InputError as exc:
                history.pop()
                print(f"\nprima: {exc}", file=sys.stderr)
                continue
            except KeyboardInterrupt:
                # Ctrl-C stops this reply, not the chat: keep what was shown as the turn.
                reply = "".join(shown)
                print(" [stopped]", file=sys.stderr, end="")
            sys.stdout.write("\n")
            sys.stdout.flush()
            history.append({"role": "assistant", "content": reply})
    finally:
        session.close()
        _save_history(interactive)
    return 0


HISTORY_LINES = 1000


def _history_file() -> Path:
    return paths.cache_root() / "chat_history"


def _enable_line_editing() -> None:
    """readline's editing keys and history (kept across chats) for input(), where available."""
    try:
        import readline
    except ImportError:  # not on every platform; plain input() still works
        return
    readline.set_history_length(HISTORY_LINES)
    with contextlib.suppress(OSError):
        readline.read_history_file(_history_file())


def _save_history(interactive: bool) -> None:
    readline = sys.modules.get("readline")
    if not interactive or readline is None:
        return
    with contextlib.suppress(OSError):
        _history_file().parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(_history_file())


def _read_line(interactive: bool) -> str | None:
    """The next line typed (None at end of input). At the prompt, Ctrl-C abandons the line, as
    in a shell, and Ctrl-D ends the chat on a fresh line."""
    if not interactive:
        return sys.stdin.readline() or None
    while True:
        try:
            return input("> ")
        except KeyboardInterrupt:
            sys.stdout.write("\n")
        except EOFError:
            sys.stdout.write("\n")
            sys.stdout.flush()
            return None


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
