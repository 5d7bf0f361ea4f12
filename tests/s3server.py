"""moto's S3 server on 127.0.0.1 over real HTTP, for the tests (there is no MinIO here).

Started once per test session, bound to loopback, stopped afterwards. Credentials and the
endpoint reach s3fs the way users configure them: environment variables (fsspec's usual path).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from servers import free_port, stop, wait_until_serving

ENV = {"AWS_ACCESS_KEY_ID": "testing-key", "AWS_SECRET_ACCESS_KEY": "testing-secret-DO-NOT-LOG",
       "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class MotoServer:
    """A running ``moto.server`` process."""

    proc: subprocess.Popen
    endpoint: str

    @property
    def env(self) -> dict[str, str]:
        """Environment that points boto (and so s3fs) at this server."""
        return dict(ENV, AWS_ENDPOINT_URL=self.endpoint)

    def storage_options(self) -> dict:
        """The same through ``storage_options`` instead of the environment."""
        return {"key": ENV["AWS_ACCESS_KEY_ID"], "secret": ENV["AWS_SECRET_ACCESS_KEY"],
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def stop(self) -> None:
        stop(self.proc)


def start(port: int | None = None) -> MotoServer:
    """Start the server and wait until it answers (at most 30 s)."""
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    wait_until_serving(proc, f"{endpoint}/moto-api/", "moto server", 30)
    return MotoServer(proc, endpoint)


def make_bucket(server: MotoServer, name: str) -> None:
    """Create bucket ``name`` (idempotent)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                      aws_access_key_id=ENV["AWS_ACCESS_KEY_ID"], aws_secret_access_key=ENV["AWS_SECRET_ACCESS_KEY"])
    try:
        s3.create_bucket(Bucket=name)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
