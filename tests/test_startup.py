"""prima.startup, which every entry point imports first: hashing without OpenSSL's libcrypto
(3.3 MiB resident), while TLS still loads its OpenSSL for the daemons that need it."""

from __future__ import annotations

import json

from tests.conftest import run_python

PROBE = """
import json, sys
import prima.startup
import hashlib
def crypto_mapped():
    return any("libcrypto" in line for line in open("/proc/self/maps"))
digest = hashlib.sha256(b"prima").hexdigest()
before_tls = crypto_mapped()
import ssl
ssl.create_default_context()
print(json.dumps({
    "hashlib_openssl": sys.modules.get("_hashlib") is not None,
    "sha256": digest,
    "crypto_before_tls": before_tls,
    "crypto_with_tls": crypto_mapped(),
}))
"""


def test_hashing_runs_without_openssl_and_tls_still_has_it() -> None:
    out = json.loads(run_python(PROBE, timeout=60).stdout)
    assert out["hashlib_openssl"] is False
    assert out["sha256"] == "51365d01e295763226b90cadb302b717b086f77b8fab3384996038163c2baf7d"
    assert out["crypto_before_tls"] is False
    assert out["crypto_with_tls"] is True
