"""One exception tree for prima. Library code raises these; only the CLI maps them to exit codes
and only the HTTP API maps them to status codes. Every message says what is wrong and what to do."""

from __future__ import annotations


class PrimaError(Exception):
    """Base of every error prima raises on purpose."""


class ModelFileError(PrimaError):
    """A model file is missing, truncated, not GGUF, or lacks tensors we need."""


class UnsupportedModelError(PrimaError):
    """The GGUF is valid but uses an architecture or tensor type prima cannot run."""


class ModelFetchError(PrimaError):
    """A named model could not be fetched or failed its checksum."""


class TokenizerError(PrimaError):
    """The vocabulary in the GGUF cannot be turned into a tokenizer."""


class InputError(PrimaError):
    """User input is unusable: an empty prompt, a prompt longer than the context, bad flags."""


class ContextFullError(InputError):
    """The KV cache has no room for more tokens."""


class PlanError(PrimaError):
    """No valid plan: layers unassigned, a window not covering the model, inconsistent nodes."""


class NodeError(PrimaError):
    """A peer daemon is unreachable, answered with an error, or vanished mid-session."""


class UntrustedNodeError(NodeError):
    """A peer failed the TLS handshake: it (or this device) holds no certificate of the cluster."""


class ProtocolError(PrimaError):
    """A message on the wire is malformed, oversized, or inconsistent with the session."""


class GenerationCancelled(PrimaError):
    """Whoever asked for a generation went away (a client disconnected, a server is stopping);
    raised where the generation checks between tokens."""
