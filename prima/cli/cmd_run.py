"""`prima run`: generate text for one prompt and stream it to the terminal (or print JSON)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from prima.cli.arg_types import non_negative_int
from prima.cli.engine_options import add_model_args, open_session
from prima.engine.prompt import chat_prompt_ids, prompt_ids
from prima.engine.sampling import SamplerConfig
from prima.errors import InputError
from prima.model.chat_template import model_chat_template, read_chat_template
from prima.scheduler.profile_schema import ModelProfile

if TYPE_CHECKING:
    from prima.coordinator.ring import Ring
    from prima.forward.loader import LoadedModel
    from prima.model.files import ModelFiles


def add_sampling_args(parser: argparse.ArgumentParser, temp: float = 0.0) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temp", type=float, default=temp, help=f"temperature; 0 = greedy (default {temp:g})")
    g.add_argument(
        "--top-k",
        type=non_negative_int,
        default=40,
        help="keep the k most likely tokens; 0 = off (default 40)",
    )
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    g.add_argument(
        "--min-p", type=float, default=0.05, help="drop tokens below min-p x the best (default 0.05)"
    )
    g.add_argument(
        "--repeat-penalty", type=float, default=1.0, help="penalize repeated tokens (default 1.0 = off)"
    )
    g.add_argument("--seed", type=non_negative_int, default=None, help="random seed for sampling")
    g.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")


def sampler_from_args(args: argparse.Namespace) -> SamplerConfig:
    return SamplerConfig(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )


def add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        type=Path,
        default=None,
        help="Jinja chat template to use instead of the model's own (for models that ship none: "
        "save the chat_template of its Hugging Face tokenizer_config.json to a file)",
    )


def chat_template_from_args(args: argparse.Namespace) -> str | None:
    """The --chat-template file's text (read before the model loads, so a bad path fails fast),
    or None for the model's own template."""
    return read_chat_template(args.chat_template) if args.chat_template is not None else None


def warn_if_no_chat_template(loaded: ModelFiles, template: str | None, *, run_hint: bool = False) -> None:
    """Say once on stderr that chat falls back to a guessed format when the model ships no
    template and none was given: small models answer such prompts with garbage."""
    if template is not None or model_chat_template(loaded.gguf.metadata) is not None:
        return
    alternative = "; or leave out --chat to send the prompt as it is" if run_hint else ""
    print(
        f"prima: warning: {loaded.path.name} ships no chat template (tokenizer.chat_template), so chat "
        "prompts use a generic built-in turn format the model was not trained on and may answer with "
        f"garbage. Pass the model's own template with --chat-template FILE{alternative}.",
        file=sys.stderr,
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text for a prompt", description=__doc__)
    add_model_args(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("-p", "--prompt", help="the prompt text; - reads it from stdin")
    source.add_argument("-f", "--file", type=Path, help="read the prompt from this file")
    p.add_argument(
        "-n",
        "--n-predict",
        type=non_negative_int,
        default=128,
        help="tokens to generate at most; 0 computes the prompt only (default 128)",
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_chat_template_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--logits-out", type=Path, help="write the last prompt token's float32 logits (.npy)")
    add_sampling_args(p)
    p.set_defaults(func=run)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt of -p TEXT, -p - (stdin) or -f FILE, as given (a file's final newline kept,
    as llama-cli keeps it)."""
    if args.file is not None:
        try:
            return args.file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read the prompt from {args.file}: {exc}") from None
    if args.prompt == "-":
        return sys.stdin.read()
    return args.prompt


def run(args: argparse.Namespace) -> int:
    args.prompt = read_prompt(args)
    if not args.prompt:
        raise InputError("the prompt is empty: give some text with -p TEXT, -p - (stdin) or -f FILE")
    if args.chat_template is not None and not args.chat:
        raise InputError("--chat-template only applies with --chat")
    if args.logits_out is not None and not args.logits_out.parent.is_dir():
        raise InputError(f"--logits-out: the directory {args.logits_out.parent} does not exist")
    # Everything the flags say is checked before the model is resolved (and perhaps downloaded).
    template = chat_template_from_args(args)
    sampler = sampler_from_args(args)
    session = open_session(args)
    try:
        loaded = session.loaded
        tok = loaded.tokenizer
        if args.chat:
            warn_if_no_chat_template(loaded, template, run_hint=True)
            messages = [{"role": "user", "content": args.prompt}]
            ids = chat_prompt_ids(loaded.gguf.metadata, tok, messages, template)
        else:
            ids = prompt_ids(tok, args.prompt)
        stream_out = None if args.json else _write_stdout
        request = session.request(
            ids,
            max_tokens=args.n_predict,
            sampler=sampler,
            want_prompt_logits=args.logits_out is not None,
        )
        result = session.generate(
            request, stop_strings=args.stop, decoder=tok.stream_decoder(), on_text=stream_out
        )
        hops = (
            _hop_times(session.ring, loaded, session.n_ctx)
            if args.json and session.ring is not None
            else None
        )
    finally:
        session.close()
    if args.logits_out and result.prompt_logits is not None:
        np.save(args.logits_out, np.asarray(result.prompt_logits, dtype=np.float32))
    if args.json:
        out = {
            "model": str(loaded.path),
            "prompt_token_ids": result.prompt_token_ids,
            "token_ids": result.token_ids,
            "text": result.text,
            "stop_reason": result.stop_reason,
            "timings": result.timings.as_dict(),
        }
        if session.ring is not None:
            out["plan"] = session.ring.plan.to_dict()
            out["hops"] = hops
            out["recoveries"] = [r.as_dict() for r in getattr(session.generator, "recoveries", [])]
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        t = result.timings
        print(
            f"[{t.prompt_tokens} prompt tokens at {t.prefill_tokens_per_s:.1f} tok/s, "
            f"{t.generated_tokens} generated at {t.decode_tokens_per_s:.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _hop_times(ring: Ring, loaded: LoadedModel, n_ctx: int) -> list[dict[str, object]]:
    """Each hop of the ring's forward pass: Halda's predicted ms and what its node measured per
    decode step, so a run shows where a prediction and the ring part (bench/bench_scale.py)."""
    from prima.api.cluster_view import ClusterMonitor, read_ring  # a ring's: gRPC loads with it

    model = ModelProfile.from_gguf(loaded.gguf, ctx_tokens=n_ctx)  # as Halda planned
    monitor = ClusterMonitor(loaded.name, lambda: read_ring(ring), model)
    return monitor.snapshot().to_dict()["hops"]
