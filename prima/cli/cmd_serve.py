"""`prima serve`: an OpenAI-compatible HTTP API over one model (on this device or a ring), and a
web page at / to chat with it and watch the cluster.

The sampling flags set the defaults a request gets when it leaves a field out; request fields
always win. Up to --parallel requests generate at once, the rest wait in turn. SIGTERM or
Ctrl-C stops the server gracefully: new requests get 503, those in flight finish within
--shutdown-timeout or end with an error event, then a ring started here stops too.

With --api-key (or $PRIMA_API_KEY) every route but /health and the web page needs
`Authorization: Bearer KEY`. Without one, listening beyond loopback prints a warning: anyone
who can reach the port can use the model."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from prima.api.cluster_view import ClusterMonitor, read_local, read_ring
from prima.api.server import API_KEY_ENV, ApiServer, HttpLimits
from prima.api.service import CompletionService, EngineQueue, ServeDefaults
from prima.api.shutdown import drain
from prima.cli.arg_types import non_negative_int, port, positive_int
from prima.cli.cmd_run import (
    add_chat_template_arg,
    add_sampling_args,
    chat_template_from_args,
    sampler_from_args,
    warn_if_no_chat_template,
)
from prima.cli.engine_options import add_model_args, draft_from_args, open_session
from prima.cli.stop_signals import StopSignals, add_shutdown_timeout_arg
from prima.coordinator.session import Session
from prima.errors import InputError
from prima.net.credentials import is_loopback
from prima.scheduler.profile_schema import ModelProfile

DEFAULT_PARALLEL = 4


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API", description=__doc__)
    add_model_args(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)"
    )
    p.add_argument("--port", type=port, default=8080, help="TCP port (default 8080; 0 picks a free one)")
    p.add_argument(
        "-n",
        "--n-predict",
        type=positive_int,
        default=512,
        help="tokens per reply when a request sets no max_tokens (default 512)",
    )
    p.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=16,
        help="requests that may wait for the model (default 16)",
    )
    p.add_argument(
        "-np",
        "--parallel",
        type=positive_int,
        default=DEFAULT_PARALLEL,
        help=f"requests generated at once, each with its own KV cache; on this device their decode steps "
        f"run batched, one pass over the weights for all; more wait in turn (default {DEFAULT_PARALLEL})",
    )
    p.add_argument("--model-id", default=None, help="the model name the API reports (default: the -m value)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default ${API_KEY_ENV}; prefer the variable: "
        "flags show in the process list)",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=HttpLimits.max_connections,
        help=f"connections served at once; more get 429 (default {HttpLimits.max_connections})",
    )
    add_shutdown_timeout_arg(p, "the requests in flight")
    add_chat_template_arg(p)
    add_sampling_args(p, temp=0.7)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    defaults = ServeDefaults(
        sampler=sampler_from_args(args),
        max_tokens=args.n_predict,
        stop=tuple(args.stop),
        draft=draft_from_args(args),
    )
    template = chat_template_from_args(args)
    session = open_session(args, parallel=args.parallel)
    defaults = replace(defaults, draft=session.draft)  # with the --draft-model file's fingerprint
    warn_if_no_chat_template(session.loaded, template)
    model_id = args.model_id or _model_id(args.model)
    service = CompletionService(
        session.loaded,
        session.generator,
        model_id,
        session.n_ctx,
        defaults=defaults,
        queue=EngineQueue(max_waiting=args.max_queue, slots=_slots(session, args.parallel)),
        chat_template=template,
    )
    monitor = _cluster_monitor(session, model_id, args.ctx)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    limits = HttpLimits(max_connections=args.max_connections)
    try:
        server = ApiServer((args.host, args.port), service, monitor=monitor, limits=limits, api_key=api_key)
    except OSError as exc:
        session.close()
        raise InputError(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror}; pick another --port"
        ) from None
    print(
        f"prima serve: {model_id} (context {service.n_ctx}) at {server.url}/v1, web page at "
        f"{server.url}/  (Ctrl-C stops)",
        file=sys.stderr,
    )
    warning = open_access_warning(args.host, api_key)
    if warning:
        print(f"prima serve: warning: {warning}", file=sys.stderr)
    signals = StopSignals()
    try:
        server.serve_in_background()
        name = signals.wait()
        in_flight = server.stop_taking_work()
        print(
            f"prima serve: {name}: stopping: {in_flight} request(s) in flight, finishing them within "
            f"{args.shutdown_timeout:g} s (--shutdown-timeout); new requests get 503",
            file=sys.stderr,
            flush=True,
        )
        report = drain(server, args.shutdown_timeout, signals.now)
        print(
            f"prima serve: stopped: {report.finished} request(s) finished, {report.cut} cut"
            + (" (ended with an error event, or refused while queued)" if report.cut else ""),
            file=sys.stderr,
            flush=True,
        )
    finally:
        service.close()  # anything still running ends at its next token
        server.shutdown()
        server.server_close()
        session.close()  # a ring started here (--local-ring) stops with it
    return 0


def open_access_warning(host: str, api_key: str | None) -> str | None:
    """What to tell the user when the API is open to more than this machine, else None."""
    if api_key or is_loopback(host):
        return None
    return (
        f"listening on {host or 'every address'} with no API key: anyone who can reach this port "
        f"can use the model and read the cluster view; set ${API_KEY_ENV} (or --api-key) or "
        "bind --host 127.0.0.1"
    )


def _cluster_monitor(session: Session, model_id: str, n_ctx: int) -> ClusterMonitor:
    """What GET /v1/cluster reads: the ring's daemons (with the cost model Halda planned with,
    for predicted times), or this device."""
    from prima.engine.local import LocalGeneratorPool

    ring = session.ring
    if ring is not None:
        model = ModelProfile.from_gguf(session.loaded.gguf, ctx_tokens=n_ctx)
        return ClusterMonitor(model_id, lambda: read_ring(ring), model)
    gen = session.generator
    streamer = gen.streamer if isinstance(gen, LocalGeneratorPool) else None
    return ClusterMonitor(model_id, lambda: read_local(session.loaded, streamer))


def _slots(session: Session, parallel: int) -> int:
    """Requests to run at once: --parallel, unless this device's generator holds fewer engines
    (a model streamed from disk runs one at a time)."""
    size = getattr(session.generator, "size", None)
    return min(parallel, size) if size is not None else parallel


def _model_id(model: str) -> str:
    """A registry name stays as typed; a GGUF path becomes its file stem, which clients can echo back."""
    return Path(model).stem if model.endswith(".gguf") else model
