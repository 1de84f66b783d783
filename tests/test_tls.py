"""The one shared TLS context (engine_manager.tls): the same object for every client, and still verifying."""

from __future__ import annotations

import ssl

import httpx

from engine_manager import tls


def test_one_shared_context_that_still_verifies_certificates_and_names():
    ctx = tls.verify()
    assert ctx is tls.verify(True) is tls.tls_context()
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] > 0          # the CA bundle httpx would load is loaded
    assert tls.verify(False) is False and tls.verify("/some/ca.pem") == "/some/ca.pem"
    with httpx.Client(verify=tls.verify()) as client:       # httpx takes it as is
        assert client._transport._pool._ssl_context is ctx
