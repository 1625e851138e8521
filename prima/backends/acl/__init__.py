"""The Ascend NPU backend (`get_backend("acl", ...)`): windows exported to ONNX (onnx_window),
compiled by CANN's ATC (atc), run through pyACL (runtime, backend). Needs the `acl` extra
(onnx, onnxruntime) and, on the device, CANN; docs/orangepi.md says what was verified where."""

from __future__ import annotations

from prima.backends.acl.backend import AclBackend, AclKV, AclWindow
from prima.backends.acl.runtime import AclError

__all__ = ["AclBackend", "AclError", "AclKV", "AclWindow"]
