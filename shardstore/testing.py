"""Helpers for trying shardstore without infrastructure: a local S3 server.

``LocalS3Server`` runs moto's S3 server (a real HTTP server, not a mock of boto
calls) on 127.0.0.1 on a free port. It needs ``moto[server]`` (in shardstore's
``test`` extra). The demo, the benchmark and the test suite use it.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalS3Server:
    """moto's S3 server on 127.0.0.1; usable as a context manager."""

    def __init__(self, key: str = "testing-key", secret: str = "testing-secret", region: str = "us-east-1") -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
        self.key, self.secret, self.region = key, secret, region
        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LocalS3Server:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def create_bucket(self, name: str) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key,
                              aws_secret_access_key=self.secret, region_name=self.region)
        client.create_bucket(Bucket=name)

    def export_environment(self) -> None:
        """Points the standard AWS variables of this process (and its children) here."""
        os.environ.update(AWS_ENDPOINT_URL=self.endpoint, AWS_ACCESS_KEY_ID=self.key,
                          AWS_SECRET_ACCESS_KEY=self.secret, AWS_REGION=self.region)
